"""Shared test setup: a per-run summary the runner (tests/run.py) adds up.

When FUELSPMD_SUMMARY is set, each pytest process writes its outcome counts there as
JSON (rank 0 only under mpiexec), so one line can report every run of the suite.
"""

from __future__ import annotations

import json
import os

import pytest


def _rank() -> int:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
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
        json.dump(counts, f)
