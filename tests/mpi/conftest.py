"""Multi-rank tests: run on every rank by ``mpiexec -n N python -m pytest --with-mpi``.

A failing rank aborts the run: its failure is printed, then MPI_Abort ends every rank, so
no rank is left waiting in a collective the failed rank will never join.
"""

from __future__ import annotations

import sys

import pytest

import fuelspmd as fs


def _world() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size


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


@pytest.fixture(scope="session")
def world() -> fs.World:
    """The run's one world, shared by every module: a process calls ``fs.init()`` with one
    set of arguments (another set is a ConfigError), and every wait has this deadline."""
    return fs.init(timeout=60.0)
