"""What the suite runs in CI and what only the long run adds.

CI (``python tests/run.py``) has a time budget (tests/run.py's ``BUDGET_S``); the long
run, ``python tests/run.py --long`` (``FUELSPMD_TESTS_LONG=1``), runs every test of CI plus
the full-size, many-repeat and full-matrix variants. A check that only the long run makes
is still a test of the suite, not a script beside it:

- ``@long_only`` marks a test the long run adds (a full-size calibration, the whole fault
  matrix of a second launcher); in CI it is collected and skipped with the command that
  runs it, so every run's summary counts it.
- ``runs(ci, long)`` is a repeat count or a property test's ``max_examples``: the same
  assertions, fewer repeats or examples in CI.

Test modules put ``tests/`` on ``sys.path`` and ``from budget import ...``.
"""

from __future__ import annotations

import os

import pytest

LONG = os.environ.get("FUELSPMD_TESTS_LONG") == "1"
LONG_REASON = "long run only: python tests/run.py --long (FUELSPMD_TESTS_LONG=1)"
long_only = pytest.mark.long


def runs(ci: int, long: int) -> int:
    """``long`` in the long run, else ``ci``: a repeat count or a ``max_examples``."""
    if not 0 < ci <= long:
        raise ValueError(f"runs(ci={ci}, long={long}): CI runs at least one, at most long's")
    return long if LONG else ci
