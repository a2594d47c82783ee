"""The collective guard on the real MPI transport, at any world size.

``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_guard.py`` (N = 1..4). Each
test builds a fresh GuardedTransport on a fresh split of the world, so a test that leaves
messages unread (a mismatch stops the exchange half-way) cannot leak them into the next.
A fault is injected after a history of good guarded operations (``GOOD``: 520, the
issue's "after 500 good operations", in the long run ``python tests/run.py --long``; 100
in CI, twenty of each kind, for all 52 field and pair cases at each world size); then every
rank's outcome (error type, seconds to raise, message) is all-gathered over the world, and
every rank asserts on all of them, so a rank that did not raise fails the test everywhere. The
all_reduces run each path the transport has: MPI's own with the buffer carried in the
check (small), MPI's own after the check (large), and the shared-memory header.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuelspmd.cli.trace import main as trace_main
from fuelspmd.comm import GuardedTransport, Recorder
from fuelspmd.errors import CollectiveMismatchError, CommError, CommTimeoutError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget import runs

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

TIMEOUT = 20.0       # data waits
GUARD_TIMEOUT = 8.0  # longer than the 5 s a mismatch may take: a mismatch is not a timeout
GOOD = runs(ci=100, long=520)  # good operations before the fault, in every field and pair case
N = 1 << 16  # float32 elements: 256 KiB, the shared-memory path where the policy is shm


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    yield t
    t.barrier().wait()


def drain(comm: Any, world: Any) -> None:
    """Receive what a faulty test left unreceived on ``comm``: once the communicator is
    freed, MPI may give its context to a later split, whose receives would match it."""
    from mpi4py import MPI

    world.Barrier()
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        comm.Recv(np.empty(status.Get_count(MPI.BYTE), np.uint8), status.Get_source(),
                  status.Get_tag())
    world.Barrier()


@contextmanager
def guarded(world: Any, algorithm: str = "mpi", *, recorder: bool = True,
            timeout: float = GUARD_TIMEOUT, nodes: list[int] | None = None, mode: str = "default",
            trace_dir: str | None = None) -> Iterator[GuardedTransport]:
    """A guard over a fresh split of the world whose all_reduce policy is ``algorithm``;
    the guard is closed (which drains its control channel) and the split drained and
    finalized after (a test that leaves it out of step harms no other)."""
    t = world.split(0, world.rank)
    g = None
    try:
        algo = algorithm if world.size > 1 else "mpi"
        assert t.set_all_reduce_policy(algorithm=algo, nodes=nodes) == algo
        g = GuardedTransport(t, timeout=timeout, mode=mode,
                             recorder=Recorder() if recorder else None, trace_dir=trace_dir)
        yield g
    finally:
        if g is not None:
            g.close()
        drain(t.comm, world.comm)
        t.finalize()


@pytest.fixture(params=["mpi", "shm"])
def gt(world: Any, request: Any) -> Iterator[GuardedTransport]:
    with guarded(world, request.param) as g:
        yield g


def good_ops(g: GuardedTransport, n: int) -> None:
    """Run ``n`` guarded operations (small and large all_reduces, all_gathers, broadcasts,
    pairwise swaps) and check them against numpy."""
    for i in range(n):
        good_op(g, i, i % 5)
        if i % 5 == 4:
            g.barrier().wait()


def good_op(g: GuardedTransport, i: int, kind: int) -> None:
    """Op number ``i`` of one ``kind``: 0 a small all_reduce, 1 an all_gather, 2 a
    broadcast, 3 a swap with rank ``rank ^ 1`` written the same on both (send, then recv),
    4 a large all_reduce."""
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
    elif kind == 3 and peer < size:
        s = np.arange(3.0) + r + i
        q = np.empty(3)
        ws, wr = g.send(s, peer, i % 7), g.recv(q, peer, i % 7)
        wr.wait()
        ws.wait()
        np.testing.assert_array_equal(q, np.arange(3.0) + peer + i)
    elif kind == 4:
        b = np.full(N, float(r + i), np.float32)
        g.all_reduce(b, "sum").wait()
        assert b[0] == b[-1] == sum(range(size)) + size * i


def outcome(world: Any, action: Callable[[], None]) -> list[tuple[str, float, str]]:
    """Run ``action`` on this rank; return every rank's (error type, seconds, message)."""
    world.comm.Barrier()
    t0 = time.monotonic()
    try:
        action()
        mine = ("none", time.monotonic() - t0, "")
    except CommError as e:
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
    n = runs(ci=200, long=600)
    good_ops(gt, n)
    assert gt.cseq == n  # per five ops: four collectives (not the swap) and a barrier
    recs = gt.guard.recorder.records()  # type: ignore[union-attr]
    assert len(recs) == min(gt.seq, 1024) and all(r.state == "completed" for r in recs)


