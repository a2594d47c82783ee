"""``fuelspmd info`` as a user runs it: a plain script run and a 2-rank mpiexec job.

Checked: the text names the version, the launcher, the world's transport and every
installed transport plugin; ``--json`` carries the same facts; under mpiexec the world's
all-reduce plan is reported per size (what ``transport.all_reduce_algorithm`` answers),
MPI's own for 8 bytes, and nothing for a one-process world, which has no choice to make.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import mpiexec, needs_mpiexec, run_job

import fuelspmd

INFO = [sys.executable, "-m", "fuelspmd", "info"]


def test_plain_run_text_and_json() -> None:
    text = run_job(INFO, deadline=120)
    assert text.code == 0, text.err
    assert f"fuelspmd {fuelspmd.__version__}" in text.out
    assert "launcher   none: 1 rank(s)" in text.out and "transport self" in text.out
    assert "all_reduce" not in text.out  # one process: nothing is reduced
    facts = json.loads(run_job([*INFO, "--json"], deadline=120).out)
    assert facts["size"] == 1 and facts["transport"] == "self" and facts["all_reduce"] is None
    names = {t["name"] for t in facts["transports"]}
    assert "mpi" in names and all(name in text.out for name in names)


@needs_mpiexec
def test_mpiexec_reports_the_all_reduce_plan() -> None:
    job = run_job(mpiexec(2, *INFO, "--json"), deadline=180)
    assert job.code == 0, job.err
    facts = json.loads(job.out)  # rank 0 alone prints
    assert facts["size"] == 2 and facts["launcher"] == "mpiexec"
    assert facts["transport"] == "guarded-mpi"
    plan = facts["all_reduce"]
    assert list(plan) == ["8 B", "64 KiB", "1 MiB", "16 MiB", "64 MiB"]
    assert plan["8 B"] == "mpi" and set(plan.values()) <= {"mpi", "shm", "hierarchical"}
    text = run_job(mpiexec(2, *INFO), deadline=180)
    assert text.code == 0, text.err
    line = next(ln for ln in text.out.splitlines() if ln.startswith("all_reduce"))
    assert "8 B mpi" in line and "explain_all_reduce" in line
