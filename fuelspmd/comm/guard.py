"""The collective guard: ranks that disagree on an operation raise, they never hang.

Before a rank issues an operation to its Transport, :meth:`Guard.check` sends the
operation's :class:`~fuelspmd.comm.fingerprint.Fingerprint` to every other participant
over a CONTROL channel (a private ``split`` of the transport, so control messages never
match data) and compares it with theirs.

Why it cannot hang. Per ordered pair of ranks (p, q) the control messages form one
ordered stream (MPI's non-overtaking rule on one communicator and tag): every op p issues
that involves q puts one descriptor on it, in issue order. Each rank keeps one receive
posted per peer, so whatever a peer did next is what arrives, and the comparison is
immediate:

- a collective is a *fence*: it is matched against the peer's next collective, and both
  sides must have matched every send/recv they exchanged before it;
- a send is matched with the peer's recv in the order each side issued them (likewise a
  recv), so the two directions of a pair may interleave freely (a 2-rank swap written
  ``send; recv`` on both ranks is fine) but a skipped send or recv is seen as soon as the
  peer reaches its next collective, or the first time the pair's descriptors disagree on
  peer, tag, shape or dtype;
- in ``default`` mode the descriptor is sent and the operation issued at once; the
  comparison completes while the operation is waited on, before its result is released
  (``wait`` raises instead of returning). No extra round trip is added to the critical
  path, which is what keeps the guard within 2% of a 1 MiB all_reduce. A mismatched
  collective is then briefly in flight: MPI reports a size mismatch as an error (which
  the guard replaces by the mismatch it explains) and never writes past a buffer, and a
  mismatched pair that would never complete is seen on the control streams, which are
  polled throughout the wait. The job must end after a mismatch anyway (the data
  communicator is left with an operation in flight). ``debug`` mode compares a
  collective's descriptors *before* issuing it, so a mismatched collective never reaches
  the transport;
- a send/recv is matched while it is waited on in every mode (a recv is released only
  once the sender's descriptor agrees), so a ring of sends-then-receives does not turn
  into a rendezvous deadlock.

The rank that finds a disagreement sends an *abort* descriptor, carrying both
fingerprints, to every other rank of the group before it raises; a rank waiting on any
stream sees it within one poll and raises the same :class:`CollectiveMismatchError`,
naming both ranks, the sequence numbers and the differing fields with both values. Only a
rank that never arrives (stuck, dead) leaves the others waiting, until the guard's
``timeout``: :class:`CommTimeoutError` then names it.

Modes: ``default`` (the above), ``debug`` (also compares a CRC of every result that must be
identical on all ranks: all_reduce, all_gather, broadcast), ``off`` (records, checks
nothing). Creating a Guard is collective over the transport (it splits the control
channel). The flight :class:`~fuelspmd.comm.recorder.Recorder`, when given, records every
operation and is dumped to ``trace_dir`` on a mismatch or timeout.
"""

from __future__ import annotations

import os
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.comm.fingerprint import (
    CSEQ,
    FP_LEN,
    OP,
    SEQ,
    Fingerprint,
    describe,
    diff,
    group_id,
    render,
)
from fuelspmd.comm.recorder import Record, Recorder
from fuelspmd.errors import CollectiveMismatchError, CommError, CommTimeoutError, ConfigError
from fuelspmd.transport import Transport, Work

__all__ = ["MODES", "Guard", "Ticket"]

MODES = ("default", "debug", "off")
_OP, _ABORT = 1, 2
_FP = slice(2, 2 + FP_LEN)
_OTHER = 2 + FP_LEN
_OTHER_FP = slice(_OTHER + 1, _OTHER + 1 + FP_LEN)
MSG_LEN = _OTHER + 1 + FP_LEN  # [kind, sender, fp, other rank, other fp]
_TAG = 0
# As MPIWork.wait: spin, and after 10 us yield the core between polls, so a peer sharing
# the core runs (measured: a guard that spun 150 us before its first yield lost a whole
# 10 ms time slice on 2-3% of its operations on 2 busy cores).
_YIELD_AFTER_S = 1e-5
_DEPTH = 2  # control receives kept posted per peer
# In default mode a wait first waits on the data operation itself (the transport's own
# tuned loop) in slices of this long, looking at the control streams between slices, so
# a mismatched operation that never completes is still explained within a slice.
_SLICE_S = 0.05
_SEND, _RECV = 6, 7  # OPS.index("send"), OPS.index("recv")
_HINT = ("every rank must issue the same collectives in the same order, and every send "
         "must meet a recv with the same tag, shape and dtype")


