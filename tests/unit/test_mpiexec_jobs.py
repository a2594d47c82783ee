"""Whole jobs under a real ``mpiexec``: the world each rank sees, one failure ending the job,
and a rank that never joins turning into CommTimeoutError on the others.

Each test starts its own ``mpiexec`` from this one pytest process, in its own process group,
with a deadline, and kills the group if it outlives it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import mpiexec, needs_mpiexec
from jobs import run_job as _run

pytestmark = needs_mpiexec


def run_job(n: int, code: str, *, deadline: float = 60.0) -> tuple[int, str, str, float]:
    """Run ``python -c code`` on ``n`` ranks; return (exit code, stdout, stderr, seconds)."""
    job = _run(mpiexec(n, sys.executable, "-c", code), deadline=deadline)
    return job.code, job.out, job.err, job.seconds


@pytest.mark.timeout(90)
def test_three_ranks_see_one_world() -> None:
    # one os.write per rank: a line is never split between ranks' output
    rc, out, err, _ = run_job(3, "import os, fuelspmd as fs; w = fs.init(); os.write(1, "
                                 "f'RANK {w.rank} {w.size} {w.local_rank} {w.local_size} "
                                 "{w.launcher}\\n'.encode())")
    assert rc == 0, err
    rows = sorted(re.findall(r"RANK (\d+) (\d+) (\d+) (\d+) (\w+)", out))
    assert rows == [(str(r), "3", str(r), "3", "mpiexec") for r in range(3)], out


CRASH = """
import numpy as np, fuelspmd as fs
w = fs.init(timeout=120)
buf = np.ones(4, dtype=np.float32)
if w.rank == 1:
    raise ValueError("rank one fails on purpose")
w.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()  # rank 0 waits here for rank 1
"""


@pytest.mark.timeout(90)
def test_an_exception_on_one_rank_ends_the_job_within_seconds() -> None:
    rc, _, err, took = run_job(2, CRASH)
    assert rc != 0
    assert took < 20, f"the job took {took:.1f} s to end"
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "[rank 1] ValueError: rank one fails on purpose" in err
    assert "aborting all 2 ranks" in err


NEVER_JOINS = """
import os, sys, time, numpy as np, fuelspmd as fs
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()   # a slow import is not the timeout under test
w = fs.init(timeout=1.5)
if w.rank == 1:
    time.sleep(6)          # never joins the all_reduce in time
    os._exit(0)
buf = np.ones(4, dtype=np.float32)
start = time.monotonic()
try:
    w.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()
except fs.CommTimeoutError as e:
    print(f"TIMEOUT {time.monotonic() - start:.2f} {e}", flush=True)
    os._exit(0)
print("NO TIMEOUT", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_rank_that_never_joins_is_a_timeout_not_a_hang() -> None:
    _, out, err, _ = run_job(2, NEVER_JOINS)
    line = next((ln for ln in out.splitlines() if ln.startswith("TIMEOUT")), None)
    assert line is not None, f"{out}\n{err}"
    waited = float(line.split()[1])
    assert 1.4 <= waited < 3.5, line
    assert "all_reduce" in line
