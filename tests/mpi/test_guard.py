"""The collective guard on the real MPI transport, at any world size.

``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_guard.py`` (N = 1..4). Each
test builds a fresh GuardedTransport on a fresh split of the world, so a test that leaves
control messages unread (a mismatch stops the exchange half-way) cannot leak them into the
next. A fault is injected after hundreds of good guarded operations; then every rank's
outcome (error type, seconds to raise, message) is all-gathered over the world, and every
rank asserts on all of them, so a rank that did not raise fails the test everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuelspmd.cli.trace import main as trace_main
from fuelspmd.comm import Fingerprint, GuardedTransport, Recorder
from fuelspmd.errors import CollectiveMismatchError, CommTimeoutError
from fuelspmd.transport import DONE

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

TIMEOUT = 20.0       # data waits
GUARD_TIMEOUT = 8.0  # longer than the 5 s a mismatch may take: a mismatch is not a timeout
GOOD = 520  # the issue's "after 500 good operations", for every field and pair case


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    yield t
    t.barrier().wait()


@pytest.fixture
def gt(world: Any) -> Iterator[GuardedTransport]:
    g = GuardedTransport(world.split(0, world.rank), timeout=GUARD_TIMEOUT,
                         recorder=Recorder())
    yield g
    g.close()


def good_ops(g: GuardedTransport, n: int) -> None:
    """Run ``n`` guarded collectives (and pairwise swaps) and check them against numpy."""
    for i in range(n):
        good_op(g, i, i % 4)
        if i % 4 == 3:
            g.barrier().wait()


def good_op(g: GuardedTransport, i: int, kind: int) -> None:
    """Op number ``i`` of one ``kind``: 0 a small all_reduce, 1 an all_gather, 2 a
    broadcast, 3 a swap with rank ``rank ^ 1`` written the same on both (send, then recv)."""
    r, size = g.rank, g.size
    peer = r ^ 1
    if kind == 0:
        b = np.full(3 + i % 5, r + i, np.float32)
        g.all_reduce(b, "sum").wait()
        assert b[0] == sum(range(size)) + size * i
    elif kind == 1:
        s = np.full(2, r * 10 + i, np.int64)
        out = np.empty(2 * size, np.int64)
        g.all_gather(s, out).wait()
        np.testing.assert_array_equal(out[::2], np.arange(size) * 10 + i)
    elif kind == 2:
        b = np.full(4, float(r == i % size) * i, np.float64)
        g.broadcast(b, i % size).wait()
        assert b[0] == i
    elif peer < size:
        s = np.arange(3.0) + r + i
        q = np.empty(3)
        ws, wr = g.send(s, peer, i % 7), g.recv(q, peer, i % 7)
        wr.wait()
        ws.wait()
        np.testing.assert_array_equal(q, np.arange(3.0) + peer + i)


def outcome(world: Any, action: Callable[[], None]) -> list[tuple[str, float, str]]:
    """Run ``action`` on this rank; return every rank's (error type, seconds, message).

    Starts at a world barrier outside the guard: a rank still settling its last good
    operation would otherwise (rightly) raise there, on the abort of a faster rank that
    had already reached the fault.
    """
    world.comm.Barrier()
    t0 = time.monotonic()
    try:
        action()
        mine = ("none", time.monotonic() - t0, "")
    except (CollectiveMismatchError, CommTimeoutError) as e:
        mine = (type(e).__name__, time.monotonic() - t0, str(e))
    return world.comm.allgather(mine)


def assert_all_raised(every: list[tuple[str, float, str]], *names: str) -> None:
    for rank, (kind, took, text) in enumerate(every):
        assert kind == "CollectiveMismatchError", f"rank {rank}: {kind} {text}"
        assert took < 5.0, f"rank {rank} took {took:.2f} s to raise"
        for name in names:
            assert name in text, f"rank {rank}: {name!r} not in: {text}"


def assert_timed_out(every: list[tuple[str, float, str]], bad: int) -> None:
    """Rank ``bad`` (stuck past a 1.5 s deadline) raised nothing; every other rank raised
    CommTimeoutError after the deadline, within 5 s, naming it."""
    for rank, (kind, took, text) in enumerate(every):
        if rank == bad:
            assert kind == "none"
        else:
            assert kind == "CommTimeoutError", text
            assert 1.4 < took < 5.0 and f"[{bad}]" in text, (took, text)


def test_good_ops_match_numpy(gt: GuardedTransport) -> None:
    good_ops(gt, 600)
    assert gt.cseq == 600
    assert gt.seq == 600 + (300 if gt.rank ^ 1 < gt.size else 0)
    recs = gt.guard.recorder.records()  # type: ignore[union-attr]
    assert len(recs) == min(gt.seq, 1024) and all(r.state == "completed" for r in recs)


def _need2(world: Any) -> None:
    if world.size < 2:
        pytest.skip("a mismatch needs two ranks")


def _collective(g: GuardedTransport, bad: bool, field: str) -> None:
    if field == "op" and bad:
        out = np.empty(8 * g.size, np.float32)
        g.all_gather(np.zeros(8, np.float32), out).wait()
    elif field == "root":
        g.broadcast(np.zeros(8, np.float32), 1 if bad else 0).wait()
    elif field in ("group", "seq") and bad:
        fp = Fingerprint(g.seq, "all_reduce", (8,), "float32", "sum", group=g.guard.group,
                         cseq=g.cseq)
        if field == "group":
            fp.group += 1
        else:  # this rank created a collective it never issued: its counters moved on
            fp.seq += 1
            fp.cseq = (fp.cseq or 0) + 1
        g.guard.wait(g.guard.check(fp), DONE)
    else:
        shape = (9,) if bad and field == "shape" else (8,)
        dt = np.float64 if bad and field == "dtype" else np.float32
        g.all_reduce(np.zeros(shape, dt), "max" if bad and field == "reduce_op" else "sum").wait()


@pytest.mark.parametrize("field", ["op", "shape", "dtype", "reduce_op", "root", "group", "seq"])
def test_collective_mismatch_raises_everywhere(world: Any, gt: GuardedTransport,
                                               field: str) -> None:
    _need2(world)
    good_ops(gt, GOOD)
    bad = world.size - 1
    every = outcome(world, lambda: _collective(gt, gt.rank == bad, field))
    assert_all_raised(every, field, f"rank {bad}")
    for _, _, text in every:  # both ranks of a disagreeing pair are named
        assert any(f"rank {r}" in text for r in range(world.size) if r != bad), text


@contextmanager
def guarded_split(world: Any, algorithm: str, recorder: bool = False,
                  nodes: list[int] | None = None) -> Iterator[GuardedTransport]:
    """A guard over a fresh split of the world whose all_reduce policy is ``algorithm``;
    the split is finalized after (a test that leaves it out of step harms no other)."""
    t = world.split(0, world.rank)
    g = None
    try:
        assert t.set_all_reduce_policy(algorithm=algorithm, nodes=nodes) == algorithm
        g = GuardedTransport(t, timeout=GUARD_TIMEOUT, recorder=Recorder() if recorder else None)
        yield g
    finally:
        if g is not None:
            g.close()
        t.finalize()


def _broadcast_against(g: GuardedTransport, world: Any,
                       all_reduce: Callable[[], None]) -> None:
    """The last rank broadcasts while the others run ``all_reduce``: all must raise."""
    bad = g.size - 1

    def fault() -> None:
        if g.rank == bad:
            g.broadcast(np.zeros(4, np.float32), 0).wait()
        else:
            all_reduce()

    assert_all_raised(outcome(world, fault), "all_reduce", "broadcast", f"rank {bad}")


@pytest.mark.parametrize("recorder", [False, True])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("algo", ["shm", "hierarchical"])
def test_a_blocking_all_reduce_against_another_op_raises_within_a_slice(
        world: Any, recorder: bool, first: bool, algo: str) -> None:
    """The shared-memory and the hierarchical all-reduce wait for their peers inside the
    transport's call; the guard reads its streams from there (``watch``), so a rank in
    one while a peer broadcasts raises within a slice, like the peer, not at the
    transport's deadline (20 s here). ``first``: the all_reduce's first shape, whose
    descriptor would only go out after the issue returned (the watch sends it); else a
    repeated one (sent before). The hierarchical case runs on a declared two-node layout
    (4 ranks and more, even)."""
    _need2(world)
    nodes = None
    if algo == "hierarchical":
        if world.size < 4 or world.size % 2:
            pytest.skip("the hierarchical all-reduce needs two nodes of 2+ ranks each")
        nodes = [r * 2 // world.size for r in range(world.size)]
    with guarded_split(world, algo, recorder, nodes) as g:
        n = 1 << 16  # 256 KiB of float32: the shared-memory path
        for i in range(40):
            b = np.full(n, float(g.rank + i), np.float32)
            g.all_reduce(b, "sum").wait()
            assert b[0] == sum(range(g.size)) + g.size * i
        shape = (n + 7,) if first else (n,)
        _broadcast_against(g, world,
                           lambda: g.all_reduce(np.ones(shape, np.float32), "sum").wait())


def test_a_new_size_in_the_graph_against_another_op_raises_within_a_slice(
        world: Any) -> None:
    """The graph places an all_reduce input in a lent shared area (``window_buffer``); the
    first all_reduce of a size has none yet, and its area is made inside that call, after
    the header sync, where allocating (collective) is safe: a rank whose peer is in another
    operation raises the mismatch within a slice instead of waiting inside MPI's window
    allocation, which has no deadline."""
    import fuelspmd as fs
    from fuelspmd.comm import Communicator

    _need2(world)
    with guarded_split(world, "shm") as g:
        comm = Communicator(g, device="cpu:0", timeout=TIMEOUT)
        count = 3 << 18  # 3 MiB of float32: a size class no call here made before
        _broadcast_against(g, world, lambda: comm.all_reduce(
            fs.tensor(np.ones(count, np.float32))).realize())


def test_a_late_peer_at_a_shared_memory_all_reduce_is_no_mismatch(world: Any) -> None:
    """Watching the streams while a peer is only late (in compute, 0.3 s) finds nothing
    wrong: the all-reduce completes with the right sum on every rank."""
    with guarded_split(world, "shm" if world.size > 1 else "mpi") as g:
        for _ in range(3):
            if g.rank == g.size - 1:
                time.sleep(0.3)
            b = np.full(1 << 16, float(g.rank), np.float32)
            g.all_reduce(b, "sum").wait()
            assert b[0] == sum(range(g.size))


def _p2p(g: GuardedTransport, case: str) -> None:
    """Pair (0, 1) exchanges one message with the fault injected; then all meet twice."""
    r = g.rank
    x = np.arange(4.0)
    if r == 0 and case != "skip_send":
        g.send(x, 1, 5).wait()
    elif r == 1 and case != "skip_recv":
        if case == "both_send":
            g.send(x, 0, 5).wait()
        else:
            peer = 2 if case == "peer" else 0
            tag = 6 if case == "tag" else 5
            shape = (5,) if case == "shape" else (4,)
            g.recv(np.empty(shape), peer, tag).wait()
    elif r == 2 and case == "peer":  # the rank 1 wrongly waits on; it talks to rank 3
        if g.size > 3:
            g.send(x, 3, 5).wait()
    elif r == 3 and case == "peer":
        g.recv(np.empty(4), 2, 5).wait()
    # a rank outside the faulty pair may get through this barrier (its own descriptors all
    # agree) and raises at its next guarded operation, on the pair's abort
    g.barrier().wait()
    g.barrier().wait()


@pytest.mark.parametrize("case", ["tag", "shape", "both_send", "peer", "skip_send",
                                  "skip_recv"])
def test_p2p_mismatch_raises_everywhere(world: Any, gt: GuardedTransport, case: str) -> None:
    _need2(world)
    if case == "peer" and world.size < 3:
        pytest.skip("a wrong peer needs a third rank")
    good_ops(gt, GOOD)
    every = outcome(world, lambda: _p2p(gt, case))
    names = {"tag": ("tag", "rank 0", "rank 1"), "shape": ("shape", "rank 0", "rank 1"),
             "both_send": ("op", "send"), "peer": ("rank 1", "rank 2", "src=2"),
             "skip_send": ("rank 0", "rank 1", "recv"),
             "skip_recv": ("rank 0", "rank 1", "send")}[case]
    assert_all_raised(every, *names)


def test_stuck_rank_times_out_and_trace_names_it(world: Any, tmp_path_factory: Any) -> None:
    """A rank that skips a collective and stays away: the others time out naming it."""
    _need2(world)
    bad = 2 if world.size > 2 else 1
    where = world.comm.bcast(str(tmp_path_factory.mktemp("trace")) if world.rank == 0
                             else None, root=0)
    g = GuardedTransport(world.split(0, world.rank), timeout=1.5, recorder=Recorder(),
                         trace_dir=where)
    try:
        good_ops(g, 60)
        skipped = g.cseq

        def step() -> None:
            if g.rank == bad:
                time.sleep(2.5)  # stuck in compute past the others' deadline
                g.guard.dump(reason="rank skipped a collective")
            else:
                g.all_reduce(np.ones(8, np.float32), "sum").wait()

        every = outcome(world, step)
    finally:
        g.close()
    assert_timed_out(every, bad)
    if world.rank == 0:
        assert sorted(p.name for p in Path(where).glob("rank*.json")) == sorted(
            f"rank{r}.json" for r in range(world.size))
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = trace_main([where])
        out = buf.getvalue()
        assert code == 1, out
        assert f"FIRST DIFFERENCE at collective #{skipped}" in out, out
        assert f"rank {bad} never issued collective #{skipped}" in out, out
    world.comm.barrier()


def test_debug_mode_checks_first_and_compares_results(world: Any) -> None:
    """debug: a mismatched collective is refused before it is issued; results are CRC'd."""
    _need2(world)
    g = GuardedTransport(world.split(0, world.rank), mode="debug", timeout=GUARD_TIMEOUT,
                         recorder=Recorder())
    try:
        good_ops(g, 60)  # every all_reduce, all_gather and broadcast result compared
        t = g.guard.check(Fingerprint(g.seq, "all_reduce", (4,), "float32", "sum",
                                      group=g.guard.group, cseq=g.cseq))
        g.seq, g.cseq = g.seq + 1, g.cseq + 1
        every = outcome(world, lambda: g.guard.verify(t, np.full(4, g.rank, np.float32)))
        assert_all_raised(every, "debug check", "rank 0")
    finally:
        g.close()
    g = GuardedTransport(world.split(0, world.rank), mode="debug", timeout=GUARD_TIMEOUT)
    try:
        good_ops(g, 20)
        every = outcome(world, lambda: _collective(g, g.rank == world.size - 1, "dtype"))
        assert_all_raised(every, "dtype", f"rank {world.size - 1}")
    finally:
        g.close()


