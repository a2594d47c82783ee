"""No mismatched collective reaches MPI, and no failure corrupts memory.

The documented example of docs/reliability.md (``plugin.world()`` + ``GuardedTransport``,
rank 2 all-reducing float64 where the others use float32) and the whole mismatch matrix
(every collective field and every send/recv fault, in the default and debug modes, on
MPI's own all-reduce and the shared-memory one, small and large) run under glibc's
``MALLOC_CHECK_=3`` and ``MALLOC_PERTURB_``, which turn a write into freed memory into an
abort (SIGABRT) at the next allocation instead of a wrong number later. Every rank must
raise ``CollectiveMismatchError`` in every case, and no job may end any other way.

A corruption shows only in some runs, so the repeats are the test's budget: the example
3 times and the matrix twice (one job) in CI, 20 times each (the matrix in jobs of 5
rounds) in the long run, ``python tests/run.py --long`` (tests/budget.py).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget import runs
from jobs import clean_env, mpiexec, needs_mpiexec, run_job

JOB = Path(__file__).with_name("mismatch_job.py")
RUNS = runs(ci=3, long=20)  # jobs of the documented example
ROUNDS = runs(ci=2, long=20)  # rounds of the whole matrix
PER_JOB = min(ROUNDS, 5)  # rounds in one job of the matrix
HEAP = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
pytestmark = [needs_mpiexec, pytest.mark.timeout(600)]


def _no_heap_abort(text: str) -> None:
    for sign in ("malloc", "corrupted", "double free", "free():", "Aborted"):
        assert sign not in text, text[-3000:]


def test_the_documented_example_raises_everywhere_and_corrupts_nothing(tmp_path: Path) -> None:
    for i in range(RUNS):
        cwd = tmp_path / f"run{i}"
        cwd.mkdir()
        job = run_job(mpiexec(4, sys.executable, str(JOB), "example"), deadline=60,
                      env=clean_env(**HEAP), cwd=cwd)
        _no_heap_abort(job.out + job.err)
        assert job.code not in (-signal.SIGABRT, 128 + signal.SIGABRT, 134), job.err[-3000:]
        assert job.code != 0, "the example's mismatch must end the job"
        raised = job.err.count("fuelspmd.errors.CollectiveMismatchError: collective mismatch")
        assert raised == 4, f"run {i}: {raised} of 4 ranks raised\n{job.err[-3000:]}"
        assert "differing fields ['dtype']" in job.err
        assert sorted(p.name for p in (cwd / "trace").iterdir()) == [
            f"rank{r}.json" for r in range(4)]  # the flight recorder's dumps


def test_the_mismatch_matrix_raises_everywhere_and_corrupts_nothing(tmp_path: Path) -> None:
    for j in range(ROUNDS // PER_JOB):
        out = tmp_path / f"job{j}"
        out.mkdir()
        job = run_job(mpiexec(4, sys.executable, str(JOB), "matrix", str(out), str(PER_JOB)),
                      deadline=240, env=clean_env(**HEAP))
        _no_heap_abort(job.out + job.err)
        assert job.code == 0, job.err[-3000:]
        for rank in range(4):
            lines = (out / f"rank{rank}.txt").read_text().split("\n")[:-1]
            assert len(lines) == 96 * PER_JOB, (rank, len(lines))
            for line in lines:
                _, got, took = line.split()
                assert got == "CollectiveMismatchError", f"rank {rank}: {line}"
                assert float(took) < 5.0, f"rank {rank}: {line}"
