"""Shared test setup: a per-run summary the runner (tests/run.py) adds up, the long run's
tests skipped in CI, and the shared-memory files of the jobs the tests ended removed
afterwards.

When FUELSPMD_SUMMARY is set, each pytest process writes its outcome counts and the
seconds spent in each test file (setup, call and teardown) there as JSON (rank 0 only
under mpiexec), so the runner can report every run of the suite in one line and name the
slowest files.

A test marked ``long`` (``budget.long_only``) runs only in the long run,
``python tests/run.py --long``; otherwise it is skipped with that command as the reason
(tests/budget.py).

MPICH and Open MPI unlink their shared-memory segment in MPI_Finalize, so every job a
test aborts on purpose (a mismatch, a crash) leaves one in /dev/shm: about 18 MB per run
of the one-process suite before this cleanup, 1.5 GB on a development machine after a
day, and a container's 64 MiB /dev/shm filled up within one run. A session that is not
itself a rank of a job removes, after each test and at its end, those created meanwhile
and mapped by no process (:func:`jobs.remove_segments`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from budget import LONG, LONG_REASON
from jobs import remove_segments

_STARTED = time.time()
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
_RANK = any(name in os.environ for name in _RANK_VARS)  # a job's rank: its job runs on
_FILE_SECONDS: dict[str, float] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"long: {LONG_REASON}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG:
        return
    skip = pytest.mark.skip(reason=LONG_REASON)
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After each test, the segments of the jobs it aborted (a 64 MiB /dev/shm, a
    container's default, otherwise fills up within the suite and MPICH's next job fails to
    start); listing /dev/shm is all it costs when the test aborted none."""
    started = time.time()
    yield
    if not _RANK:
        remove_segments(started)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _RANK:
        remove_segments(_STARTED)


def _rank() -> int:
    for name in _RANK_VARS:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    path = os.environ.get("FUELSPMD_SUMMARY")
    if not path or _rank() != 0:
        return
    stats = terminalreporter.stats
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") != "teardown"
                      or k == "error"]) for k in ("passed", "failed", "skipped", "error")}
    with open(path, "w") as f:
        json.dump({**counts, "files": _FILE_SECONDS}, f)