def test_many_collectives_in_flight_waited_out_of_order(gt: GuardedTransport) -> None:
    """More collectives in flight than the guard has send slots, waited newest first: the
    ones past the slots take the general path, and every result is still right."""
    for rnd in range(3):
        bufs = [np.full(5 + i % 3, gt.rank + i + rnd, np.float64) for i in range(20)]
        works = [gt.all_reduce(b, "sum") for b in bufs]
        for w in reversed(works):
            w.wait()
        size = gt.size
        for i, b in enumerate(bufs):
            np.testing.assert_array_equal(b, np.full(b.shape, size * (i + rnd)
                                                     + size * (size - 1) / 2))
    good_ops(gt, 40)  # and the fast path is back in step afterwards
    assert all(r.state == "completed" for r in gt.guard.recorder.records())  # type: ignore[union-attr]


class _Seam:
    """The MPI transport seen through the Transport protocol only (no ``comm``): the guard
    then drives its control streams through ``send``/``recv`` Works, as it does for any
    transport that is not MPI's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self.world_ranks = inner.world_ranks

    def __getattr__(self, name: str) -> Any:
        if name == "comm":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def split(self, color: int, key: int) -> _Seam:
        return _Seam(self.inner.split(color, key))


def test_guard_over_the_transport_protocol_alone(world: Any) -> None:
    """Without mpi4py's persistent requests the guard matches and raises the same way."""
    _need2(world)
    g = GuardedTransport(_Seam(world.split(0, world.rank)), timeout=GUARD_TIMEOUT,
                         recorder=Recorder())
    try:
        assert not g.guard._channel.mpi
        good_ops(g, 120)
        every = outcome(world, lambda: _collective(g, g.rank == world.size - 1, "shape"))
        assert_all_raised(every, "shape", f"rank {world.size - 1}")
    finally:
        g.close()


