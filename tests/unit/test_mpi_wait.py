"""The MPI transport's one wait (``fuelspmd_mpi._work.spin``), without MPI: it spins, then
yields the core between bursts of polls past ``spin_s`` (at once for ranks that share
cores), calls ``watch`` every slice, and raises CommTimeoutError at its deadline."""

from __future__ import annotations

import itertools
import os
import time

import pytest

from fuelspmd.errors import CommTimeoutError
from fuelspmd.transport import WATCH_S
from fuelspmd_mpi import _work
from fuelspmd_mpi._work import YIELD_AFTER_S, spin


class _After:
    """A ``done`` that holds from its ``n``-th poll on, or once ``seconds`` have passed."""

    def __init__(self, n: int = 1 << 62, seconds: float = 1e9) -> None:
        self.n, self.polls, self.until = n, 0, time.monotonic() + seconds

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls >= self.n or time.monotonic() >= self.until


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of ``os.sched_yield`` the wait makes."""
    count = [0]
    real = os.sched_yield

    def counted() -> None:
        count[0] += 1
        real()

    monkeypatch.setattr(_work.os, "sched_yield", counted)
    return count


def _late(limit: float) -> str:
    return f"the operation did not complete within {limit:g} s"


def test_a_quick_wait_never_yields_and_reports_no_wait(yields: list[int]) -> None:
    done = _After(n=5)
    assert spin(done, 10.0, _late, spin_s=1.0) == 0.0
    assert done.polls == 5 and yields[0] == 0


def test_ranks_that_share_cores_yield_after_the_first_burst(yields: list[int]) -> None:
    done = _After(seconds=0.02)
    waited = spin(done, 10.0, _late, spin_s=0.0)
    assert waited > 0.015 and yields[0] >= 1
    # the clock is read, and the core given up, once per burst of polls
    assert done.polls <= (yields[0] + 1) * _work._BURST


def test_a_rank_with_a_core_spins_before_it_yields(yields: list[int]) -> None:
    assert spin(_After(seconds=0.02), 10.0, _late, spin_s=1.0) == 0.0  # within the spin
    assert yields[0] == 0
    assert YIELD_AFTER_S < 0.015  # the default spin, a rank with a core's, is short
    assert spin(_After(seconds=0.02), 10.0, _late) > 0.015
    assert yields[0] >= 1


def test_the_deadline_raises_the_callers_text() -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"did not complete within 0\.05 s"):
        spin(_After(), 0.05, _late, spin_s=0.0)
    assert 0.05 <= time.monotonic() - start < 2.0


def test_watch_is_called_once_per_slice_and_may_raise() -> None:
    calls: list[float] = []
    spin(_After(seconds=3.5 * WATCH_S), 10.0, _late, lambda: calls.append(time.monotonic()),
         spin_s=0.0)
    assert 1 <= len(calls) <= 4  # a stalled machine may skip a slice, never add one
    assert all(b - a >= WATCH_S * 0.9 for a, b in itertools.pairwise(calls))

    def stop() -> None:
        raise CommTimeoutError("a peer's note says it is elsewhere")

    with pytest.raises(CommTimeoutError, match="elsewhere"):
        spin(_After(), 10.0, _late, stop, spin_s=0.0)