def _need2(world: Any) -> None:
    if world.size < 2:
        pytest.skip("a mismatch needs two ranks")


def _collective(g: GuardedTransport, bad: bool, field: str, n: int) -> None:
    if field == "op" and bad:
        out = np.empty(n * g.size, np.float32)
        g.all_gather(np.zeros(n, np.float32), out).wait()
    elif field == "root":
        g.broadcast(np.zeros(n, np.float32), 1 if bad else 0).wait()
    else:
        if bad and field == "seq":  # this rank counted a collective it never issued
            g.seq += 1
            g.cseq += 1
        if bad and field == "group":  # as a rank in another group would describe it
            g.group += 1
            g._calls.clear()  # and the memo of the last kind, built for the old group
            g._memo = ((), None, None, None)
        shape = (n + 8,) if bad and field == "shape" else (n,)
        dt = np.float64 if bad and field == "dtype" else np.float32
        g.all_reduce(np.ones(shape, dt), "max" if bad and field == "reduce_op" else "sum").wait()


@pytest.mark.parametrize("n", [8, N])
@pytest.mark.parametrize("field", ["op", "shape", "dtype", "reduce_op", "root", "group", "seq"])
def test_collective_mismatch_raises_everywhere(world: Any, gt: GuardedTransport,
                                               field: str, n: int) -> None:
    _need2(world)
    good_ops(gt, GOOD)
    bad = world.size - 1
    every = outcome(world, lambda: _collective(gt, gt.rank == bad, field, n))
    assert_all_raised(every, field, f"rank {bad}")
    for _, _, text in every:  # both ranks of a disagreeing pair are named
        assert any(f"rank {r}" in text for r in range(world.size) if r != bad), text


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


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("algo", ["mpi", "shm", "hierarchical"])
def test_an_all_reduce_against_another_op_raises_within_a_slice(
        world: Any, first: bool, algo: str) -> None:
    """The all_reduce meets in the transport (the shared-memory header, the fixed-size
    check of MPI's own path) while the broadcast meets on the guard's control channel:
    the ranks wait in different places, and their notes (every 50 ms) show it. The
    hierarchical case runs on a declared two-node layout (4 ranks and more, even)."""
    _need2(world)
    nodes = None
    if algo == "hierarchical":
        if world.size < 4 or world.size % 2:
            pytest.skip("the hierarchical all-reduce needs two nodes of 2+ ranks each")
        nodes = [r * 2 // world.size for r in range(world.size)]
    with guarded(world, algo, nodes=nodes) as g:
        for i in range(40):
            good_op(g, i, 4)
        shape = (N + 7,) if first else (N,)
        _broadcast_against(g, world,
                           lambda: g.all_reduce(np.ones(shape, np.float32), "sum").wait())


def test_a_new_size_in_the_graph_against_another_op_raises_within_a_slice(
        world: Any) -> None:
    """The graph places an all_reduce input in a lent shared area; the first all_reduce
    of a size has none yet, and its area is made inside that call, after the header sync,
    where allocating (collective) is safe."""
    import fuelspmd as fs
    from fuelspmd.comm import Communicator

    _need2(world)
    with guarded(world, "shm") as g:
        comm = Communicator(g, device="cpu:0", timeout=TIMEOUT)
        count = 3 << 18  # 3 MiB of float32: a size class no call here made before
        _broadcast_against(g, world, lambda: comm.all_reduce(
            fs.tensor(np.ones(count, np.float32))).realize())


@pytest.mark.parametrize("algo", ["mpi", "shm"])
def test_a_late_peer_is_no_mismatch(world: Any, algo: str) -> None:
    """Notes exchanged while a peer is only late (in compute, 0.3 s) find nothing wrong."""
    with guarded(world, algo) as g:
        for i in range(3):
            if g.rank == g.size - 1:
                time.sleep(0.3)
            good_op(g, i, 4)
            good_op(g, i, 1)


def _p2p(g: GuardedTransport, case: str, n: int) -> None:
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
    for i in range(2):  # a collective, and a large all_reduce (in the shm header, or not)
        g.barrier().wait()
        good_op(g, i, 4 if n > 8 else 0)


@pytest.mark.parametrize("n", [8, N])
@pytest.mark.parametrize("case", ["tag", "shape", "both_send", "peer", "skip_send",
                                  "skip_recv"])
def test_p2p_mismatch_raises_everywhere(world: Any, gt: GuardedTransport, case: str,
                                        n: int) -> None:
    _need2(world)
    if case == "peer" and world.size < 3:
        pytest.skip("a wrong peer needs a third rank")
    good_ops(gt, GOOD)
    every = outcome(world, lambda: _p2p(gt, case, n))
    names = {"tag": ("tag", "rank 0", "rank 1"), "shape": ("shape", "rank 0", "rank 1"),
             "both_send": ("op", "send"), "peer": ("rank 1", "rank 2", "src=2"),
             "skip_send": ("rank 0", "rank 1", "recv"),
             "skip_recv": ("rank 0", "rank 1", "send")}[case]
    assert_all_raised(every, *names)


def test_a_failed_rank_that_closes_passes_on_its_failure(world: Any) -> None:
    """Rank 1's guard failed, learning it from a peer's abort (so it told no one), and
    closes. The others, waiting in a barrier, read its notes before any other rank's abort
    (in a real job, a race): they raise its mismatch, not that it left."""
    _need2(world)
    with guarded(world) as g:
        good_ops(g, 10)

        def action() -> None:
            if g.rank == 1:
                with pytest.raises(CollectiveMismatchError):
                    g.guard.fail("rank 0 aborted: injected mismatch", tell=False)
                g.close()
                g.barrier().wait()
                return
            try:
                g.barrier().wait()
            finally:  # the others' byes, which rank 1's close waits for (else its timeout)
                g.close()

        every = outcome(world, action)
    for rank, (kind, took, text) in enumerate(every):
        if rank != 1:
            assert kind == "CollectiveMismatchError", f"rank {rank}: {kind} {text}"
            assert took < 5.0 and "rank 1 aborted: rank 0 aborted: injected" in text, text


@pytest.mark.parametrize("algo", ["mpi", "shm"])
def test_stuck_rank_times_out_and_trace_names_it(world: Any, tmp_path_factory: Any,
                                                 algo: str) -> None:
    """A rank that skips a collective and stays away: the others time out naming it."""
    _need2(world)
    bad = 2 if world.size > 2 else 1
    where = world.comm.bcast(str(tmp_path_factory.mktemp("trace")) if world.rank == 0
                             else None, root=0)
    with guarded(world, algo, timeout=1.5, trace_dir=where) as g:
        good_ops(g, 60)
        skipped = g.cseq

        def step() -> None:
            if g.rank == bad:
                time.sleep(2.5)  # stuck in compute past the others' deadline
                g.guard.dump(reason="rank skipped a collective")
            else:
                good_op(g, 0, 4)

        every = outcome(world, step)
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


def test_debug_mode_compares_results(world: Any) -> None:
    """debug: results that must be alike are CRC'd; a rank whose result differs (here:
    its buffer changed after the reduction) makes every rank raise."""
    _need2(world)
    with guarded(world, "mpi", mode="debug") as g:
        good_ops(g, 60)  # every all_reduce, all_gather and broadcast result compared
        b = np.ones(4, np.float32)
        w = g.all_reduce(b, "sum")
        if g.rank == 0:
            b[0] = -1.0  # as a transport that returned other data on one rank would
        every = outcome(world, w.wait)
        assert_all_raised(every, "debug check", "rank 0")
    with guarded(world, "mpi", mode="debug") as g:
        good_ops(g, 20)
        every = outcome(world, lambda: _collective(g, g.rank == world.size - 1, "dtype", 8))
        assert_all_raised(every, "dtype", f"rank {world.size - 1}")


def test_many_collectives_in_flight_waited_out_of_order(gt: GuardedTransport) -> None:
    """Collectives issued back to back and waited newest first: every result is right."""
    for rnd in range(3):
        bufs = [np.full(5 + i % 3 + (N if i % 4 == 0 else 0), gt.rank + i + rnd, np.float64)
                for i in range(20)]
        works = [gt.all_reduce(b, "sum") for b in bufs]
        for w in reversed(works):
            w.wait()
        size = gt.size
        for i, b in enumerate(bufs):
            np.testing.assert_array_equal(b, np.full(b.shape, size * (i + rnd)
                                                     + size * (size - 1) / 2))
    good_ops(gt, 40)
    assert all(r.state == "completed" for r in gt.guard.recorder.records())  # type: ignore[union-attr]


class _Seam:
    """The MPI transport seen through the Transport protocol alone: no capability, so
    the guard meets on its control channel for every collective and exchanges no notes."""

    capabilities: frozenset[str] = frozenset()

    def __init__(self, inner: Any, capabilities: frozenset[str] = frozenset()) -> None:
        self.inner = inner
        self.capabilities = capabilities
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self.tag_bound = inner.tag_bound
        self.comm = inner.comm
        self.refuse = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_reduce(self, buf: Any, op: Any) -> Any:
        if self.refuse:
            raise RuntimeError("transport refused")
        return self.inner.all_reduce(buf, op)

    def split(self, color: int, key: int) -> _Seam:
        return _Seam(self.inner.split(color, key), self.capabilities)


def test_guard_over_the_transport_protocol_alone(world: Any) -> None:
    """Without any capability the guard checks and raises the same way."""
    _need2(world)
    seam = _Seam(world.split(0, world.rank))
    g = GuardedTransport(seam, timeout=GUARD_TIMEOUT, recorder=Recorder())
    try:
        good_ops(g, 120)
        every = outcome(world, lambda: _collective(g, g.rank == world.size - 1, "shape", 8))
        assert_all_raised(every, "shape", f"rank {world.size - 1}")
    finally:
        g.close()
        seam.inner.finalize()


def test_off_mode_records_and_checks_nothing(world: Any) -> None:
    g = GuardedTransport(world.split(0, world.rank), mode="off", timeout=GUARD_TIMEOUT,
                         recorder=Recorder(capacity=64))
    try:
        assert not g.guard.checks
        good_ops(g, 80)
        recs = g.guard.recorder.records()  # type: ignore[union-attr]
        assert len(recs) == 64 and all(r.state == "completed" for r in recs)
        assert recs[-1].cseq == g.cseq - 1
    finally:
        g.close()


def test_a_refused_issue_after_the_check_fails_the_guard_everywhere(world: Any) -> None:
    """The ranks agreed on an all_reduce, then one rank's transport refuses to issue it:
    the error propagates there and every other rank, left waiting in the all_reduce,
    raises too (the refusing rank's abort note), within 5 s."""
    _need2(world)
    seam = _Seam(world.split(0, world.rank), frozenset({"probe"}))
    g = GuardedTransport(seam, timeout=GUARD_TIMEOUT, recorder=Recorder())
    try:
        for _ in range(3):
            g.all_reduce(np.ones(4, np.float32), "sum").wait()
        bad = world.size - 1
        seam.refuse = g.rank == bad

        def step() -> None:
            try:
                g.all_reduce(np.ones(4, np.float32), "sum").wait()
            except RuntimeError as e:
                if isinstance(e, CommError):
                    raise
                raise CommError(str(e)) from e

        every = outcome(world, step)
        for rank, (kind, took, text) in enumerate(every):
            assert kind in ("CommError", "CollectiveMismatchError"), (rank, kind, text)
            assert took < 5.0 and "refused" in text, (rank, took, text)
        with pytest.raises((CommError, CollectiveMismatchError)):
            g.barrier()
    finally:
        g.close()
        drain(seam.comm, world.comm)
        seam.inner.finalize()


def test_every_rank_agrees_on_the_mode(world: Any) -> None:
    """Ranks that build their guards in different modes raise at construction."""
    _need2(world)
    t = world.split(0, world.rank)
    every = outcome(world, lambda: GuardedTransport(
        t, mode="debug" if world.rank == 0 else "default", timeout=GUARD_TIMEOUT))
    for kind, _, text in every:
        assert kind == "CollectiveMismatchError" and "mode" in text, text
    t.finalize()


def test_a_mismatch_after_the_check_is_never_silent(world: Any) -> None:
    """A CollectiveMismatchError from the guard is raised before any data moved: the
    buffers of every rank are as the caller left them."""
    _need2(world)
    with guarded(world, "mpi") as g:
        good_ops(g, 10)
        bad = world.size - 1
        b = np.full(8 + (bad == g.rank), 7.0, np.float32)
        every = outcome(world, lambda: g.all_reduce(b, "sum").wait())
        assert all(k == "CollectiveMismatchError" for k, _, _ in every), every
        np.testing.assert_array_equal(b, 7.0)
    with pytest.raises(CollectiveMismatchError):
        raise CollectiveMismatchError("sanity")
    assert CommTimeoutError is not CollectiveMismatchError


@pytest.mark.mpi(min_size=4)
def test_a_peer_that_finished_a_collective_early_is_not_a_mismatch(world: Any) -> None:
    """A broadcast's root (and a rank whose share arrived) may finish a collective while
    others still wait in it, and wait in the next one: its notes name a later collective.
    Rank 2 holds still after posting each broadcast (no MPI progress: rank 3, which the
    binomial tree feeds through it, stalls), so the root waits in the next one past the
    watch slice while rank 3 still waits in this one; nothing may raise, and every value
    arrives."""
    from fuelspmd.transport import WATCH_S

    with guarded(world) as g:
        for i in range(4):
            buf = np.full(8, float(i) if g.rank == 0 else -1.0, np.float32)
            work = g.broadcast(buf, 0)
            if g.rank == 2:
                time.sleep(4 * WATCH_S)
            work.wait()
            assert (buf == i).all(), (g.rank, i, buf)


@pytest.mark.mpi(min_size=2)
def test_a_recv_of_a_message_already_sent_is_not_a_mismatch(world: Any) -> None:
    """Rank 1 sent to rank 0 and waits in a recv from it (its note: waiting for rank 0's
    send #1, which rank 0 has not issued), while rank 0 waits in its recv of rank 1's
    message: not a deadlock, since rank 1 already sent it, so the recv completes and rank 0
    sends next. The note, read inside that recv, must not raise; one whose sender had not
    sent must. (Driven through the guard's decision directly: when the note arrives within
    a recv depends on MPI's progress and the collector's timing.)"""
    from fuelspmd.comm.fingerprint import Fingerprint
    from fuelspmd.comm.guard import _NOTE, _WAIT, FP_LEN

    with guarded(world) as g:
        if g.rank == 0:
            guard = g.guard
            fp = Fingerprint(0, "recv", (4,), "float32", None, None, g.group, 1, 0, 5, 0)
            k = guard.recvd_from(1)  # this rank's recv #1 from rank 1
            guard.cur = (fp.encode(), 0, 0, k, -1, None)
            note = np.zeros(_NOTE, np.int64)
            theirs = Fingerprint(1, "recv", (4,), "float32", None, None, g.group, 0, 1, 6, 0)
            note[:4] = (_WAIT, 1, 1, 1)  # rank 1 sent 1 to rank 0 and waits in recv #1
            note[4:4 + FP_LEN] = theirs.encode()
            guard._square(1, note)  # nothing raised
            note[2] = 0  # had rank 1 not sent, both would wait for each other for ever
            with pytest.raises(CollectiveMismatchError, match="point-to-point mismatch"):
                guard._square(1, note)
        world.comm.Barrier()  # no rank's guard says bye before rank 0 has begun its recv


def _counted(g: GuardedTransport) -> list[int]:
    """Count the meetings of ``g``'s collectives from now on: its transport's ``checked``,
    or the guard's own on its control channel."""
    n = [0]
    inner = g._checked or g.guard.meet

    def counted(*args: Any) -> Any:
        n[0] += 1
        return inner(*args)

    if g._checked is not None:
        g._checked = counted
    else:
        g.guard.meet = counted  # type: ignore[method-assign]
    return n


def _plan_step(comm: Any, xs: list[Any]) -> list[np.ndarray]:
    """Five collectives realised as one graph (one plan): a training step's gradients."""
    from fuelspmd.tensor import realize

    ys = [comm.all_reduce(x) for x in xs[:3]] + [comm.all_reduce(xs[3], "max"),
                                                  comm.all_gather(xs[4])]
    realize(*ys)
    return [y.numpy() for y in ys]


def _leaves(r: int) -> list[Any]:
    from fuelspmd.tensor import tensor

    return [tensor(np.full(n, float(r + k), np.float32))
            for k, n in enumerate([3, 4096, N, 5, 2])]


def _expect(size: int) -> list[np.ndarray]:
    s = sum(range(size))
    return [np.full(3, s, np.float32), np.full(4096, s + size, np.float32),
            np.full(N, s + 2 * size, np.float32), np.full(5, size - 1 + 3, np.float32),
            np.concatenate([np.full(2, r + 4.0, np.float32) for r in range(size)])]


@contextmanager
def _over_the_seam(world: Any) -> Iterator[GuardedTransport]:
    seam = _Seam(world.split(0, world.rank), frozenset({"probe"}))
    g = GuardedTransport(seam, timeout=GUARD_TIMEOUT)
    try:
        yield g
    finally:
        g.close()
        drain(seam.comm, world.comm)
        seam.inner.finalize()


@pytest.mark.parametrize("algo", ["mpi", "shm", "seam"])
def test_every_run_of_a_plan_meets_at_each_collective(world: Any, algo: str) -> None:
    """A plan's every run is checked call by call, as its first: five meetings per run of
    five collectives, also when one rank planned the graph anew (its cache cleared), and
    the same over a transport without ``checked`` (the guard's own meetings)."""
    _need2(world)
    from fuelspmd.comm.communicator import Communicator
    from fuelspmd.graph.executor import default_executor

    with (_over_the_seam(world) if algo == "seam"
          else guarded(world, algo, recorder=False)) as g:
        comm = Communicator(g, device="cpu:0")
        xs, want = _leaves(g.rank), _expect(g.size)
        met = _counted(g)
        per_run = []
        for run in range(4):
            if run == 2 and g.rank == 0:
                default_executor().cache.clear()
            before = met[0]
            for got, w in zip(_plan_step(comm, xs), want):
                np.testing.assert_array_equal(got, w)
            per_run.append(met[0] - before)
        assert per_run == [5, 5, 5, 5], per_run
        g.barrier().wait()