def test_off_mode_records_and_checks_nothing(world: Any) -> None:
    g = GuardedTransport(world.split(0, world.rank), mode="off", timeout=GUARD_TIMEOUT,
                         recorder=Recorder(capacity=64))
    try:
        assert not g.guard.checks
        good_ops(g, 80)  # repeated all_reduces of one shape take the cached path
        recs = g.guard.recorder.records()  # type: ignore[union-attr]
        assert len(recs) == 64 and all(r.state == "completed" for r in recs)
        assert recs[-1].cseq == g.cseq - 1
    finally:
        g.close()


class _Refusing(_Seam):
    """The MPI transport, except that its all_reduce raises once ``refuse`` is set (as a
    transport that fails after the guard announced an operation would)."""

    refuse = False

    def all_reduce(self, buf: Any, op: Any) -> Any:
        if self.refuse:
            raise RuntimeError("transport refused")
        return self.inner.all_reduce(buf, op)

    def split(self, color: int, key: int) -> _Seam:
        return _Seam(self.inner.split(color, key))


def test_a_refused_issue_after_the_announcement_fails_the_guard(world: Any) -> None:
    """The hot path announces a repeated all_reduce before issuing it; if the transport then
    refuses it, the ranks are out of step: the error propagates and the guard fails."""
    seam = _Refusing(world.split(0, world.rank))
    g = GuardedTransport(seam, timeout=GUARD_TIMEOUT, recorder=Recorder())
    try:
        for _ in range(3):
            g.all_reduce(np.ones(4, np.float32), "sum").wait()
        seam.refuse = True
        with pytest.raises(RuntimeError, match="transport refused"):
            g.all_reduce(np.ones(4, np.float32), "sum")
        if world.size > 1:  # one rank announces nothing: its guard checks nothing
            with pytest.raises(RuntimeError, match="out of step"):
                g.barrier()
            assert g.guard.recorder.records()[-1].state == "failed"  # type: ignore[union-attr]
    finally:
        g.close()
    world.comm.barrier()
