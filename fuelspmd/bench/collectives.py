"""``fuelspmd bench collectives``: nccl-tests-style bandwidth of the world transport.

    mpiexec -n 2 fuelspmd bench collectives --baseline mpi4py [--ops all_reduce] [--json]

For each op and size the table gives the time per call, the algorithm bandwidth
(``algbw = size / time``) and the bus bandwidth, which nccl-tests defines so that it is
comparable across rank counts: ``busbw = algbw * f(n)`` with f = 2(n-1)/n for all_reduce,
(n-1)/n for all_gather, reduce_scatter and all_to_all, and 1 for broadcast. ``size`` is the
bytes of the full buffer (the gathered result, the scattered input), as in nccl-tests,
rounded down to a multiple of the rank count.

A transport call is issue + ``wait()``. ``--baseline mpi4py`` runs raw mpi4py buffer calls
(``Allreduce(MPI.IN_PLACE, buf)``, ``Allgather``, ``Reduce_scatter_block``, ``Bcast``,
``Alltoall``) on buffers of the same size (each candidate has its own, so none finds its
data in cache because another just touched it), interleaved with the transport's round by
round (A, B, A, B): ``ratio`` is transport busbw / mpi4py busbw (the median over rounds of
the paired ratio), ``+us`` the latency the transport adds (difference of the medians).
A round starts at a barrier and times k back-to-back calls (k chosen, the same on every
rank, so a round lasts about 2 ms); a round's time is the slowest rank's, and a cell is
the median over rounds. Candidates are a name -> call table; ``lazy`` is the lazy
Communicator over the same transport, a collective built and realised per call (``lazy
ratio`` = lazy busbw / mpi4py busbw, ``lazy +us`` its added latency). For all_reduce and
broadcast the lazy program gives up its input as the in-place baseline does
(``x = comm.all_reduce(x.donate())``), so nothing is copied; a program that keeps its
input pays one copy of it.
"""

from __future__ import annotations

import argparse
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
    time_calls,
)
from fuelspmd.comm.communicator import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.launch import init
from fuelspmd.tensor import tensor
from fuelspmd.transport import ReduceOp, Transport

__all__ = ["BUS_FACTOR", "main", "run"]

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
DTYPES = ("float32", "float64", "int32", "int64")
ROUND_S = 2e-3  # target length of one timed round
MAX_CALLS = 1000  # calls per round, at most

Call = Callable[[], object]


def _buffers(op: str, count: int, n: int, dt: np.dtype) -> tuple[np.ndarray, ...]:
    """The buffers of ``op`` for a full buffer of ``count`` elements (zeros: sums stay 0)."""
    if op in ("all_reduce", "broadcast"):
        return (np.zeros(count, dt),)
    if op == "all_gather":
        return np.zeros(count // n, dt), np.zeros(count, dt)
    if op == "reduce_scatter":
        return np.zeros(count, dt), np.zeros(count // n, dt)
    return np.zeros(count, dt), np.zeros(count, dt)


def _transport_call(t: Transport, op: str, bufs: tuple[np.ndarray, ...], rop: ReduceOp) -> Call:
    if op == "all_reduce":
        (buf,) = bufs
        return lambda: t.all_reduce(buf, rop).wait()
    if op == "broadcast":
        (buf,) = bufs
        return lambda: t.broadcast(buf, 0).wait()
    send, recv = bufs
    if op == "all_gather":
        return lambda: t.all_gather(send, recv).wait()
    if op == "reduce_scatter":
        return lambda: t.reduce_scatter(send, recv, rop).wait()
    return lambda: t.all_to_all(send, recv).wait()


def _lazy_call(comm: Communicator, op: str, bufs: tuple[np.ndarray, ...], rop: ReduceOp
               ) -> Call:
    """Build the lazy collective and realise it, each call: the whole cost a program sees
    (building the node, realising it, the transport call).

    The in-place ops (all_reduce, broadcast) are timed as the raw baseline runs them: the
    program gives up its input (``x = comm.all_reduce(x.donate())``), so the call copies
    nothing, as ``Allreduce(IN_PLACE)`` copies nothing.
    The other ops read a leaf made once, as a parameter is.
    """
    if op in ("all_reduce", "broadcast"):
        state = [tensor(bufs[0].copy(), device=comm.device)]  # the program's own array

        def consume() -> None:
            x = state.pop()
            state.append(comm.all_reduce(x.donate(), rop) if op == "all_reduce" else
                         comm.broadcast(x.donate(), 0))
            del x
            state[0].realize()
        return consume
    x = tensor(bufs[0], device=comm.device)
    if op == "all_gather":
        return lambda: comm.all_gather(x, 0).realize()
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, 0, rop).realize()
    return lambda: comm.all_to_all(x, 0, 0).realize()


def _mpi4py_call(comm: Any, op: str, bufs: tuple[np.ndarray, ...], rop: ReduceOp) -> Call:
    from mpi4py import MPI

    mop = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MIN: MPI.MIN,
           ReduceOp.MAX: MPI.MAX}[rop]
    if op == "all_reduce":
        (buf,) = bufs
        return lambda: comm.Allreduce(MPI.IN_PLACE, buf, mop)
    if op == "broadcast":
        (buf,) = bufs
        return lambda: comm.Bcast(buf, 0)
    send, recv = bufs
    if op == "all_gather":
        return lambda: comm.Allgather(send, recv)
    if op == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(send, recv, mop)
    return lambda: comm.Alltoall(send, recv)


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    return [*out, hi]


