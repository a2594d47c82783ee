"""``fuelspmd bench shm``: the shared-memory all-reduce against MPICH's own Allreduce.

    mpiexec -n 2 fuelspmd bench shm [--sizes 1M,4M,16M,64M] [--rounds 40] [--json]

Three candidates, interleaved round by round (A, B, C, A, B, C, ...) on the same machine
state: ``mpi`` is raw ``comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)``; ``shm`` is the
transport's all_reduce through the shared window, copying the input in (any buffer);
``shm_zc`` is the same with the input already in a lent area of the window (the
transport's ``lend``), as the lazy graph places all_reduce inputs. Before every round each
buffer is refilled with the rank's input (untimed), the ranks meet at a barrier, and one
call is timed; a round's time is the slowest rank's. Reported: each candidate's median,
the speedup ``mpi / shm`` as the median over rounds of the paired ratios (robust to a slow
phase), and the all-reduce the calibrated cost model picks for the size (``model picks``;
the calibration in its default place): mpi where it predicts no win for shm.

Correctness, checked once per size before timing: every rank's input is the float32
``((i + 7 r) mod 97) * 0.37 - 11``; the shm results must equal, bitwise, numpy's fold in
rank order (``((x_0 + x_1) + x_2) + ...``), and MPI's must match it within float32
rounding (its association may differ). ``max|shm-mpi|`` is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.bench import Column, interleave, median, parse_bytes, parser, print_json, print_table
from fuelspmd.cost.policy import AllReducePlan, Band, planner_for
from fuelspmd.errors import ConfigError
from fuelspmd.launch import init

__all__ = ["inputs", "main", "reference", "run"]

CANDIDATES = ("mpi", "shm", "shm_zc")


def inputs(rank: int, count: int) -> np.ndarray:
    """Rank ``rank``'s float32 input: cheap to rebuild on any rank, not all equal."""
    i = np.arange(count, dtype=np.int64)
    return (((i + 7 * rank) % 97) * 0.37 - 11).astype(np.float32)


def reference(size: int, count: int) -> np.ndarray:
    """The all-reduce sum as the shm path defines it: a left fold in rank order."""
    acc = inputs(0, count)
    for r in range(1, size):
        np.add(acc, inputs(r, count), out=acc)
    return acc


def _lent(t: Any, count: int) -> np.ndarray:
    """``count`` float32 in a lent area: the size's first all_reduce (the one ``_check``
    runs on a buffer of its own) makes it on every rank, after the first ``lend`` asked."""
    area = t.lend(count * 4, np.dtype(np.float32))
    if area is None:
        raise ConfigError(f"no lent area of {count * 4} bytes: the shared windows are above "
                          f"the cap ({t.explain_all_reduce(count * 4)}); pass a larger --cap")
    return area[:count * 4].view(np.float32)


def _check(t: Any, comm: Any, MPI: Any, count: int) -> tuple[dict[str, Any], np.ndarray]:
    """Run each candidate once on the real inputs; compare with the numpy fold. Returns
    the row's fields and the lent buffer of ``shm_zc``."""
    want = reference(t.size, count)
    mine = inputs(t.rank, count)
    got_mpi = mine.copy()
    comm.Allreduce(MPI.IN_PLACE, got_mpi, MPI.SUM)
    got_shm = mine.copy()
    t.lend(count * 4, np.dtype(np.float32))  # asks for the area the next call makes
    t.all_reduce(got_shm, "sum").wait()
    zc = _lent(t, count)
    zc[...] = mine
    t.all_reduce(zc, "sum").wait()
    ok = bool(np.array_equal(got_shm, want) and np.array_equal(zc, want)
              and np.allclose(got_mpi, want, rtol=1e-6, atol=1e-4))
    flags = np.array([ok], np.int8)
    comm.Allreduce(MPI.IN_PLACE, flags, MPI.MIN)
    return {"correct": bool(flags[0]),
            "max_diff_vs_mpi": float(np.max(np.abs(got_shm - got_mpi))) if count else 0.0}, zc


