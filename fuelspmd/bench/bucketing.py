"""``fuelspmd bench bucketing``: many small lazy all_reduces realised together, bucketed.

    mpiexec -n 2 fuelspmd bench bucketing [--count 256] [--bytes 16K] [--bucket 4M]
        [--check default|off] [--json]

What a data-parallel step does with its gradients: ``count`` all_reduces of ``bytes``
each. Candidates, interleaved round by round (A, B, C, A, B, C ...), each round started at
a barrier and timed on the slowest rank:

- ``mpi4py``: ``count`` raw ``Allreduce(IN_PLACE, buf)`` calls one by one (what a user
  writes by hand);
- ``lazy``: the same all_reduces built on leaves (made once, as parameters are) on a
  Communicator without bucketing and realised together (one graph, ``count`` calls);
- ``bucketed``: the same on a Communicator with ``bucket_bytes`` set: the planner fuses
  them into buckets (one transport call per bucket) and splits the results back out (a
  bucket is concatenated into the transport's shared window where it reduces the bucket's
  size in shared memory, ``transport.explain_all_reduce``, and reduced where it lies);
- ``floor``: raw ``Allreduce(IN_PLACE)`` calls on buffers already holding whole buckets
  (no concatenation, no split, no graph): the best any bucketing can do on this machine,
  as the transport's bandwidth at the bucket size sets it;
- ``floor_fs``: the same whole-bucket calls through the fuelspmd transport
  (``all_reduce(buf).wait()``, non-blocking MPI polled to completion): ``bucketed`` minus
  ``floor_fs`` is what the graph costs (building the nodes, the copy into the bucket, the
  views out), ``floor_fs`` minus ``floor`` what the transport costs.

The world is checked as ``fs.init`` checks it (``--check default``: every all_reduce is
compared across ranks before its data moves, :mod:`fuelspmd.comm.guard`); ``--check off``
measures the transport alone, so the two runs side by side give what the guard costs.

``ratio`` = candidate time / mpi4py time, the median of the paired per-round ratios
(target for ``bucketed``: at most 0.5). Results are checked against numpy once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.bench import (
    Column,
    interleave,
    median,
    mpi_comm,
    parse_bytes,
    parser,
    print_json,
    print_table,
)
from fuelspmd.comm.communicator import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.launch import init
from fuelspmd.tensor import realize, tensor
from fuelspmd.transport import ReduceOp, Transport

__all__ = ["main", "run"]


def _max_over_ranks(t: Transport, values: list[float]) -> list[float]:
    arr = np.asarray(values, np.float64)
    t.all_reduce(arr, ReduceOp.MAX).wait()
    return arr.tolist()


def run(t: Transport, *, count: int, nbytes: int, bucket: int, rounds: int
        ) -> dict[str, Any]:
    """Time the candidates; return their medians and ratios (the same on every rank)."""
    from mpi4py import MPI

    mpi = mpi_comm(t)
    if mpi is None:
        raise ConfigError(f"bench bucketing needs the MPI transport, but this world runs on "
                          f"{t.name!r}; start it under mpiexec -n 2 (or more)")
    n = max(1, nbytes // 4)
    bufs = [np.full(n, 1.0, np.float32) for _ in range(count)]
    plain = Communicator(t, device="cpu:0")
    fused = Communicator(t, device="cpu:0", bucket_bytes=bucket)

    def raw() -> None:
        for b in bufs:
            mpi.Allreduce(MPI.IN_PLACE, b, MPI.SUM)

    per = max(1, bucket // (n * 4)) if bucket > 0 else count  # all_reduces per bucket
    whole = [np.zeros(n * min(per, count - k), np.float32) for k in range(0, count, per)]

    def floor() -> None:
        for b in whole:
            mpi.Allreduce(MPI.IN_PLACE, b, MPI.SUM)

    whole_fs = [b.copy() for b in whole]  # its own buffers, as every candidate has

    def floor_fs() -> None:
        for b in whole_fs:
            t.all_reduce(b, ReduceOp.SUM).wait()

    leaves = [tensor(b) for b in bufs]  # made once, as parameters are

    def lazy(comm: Communicator) -> Callable[[], None]:
        def go() -> None:
            realize(*[comm.all_reduce(x) for x in leaves])
        return go

    ys = [fused.all_reduce(x) for x in leaves[:3]]
    realize(*ys)
    if not all(np.array_equal(y.numpy(), b * t.size) for y, b in zip(ys, bufs)):
        raise RuntimeError("bucketed all_reduce gave a wrong result")
    for b in bufs:
        b[...] = 0.0  # zeros stay zeros under raw in-place sums, round after round
    cands = {"mpi4py": raw, "lazy": lazy(plain), "bucketed": lazy(fused), "floor": floor,
             "floor_fs": floor_fs}
    for fn in cands.values():
        fn()

    def timed(fn: Callable[[], None]) -> Callable[[], float]:
        def one() -> float:
            mpi.Barrier()
            start = MPI.Wtime()
            fn()
            return MPI.Wtime() - start
        return one

    times = interleave({k: timed(fn) for k, fn in cands.items()}, count=rounds)
    slow = {k: _max_over_ranks(t, v) for k, v in times.items()}
    out: dict[str, Any] = {"ranks": t.size, "count": count, "bytes": n * 4,
                           "bucket_bytes": bucket, "rounds": rounds}
    for k, v in slow.items():
        out[f"{k}_ms"] = median(v) * 1e3
        out[f"{k}_ratio"] = median([a / b for a, b in zip(v, slow["mpi4py"])])
    return out


def main(argv: list[str]) -> int:
    """Run the benchmark; rank 0 prints. Returns the exit code (2 on a bad option)."""
    p = parser("fuelspmd bench bucketing", __doc__)
    p.add_argument("--count", type=int, default=256, help="all_reduces per step (256)")
    p.add_argument("--bytes", default="16K", help="bytes of each (16K)")
    p.add_argument("--bucket", default="4M", help="bucket size of the bucketed candidate (4M)")
    p.add_argument("--iters", type=int, default=40, help="timed rounds per candidate (40)")
    p.add_argument("--check", default="default", choices=("default", "off"),
                   help="fs.init's check mode (default: checked, as users run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        if args.count < 1 or args.iters < 1:
            raise ConfigError(f"bench bucketing: --count and --iters must be >= 1 (got "
                              f"{args.count}, {args.iters})")
        t = init(check=args.check).transport
        res = run(t, count=args.count, nbytes=parse_bytes(args.bytes),
                  bucket=parse_bytes(args.bucket), rounds=args.iters)
        res["check"] = args.check
    except ConfigError as e:
        print(f"fuelspmd bench bucketing: {e}", file=sys.stderr, flush=True)
        return 2
    if t.rank != 0:
        return 0
    if args.json:
        print_json({"bench": "bucketing", **res})
        return 0
    rows = [{"what": k, "ms": res[f"{k}_ms"], "ratio": res[f"{k}_ratio"]}
            for k in ("mpi4py", "lazy", "bucketed", "floor", "floor_fs")]
    print_table(f"{res['count']} all_reduces of {res['bytes']} B, {res['ranks']} ranks, "
                f"bucket {res['bucket_bytes']} B, check {res['check']} (median of "
                f"{res['rounds']} rounds, slowest rank; ratio = time / mpi4py time)",
                [Column("candidate", "what"), Column("ms/step", "ms", "{:.3f}"),
                 Column("ratio", "ratio", "{:.3f}")], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