def _max_over_ranks(t: Transport, values: list[float]) -> np.ndarray:
    arr = np.asarray(values, np.float64)
    t.all_reduce(arr, ReduceOp.MAX).wait()
    return arr


def _measure(t: Transport, calls: dict[str, Call], sync: Call, *, warmup: int,
             rounds: int) -> dict[str, list[float]]:
    """Return each candidate's seconds per call in every round (slowest rank), interleaved."""
    est = [time_calls(fn, max(warmup, 1)) for fn in calls.values()]
    k = int(min(MAX_CALLS, max(1, ROUND_S / max(float(_max_over_ranks(t, est).max()), 1e-9))))

    def timed(fn: Call) -> Callable[[], float]:
        def one_round() -> float:
            sync()
            return time_calls(fn, k)
        return one_round

    times = interleave({name: timed(fn) for name, fn in calls.items()}, count=rounds)
    return {name: _max_over_ranks(t, ts).tolist() for name, ts in times.items()}


def run(t: Transport, *, ops: list[str], sizes: list[int], dtype: str, reduce_op: ReduceOp,
        baseline: str | None, warmup: int, rounds: int, with_lazy: bool = True
        ) -> list[dict[str, Any]]:
    """Measure every op at every size; return one row per (op, size), on every rank."""
    dt = np.dtype(dtype)
    n = t.size
    comm = None
    if baseline == "mpi4py":
        comm = mpi_comm(t)
        if comm is None:
            raise ConfigError(f"--baseline mpi4py needs the MPI transport, but this world runs "
                              f"on {t.name!r}; start the job under mpiexec or srun")
    if reduce_op is ReduceOp.AVG and comm is not None:
        raise ConfigError("--op avg has no raw MPI counterpart; use sum, prod, min or max")
    sync: Call = comm.Barrier if comm is not None else (lambda: t.barrier().wait())
    lazy = Communicator(t, device="cpu:0") if with_lazy else None
    rows = []
    for op in ops:
        for size in sizes:
            count = max(n, size // dt.itemsize // n * n)
            # each candidate its own buffers: none finds its data in cache because another
            # candidate just touched it (at 4 MiB that alone was worth 10-25% here)
            calls = {"fuelspmd": _transport_call(t, op, _buffers(op, count, n, dt), reduce_op)}
            if lazy is not None:
                calls["lazy"] = _lazy_call(lazy, op, _buffers(op, count, n, dt), reduce_op)
            if comm is not None:
                calls["mpi4py"] = _mpi4py_call(comm, op, _buffers(op, count, n, dt),
                                               reduce_op)
            per_round = _measure(t, calls, sync, warmup=warmup, rounds=rounds)
            secs = {name: median(ts) for name, ts in per_round.items()}
            nbytes = count * dt.itemsize
            row: dict[str, Any] = {"op": op, "bytes": nbytes, "count": count}
            for name, s in secs.items():
                algbw = nbytes / s / 1e9
                row[name] = {"time_us": s * 1e6, "algbw": algbw,
                             "busbw": algbw * BUS_FACTOR[op](n)}
            if "mpi4py" in secs:
                # the median of paired ratios: rounds A_i, B_i ran back to back, so each
                # pair saw the same machine state; robust to a slow phase mid-run
                row["ratio"] = median([b / a for a, b in zip(per_round["fuelspmd"],
                                                             per_round["mpi4py"])])
                row["added_us"] = (secs["fuelspmd"] - secs["mpi4py"]) * 1e6
                if "lazy" in secs:
                    row["lazy_ratio"] = median([b / a for a, b in zip(per_round["lazy"],
                                                                      per_round["mpi4py"])])
                    row["lazy_added_us"] = (secs["lazy"] - secs["mpi4py"]) * 1e6
            rows.append(row)
    return rows


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if not isinstance(v, dict)}
    for name in ("fuelspmd", "lazy", "mpi4py"):
        for k, v in row.get(name, {}).items():
            out[f"{name}.{k}"] = v
    return out


