"""How a failed multi-rank job reads: the cause once, the statuses a shell expects, and no
MPI shared memory left in /dev/shm.

Real ``mpiexec -n 4`` jobs, each with a deadline after which its process group is killed.
Every rank prints the /dev/shm files it maps (``SEGMENT path``), so a test checks that
exactly this job's files are gone, whatever other jobs on the machine leave.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import clean_env, mpiexec, needs_mpiexec, run_job

pytestmark = [needs_mpiexec, pytest.mark.timeout(180)]

PROGRAM = r"""
import os, sys, time
import numpy as np
import fuelspmd as fs
from fuelspmd.errors import ConfigError
world = fs.init(timeout=60, tracebacks=sys.argv[2] if len(sys.argv) > 2 else "first")
with open("/proc/self/maps") as f:
    shm = sorted({l.split()[-1] for l in f if "/dev/shm/mpich_shm_" in l
                  and not l.rstrip().endswith("(deleted)")})
sys.stdout.write("".join(f"SEGMENT {p}\n" for p in shm) + f"PID {os.getpid()}\n")
sys.stdout.flush()
buf = np.ones(4)
world.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()
how = sys.argv[1]
if how == "config":  # the same bad input on every rank (invariant 4)
    raise ConfigError(f"tp=3 does not divide the 64 heads; use tp in [1, 2, 4, 8]")
if world.rank == 0:
    sys.stdout.write("READY\n")
    sys.stdout.flush()
while True:  # until a signal ends the job
    world.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()
    time.sleep(0.01)
"""


def _segments(output: str) -> set[str]:
    found = set(re.findall(r"^SEGMENT (\S+)$", output, re.M))
    assert found, f"no rank reported its MPI segment:\n{output}"
    return found


def _assert_no_segments_left(output: str) -> None:
    left = [p for p in _segments(output) if os.path.exists(p)]
    assert not left, f"the job left {left} in /dev/shm:\n{output}"


def test_an_error_every_rank_raises_prints_one_traceback() -> None:
    job = run_job(mpiexec(4, sys.executable, "-c", PROGRAM, "config"), deadline=120)
    out = job.out + job.err
    assert job.code == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    first = re.findall(r"\[rank (\d)\] unhandled ConfigError; aborting all 4 ranks", out)
    assert len(first) == 1, out
    assert f"[rank {first[0]}] fuelspmd.errors.ConfigError: tp=3 does not divide" in out
    others = re.findall(r"\[rank (\d)\] unhandled ConfigError: tp=3 does not divide the 64 "
                        r"heads; use tp in \[1, 2, 4, 8\] \(the traceback is printed once, "
                        r"by the first rank of this node to fail; init\(tracebacks='all'\)", out)
    assert first[0] not in others and len(set(others)) == len(others), out
    # the first rank's header and 4 lines of traceback, a line from each other rank that
    # failed before the first one's abort ended it, and that abort, reported at most once by
    # MPICH: its line is written inside MPI_Abort, which has the process manager kill the
    # job, so the proxy may die before it forwards that line (ours precede it by a pause)
    report = [line for line in job.err.splitlines() if not line.startswith("Abort(")]
    mine = [line for line in report if line.startswith(f"[rank {first[0]}] ")]
    assert mine[0].endswith("unhandled ConfigError; aborting all 4 ranks")
    assert mine[1].endswith("Traceback (most recent call last):"), job.err
    assert len(report) == len(mine) + len(others), job.err
    assert len(re.findall(r"^Abort\(1\) on node", job.err, re.M)) <= 1, job.err
    _assert_no_segments_left(out)


def test_verbose_prints_every_ranks_traceback() -> None:
    job = run_job(mpiexec(4, sys.executable, "-c", PROGRAM, "config", "all"), deadline=120)
    out = job.out + job.err
    assert job.code == 1, out
    assert out.count("Traceback (most recent call last)") >= 2, out
    _assert_no_segments_left(out)


def _signalled(send: str) -> tuple[int | None, str]:
    """Start the looping job, wait for READY, send the signal; return (status, output)."""
    proc = subprocess.Popen(mpiexec(4, sys.executable, "-c", PROGRAM, "loop"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(), start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + 60
    while not any("READY" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert any("READY" in line for line in lines), "".join(lines)
        if send == "ctrl-c":  # a terminal's Ctrl-C: SIGINT to the whole foreground group
            os.killpg(proc.pid, signal.SIGINT)
        else:  # one rank asked to stop, as a scheduler's preemption does
            os.kill(int(re.findall(r"^PID (\d+)$", "".join(lines), re.M)[-1]), signal.SIGTERM)
        code: int | None = proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, AssertionError):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(10)
    return code, "".join(lines)


def test_ctrl_c_ends_the_job_with_130_and_no_traceback() -> None:
    code, out = _signalled("ctrl-c")
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert len(re.findall(r"\[rank \d\] interrupted \(SIGINT\) at \S+:\d+ in \S+; ending "
                          r"all 4 ranks, exit status 130", out)) == 1, out
    _assert_no_segments_left(out)


def test_sigterm_to_one_rank_ends_the_job_with_143() -> None:
    code, out = _signalled("sigterm")
    assert code == 143, out
    assert "Traceback" not in out, out
    assert len(re.findall(r"\[rank \d\] terminated \(SIGTERM\) at \S+:\d+ in \S+; "
                          r"ending all 4 ranks, exit status 143", out)) == 1, out
    _assert_no_segments_left(out)