def run(t: Any, *, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """Measure every size; return one row per size, on every rank."""
    from mpi4py import MPI

    comm = t.comm
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        mine = inputs(t.rank, count)
        fields, zc = _check(t, comm, MPI, count)
        bufs = {"mpi": np.empty(count, np.float32), "shm": np.empty(count, np.float32),
                "shm_zc": zc}
        row: dict[str, Any] = {"bytes": count * 4, **fields}
        calls: dict[str, Callable[[], object]] = {
            "mpi": lambda b=bufs["mpi"]: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
            "shm": lambda b=bufs["shm"]: t.all_reduce(b, "sum").wait(),
            "shm_zc": lambda b=bufs["shm_zc"]: t.all_reduce(b, "sum").wait(),
        }

        def timed(name: str, bufs: dict[str, np.ndarray] = bufs,
                  calls: dict[str, Callable[[], object]] = calls,
                  mine: np.ndarray = mine) -> Callable[[], float]:
            buf, fn = bufs[name], calls[name]

            def one_round() -> float:
                buf[...] = mine
                comm.Barrier()
                start = time.perf_counter()
                fn()
                return time.perf_counter() - start
            return one_round

        for name in CANDIDATES:  # warm up: page in buffers, allocate windows
            timed(name)()
        times = interleave({name: timed(name) for name in CANDIDATES}, count=rounds)
        slowest = {name: np.asarray(ts) for name, ts in times.items()}
        for a in slowest.values():
            comm.Allreduce(MPI.IN_PLACE, a, MPI.MAX)
        for name, ts in slowest.items():
            row[f"{name}_ms"] = median(ts.tolist()) * 1e3
        for name in ("shm", "shm_zc"):
            row[f"speedup_{name}"] = median((slowest["mpi"] / slowest[name]).tolist())
        rows.append(row)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = parser("fuelspmd bench shm", __doc__)
    p.add_argument("--sizes", default="1M,4M,16M,64M",
                   help="comma-separated buffer sizes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=40,
                   help="timed rounds per candidate and size (default %(default)s)")
    p.add_argument("--cap", default="512M",
                   help="shared window per rank the transport may hold (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str]) -> int:
    """Run the benchmark on the world's MPI transport; rank 0 prints. Returns the exit code.

    Exit code 1 when a correctness check failed, 2 for bad options (printed by every rank).
    """
    try:
        return _main(argv)
    except ConfigError as e:
        print(f"fuelspmd bench shm: {e}", file=sys.stderr, flush=True)
        return 2


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
        cap = parse_bytes(args.cap)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not sizes or min(sizes) < 4 or args.rounds < 1:
        raise ConfigError(f"bench shm: sizes must be >= 4 bytes (got {sizes}) and --rounds "
                          f">= 1 (got {args.rounds})")
    world = init(check="off")  # the transport's own paths, measured without the guard
    t = world.transport
    if t.name != "mpi":
        raise ConfigError(f"bench shm needs the MPI transport, but this world runs on "
                          f"{t.name!r}; start it under mpiexec (e.g. mpiexec -n 2 fuelspmd "
                          f"bench shm)")
    algorithm = t.set_all_reduce_policy(algorithm="shm", min_bytes=0, cap_bytes=cap)
    if algorithm != "shm":
        raise ConfigError(f"the shared-memory path does not apply to this world of {t.size} "
                          f"(one rank, or ranks on several nodes); run 2+ ranks on one node")
    rows = run(t, sizes=sorted(sizes), rounds=args.rounds)
    correct = all(r["correct"] for r in rows)
    plan = planner_for(world)(t.world_ranks)  # what the calibrated model would choose
    chosen = AllReducePlan(tuple(Band(*b) for b in plan["bands"]), tuple(plan["nodes"]))
    for r in rows:
        r["model"] = chosen.choose(r["bytes"]).algorithm
    if t.rank == 0:
        meta = {"bench": "shm", "ranks": t.size, "dtype": "float32", "op": "sum",
                "rounds": args.rounds}
        if args.json:
            print_json({**meta, "rows": rows})
        else:
            cols = [Column("size(B)", "bytes"), Column("mpi ms", "mpi_ms", "{:.3f}"),
                    Column("shm ms", "shm_ms", "{:.3f}"),
                    Column("shm_zc ms", "shm_zc_ms", "{:.3f}"),
                    Column("x shm", "speedup_shm", "{:.2f}"),
                    Column("x shm_zc", "speedup_shm_zc", "{:.2f}"),
                    Column("model picks", "model"),
                    Column("correct", "correct"),
                    Column("max|shm-mpi|", "max_diff_vs_mpi", "{:.2g}")]
            print_table(f"all_reduce sum float32, {t.size} ranks: MPICH Allreduce(IN_PLACE) "
                        f"vs shared window (x: median of paired mpi/shm ratios over "
                        f"{args.rounds} interleaved rounds, slowest rank)", cols, rows)
    t.finalize()
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