def _columns(baseline: bool, lazy: bool) -> list[Column]:
    cols = [Column("size(B)", "bytes"), Column("count", "count")]
    names = [("fuelspmd", "fs"), *([("lazy", "lazy")] if lazy else []),
             *([("mpi4py", "mpi4py")] if baseline else [])]
    for name, short in names:
        cols += [Column(f"{short} us", f"{name}.time_us", "{:.2f}"),
                 Column(f"{short} algbw", f"{name}.algbw", "{:.3f}"),
                 Column(f"{short} busbw", f"{name}.busbw", "{:.3f}")]
    if baseline:
        cols += [Column("ratio", "ratio", "{:.3f}"), Column("+us", "added_us", "{:+.2f}")]
        if lazy:
            cols += [Column("lazy ratio", "lazy_ratio", "{:.3f}"),
                     Column("lazy +us", "lazy_added_us", "{:+.2f}")]
    return cols


def _parser() -> argparse.ArgumentParser:
    p = parser("fuelspmd bench collectives", __doc__)
    p.add_argument("--ops", default=",".join(BUS_FACTOR),
                   help="comma-separated ops (default: all of %(default)s)")
    p.add_argument("--min-bytes", default="8", help="smallest size (default 8; 1K, 1M ok)")
    p.add_argument("--max-bytes", default="64M", help="largest size (default 64M)")
    p.add_argument("--step-factor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--op", default="sum", help="reduce op: sum, prod, min, max (avg without "
                                               "a baseline)")
    p.add_argument("--iters", type=int, default=20, help="timed rounds per candidate and size")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per candidate and size")
    p.add_argument("--baseline", choices=["mpi4py"], default=None,
                   help="interleave raw mpi4py buffer calls and print the ratio")
    p.add_argument("--no-lazy", action="store_true",
                   help="leave out the lazy Communicator column (realised per call)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def main(argv: list[str]) -> int:
    """Run the benchmark on the world transport; rank 0 prints. Returns the exit code.

    A bad option is a ConfigError, printed (by every rank, which all see the same
    options) with exit code 2.
    """
    try:
        return _main(argv)
    except ConfigError as e:
        print(f"fuelspmd bench collectives: {e}", file=sys.stderr, flush=True)
        return 2


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in BUS_FACTOR]
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    if bad or not 0 < lo <= hi or args.step_factor < 2 or args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"bench collectives: ops must be among {list(BUS_FACTOR)} (got "
                          f"{bad or ops}), 0 < --min-bytes <= --max-bytes (got {lo}, {hi}), "
                          f"--step-factor >= 2, --iters >= 1, --warmup >= 0")
    t = init().transport
    rows = run(t, ops=ops, sizes=_sizes(lo, hi, args.step_factor), dtype=args.dtype,
               reduce_op=ReduceOp.parse(args.op), baseline=args.baseline,
               with_lazy=not args.no_lazy,
               warmup=args.warmup, rounds=args.iters)
    if t.rank != 0:
        return 0
    meta = {"bench": "collectives", "transport": t.name, "ranks": t.size, "dtype": args.dtype,
            "reduce_op": args.op, "rounds": args.iters, "baseline": args.baseline}
    if args.json:
        print_json({**meta, "rows": rows})
        return 0
    cols = _columns(args.baseline is not None, not args.no_lazy)
    for op in ops:
        title = (f"{op}  {args.dtype}  {t.size} ranks  transport {t.name}  (times: median of "
                 f"{args.iters} rounds, slowest rank; bandwidths GB/s)")
        print_table(title, cols, [_flat(r) for r in rows if r["op"] == op])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
