"""A rank waiting on a peer that has finished is told within seconds, at the default
timeout: real ``mpiexec`` jobs whose rank 0 waits on a rank that left (its script ended,
or it called ``World.finalize``) without issuing what rank 0 waits for.

Rank 0 prints ``RESULT 0 <error class or OK> <seconds> <message>``; the job must end well
inside its deadline, so a wait that ran into the 600 s timeout fails the test.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import mpiexec, needs_mpiexec, run_job

pytestmark = [needs_mpiexec, pytest.mark.timeout(120)]

HEAD = """
import os, sys, time, numpy as np, fuelspmd as fs
w = fs.init()  # the default timeout, 600 s
def result(wait):
    start = time.monotonic()
    try:
        wait()
        out = "OK"
    except fs.CommError as e:
        out = f"{type(e).__name__} {time.monotonic() - start:.2f} {e}"
    os.write(1, f"RESULT {w.rank} {out.split()[0]} {out}\\n".encode())
"""


def rank0(n: int, body: str, *, ok: bool = True) -> tuple[str, str]:
    """Run ``HEAD + body`` on ``n`` ranks; return rank 0's error class (or OK) and line;
    the job must end with status 0 if ``ok``, else not."""
    job = run_job(mpiexec(n, sys.executable, "-c", HEAD + body), deadline=60.0)
    found = re.findall(r"^RESULT 0 (\S+) (.*)$", job.out, re.M)
    assert (job.code == 0) == ok and len(found) == 1, f"{job.code}\n{job.out}\n{job.err}"
    return found[0]


def seconds(line: str) -> float:
    return float(line.split()[1])


def test_recv_from_a_rank_that_exited_names_it_and_the_recv() -> None:
    kind, line = rank0(2, """
if w.rank == 0:
    result(lambda: w.comm.recv((3,), "float64", 1, tag=7).numpy())
""")  # rank 1's script ends: the interpreter exits
    assert kind == "PeerAbortedError", line
    assert seconds(line) < 10.0, line
    assert "recv op #0" in line and "src=1" in line and "tag=7" in line, line
    assert "rank 1 finished normally" in line and "message #1" in line, line


def test_collective_rank_0_enters_alone() -> None:
    kind, line = rank0(2, """
if w.rank == 0:
    result(lambda: w.comm.all_gather(fs.tensor(np.ones(3))).numpy())
""")  # rank 1's script ends at once
    assert kind == "PeerAbortedError", line
    assert seconds(line) < 10.0, line
    assert "all_gather op #0 (collective #0)" in line, line
    assert "rank 1 finished normally" in line and "never join collective #0" in line, line


def test_collective_a_finalized_rank_never_joins() -> None:
    kind, line = rank0(3, """
b = np.ones(4)
w.transport.all_reduce(b, "sum").wait()
if w.rank == 2:
    w.finalize()
    time.sleep(3)  # still alive: the bye, not the exit, tells the others
else:
    result(lambda: w.transport.all_reduce(b, "sum").wait())
    w.finalize()  # collective: it frees the world's shared windows with rank 2's
""")
    assert kind == "PeerAbortedError", line
    assert seconds(line) < 10.0, line
    assert "all_reduce op #1 (collective #1)" in line, line
    assert "rank 2 finished normally" in line and "after issuing 1 collectives" in line, line


def test_recv_on_a_split_from_a_rank_that_finalized() -> None:
    kind, line = rank0(2, """
sub = w.comm.split(0, w.rank)  # its own guard: World.finalize closes it too
if w.rank == 1:
    w.finalize()
    time.sleep(3)
else:
    result(lambda: sub.recv((2,), "float32", 1).numpy())
    w.finalize()
""")
    assert kind == "PeerAbortedError", line
    assert seconds(line) < 10.0, line
    assert "recv op #0" in line and "float32" in line and "rank 1 finished normally" in line


def test_plugin_world_under_a_guard() -> None:
    kind, line = rank0(2, """
from fuelspmd.comm import GuardedTransport
from fuelspmd_mpi import plugin
w.finalize()
g = GuardedTransport(plugin.world(timeout=600))
if g.rank == 0:
    result(lambda: g.recv(np.empty(5, np.float32), 1, 2).wait())
""")
    assert kind == "PeerAbortedError", line
    assert seconds(line) < 10.0, line
    assert "recv op #0" in line and "rank 1 finished normally" in line, line


def test_a_rank_that_died_of_an_exception_says_so() -> None:
    """Without fs.init's crash handler (which would end the job) the interpreter prints the
    traceback and exits: its exit hook says how the rank ended."""
    kind, line = rank0(2, """
from fuelspmd.comm import GuardedTransport
from fuelspmd_mpi import plugin
w.finalize()
g = GuardedTransport(plugin.world(timeout=600))
if g.rank == 1:
    raise ValueError("rank one fails on purpose")
result(lambda: g.recv(np.empty(5, np.float32), 1, 2).wait())
""", ok=False)
    assert kind == "PeerAbortedError", line
    assert seconds(line) < 10.0, line
    assert "rank 1 died of an unhandled ValueError (rank one fails on purpose)" in line, line


def test_a_peer_that_sent_everything_before_leaving_is_no_error() -> None:
    kind, line = rank0(3, """
big = np.arange(1 << 18, dtype=np.float64)
if w.rank == 1:
    w.comm.send(fs.tensor(big), 0, tag=1).realize()  # then its script ends
elif w.rank == 2:
    time.sleep(1.0)  # a slow peer that will send: rank 1's bye must not fail this
    w.transport.send(big[:8], 0, 4).wait()
else:
    time.sleep(1.5)  # rank 1 has left by now
    def both():
        got = w.comm.recv(big.shape, "float64", 1, tag=1).numpy()
        assert np.array_equal(got, big)
        small = np.empty(8)
        w.transport.recv(small, 2, 4).wait()
        assert np.array_equal(small, big[:8])
    result(both)
""")
    assert kind == "OK", line
