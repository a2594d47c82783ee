"""The guard's in-band path: an all_reduce checked in the header of the transport's own call.

``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_guard_inband.py`` (N = 1..4).
On the shared-memory all-reduce a settled guard sends no control message for a repeated
all_reduce: the transport compares the descriptor's digest and collective number in the
header every rank reads (see fuelspmd.comm.guard). These tests check that it does so, that
results stay right when ranks announce some calls and not others (point-to-point traffic
in between), and that every fault the control streams catch is still caught: a mismatch in
each field, another operation, a skipped send or recv, each after hundreds of good
operations, every rank raising within 5 s and naming the field and the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from test_guard import (
    GUARD_TIMEOUT,
    TIMEOUT,
    assert_all_raised,
    assert_timed_out,
    good_op,
    outcome,
)

from fuelspmd.comm import GuardedTransport

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

N = 1 << 16  # float32 elements: 256 KiB, the shared-memory path


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    yield t
    t.barrier().wait()


@contextmanager
def shm_guard(world: Any, timeout: float = GUARD_TIMEOUT) -> Iterator[GuardedTransport]:
    """A default-mode guard with no flight recorder (as ``fs.init()`` builds it) over a
    fresh split whose all_reduce runs the shared-memory path; finalized after."""
    t = world.split(0, world.rank)
    g = None
    try:
        algo = "shm" if world.size > 1 else "mpi"
        assert t.set_all_reduce_policy(algorithm=algo) == algo
        g = GuardedTransport(t, timeout=timeout)
        yield g
    finally:
        if g is not None:
            g.close()
        drain(t.comm, world.comm)
        t.finalize()


def drain(comm: Any, world: Any) -> None:
    """Receive what a faulty test left unreceived on ``comm`` (a send whose recv was
    skipped): once the communicator is freed, MPI may give its context to a later split,
    whose receives would match the stale message. The barriers are the world's: after a
    fault, ranks may have issued different collectives on ``comm``."""
    from mpi4py import MPI

    world.Barrier()  # every send of the test has been issued (an eager one has arrived)
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        comm.Recv(np.empty(status.Get_count(MPI.BYTE), np.uint8), status.Get_source(),
                  status.Get_tag())
    world.Barrier()


def big(g: GuardedTransport, i: int, op: str = "sum") -> None:
    b = np.full(N, float(g.rank + i), np.float32)
    g.all_reduce(b, op).wait()
    want = sum(range(g.size)) + g.size * i if op == "sum" else g.size - 1 + i
    assert b[0] == want and b[-1] == want, (b[0], want)


def mixed_ops(g: GuardedTransport, n: int) -> None:
    """``n`` rounds of shared-memory all_reduces, some right after a pairwise swap (whose
    matches are still in flight: that rank announces the all_reduce, and every rank then
    does), some after an all_gather or a small all_reduce (MPI's own path, announced)."""
    for i in range(n):
        k = i % 5
        if k in (1, 2, 3):  # an all_gather, a small all_reduce, a swap
            good_op(g, i, (1, 0, 3)[k - 1])
        big(g, i, "max" if k == 4 else "sum")


def test_a_repeated_all_reduce_sends_no_control_message(world: Any) -> None:
    if world.size < 2:
        pytest.skip("a check between ranks needs two")
    with shm_guard(world) as g:
        big(g, 0)  # the first of its kind is announced
        announced = g.guard._colls_issued
        for i in range(1, 300):
            big(g, i)
        assert g.guard._colls_issued == announced
        assert g.cseq == 300 and g.guard.settled()
        # an equal dtype that is another object (numpy makes one per byte-order request)
        other = np.dtype(np.float32).newbyteorder("<")
        assert other == np.float32 and other is not np.dtype(np.float32)
        for i in range(20):
            b = np.full(N, float(g.rank + i), other if i % 2 else np.float32)
            g.all_reduce(b, "sum").wait()
            assert b[0] == sum(range(g.size)) + g.size * i
        assert g.guard._colls_issued == announced


def test_announced_and_in_band_calls_mixed_stay_in_step(world: Any) -> None:
    with shm_guard(world) as g:
        mixed_ops(g, 400)
        g.barrier().wait()
        every = world.comm.allgather((g.seq, g.cseq))
        assert all(c == every[0][1] for _, c in every), every
        assert g.guard.settled() or world.size == 1


def _fault(g: GuardedTransport, bad: bool, field: str) -> None:
    if bad and field == "op":
        g.all_gather(np.zeros(N, np.float32), np.empty(N * g.size, np.float32)).wait()
        return
    if bad and field == "seq":  # this rank counted a collective it never issued
        g.seq += 1
        g.cseq += 1
    if bad and field == "group":  # as a rank in another group would describe it
        g.guard.group += 1
        g._ar_cache.clear()
        g._cache.clear()
        g._last.op = None  # and the hot path's memo of the last kind
    n = N + 8 if bad and field == "shape" else N
    dt = np.float64 if bad and field == "dtype" else np.float32
    op = "max" if bad and field == "reduce_op" else "sum"
    g.all_reduce(np.ones(n, dt), op).wait()


@pytest.mark.parametrize("field", ["op", "shape", "dtype", "reduce_op", "group", "seq"])
def test_an_in_band_mismatch_raises_everywhere(world: Any, field: str) -> None:
    if world.size < 2:
        pytest.skip("a mismatch needs two ranks")
    bad = world.size - 1
    with shm_guard(world) as g:
        mixed_ops(g, 300)
        for i in range(3):  # settled, and the next all_reduce of this kind goes in-band
            big(g, i)
        every = outcome(world, lambda: _fault(g, g.rank == bad, field))
    assert_all_raised(every, field, f"rank {bad}")
    for _, _, text in every:
        assert any(f"rank {r}" in text for r in range(world.size) if r != bad), text


def _skip(g: GuardedTransport, case: str) -> None:
    """Rank 0 sends one message to rank 1, one of them skips its part; then every rank
    runs the in-band all_reduce."""
    x = np.arange(4.0)
    if g.rank == 0 and case != "skip_send":
        g.send(x, 1, 5).wait()
    elif g.rank == 1 and case != "skip_recv":
        g.recv(np.empty(4), 0, 5).wait()
    for i in range(2):
        big(g, i)


@pytest.mark.parametrize("case", ["skip_send", "skip_recv"])
def test_a_skipped_send_or_recv_before_an_in_band_call_raises_everywhere(
        world: Any, case: str) -> None:
    if world.size < 2:
        pytest.skip("a pair needs two ranks")
    with shm_guard(world) as g:
        mixed_ops(g, 300)
        for i in range(3):
            big(g, i)
        every = outcome(world, lambda: _skip(g, case))
    assert_all_raised(every, "rank 0", "rank 1", "recv" if case == "skip_send" else "send")


def test_a_rank_that_never_comes_to_an_in_band_call_times_out_naming_it(world: Any) -> None:
    """A rank stuck in compute past the guard's deadline: the others, waiting in the
    transport's header sync, give up at the guard's deadline (1.5 s here, not the
    transport's 20 s) with a CommTimeoutError naming it."""
    if world.size < 2:
        pytest.skip("a missing rank needs two")
    bad = world.size - 1
    with shm_guard(world, timeout=1.5) as g:
        for i in range(3):
            big(g, i)

        def step() -> None:
            if g.rank == bad:
                time.sleep(2.5)
            else:
                big(g, 3)

        every = outcome(world, step)
    assert_timed_out(every, bad)
