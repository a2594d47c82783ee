"""Crash propagation: {exception, sys.exit(1), os.abort(), SIGKILL} x {MPICH mpiexec,
Open MPI mpiexec, srun} x {before, during, between collectives}.

Every cell must end ALL ranks of the job with a non-zero exit within 30 s of the failure,
print the cause once (and nothing from the ranks that were ended), and leave no process
of the job behind, checked by the job's tag in /proc/*/environ (see conftest.py), nor any
of the MPI shared-memory files its ranks mapped, where some rank of the job still runs
code on the way out (see SEGMENTS_KEPT for the cells where none does). The
ranks wait with a 120 s transport timeout, longer than the job's 60 s deadline, so a
cell passes only if the crash handler and the launcher end the job, not a timeout.

CI runs MPICH's whole matrix (12 cells) and, under Open MPI and srun, four cells each
(``PAIRS``: every kind and every moment at least once per launcher; with MPICH's cells
every pair of launcher, kind and moment); the long run, ``python tests/run.py --long``,
runs every cell of every launcher (tests/budget.py).
"""

from __future__ import annotations

import re
import time

import pytest
from budget import long_only
from faultjobs import BOUND_S, KINDS, MOMENTS, Jobs, Matrix, Outcome, mpich_launcher

# the first test of a launcher runs all of its cells (two jobs at a time)
pytestmark = pytest.mark.timeout(400)

# What names the cause, per kind: printed by the failing rank (exception, exit; abort
# through faulthandler) or by the launcher that saw the rank die (SIGKILL).
CAUSE = {
    "exception": r"\[rank {r}\] unhandled ValueError; aborting all {n} ranks",
    "exit": r"\[rank {r}\] sys\.exit\(1\) at .*crasher\.py:\d+: exit status 1; "
            r"aborting all {n} ranks",
    "abort": r"Fatal Python error: Aborted",
}
SIGKILL_SEEN = {
    "mpich": r"EXIT CODE: 9",
    "openmpi": r"exited on\s+signal 9",
    "srun": r"task {r}: Killed",
    "srun-plain": r"task {r}: Killed",
}
# The cells where no process of the job runs any code once a rank has died: the rank ends
# without Python (os.abort, SIGKILL) and Hydra SIGKILLs the others at once, so nothing can
# unlink the job's segment (it is MPI_Finalize's to unlink, and the sweep of
# tests/jobs.py's remove_segments takes it here). Everywhere else the crash path does:
# the failing rank's handler, a survivor's SIGTERM handler (srun and Open MPI's mpirun
# send SIGTERM first) or the peer watch of a plain srun.
SEGMENTS_KEPT = {("mpich", "abort"), ("mpich", "sigkill")}
# the peer watch of fs.init() on a surviving rank, when the launcher did not end the job
WATCH = r"\[rank \d+\] rank {r} \(pid \d+\) on this node \(\S+\) died without finalizing"


def check(o: Outcome) -> None:
    """Assert the cell's guarantees, with the job's output in every message."""
    c = o.cell
    context = (f"{c.launcher} {c.kind} {c.moment} (rank {c.fail_rank} of {c.ranks}): "
               f"exit {o.returncode}, {o.wall_s:.1f} s\n{o.output[-6000:]}")
    assert not o.leftovers, f"processes left behind (killed now): {o.leftovers}\n{context}"
    assert f"FAULT rank {c.fail_rank} kind {c.kind} moment {c.moment}" in o.output, (
        f"rank {c.fail_rank} never reached the moment it fails at\n{context}")
    assert o.returncode is not None, f"the job outlived its deadline\n{context}"
    assert o.returncode != 0, context
    assert o.end_s is not None and o.end_s < BOUND_S, context
    assert "SURVIVED" not in o.output, context
    pattern = CAUSE.get(c.kind) or SIGKILL_SEEN[c.launcher]
    cause = re.findall(pattern.format(r=c.fail_rank, n=c.ranks), o.output)
    assert len(cause) == 1, f"cause {pattern!r} printed {len(cause)} times\n{context}"
    tracebacks = o.output.count("Traceback (most recent call last)")
    assert tracebacks == (1 if c.kind == "exception" else 0), context
    others = [r for r in range(c.ranks) if r != c.fail_rank]
    for r in others:  # the ranks that were ended raise nothing of their own
        assert f"[rank {r}] unhandled" not in o.output, context
        assert f"[rank {r}] sys.exit" not in o.output, context
    assert "CommTimeoutError" not in o.output, context
    if c.launcher == "srun-plain" and c.kind in ("abort", "sigkill"):
        assert re.search(WATCH.format(r=c.fail_rank), o.output), context
    assert "SEGMENT /dev/shm/" in o.output, f"no rank named its MPI segment\n{context}"
    if (c.launcher, c.kind) not in SEGMENTS_KEPT:
        assert not o.segments_left, f"left in /dev/shm: {o.segments_left}\n{context}"


