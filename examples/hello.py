"""The smallest fuelspmd program: start the world, all-reduce, say who is where.

Run it any way a fuelspmd program runs::

    python examples/hello.py                       # one rank
    mpiexec -n 4 python examples/hello.py          # four ranks on this machine
    srun -n 4 --mpi=pmi2 python examples/hello.py  # four Slurm tasks
    sbatch --ntasks=4 slurm/single-node.sbatch examples/hello.py

Every rank prints one JSON line (``world.print(..., ranks="all")``: by default only rank 0
prints, and each call is one write, so the ranks' lines never run together): its place in
the job (rank, size, local rank, node, launcher, device) and the all-reduced sum of
``[rank, rank + 1, rank + 2]`` over all ranks, which must equal
``[s, s + size, s + 2 * size]`` with ``s = size * (size - 1) / 2``; ``ok`` says whether it
does. Then rank 0 alone prints a summary line. ``--exit-code N`` makes rank
``--exit-rank`` exit with N afterwards (to see how a launcher reports a failed rank);
``--raise-on-rank R`` makes rank R raise before the all-reduce, which the others are then
blocked in (to see one failure end the job).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import fuelspmd as fs


def main(argv: list[str] | None = None) -> int:
    """Run the check on this rank and return its exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--exit-code", type=int, default=0,
                        help="exit code for rank --exit-rank after printing (default 0)")
    parser.add_argument("--exit-rank", type=int, default=0,
                        help="the rank that exits with --exit-code (default 0)")
    parser.add_argument("--raise-on-rank", type=int, default=None,
                        help="this rank raises RuntimeError before the all-reduce")
    args = parser.parse_args(argv)

    world = fs.init(timeout=60.0)
    buf = np.arange(3, dtype=np.float64) + world.rank
    if args.raise_on_rank == world.rank:
        raise RuntimeError(f"rank {world.rank} fails on purpose (--raise-on-rank)")
    world.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()
    s = world.size * (world.size - 1) / 2
    expected = [s, s + world.size, s + 2 * world.size]
    line = json.dumps({
        "rank": world.rank,
        "size": world.size,
        "local_rank": world.local_rank,
        "local_size": world.local_size,
        "node": world.node,
        "launcher": world.launcher,
        "device": str(world.device),
        "transport": world.transport.name,
        "all_reduce": buf.tolist(),
        "ok": buf.tolist() == expected,
    })
    world.print(line, ranks="all", prefix=False)  # JSON lines: no [rank R] prefix
    world.print(f"{world.size} rank(s) on {world.num_nodes} node(s) agree: "
                f"{buf.tolist() == expected}")
    return args.exit_code if world.rank == args.exit_rank else 0


if __name__ == "__main__":
    sys.exit(main())
