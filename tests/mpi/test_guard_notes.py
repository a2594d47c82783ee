"""The guard's notes never make a deadlock of a correct program (issue 41).

A wait past a slice sends a note (what this rank waits in) and reads the peers' notes; a
note is read late, whenever the reader's own wait passes a slice, which the collector's
pauses and the machine's load decide. Two ways that read used to cry wolf:

- the note gave the peer's count of messages *issued* with this rank as the number of the
  one it waits for; with receives posted ahead (a pipeline's batched transfers) the count
  is larger, so a recv that an already sent message satisfies looked like a deadlock;
- a note about a *send* was taken as still true, though MPI may complete a send before
  its recv is posted, and the peer may have left it long ago.

``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_guard_notes.py`` (N >= 2:
ranks 0 and 1 exchange, the others only meet them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from fuelspmd.comm import GuardedTransport, Recorder
from fuelspmd.comm.fingerprint import Fingerprint
from fuelspmd.comm.guard import _NOTE, _WAIT, FP_LEN
from fuelspmd.errors import CollectiveMismatchError
from fuelspmd.transport import WATCH_S

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(60)]

PAUSE = 6 * WATCH_S  # long enough that the peer's wait passes a slice and sends its note


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=30)
    yield t
    t.barrier().wait()


@contextmanager
def guarded(world: Any) -> Iterator[GuardedTransport]:
    """A guard over a fresh split, closed (its channel drained) and freed after."""
    t = world.split(0, world.rank)
    g = GuardedTransport(t, timeout=10.0, recorder=Recorder())
    try:
        yield g
    finally:
        g.close()
        world.comm.Barrier()
        t.finalize()


def test_a_recv_posted_ahead_is_no_deadlock(world: Any) -> None:
    """Rank 1 posts two receives from rank 0 and waits in the first past a slice (its
    note: waiting in recv #1, with 2 issued); rank 0 sends #1, then waits in its recv of
    rank 1's first message past a slice, before it sends #2. Rank 1's recv #1 completes,
    so nothing is stuck: reading that note must not raise (it did: the count, 2, was taken
    for the message waited for, which rank 0 had not sent)."""
    with guarded(world) as g:
        got = np.empty(4)
        if g.rank == 1:
            a, b = np.empty(4), np.empty(4)
            wa, wb = g.recv(a, 0, 0), g.recv(b, 0, 1)  # posted ahead, as a batch
            wa.wait()  # rank 0 sends #1 only after PAUSE: this wait announces itself
            time.sleep(PAUSE)  # compute: rank 0 waits for our message past a slice
            g.send(np.full(4, 7.0), 0, 0).wait()
            wb.wait()
            assert (a == 1.0).all() and (b == 2.0).all(), (a, b)
        elif g.rank == 0:
            time.sleep(PAUSE)
            g.send(np.full(4, 1.0), 1, 0).wait()
            g.recv(got, 1, 0).wait()  # reads rank 1's note inside this wait
            g.send(np.full(4, 2.0), 1, 1).wait()
            assert (got == 7.0).all(), got
        g.barrier().wait()  # the fence: every send met its recv


def _note(k: int, sent: int, recvd: int, fp: Fingerprint) -> np.ndarray:
    note = np.zeros(_NOTE, np.int64)
    note[:4] = (_WAIT, k, sent, recvd)
    note[4:4 + FP_LEN] = fp.encode()
    return note


def test_a_note_about_a_send_proves_no_deadlock(world: Any) -> None:
    """Rank 0 waits in its send #1 to rank 1, which has posted no recv from it yet; rank
    1's note says it waits in its send #1 to rank 0, which rank 0 has not received either.
    MPI may complete either send unmatched (buffered), and rank 1 may have left its send
    long before this note is read, so this is no proof of a deadlock: nothing raises (the
    timeout names a real one). A note about a recv of a message rank 0 never sent does
    prove one (rank 1 is still in it), and raises. Driven through the guard's decision
    directly: when a send is still pending past a slice depends on MPI's buffering."""
    with guarded(world) as g:
        guard = g.guard
        mine = Fingerprint(0, "send", (4,), "float64", group=g.group, src=0, dst=1, tag=0,
                           cseq=0)
        if g.rank == 0:  # counted, its fingerprint posted to rank 1
            k = guard.sent_to(1, mine.encode())
        world.comm.Barrier()
        if g.rank == 1:  # which rank 1's close would otherwise wait for
            guard.descriptor(0, 1, 10.0)
        world.comm.Barrier()
        if g.rank == 0:
            guard.cur = (mine.encode(), 0, 0, k, -1, None)
            send = Fingerprint(0, "send", (4,), "float64", group=g.group, src=1, dst=0,
                               tag=0, cseq=0)
            guard._square(1, _note(1, 1, 0, send))  # nothing raised
            guard.recvd_from(1)  # rank 0's recv of that send: the pair is even again
            mine = Fingerprint(1, "recv", (4,), "float64", group=g.group, src=1, dst=0, tag=1,
                               cseq=0)
            guard.cur = (mine.encode(), 1, 0, 2, -1, None)  # its recv #2 from rank 1
            recv = Fingerprint(1, "recv", (4,), "float64", group=g.group, src=0, dst=1, tag=1,
                               cseq=0)
            with pytest.raises(CollectiveMismatchError, match="point-to-point mismatch"):
                guard._square(1, _note(2, 1, 2, recv))  # rank 1 waits for our unsent #2
            guard.cur = None
        world.comm.Barrier()
