"""What the suite runs in CI and what only the long run adds.

CI (``python tests/run.py``) has a time budget (tests/run.py's ``BUDGET_S``); the long
run, ``python tests/run.py --long`` (``FUELSPMD_TESTS_LONG=1``), runs every test of CI plus
the full-size, many-repeat and full-matrix variants. A check that only the long run makes
is still a test of the suite, not a script beside it (``grep -rn "runs(\\|long_only" tests``
lists them all):

- ``@long_only`` marks a test the long run adds (a full-size calibration, the whole fault
  matrix of a second launcher); in CI it is collected and skipped with the command that
  runs it, so every run's summary counts it.
- ``runs(ci, long)`` is a repeat count or a property test's ``max_examples``: the same
  assertions, fewer repeats or examples in CI.

And one way of not wasting the budget under ``mpiexec``: ``bcast_from_rank0`` builds a
reference on rank 0 while the other ranks wait without spinning.

Test modules put ``tests/`` on ``sys.path`` and ``from budget import ...``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")

LONG = os.environ.get("FUELSPMD_TESTS_LONG") == "1"
LONG_REASON = "long run only: python tests/run.py --long (FUELSPMD_TESTS_LONG=1)"
long_only = pytest.mark.long


def runs(ci: int, long: int) -> int:
    """``long`` in the long run, else ``ci``: a repeat count or a ``max_examples``."""
    if not 0 < ci <= long:
        raise ValueError(f"runs(ci={ci}, long={long}): CI runs at least one, at most long's")
    return long if LONG else ci


def bcast_from_rank0(make: Callable[[], T]) -> T:
    """``make()`` on rank 0 of the MPI world, its result handed to every rank.

    The other ranks wait in a polled, sleeping barrier first: a rank blocked in an MPI
    broadcast spins, and three spinning ranks leave rank 0 (building a torch reference,
    say) a fraction of one of these machines' two cores.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    value = make() if comm.rank == 0 else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)
    return comm.bcast(value, root=0)
