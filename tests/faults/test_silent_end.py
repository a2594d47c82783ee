"""No silent end: a rank that leaves without finalising is named, and the job fails
(issue 41).

Under MPICH's ``mpiexec``, a rank that called ``os._exit(0)`` while the others waited in a
collective ended the job with exit status 0 and no message, and a rank killed by SIGKILL
was named by nobody (Hydra's "BAD TERMINATION ... PID" named another rank's process). Now
``fs.init`` supervises each rank from the launcher's own child (``fuelspmd.launch
.supervise``): one line names the rank, its host and how it ended, and the job exits
non-zero, under MPICH's and Open MPI's ``mpiexec`` and ``srun``. Under a plain ``srun``,
which leaves the others running, they find the rank gone (the peer watch) and end the job.

Each case is a real 2-rank job with a 60 s deadline and the ranks' transport timeout at
120 s, so only the supervisor and the launcher can end it in time; no process of the job
may be left (the fault matrix's tag scan). CI runs ``os._exit(0)`` and a SIGKILL from
outside under MPICH, and ``os._exit(0)`` under ``srun``; the long run (``python
tests/run.py --long``) every way of ending under every launcher, Open MPI's included.
"""

from __future__ import annotations

import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget import long_only
from faultjobs import Jobs, Launcher, mpich_launcher
from hung import Background, launcher_for

pytestmark = pytest.mark.timeout(300)
HOST = socket.gethostname().split(".")[0]

# rank 1 ends one way after the first all_reduce, while rank 0 waits in the second
ENDS = {
    "exit0": "os._exit(0)",
    "exit3": "os._exit(3)",
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL); time.sleep(60)",
    "abort": "os.abort()",
    "outside": "print(f'READY rank 1 pid {os.getpid()}', flush=True); time.sleep(60)",
}
JOB = """
import os, signal, sys, time, numpy as np, fuelspmd as fs
w = fs.init(timeout=120)
buf = np.ones(4)
w.transport.all_reduce(buf, "sum").wait()
if w.rank == 1:
    sys.stderr.write(f"FAULT at {{time.time():.6f}}\\n")
    {end}
w.transport.all_reduce(buf, "sum").wait()
print("SURVIVED", w.rank, flush=True)
"""
SAID = {
    "exit0": rf"\[rank 1\] on host {HOST}: exited with status 0 without finalizing .*"
             r"the job fails, exit status 1",
    "exit3": rf"\[rank 1\] on host {HOST}: exited with status 3 without finalizing; the job "
             r"fails",
    "sigkill": rf"\[rank 1\] on host {HOST}: killed by signal 9 \(SIGKILL\) without "
               r"finalizing; the job fails",
    "abort": rf"\[rank 1\] on host {HOST}: killed by signal 6 \(SIGABRT\) without "
             r"finalizing; the job fails",
}
SAID["outside"] = SAID["sigkill"]
# the peer watch of a plain srun's surviving rank
WATCHED = r"\[rank 0\] rank 1 \(pid \d+\) on this node \(\S+\) died without finalizing"

CI = {("mpich", "exit0"), ("mpich", "outside"), ("srun", "exit0")}


def _cells(launchers: tuple[str, ...]) -> list[object]:
    return [pytest.param(lch, end, marks=() if (lch, end) in CI else long_only)
            for lch in launchers for end in ENDS]


def _run(launcher: Launcher, end: str, tmp_path: Path, fault_jobs: Jobs) -> tuple[int, str,
                                                                                  float]:
    """Run the job; return its exit status, output and seconds from the fault to its end."""
    code = JOB.format(end=ENDS[end])
    if end != "outside":
        returncode, output = fault_jobs.run_code(launcher, 2, code)
        gone = time.time()
    else:  # the interpreter killed from outside (the OOM killer, a user's kill -9)
        with Background(launcher, 2, ["-c", code], tmp_path) as job:
            (pid,) = job.ready(1).values()
            time.sleep(0.2)  # rank 0 waits in its all_reduce
            fault = time.time()
            job.signal_ranks({1: pid}, signal.SIGKILL)
            returncode, output = job.wait(60)
            gone = time.time()
        assert returncode is not None, output
        return returncode, output, gone - fault
    assert returncode is not None, output
    fault = float(re.findall(r"FAULT at ([0-9.]+)", output)[-1])
    return returncode, output, gone - fault


@pytest.mark.parametrize(("launcher", "end"), _cells(("mpich", "openmpi")) + [
    pytest.param(c.values[0], c.values[1], marks=[*c.marks, pytest.mark.slurm])
    for c in _cells(("srun",))])
def test_a_rank_that_leaves_without_finalizing_is_named_and_fails_the_job(
        launcher: str, end: str, tmp_path: Path, fault_jobs: Jobs,
        request: pytest.FixtureRequest, fault_time: Callable[[str, str, float], None]) -> None:
    returncode, output, took = _run(launcher_for(launcher, request), end, tmp_path, fault_jobs)
    fault_time(f"rank 1 {end}", launcher, took)
    assert returncode != 0, output
    assert len(re.findall(SAID[end], output)) == 1, output
    assert "SURVIVED" not in output and "CommTimeoutError" not in output, output
    assert took < 30, f"{took:.1f} s\n{output}"


@pytest.mark.slurm
@long_only
@pytest.mark.parametrize("end", ["exit0", "sigkill"])
def test_under_a_plain_srun_the_others_find_the_rank_gone(
        end: str, tmp_path: Path, fault_jobs: Jobs, request: pytest.FixtureRequest,
        fault_time: Callable[[str, str, float], None]) -> None:
    """``srun`` without --kill-on-bad-exit leaves rank 0 waiting: the supervisor names rank
    1, and rank 0's peer watch sees it gone and ends the job."""
    returncode, output, took = _run(launcher_for("srun-plain", request), end, tmp_path,
                                    fault_jobs)
    fault_time(f"rank 1 {end}", "srun-plain", took)
    assert returncode != 0, output
    assert len(re.findall(SAID[end], output)) == 1, output
    assert re.search(WATCHED, output), output
    assert took < 30, f"{took:.1f} s\n{output}"


def test_a_rank_that_finalized_may_leave_as_it_likes(fault_jobs: Jobs) -> None:
    """world.finalize(), then os._exit(0) on every rank: nothing to report, status 0."""
    code = ("import os, numpy as np, fuelspmd as fs\nw = fs.init(timeout=60)\n"
            "b = np.ones(2)\nw.transport.all_reduce(b, 'sum').wait()\nw.finalize()\n"
            "os.write(1, f'LEFT {w.rank} {b[0]}\\n'.encode())\nos._exit(0)\n")
    returncode, output = fault_jobs.run_code(mpich_launcher(), 2, code)
    assert returncode == 0, output
    assert sorted(re.findall(r"LEFT (\d) 2\.0", output)) == ["0", "1"], output
    assert "without finalizing" not in output, output