Post = Callable[[np.ndarray, int], tuple[Callable[[], bool], Any]]


def _channel(control: Transport) -> tuple[Post, Post]:
    """Return (isend, irecv) on the control transport; each gives (test, handle).

    Through the Transport protocol (``send``/``recv`` -> Work) for any transport. A
    transport that exposes its mpi4py communicator as ``comm`` (the MPI transport does) is
    driven through ``Isend``/``Irecv`` directly: the control messages are fixed, valid
    int64 buffers, so the transport's argument checks (about 3 us a call) buy nothing,
    and every microsecond a rank spends before it enters the next collective is one its
    peer spends waiting (on a busy machine, several, as the peer yields its core).
    """
    comm = getattr(control, "comm", None)
    if comm is not None and hasattr(comm, "Isend") and hasattr(comm, "Irecv"):
        def isend(buf: np.ndarray, peer: int) -> tuple[Callable[[], bool], Any]:
            req = comm.Isend(buf, peer, _TAG)
            return req.Test, req

        def irecv(buf: np.ndarray, peer: int) -> tuple[Callable[[], bool], Any]:
            req = comm.Irecv(buf, peer, _TAG)
            return req.Test, req

        return isend, irecv

    def send(buf: np.ndarray, peer: int) -> tuple[Callable[[], bool], Any]:
        work = control.send(buf, peer, _TAG)
        return work.test, work

    def recv(buf: np.ndarray, peer: int) -> tuple[Callable[[], bool], Any]:
        work = control.recv(buf, peer, _TAG)
        return work.test, work

    return send, recv


class _Peer:
    """Control-stream state for one other rank of the group."""

    __slots__ = ("coll_ok", "colls", "inbox", "last", "posted", "rank", "recv_ok", "recvs",
                 "sends", "their_recvs", "their_sends")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # receives posted ahead, in order (MPI matches them in posting order)
        self.posted: deque[tuple[Callable[[], bool], np.ndarray, Any]] = deque()
        self.inbox: deque[np.ndarray] = deque()   # received, not yet matched, in peer order
        self.colls: deque[np.ndarray] = deque()   # my collective awaiting the peer's
        self.sends: deque[np.ndarray] = deque()   # my sends to the peer awaiting its recv
        self.recvs: deque[np.ndarray] = deque()   # my recvs awaiting the peer's send
        self.their_sends: deque[np.ndarray] = deque()  # the peer's, ahead of mine
        self.their_recvs: deque[np.ndarray] = deque()
        self.recv_ok = 0  # how many of my recvs from this peer have been matched
        self.coll_ok = 0  # how many of my collectives this peer has matched
        self.last: np.ndarray | None = None  # the peer's last matched descriptor


class Ticket:
    """An operation the guard let through: what :meth:`Guard.wait` needs to settle it."""

    __slots__ = ("coll", "encoded", "fp", "n", "peer", "record")

    def __init__(self, fp: Fingerprint, encoded: np.ndarray, record: Record | None,
                 peer: _Peer | None, n: int, coll: bool = False) -> None:
        self.fp, self.encoded, self.record, self.peer, self.n = fp, encoded, record, peer, n
        self.coll = coll  # a collective: ``n`` is its ordinal among this guard's collectives


