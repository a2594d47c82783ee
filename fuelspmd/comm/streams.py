"""The guard's control streams and its general path: matching, aborts, deadlines.

The :class:`~fuelspmd.comm.guard.Guard` sends every operation's descriptor (a
:class:`~fuelspmd.comm.fingerprint.Fingerprint` in a ``MSG_LEN``-int64 message) to the
other participants over a control transport (:mod:`fuelspmd.comm.control`). This module
holds the message layout, the per-peer stream state (:class:`Peer`), the :class:`Ticket`
of an operation, and :class:`Streams`, the Guard's base class with the general path:
everything the fast path of :mod:`fuelspmd.comm.guard` hands on (a descriptor that
differs, an abort, a send/recv, a slow peer), and the failure messages.

Why it cannot hang. Per ordered pair of ranks (p, q) the control messages form one
ordered stream (MPI's non-overtaking rule on one communicator and tag): every op p issues
that involves q puts one descriptor on it, in issue order. Each rank keeps receives posted
per peer, so whatever a peer did next is what arrives, and the comparison is immediate:

- a collective is a *fence*: it is matched against the peer's next collective, and both
  sides must have matched every send/recv they exchanged before it;
- a send is matched with the peer's recv in the order each side issued them (likewise a
  recv), so the two directions of a pair may interleave freely (a 2-rank swap written
  ``send; recv`` on both ranks is fine) but a skipped send or recv is seen as soon as the
  peer reaches its next collective, or the first time the pair's descriptors disagree on
  peer, tag, shape or dtype;
- a send/recv is matched while it is waited on (a recv is released only once the
  sender's descriptor agrees), so a ring of sends-then-receives does not turn into a
  rendezvous deadlock.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fuelspmd.comm.control import Channel, Request
from fuelspmd.comm.fingerprint import CSEQ, FP_LEN, OP, SEQ, Fingerprint, describe, diff, render
from fuelspmd.comm.recorder import Recorder
from fuelspmd.errors import CollectiveMismatchError, CommError, CommTimeoutError
from fuelspmd.transport import Transport, Work

if TYPE_CHECKING:
    from fuelspmd.comm.guard import Guard

__all__ = ["MODES", "MSG_LEN", "Peer", "Streams", "Ticket"]

MODES = ("default", "debug", "off")
_OP, _ABORT = 1, 2  # message kinds
_SENDER, _KIND = 0, 1
_FP = slice(2, 2 + FP_LEN)
_OTHER = 2 + FP_LEN
_OTHER_FP = slice(_OTHER + 1, _OTHER + 1 + FP_LEN)
MSG_LEN = _OTHER + 1 + FP_LEN  # [sender, kind, fp, other rank, other fp]
_MSG_SEQ, _MSG_CSEQ = 2 + SEQ, 2 + CSEQ
# What two agreeing collective messages share byte for byte: the kind (so an abort never
# passes for an agreeing collective) and the fingerprint up to CSEQ, which is compared on
# its own: SEQ counts sends and receives too and may differ (see fingerprint.py).
_SAME = slice(_KIND, _MSG_CSEQ)
# As MPIWork.wait: spin, and after 10 us yield the core between polls, so a peer sharing
# the core runs (measured: a guard that spun 150 us before its first yield lost a whole
# 10 ms time slice on 2-3% of its operations on 2 busy cores).
_YIELD_AFTER_S = 1e-5
# Persistent control receives per peer: a ring, restarted in ring order (MPI matches
# receives in the order they were started). The fast path restarts the consumed ones
# _BATCH at a time (one Startall), the general path at once.
_DEPTH, _BATCH = 8, 4
# Collective send slots, reused once their collective is matched by every peer and their
# sends have completed; completion is tested _BATCH slots at a time (one Testall). An MPI
# call right after a 1 MiB all_reduce (caches cold) took about twice its time after an 8 B
# one (1-2 us, thread CPU time at load 5-8), so the fast path makes two per operation
# (start the send, test the receive) plus 2/_BATCH amortised.
_SLOTS = 8
# A wait first waits on the data operation itself (the transport's own tuned loop) in
# slices of this long, looking at the control streams between slices, so a mismatched
# operation that never completes is still explained within a slice.
_SLICE_S = 0.05
_NO_FP = np.full(FP_LEN, -1, np.int64)  # a Ticket's fingerprint where none is encoded
_NO_FP.setflags(write=False)
_SEND, _RECV = 6, 7  # OPS.index("send"), OPS.index("recv")
_HINT = ("every rank must issue the same collectives in the same order, and every send "
         "must meet a recv with the same tag, shape and dtype")


class Peer:
    """Control-stream state for one other rank of the group."""

    __slots__ = ("bufs", "coll_ok", "colls", "head", "idle", "inbox", "last", "rank",
                 "recv_ok", "recvs", "ring", "sends", "their_recvs", "their_sends")

    def __init__(self, rank: int, channel: Channel) -> None:
        self.rank = rank
        # persistent receives, started in ring order (MPI matches them in posting order):
        # ``head`` is the one the peer's next message lands in
        self.bufs = [np.empty(MSG_LEN, np.int64) for _ in range(_DEPTH)]
        self.ring: list[Request] = [channel.recv_init(b, rank) for b in self.bufs]
        self.head = 0
        self.idle = 0  # consumed, not yet restarted: the ``idle`` slots just before ``head``
        self.inbox: deque[np.ndarray] = deque()   # received, not yet matched, in peer order
        self.colls: deque[np.ndarray] = deque()   # my collective awaiting the peer's
        self.sends: deque[np.ndarray] = deque()   # my sends to the peer awaiting its recv
        self.recvs: deque[np.ndarray] = deque()   # my recvs awaiting the peer's send
        self.their_sends: deque[np.ndarray] = deque()  # the peer's, ahead of mine
        self.their_recvs: deque[np.ndarray] = deque()
        self.recv_ok = 0  # how many of my recvs from this peer have been matched
        self.coll_ok = 0  # how many of my collectives this peer has matched
        # the peer's last matched descriptor (a copy), or on the fast path the Ticket of my
        # collective it matched (a view of a reused buffer would change under it)
        self.last: np.ndarray | Ticket | None = None


class Ticket:
    """An operation the guard let through, and its Work once ``work`` is set.

    What :meth:`Guard.wait` needs to settle the operation; ``wait``/``test`` make it the
    Work a GuardedTransport returns (one object per operation, not two: this is built on
    the path a peer waits on).
    """

    __slots__ = ("coll", "cseq", "done", "encoded", "fp", "guard", "n", "peer", "record",
                 "result", "same", "seq", "slot", "work")

    def __init__(self, guard: Guard, fp: Fingerprint, encoded: np.ndarray, record: int,
                 peer: Peer | None, n: int, coll: bool = False, same: bytes | None = None,
                 cseq: int = 0, slot: int = -1, seq: int = 0) -> None:
        self.guard = guard
        self.work: Work | None = None  # the data operation, set by whoever issues it
        self.result: Any = None  # a result every rank must hold alike (checked in debug mode)
        self.done = False
        self.fp, self.encoded, self.record, self.peer, self.n = fp, encoded, record, peer, n
        self.coll = coll  # a collective: ``n`` is its ordinal among this guard's collectives
        self.same = same  # a staged collective: its message's _SAME bytes, for the fast match
        self.cseq = cseq
        self.slot = slot  # a staged collective: its send slot
        self.seq = seq

    def test(self) -> bool:
        """Return whether the data operation completed (never blocks)."""
        return self.done or self.work is None or self.work.test()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the operation and its match; CommTimeoutError after ``timeout`` s."""
        if self.done:
            return
        work = self.work
        if work is None:
            raise RuntimeError("Ticket.wait: no operation was issued with this ticket")
        self.guard.wait(self, work, timeout)
        if self.result is not None:
            self.guard.verify(self, self.result)
        self.done = True