# The cells CI runs under the launchers other than MPICH: each kind once, each moment at
# least once, and between the two launchers other (kind, moment) pairs.
PAIRS = {
    "openmpi": {("exception", "before"), ("exit", "during"), ("abort", "between"),
                ("sigkill", "during")},
    "srun": {("exception", "between"), ("exit", "before"), ("abort", "during"),
             ("sigkill", "before")},
}


def cells(launcher: str) -> pytest.MarkDecorator:
    """Every (kind, moment) cell; outside ``PAIRS[launcher]`` (if given) long-run only."""
    ci = PAIRS.get(launcher)
    return pytest.mark.parametrize(("kind", "moment"), [
        pytest.param(k, m, marks=() if ci is None or (k, m) in ci else long_only)
        for k in KINDS for m in MOMENTS])


@cells("mpich")
@pytest.mark.parametrize("launcher", ["mpich"])
def test_mpich_mpiexec(mpich_matrix: Matrix, launcher: str, kind: str, moment: str) -> None:
    check(mpich_matrix.outcome(kind, moment))


@cells("openmpi")
@pytest.mark.parametrize("launcher", ["openmpi"])
def test_openmpi_mpiexec(openmpi_matrix: Matrix, launcher: str, kind: str,
                         moment: str) -> None:
    check(openmpi_matrix.outcome(kind, moment))


@pytest.mark.slurm
@cells("srun")
@pytest.mark.parametrize("launcher", ["srun"])
def test_srun(srun_matrix: Matrix, launcher: str, kind: str, moment: str) -> None:
    check(srun_matrix.outcome(kind, moment))


@pytest.mark.slurm
@pytest.mark.parametrize("moment", ["during"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("launcher", ["srun-plain"])
def test_plain_srun(srun_plain_matrix: Matrix, launcher: str, kind: str, moment: str) -> None:
    """Without --kill-on-bad-exit srun leaves the survivors of a killed rank running: the
    peer watch of ``fs.init()`` ends them (a rank that reports its own failure aborts)."""
    check(srun_plain_matrix.outcome(kind, moment))


CAUGHT_EXIT = r"""
import sys, numpy as np, fuelspmd as fs
w = fs.init(timeout=60)
try:
    sys.exit(3)              # caught: the program goes on, the job must not end
except SystemExit as e:
    assert e.code == 3
buf = np.ones(4)
w.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()
sys.stdout.write(f"rank {w.rank} sum {buf[0]:g}\n")  # one write: ranks share the output
sys.stdout.flush()
sys.exit(0)                  # a zero exit on every rank is a normal end
"""


@pytest.mark.timeout(120)
def test_caught_or_zero_sys_exit_does_not_end_the_job(fault_jobs: Jobs) -> None:
    """Only a non-zero SystemExit that ends the process aborts; a caught one, or 0, does not."""
    launcher = mpich_launcher()
    rc, output = fault_jobs.run_code(launcher, 2, CAUGHT_EXIT)
    assert rc == 0, output
    assert sorted(re.findall(r"rank (\d) sum (\d+)", output)) == [("0", "2"), ("1", "2")], output
    assert "aborting" not in output, output


BEFORE_INIT = r"""
import os, time
if os.environ["PMI_RANK"] == "1":
    raise ValueError("rank 1 fails before fs.init()")
import fuelspmd as fs
fs.init(timeout=4)           # MPI_Init waits for rank 1, which never comes
print("NOT REACHED", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_failing_before_init_does_not_hang_mpich(fault_jobs: Jobs) -> None:
    """Hydra leaves the other rank in MPI_Init; init's startup deadline ends it."""
    start = time.monotonic()
    rc, output = fault_jobs.run_code(mpich_launcher(), 2, BEFORE_INIT)
    took = time.monotonic() - start
    assert rc is not None and rc != 0, output
    assert 4 <= took < 20, f"{took:.1f} s\n{output}"
    assert output.count("ValueError: rank 1 fails before fs.init()") == 1, output
    assert "Timeout (0:00:04)!" in output and "in _start_transport" in output, output
    assert "NOT REACHED" not in output, output