class Guard:
    """Check each operation's fingerprint against the other participants' before it runs."""

    def __init__(self, transport: Transport, *, mode: str = "default", timeout: float = 600.0,
                 recorder: Recorder | None = None, group: int | None = None,
                 trace_dir: str | os.PathLike[str] | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"Guard(mode={mode!r}): use one of {MODES}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"Guard(timeout={timeout!r}): give a positive number of seconds")
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.mode, self.timeout = mode, float(timeout)
        self.recorder, self.trace_dir = recorder, trace_dir
        members = getattr(transport, "world_ranks", range(transport.size))
        self.group = group_id(members) if group is None else int(group)
        self._failed: str | None = None
        self._failed_kind: type[Exception] = CollectiveMismatchError
        self._inflight: deque[tuple[Callable[[], bool], np.ndarray]] = deque()
        self._control: Transport | None = None
        self._peers: list[_Peer | None] = []
        if mode != "off" and self.size > 1:
            self._control = transport.split(0, transport.rank)
            self._isend, self._irecv = _channel(self._control)
            self._peers = [None if r == self.rank else _Peer(r) for r in range(self.size)]
        self._all = [p for p in self._peers if p is not None]
        for p in self._all:
            self._top_up(p)
        self._colls_issued = 0

    # -- the two calls around an operation -------------------------------------------------

    @staticmethod
    def message(fp: Fingerprint) -> np.ndarray:
        """Return the control message that announces ``fp`` (``MSG_LEN`` int64s).

        A caller that issues many alike operations may cache it and change only the
        ``SEQ`` and ``CSEQ`` slots of ``message[2:]`` (the encoded fingerprint) per call.
        """
        msg = np.full(MSG_LEN, -1, np.int64)
        msg[0] = _OP
        msg[_FP] = fp.encode()
        return msg

    def check(self, fp: Fingerprint, *, message: np.ndarray | None = None) -> Ticket:
        """Agree on ``fp`` with the other participants; raise if any disagrees.

        Sends ``fp`` to the participants and returns a Ticket; :meth:`wait` completes the
        comparison before the operation's result is released. In ``debug`` mode a
        collective is compared before this returns, so a mismatched collective is never
        issued at all. ``message`` is ``Guard.message(fp)`` when the caller caches it (it
        is sent as it is, and must not be changed afterwards); its SEQ and CSEQ slots are
        the operation's numbers, and ``fp`` may then be a shared template.
        """
        if self._failed is not None:  # the group is out of step: nothing more can be agreed
            raise self._failed_kind(f"the guard already failed: {self._failed}")
        msg = self.message(fp) if message is None else message
        msg[1] = self.rank
        a = msg[_FP]
        rec = (self.recorder.record(fp, int(a[SEQ]), int(a[CSEQ]))
               if self.recorder is not None else None)
        if self._control is None:
            return Ticket(fp, a, rec, None, 0)
        inflight = self._inflight
        while inflight and inflight[0][0]():
            inflight.popleft()
        op = int(a[OP])
        if op == _SEND or op == _RECV:
            peer = fp.dst if op == _SEND else fp.src
            if peer is None or peer == self.rank:
                return Ticket(fp, a, rec, None, 0)
            p = self._peers[int(peer)]
            if p is None:
                raise RuntimeError(f"guard: no control stream to peer {peer}")
            self._post(msg, p.rank)
            self._top_up(p)
            if op == _SEND:
                p.sends.append(a)
                n = 0
            else:
                p.recvs.append(a)
                n = p.recv_ok + len(p.recvs)
            self._meet_early(p, rec)
            self._advance(p, rec)
            return Ticket(fp, a, rec, p, n)
        self._colls_issued = n = self._colls_issued + 1
        for p in self._all:
            self._post(msg, p.rank)
            self._top_up(p)
            p.colls.append(a)
            if p.their_sends or p.their_recvs:  # it issued p2p before its fence I never met
                self._mismatch(a, p.rank, (p.their_sends or p.their_recvs)[0], rec)
        if self.mode == "debug":
            self._drive(lambda: self._colls_matched(n), self._all, a, rec, None)
        return Ticket(fp, a, rec, None, n, True)

    def wait(self, ticket: Ticket, work: Work, timeout: float | None = None) -> None:
        """Wait for ``work`` (issued after ``ticket``'s check) and, for a recv, its match."""
        rec = ticket.record
        try:
            p, n = ticket.peer, ticket.n
            if self._control is None or (p is None and not ticket.coll):
                work.wait(timeout)
            elif ticket.coll and self.mode == "default" and self._fast(work, n, rec):
                pass
            elif ticket.coll:
                self._settle(work, lambda: work.test() and self._colls_matched(n),
                             lambda: self._colls_matched(n), self._all, ticket, timeout)
            elif n:  # a recv: released only once the peer's matching send descriptor is in
                self._settle(work, lambda: work.test() and p.recv_ok >= n,
                             lambda: p.recv_ok >= n,
                             [p], ticket, timeout)
            else:  # a send: done when the data is; its match is checked as the streams move
                self._settle(work, work.test, lambda: True, [p], ticket, timeout)
        except CommTimeoutError as e:
            self._fail(str(e), "timeout", rec, CommTimeoutError, raise_now=False)
            raise
        except CommError as e:
            self._fail(str(e), "mismatch" if isinstance(e, CollectiveMismatchError)
                       else "failed", rec, type(e), raise_now=False)
            raise
        if rec is not None:
            rec.settle("completed")

    def verify(self, ticket: Ticket, result: Any) -> None:
        """In debug mode, raise unless every rank holds the same ``result`` (a host array).

        Run after a collective whose result is identical on all ranks (all_reduce,
        all_gather, broadcast): a CRC of the bytes is all-gathered over the control channel.
        """
        if self.mode != "debug" or self._control is None:
            return
        mine = np.array([zlib.crc32(np.ascontiguousarray(result).view(np.uint8))], np.int64)
        every = np.empty(self.size, np.int64)
        self._control.all_gather(mine, every).wait(self.timeout)
        odd = [r for r in range(self.size) if every[r] != every[0]]
        if odd:
            a = ticket.encoded
            self._fail(f"debug check: after {describe(a)} in group {self.group} the result "
                       f"differs between rank 0 (crc {every[0]}) and rank(s) {odd} (crc "
                       f"{[int(every[r]) for r in odd]}); the transport returned different data "
                       f"on different ranks", "mismatch", ticket.record, CollectiveMismatchError)

    # -- failure hooks ---------------------------------------------------------------------

    def dump(self, directory: str | os.PathLike[str] | None = None, *,
             reason: str = "") -> Path | None:
        """Write the flight recorder to ``directory`` (default ``trace_dir``); None if neither."""
        where = directory if directory is not None else self.trace_dir
        if self.recorder is None or where is None:
            return None
        return self.recorder.dump(where, getattr(self.transport, "world_ranks",
                                                 range(self.size))[self.rank], reason=reason)

    def close(self) -> None:
        """Withdraw the posted control receives (the guard checks nothing afterwards)."""
        for p in self._all:
            for test, _, handle in p.posted:
                cancel = getattr(handle, "cancel", None) or getattr(handle, "Cancel", None)
                if cancel is not None and not test():
                    cancel()
            p.posted.clear()
        self._all = []
        self._control = None
        if self._failed is None:
            self._failed, self._failed_kind = "it was closed", RuntimeError

    # -- the machinery ---------------------------------------------------------------------

    def _post(self, msg: np.ndarray, peer: int) -> None:
        self._inflight.append((self._isend(msg, peer)[0], msg))

    def _fast(self, work: Work, n: int, rec: Record | None) -> bool:
        """The common case of a collective, inline: the data completes within one slice and
        every peer's descriptor is in by then. Return False to take the general path."""
        try:
            work.wait(_SLICE_S)
        except CommError:  # slow, or failed: the general path explains it
            return False
        for p in self._all:
            posted = p.posted
            if posted and posted[0][0]():
                self._pump(p)
            if p.inbox:
                self._advance(p, rec)
            if p.coll_ok < n:
                return False
        return True

    def _colls_matched(self, n: int) -> bool:
        for p in self._all:
            if p.coll_ok < n:
                return False
        return True

    def _wait_data(self, work: Work, peers: Sequence[_Peer], ticket: Ticket,
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
                peers: Sequence[_Peer], ticket: Ticket, timeout: float | None) -> None:
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

    def _pump(self, p: _Peer) -> None:
        """Move every control message that has arrived from ``p`` into its inbox."""
        posted = p.posted
        while posted and posted[0][0]():
            p.inbox.append(posted.popleft()[1])
        if not posted:
            self._top_up(p)

    def _top_up(self, p: _Peer) -> None:
        """Keep ``_DEPTH`` receives posted from ``p``, so a descriptor lands in one that is
        already waiting and reposting happens off the critical path (after an issue)."""
        posted = p.posted
        while len(posted) < _DEPTH:
            buf = np.empty(MSG_LEN, np.int64)
            test, handle = self._irecv(buf, p.rank)
            posted.append((test, buf, handle))

    def _meet_early(self, p: _Peer, rec: Record | None) -> None:
        """Match my newest p2p op with the peer's descriptors that arrived before it."""
        while p.sends and p.their_recvs:
            self._agree(p.sends.popleft(), p, p.their_recvs.popleft(), rec)
        while p.recvs and p.their_sends:
            self._agree(p.recvs.popleft(), p, p.their_sends.popleft(), rec)
            p.recv_ok += 1

    def _agree(self, mine: np.ndarray, p: _Peer, theirs: np.ndarray, rec: Record | None) -> None:
        # equal past the op number (slot 0): two collectives that agree; else the full rules
        if mine[1:].tobytes() != theirs[1:].tobytes() and diff(mine, theirs):
            self._mismatch(mine, p.rank, theirs, rec)
        p.last = theirs

    def _advance(self, p: _Peer, rec: Record | None) -> None:
        """Consume what ``p`` sent, in order, as far as it can be matched now."""
        inbox = p.inbox
        while inbox:
            m = inbox[0]
            if m[0] == _ABORT:
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

    def _scan(self, rec: Record | None) -> None:
        """Pump and advance every stream; raise on an abort anywhere in any inbox."""
        for p in self._all:
            self._pump(p)
            for m in p.inbox:
                if m[0] == _ABORT:
                    self._aborted(m, rec)
            self._advance(p, rec)

    def _drive(self, done: Callable[[], bool], peers: Sequence[_Peer], mine: np.ndarray,
               rec: Record | None, timeout: float | None) -> None:
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
                posted = p.posted
                if posted and posted[0][0]():
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

    def _late(self, mine: np.ndarray, peers: Sequence[_Peer], limit: float,
              rec: Record | None) -> None:
        missing = [p for p in peers if p.colls or p.sends or p.recvs]
        if not missing:
            self._fail(f"{describe(mine)} on rank {self.rank} (group {self.group}): every "
                       f"participant announced it and the descriptors agree, but the "
                       f"transport did not complete it within {limit:g} s: a rank died or "
                       f"is stuck inside the transport; if it is only slow, raise the "
                       f"timeout", "timeout", rec, CommTimeoutError)
        seen = "; ".join(f"last seen from rank {p.rank}: "
                         f"{describe(p.last) if p.last is not None else 'nothing yet'}"
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

    def _mismatch(self, mine: np.ndarray, other: int, theirs: np.ndarray,
                  rec: Record | None) -> None:
        msg = np.empty(MSG_LEN, np.int64)
        msg[0], msg[1], msg[_FP], msg[_OTHER], msg[_OTHER_FP] = (
            _ABORT, self.rank, mine, other, theirs)
        for p in self._all:
            self._post(msg, p.rank)
        self._fail(self._explain(self.rank, mine, other, theirs), "mismatch", rec,
                   CollectiveMismatchError)

    def _aborted(self, m: np.ndarray, rec: Record | None) -> None:
        text = self._explain(int(m[1]), m[_FP], int(m[_OTHER]), m[_OTHER_FP])
        self._fail(f"rank {int(m[1])} reported a {text}", "mismatch", rec,
                   CollectiveMismatchError)

    def _fail(self, text: str, state: str, rec: Record | None, kind: type[Exception],
              *, raise_now: bool = True) -> None:
        if self._failed is None:
            self._failed, self._failed_kind = text, kind
            if rec is not None:
                rec.settle(state, text)
            try:
                self.dump(reason=text)
            except OSError as e:  # a failed dump must not hide the failure itself
                text = f"{text} (flight recorder dump failed: {e})"
        if raise_now:
            raise kind(text)