class Streams:
    """The Guard's general path over its control streams (a base class: see guard.py)."""

    rank: int
    size: int
    group: int
    mode: str
    timeout: float
    recorder: Recorder | None
    _control: Transport | None
    _channel: Channel
    _all: list[Peer]
    _inflight: deque[tuple[Callable[[], bool], np.ndarray]]
    _failed: str | None
    _failed_kind: type[Exception]
    _loud: bool  # something may await a peer (see Guard.settled)
    transport: Transport
    trace_dir: str | os.PathLike[str] | None

    def dump(self, directory: str | os.PathLike[str] | None = None, *,
             reason: str = "") -> Path | None:
        """Write the flight recorder to ``directory`` (default ``trace_dir``); None if neither."""
        where = directory if directory is not None else self.trace_dir
        if self.recorder is None or where is None:
            return None
        return self.recorder.dump(where, getattr(self.transport, "world_ranks",
                                                 range(self.size))[self.rank], reason=reason)

    def _post(self, msg: np.ndarray, peer: int) -> None:
        self._inflight.append((self._channel.isend(msg, peer), msg))

    def _colls_matched(self, n: int) -> bool:
        for p in self._all:
            if p.coll_ok < n:
                return False
        return True

    def _wait_data(self, work: Work, peers: Sequence[Peer], ticket: Ticket,
                   timeout: float | None) -> None:
        """Wait on the data operation in slices, reading the control streams in between."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        while True:
            left = limit - (time.monotonic() - start)
            try:
                work.wait(max(min(_SLICE_S, left), 1e-6))
                return
            except CommTimeoutError:
                self._scan(ticket.record)
                for p in peers:
                    self._advance(p, ticket.record)
                if time.monotonic() - start > limit:
                    self._late(ticket.encoded, peers, limit, ticket.record)

    def _settle(self, work: Work, done: Callable[[], bool], agreed: Callable[[], bool],
                peers: Sequence[Peer], ticket: Ticket, timeout: float | None) -> None:
        """Drive until ``done()``; if the data operation itself fails (MPI reports a
        truncation, say), first give the descriptors up to 2 s to explain it as a mismatch,
        which names the ranks and fields, and raise the transport's error only if they agree.
        """
        try:
            if self.mode == "default":
                self._wait_data(work, peers, ticket, timeout)
            self._drive(done, peers, ticket.encoded, ticket.record, timeout)
        except (CollectiveMismatchError, CommTimeoutError):
            raise
        except CommError:
            if self._failed is None:
                try:
                    self._drive(agreed, peers, ticket.encoded, ticket.record, 2.0)
                except CommTimeoutError:
                    self._failed = None  # the descriptors agree: the transport's error stands
            raise

    def _pump(self, p: Peer) -> None:
        """Copy every control message that has arrived from ``p`` into its inbox, restarting
        each receive in ring order so the ring stays posted."""
        if p.idle:
            self._restart(p)
        ring, bufs = p.ring, p.bufs
        head = p.head
        while ring[head].Test():
            self._loud = True
            p.inbox.append(bufs[head].copy())
            ring[head].Start()
            head = (head + 1) % _DEPTH
        p.head = head

    def _restart(self, p: Peer) -> None:
        """Restart the receives the fast path consumed, in ring order, with one call."""
        idle, head = p.idle, p.head
        ring = p.ring
        self._channel.startall([ring[(head - idle + i) % _DEPTH] for i in range(idle)])
        p.idle = 0

    def _meet_early(self, p: Peer, rec: int) -> None:
        """Match my newest p2p op with the peer's descriptors that arrived before it."""
        while p.sends and p.their_recvs:
            self._agree(p.sends.popleft(), p, p.their_recvs.popleft(), rec)
        while p.recvs and p.their_sends:
            self._agree(p.recvs.popleft(), p, p.their_sends.popleft(), rec)
            p.recv_ok += 1

    def _agree(self, mine: np.ndarray, p: Peer, theirs: np.ndarray, rec: int) -> None:
        # equal up to the op number (SEQ, last): two collectives that agree; else the rules
        if mine[:SEQ].tobytes() != theirs[:SEQ].tobytes() and diff(mine, theirs):
            self._mismatch(mine, p.rank, theirs, rec)
        p.last = theirs

    def _advance(self, p: Peer, rec: int) -> None:
        """Consume what ``p`` sent, in order, as far as it can be matched now."""
        inbox = p.inbox
        while inbox:
            m = inbox[0]
            if m[_KIND] == _ABORT:
                self._aborted(m, rec)
            theirs = m[_FP]
            op = int(theirs[OP])
            if op == _SEND or op == _RECV:
                mine_q, their_q = (p.recvs, p.their_sends) if op == _SEND else (p.sends,
                                                                                  p.their_recvs)
                if mine_q:
                    self._agree(mine_q.popleft(), p, theirs, rec)
                    if op == _SEND:
                        p.recv_ok += 1
                elif p.colls:  # I reached my fence; this op of theirs precedes theirs
                    self._mismatch(p.colls[0], p.rank, theirs, rec)
                else:
                    their_q.append(theirs)
                inbox.popleft()
                continue
            pending = p.sends or p.recvs  # their fence came before they met my p2p
            if pending:
                self._mismatch(pending[0], p.rank, theirs, rec)
            if not p.colls:
                return  # I have not reached my next collective yet
            early = p.their_sends or p.their_recvs
            if early:
                self._mismatch(p.colls[0], p.rank, early[0], rec)
            self._agree(p.colls.popleft(), p, theirs, rec)
            p.coll_ok += 1
            inbox.popleft()

    def _scan(self, rec: int) -> None:
        """Pump and advance every stream; raise on an abort anywhere in any inbox."""
        for p in self._all:
            self._pump(p)
            for m in p.inbox:
                if m[_KIND] == _ABORT:
                    self._aborted(m, rec)
            self._advance(p, rec)

    def _drive(self, done: Callable[[], bool], peers: Sequence[Peer], mine: np.ndarray,
               rec: int, timeout: float | None) -> None:
        """Progress the control streams of ``peers`` until ``done()``, under the deadline.

        Spins (as MPI's own waits do: a peer progresses only inside MPI calls), looks at
        every stream for aborts every 64 polls once past 10 us, and then yields the core
        between polls.
        """
        limit = self.timeout if timeout is None else timeout
        clock = time.monotonic
        start = clock()
        spins = 0
        while True:
            for p in peers:
                if p.ring[p.head].Test():
                    self._pump(p)
                if p.inbox:
                    self._advance(p, rec)
            if done():
                return
            spins += 1
            if spins & 7 == 0:
                now = clock()
                if now - start > _YIELD_AFTER_S:
                    if spins & 63 == 0:
                        self._scan(rec)
                        if now - start > limit:
                            self._late(mine, peers, limit, rec)
                    os.sched_yield()

    @staticmethod
    def _last_seen(p: Peer) -> str:
        last = p.last
        if last is None:
            return "nothing yet"
        if isinstance(last, Ticket):
            a = last.fp.encode()
            a[SEQ], a[CSEQ] = last.seq, last.cseq
            return f"its match of my {describe(a)}"
        return describe(last)

    def _late(self, mine: np.ndarray, peers: Sequence[Peer], limit: float, rec: int) -> None:
        missing = [p for p in peers if p.colls or p.sends or p.recvs]
        if not missing:
            self._fail(f"{describe(mine)} on rank {self.rank} (group {self.group}): every "
                       f"participant announced it and the descriptors agree, but the "
                       f"transport did not complete it within {limit:g} s: a rank died or "
                       f"is stuck inside the transport; if it is only slow, raise the "
                       f"timeout", "timeout", rec, CommTimeoutError)
        seen = "; ".join(f"last seen from rank {p.rank}: {self._last_seen(p)}"
                         for p in missing)
        ranks = [p.rank for p in missing]
        self._fail(f"{describe(mine)} on rank {self.rank} (group {self.group}): rank(s) "
                   f"{ranks} did not reach it within {limit:g} s ({seen}); they are stuck "
                   f"in compute, dead, or waiting elsewhere; if they are only slow, raise "
                   f"the timeout", "timeout", rec, CommTimeoutError)

    def _explain(self, a: int, mine: np.ndarray, b: int, theirs: np.ndarray) -> str:
        fields = diff(mine, theirs) or ["op"]
        what = "; ".join(f"{f}: rank {a} has {render(mine, f)}, rank {b} has "
                         f"{render(theirs, f)}" for f in fields)
        return (f"collective mismatch in group {self.group} at collective "
                f"#{int(mine[CSEQ])} between rank {a} ({describe(mine)}) and rank {b} "
                f"({describe(theirs)}): differing fields {fields}: {what}. Fix: {_HINT}")

    def _mismatch(self, mine: np.ndarray, other: int, theirs: np.ndarray, rec: int) -> None:
        msg = np.empty(MSG_LEN, np.int64)
        msg[_KIND], msg[_SENDER], msg[_FP], msg[_OTHER], msg[_OTHER_FP] = (
            _ABORT, self.rank, mine, other, theirs)
        for p in self._all:
            self._post(msg, p.rank)
        self._fail(self._explain(self.rank, mine, other, theirs), "mismatch", rec,
                   CollectiveMismatchError)

    def _aborted(self, m: np.ndarray, rec: int) -> None:
        text = self._explain(int(m[_SENDER]), m[_FP], int(m[_OTHER]), m[_OTHER_FP])
        self._fail(f"rank {int(m[_SENDER])} reported a {text}", "mismatch", rec,
                   CollectiveMismatchError)

    def _fail(self, text: str, state: str, rec: int, kind: type[Exception],
              *, raise_now: bool = True) -> None:
        self._loud = True
        if self._failed is None:
            self._failed, self._failed_kind = text, kind
            if rec >= 0 and self.recorder is not None:
                self.recorder.mark(rec, state, text)
            try:
                self.dump(reason=text)
            except OSError as e:  # a failed dump must not hide the failure itself
                text = f"{text} (flight recorder dump failed: {e})"
        if raise_now:
            raise kind(text)
