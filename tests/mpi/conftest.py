"""Multi-rank tests: run on every rank by ``mpiexec -n N python -m pytest --with-mpi``.

A failing rank aborts the run: its failure is printed, then MPI_Abort ends every rank, so
no rank is left waiting in a collective the failed rank will never join. Ranks other than
0 write their output to FUELSPMD_RANK_LOGS/rank-N.log when that is set (the runner shows
the logs of a failed run), so a passing run prints one report, not one per rank.
"""

from __future__ import annotations

import os
import sys

import pytest


def _world() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("with_mpi", default=False):
        return
    rank, _ = _world()
    logs = os.environ.get("FUELSPMD_RANK_LOGS")
    if rank > 0 and logs:
        os.makedirs(logs, exist_ok=True)
        fd = os.open(os.path.join(logs, f"rank-{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or "mpi" not in report.keywords:
        return
    rank, size = _world()
    if size == 1:
        return
    sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}); aborting all "
                     f"{size} ranks\n{report.longreprtext}\n")
    sys.stderr.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)
