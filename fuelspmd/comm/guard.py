"""The collective guard: ranks that disagree on an operation raise, they never hang.

Every guarded operation's :class:`~fuelspmd.comm.fingerprint.Fingerprint` (op, collective
number, shape, dtype, reduce op, root, group; for send/recv also src, dst, tag) is sent to
every other participant over a CONTROL channel (a private ``split`` of the transport, so
control messages never match data) and compared with theirs. How the per-pair streams
are matched, and why that cannot hang, is in :mod:`fuelspmd.comm.streams`.

What ``default`` mode (the mode ``fs.init()`` uses) guarantees, exactly:

1. ``wait`` on a guarded collective returns only after this rank has compared its
   descriptor with the matching collective descriptor of every other rank of the group,
   and they agree; ``wait`` on a recv, only after the sender's matching send descriptor
   agrees. The comparison is per operation, not batched: no result is released before it
   is checked. ``wait`` on a send returns once the data is sent; the send's descriptor is
   compared with the peer's recv as the streams move, at the latest when either rank
   waits on the group's next collective (which then raises).
2. If two descriptors disagree, ``wait`` raises :class:`CollectiveMismatchError` instead of
   returning, on every rank of the group: the rank that sees it first sends an *abort*
   carrying both descriptors to every other rank before raising, and a rank that is
   waiting in the guard sees it within one poll (at most ``_SLICE_S`` = 50 ms while its
   own data operation is still running), a rank that enters the guard later raises at its
   next guarded operation. Every rank's message names both ranks, the collective number
   and every differing field with both values.
3. The descriptor goes out together with the data operation (just before it for an
   all_reduce that repeats an accepted one, just after it otherwise, so that a caller's
   mistake in a buffer raises from the transport before anything is sent), not ahead of
   a comparison: a mismatched collective has already been issued when it is found (MPI
   then either completes it with meaningless data, which is never released, or reports an
   error such as a truncation, which the guard replaces by the mismatch that explains it,
   waiting up to 2 s for the descriptors). The data communicator is left unusable after a
   mismatch: the job must end (invariant 3 of DESIGN.md).
4. A rank that never issues its part (stuck in compute, dead, or waiting on something
   else) is not a mismatch: the others wait until the guard's ``timeout`` and raise
   :class:`CommTimeoutError`, naming the ranks whose descriptor never came and what each
   did last; if every descriptor came and agrees but the transport still does not finish,
   the error says so.
5. Once the guard has failed, every later operation on it raises the same error class.

In-band. Where the transport already makes the ranks meet over a header they all read
(the MPI transport's shared-memory all-reduce: ``checks_all_reduce``), a repeated
all_reduce sends no control message at all: its :class:`Call` (a
:class:`~fuelspmd.transport.CallCheck`) puts a digest of the descriptor (``key``, which
covers op, shape, dtype, reduce op and group) and the collective number in that header,
and the transport compares them with every peer's before it moves any data. That is the
same per-operation comparison as guarantee 1, made where the ranks meet anyway, so
nothing is released unchecked. It keeps the guarantees because every rank decides alike
from the headers it read:

- a rank takes the in-band path only when the guard is *settled* (every descriptor it
  sent matched, every one it received consumed: no send or recv awaits its match, so
  the fence of guarantee 1 holds); otherwise it announces the collective as before and
  sets ``oob`` in the header, and every rank that sees an ``oob`` announces the
  collective too (*promotes* it), after the data moved, and matches it as usual: the
  control streams stay in step, each pair's stream holding the same collectives;
- ranks whose digests or numbers differ all promote and match (:meth:`Guard.disagree`),
  so the error names the fields as ever;
- a rank waiting in such a call reads its streams every slice (``watch``): an abort, or
  any descriptor a peer sent (a peer that went to another operation announced it; one
  that sent or awaits a point-to-point message this rank never issued did too), makes it
  promote its collective there, and the match raises the mismatch on both sides. A peer
  that is only late sends nothing, and nothing happens.

With a flight recorder every operation is announced (the in-band path records nothing).
Measured, ``fuelspmd bench guard`` at 1 MiB on 2 ranks: 1.01x the unguarded all_reduce
in-band, 1.11-1.14x announced (docs/reliability.md).

``debug`` mode also compares a collective's descriptors *before* issuing it (a mismatched
collective never reaches the transport) and a CRC of every result that must be identical
on all ranks (all_reduce, all_gather, broadcast). ``off`` records, checks nothing.
Creating a Guard is collective over the transport (it splits the control channel). The
flight :class:`~fuelspmd.comm.recorder.Recorder`, when given, records every operation and
is dumped to ``trace_dir`` on a mismatch or timeout.

What it costs, and why each step sits where it does. Every microsecond of Python a rank
runs per operation is a microsecond its peers wait (measured: 3 us of busy work before the
issue, between issue and wait, or after completion each added 1.6-2.1% to a 200 us 1 MiB
all_reduce at 2 ranks), and right after a 1 MiB all_reduce the interpreter and MPI run
with cold caches, at about half speed (the guard's steps took about twice the thread CPU
time after a 1 MiB all_reduce as after an 8 B one, load 5-8). So the hot path of a
default-mode collective is short and makes few MPI calls: :meth:`Guard.stage` writes two
numbers into a preallocated send slot holding the cached descriptor and records the
operation; :meth:`Guard.post` starts the slot's persistent sends (one MPI call), for a
repeated all_reduce just before the issue, so a peer whose data completes finds the
descriptor already there; after completion, per peer, the head of a ring of persistent
receives is tested (one MPI call), 15 int64s compared as bytes and the collective number
as an int; consumed receives are restarted, and finished sends tested, four at a time.
Anything else (a descriptor that differs, an abort, a send/recv, a slow peer, more
collectives in flight than slots) takes the general path (:mod:`fuelspmd.comm.streams`).
Measured figures: ``fuelspmd bench guard`` (:mod:`fuelspmd.bench.guard`).
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.comm.control import Channel, Request
from fuelspmd.comm.fingerprint import CSEQ, OP, SEQ, Fingerprint, describe, group_id
from fuelspmd.comm.recorder import Recorder
from fuelspmd.comm.streams import (
    _BATCH,
    _DEPTH,
    _FP,
    _HINT,
    _KIND,
    _MSG_CSEQ,
    _MSG_SEQ,
    _NO_FP,
    _OP,
    _RECV,
    _SAME,
    _SEND,
    _SENDER,
    _SLICE_S,
    _SLOTS,
    MODES,
    MSG_LEN,
    Peer,
    Streams,
    Ticket,
)
from fuelspmd.errors import CollectiveMismatchError, CommError, CommTimeoutError, ConfigError
from fuelspmd.transport import Transport, Work

__all__ = ["MODES", "MSG_LEN", "Guard", "Ticket"]


def descriptor_key(template: np.ndarray) -> int:
    """A digest of what two agreeing collectives share (a message's ``_SAME`` run: kind,
    op, shape, dtype, reduce op, root, group...), alike on every rank (CRC-32 and Adler-32,
    not Python's per-process salted ``hash``); 62 bits, for an int64 header word."""
    b = template[_SAME].tobytes()
    return (zlib.crc32(b) << 30) ^ zlib.adler32(b)


class Call:
    """One kind of guarded all_reduce (shape, dtype, reduce op), and its in-band check.

    A GuardedTransport (``owner``: its ``seq`` is the call's number) caches one per kind:
    ``fp`` and ``template`` are its fingerprint and control message templates, ``key``
    their digest, ``shape``, ``dtype`` and ``op`` what it is looked up by. It is the
    :class:`~fuelspmd.transport.CallCheck` handed to a transport that checks in-band:
    ``cseq`` and ``outcome`` are set per call; ``oob`` is 1 while the call is announced
    over the control streams (posted before the issue, or promoted: ``ticket``), and every
    rank that sees it in a header announces the call too. ``inband`` says whether the
    transport checked the last call of this kind (MPI's own all-reduce of a small size
    does not): it predicts the next, which is otherwise announced first.
    """

    __slots__ = ("cseq", "dtype", "fp", "guard", "inband", "key", "oob", "op", "outcome",
                 "owner", "shape", "template", "ticket", "timeout")

    def __init__(self, guard: Guard, fp: Fingerprint, template: np.ndarray,
                 owner: Any) -> None:
        self.guard, self.fp, self.template, self.owner = guard, fp, template, owner
        self.timeout = guard.timeout  # the guard's deadline, for the transport's wait
        self.key = descriptor_key(template)
        self.cseq = self.oob = 0
        self.outcome: bool | None = None
        self.inband = True
        self.ticket: Ticket | None = None
        self.shape: Any = None
        self.dtype: Any = None
        self.op: Any = None

    def watch(self) -> None:
        """Read the control streams while the transport waits for the peers (Guard.watch)."""
        self.guard.watch(self)

    def disagree(self, rows: list[list[int]]) -> None:
        """The ranks' descriptors differ (rows of [key, cseq, oob]): Guard.disagree raises."""
        self.guard.disagree(rows, self)


class Guard(Streams):
    """Check each operation's fingerprint against the other participants' (see the module)."""

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
        self._peers: list[Peer | None] = []
        self._colls_issued = 0
        # collective send slots (default mode): message buffer, its fingerprint view, the
        # persistent sends to every peer, the ordinal of the collective last sent from it
        self._slot_buf: list[np.ndarray] = []
        self._slot_fp: list[np.ndarray] = []
        self._slot_reqs: list[list[Request]] = []
        self._slot_start: list[Callable[[], None]] = []
        self._slot_n: list[int] = []
        self._slot_sent: list[bool] = []  # its last sends are known to have completed
        self._batch_reqs: list[list[Request]] = []  # sends of slots k..k+_BATCH-1, k % _BATCH == 0
        self._slot_same: list[bytes] = []
        self._slot_tmpl: list[np.ndarray | None] = []
        self._next_slot = 0
        self._unposted: Ticket | None = None  # staged, its descriptor not sent yet
        # in-band (see the module): ``_loud`` until settled() found nothing awaiting a peer
        self._loud = True
        if mode != "off" and self.size > 1:
            self._control = transport.split(0, transport.rank)
            self._channel = Channel(self._control)
            self._peers = [None if r == self.rank else Peer(r, self._channel)
                           for r in range(self.size)]
        self._all = [p for p in self._peers if p is not None]
        for p in self._all:
            self._channel.startall(p.ring)
        if self._all and mode == "default":
            for _ in range(_SLOTS):
                buf = np.full(MSG_LEN, -1, np.int64)
                self._slot_buf.append(buf)
                self._slot_fp.append(buf[_FP])
                reqs = [self._channel.send_init(buf, p.rank) for p in self._all]
                self._slot_reqs.append(reqs)
                self._slot_start.append(self._channel.starter(reqs))
                self._slot_n.append(0)
                self._slot_sent.append(True)
                self._slot_same.append(b"")
                self._slot_tmpl.append(None)
            self._batch_reqs = [[r for reqs in self._slot_reqs[k:k + _BATCH] for r in reqs]
                                for k in range(0, _SLOTS, _BATCH)]

    # -- the calls around an operation -----------------------------------------------------

    @staticmethod
    def message(fp: Fingerprint) -> np.ndarray:
        """Return the control message that announces ``fp`` (``MSG_LEN`` int64s).

        A caller that issues many alike operations may cache it as a template: copy it and
        set the SEQ and CSEQ slots of ``message[2:]`` (the encoded fingerprint) per call,
        or hand it to :meth:`stage`.
        """
        msg = np.full(MSG_LEN, -1, np.int64)
        msg[_KIND] = _OP
        msg[_FP] = fp.encode()
        return msg

    def stage(self, fp: Fingerprint, template: np.ndarray, seq: int,
              cseq: int) -> Ticket | None:
        """Prepare a collective for :meth:`post`: fill a send slot, record it; or None.

        Called before the data operation is issued, so that none of this runs while it
        is in flight; :meth:`post`, right after the issue, sends it (and :meth:`unstage`,
        if the issue raised, takes the record back). ``template`` is
        ``Guard.message(fp)``, kept unchanged by the caller, and ``fp`` may be a shared
        template (its numbers are ``seq`` and ``cseq``): a slot that last held the same
        template object only gets the two numbers written. Returns None where the fast
        path does not apply (debug or off mode, one rank, or the next slot still awaiting
        a peer's match or its send): the caller then uses :meth:`check`. Raises at once
        if the guard has failed or a peer is already known to be out of step.
        """
        if self._failed is not None:  # the group is out of step: nothing more can be agreed
            raise self._failed_kind(f"the guard already failed: {self._failed}")
        if not self._slot_buf:
            return None
        k = self._next_slot
        n = self._slot_n[k]
        for p in self._all:
            if p.coll_ok < n:  # a slot is reused once every peer matched its collective
                return None
            if p.their_sends or p.their_recvs:  # p2p of theirs before a fence I never met
                return None  # check() raises the mismatch
        if not self._slot_sent[k]:  # ... and its sends completed
            if k % _BATCH == 0 and self._channel.testall(self._batch_reqs[k // _BATCH]):
                for j in range(k, k + _BATCH):
                    self._slot_sent[j] = True
            elif self._channel.testall(self._slot_reqs[k]):
                self._slot_sent[k] = True
            else:
                return None
        buf = self._slot_buf[k]
        if self._slot_tmpl[k] is not template:
            buf[:] = template
            buf[_SENDER] = self.rank
            self._slot_tmpl[k] = template
            self._slot_same[k] = buf[_SAME].tobytes()
        buf[_MSG_SEQ] = seq
        buf[_MSG_CSEQ] = cseq
        rec = self.recorder.push(fp, seq, cseq) if self.recorder is not None else -1
        self._unposted = t = Ticket(self, fp, self._slot_fp[k], rec, None,
                                    self._colls_issued + 1, True, self._slot_same[k], cseq,
                                    k, seq)
        return t

    def post(self, ticket: Ticket) -> Ticket:
        """Send the collective :meth:`stage` prepared to every peer; return its Ticket.

        The one step between the data operation's issue and its wait: one MPI call, three
        stores and an append per peer. The comparison happens in :meth:`wait`. A ticket
        already posted (by :meth:`watch`, while its issue blocked) is not posted again.
        """
        if ticket is not self._unposted:
            return ticket
        self._unposted = None
        self._loud = True
        k = ticket.slot
        self._slot_start[k]()
        self._colls_issued = n = ticket.n
        self._slot_n[k] = n
        self._slot_sent[k] = False
        self._next_slot = (k + 1) % _SLOTS
        a = ticket.encoded
        for p in self._all:
            p.colls.append(a)
        return ticket

    def abandon(self, ticket: Ticket, error: BaseException) -> None:
        """A posted collective whose issue raised: its descriptor is out, the operation is
        not, so the group is out of step; the guard fails (every later operation raises)."""
        self._fail(f"{describe(ticket.encoded)} on rank {self.rank} was announced to the "
                   f"group but the transport refused to issue it ({type(error).__name__}: "
                   f"{error}); the ranks are out of step and the job must end",
                   "failed", ticket.record, RuntimeError, raise_now=False)

    def unstage(self, ticket: Ticket) -> None:
        """Forget a staged collective whose issue raised (its record is taken back)."""
        if ticket is self._unposted:
            self._unposted = None
        if ticket.record >= 0 and self.recorder is not None:
            self.recorder.unpush(ticket.record)

    def watch(self, call: Call | None = None) -> None:
        """Read the control streams while the transport blocks inside an operation's issue.

        The shared-memory all-reduce waits for its peers inside ``all_reduce`` (it
        returns a finished Work), so a peer that is in another operation would only be
        found at the transport's deadline; the transport calls this every slice of that
        wait instead (``checks_all_reduce``). It sends this rank's staged descriptor if
        it is not out yet (the peers need it to see the disagreement), then reads every
        stream as a wait does: an abort, or a peer's descriptor that disagrees with the
        collective this rank is in, raises here, on every rank within a slice. A ``call``
        checked in-band (not announced: ``oob`` 0) is promoted as soon as any peer's
        descriptor is here: that peer announced its operation, so it either set ``oob``
        in its header (every rank promotes this call) or is in another operation (the
        match raises).
        """
        if self._control is None:
            return
        if self._unposted is not None:
            self.post(self._unposted)
        self._scan(-1)
        if call is not None and not call.oob:
            for p in self._all:
                if p.inbox or p.their_sends or p.their_recvs:
                    self._promote(call)
                    self._scan(-1)
                    break

    def settled(self) -> bool:
        """Whether nothing of this guard awaits a peer: every descriptor it sent has been
        matched and every one it received consumed (then an all_reduce may be checked
        in-band). Cheap once true: ``_loud`` is set again by whatever sends or receives."""
        if self._failed is not None or self._unposted is not None or self._control is None:
            return False
        for p in self._all:
            if p.colls or p.sends or p.recvs or p.inbox or p.their_sends or p.their_recvs:
                return False
        self._loud = False
        return True

    def _promote(self, call: Call) -> Ticket:
        """Announce ``call``, checked in-band until now, as any collective (see the module)."""
        msg = call.template.copy()
        msg[_MSG_SEQ] = call.owner.seq
        msg[_MSG_CSEQ] = call.cseq
        call.oob = 1
        call.ticket = t = self.check(call.fp, message=msg)
        return t

    def finish(self, call: Call, work: Work) -> Work:
        """The in-band ``call`` returned, but not plainly agreed (``outcome`` True: some
        rank announced it; None: the transport checked nothing, the size took MPI's own
        all-reduce; or this rank promoted it): announce it now, unless promoted already,
        and return its Ticket; the wait matches it as any collective. Called before the
        owner counts the call."""
        t = call.ticket if call.ticket is not None else self._promote(call)
        call.ticket, call.oob = None, 0
        if call.outcome is None:
            call.inband = False  # announce the next of its kind first
        t.work = work
        return t

    def end(self, call: Call, error: BaseException) -> None:
        """The in-band ``call`` raised. A CommError (a timeout, a mismatch) fails the
        guard; a refusal before any communication (a bad buffer) leaves it as it was."""
        t = call.ticket
        call.ticket, call.oob = None, 0
        if isinstance(error, CommError):
            state = ("mismatch" if isinstance(error, CollectiveMismatchError) else
                     "timeout" if isinstance(error, CommTimeoutError) else "failed")
            self._fail(str(error), state, -1, type(error), raise_now=False)
        elif t is not None:
            self.abandon(t, error)

    def disagree(self, rows: list[list[int]], call: Call | None = None) -> None:
        """The transport's header shows the ranks' descriptors differ (``rows``: every
        rank's [key, cseq, oob]); every rank sees it, so every rank announces its
        collective (``call``, unless announced already) and matches the peers' here,
        which raises the mismatch naming the fields (up to 2 s for the descriptors;
        failing that, the header's words)."""
        if self._control is None:
            raise CollectiveMismatchError(f"collective mismatch in group {self.group}: the "
                                          f"transport's header gives {rows} per rank")
        if self._unposted is not None:
            self.post(self._unposted)
        if call is not None and not call.oob:
            self._promote(call)
        n = self._colls_issued
        mine = next((p.colls[-1] for p in self._all if p.colls), _NO_FP)
        try:
            self._drive(lambda: self._colls_matched(n), self._all, mine, -1, 2.0)
        except CommTimeoutError:
            self._failed = None
        who = "; ".join(f"rank {k}: key {r[0]} collective #{r[1]}" for k, r in enumerate(rows))
        self._fail(f"collective mismatch in group {self.group} at collective "
                   f"#{rows[self.rank][1]} on rank {self.rank}: the ranks' descriptors differ "
                   f"in the transport's header ({who}), and the control streams did not name "
                   f"the fields within 2 s. Fix: {_HINT}", "mismatch", -1,
                   CollectiveMismatchError)

    @property
    def checks(self) -> bool:
        """Whether operations are compared at all (not in off mode, nor with one rank)."""
        return self._control is not None

    def note(self, fp: Fingerprint, seq: int, cseq: int) -> Ticket:
        """Record an operation of a guard that checks nothing (off mode, one rank)."""
        if self._failed is not None:
            raise self._failed_kind(f"the guard already failed: {self._failed}")
        if self._control is not None:
            raise RuntimeError("Guard.note on a guard that checks: use stage/post or check")
        rec = self.recorder.push(fp, seq, cseq) if self.recorder is not None else -1
        return Ticket(self, fp, _NO_FP, rec, None, 0, cseq=cseq, seq=seq)

    def check(self, fp: Fingerprint, *, message: np.ndarray | None = None) -> Ticket:
        """Announce ``fp`` to the participants; raise if a disagreement is already known.

        Returns a Ticket; :meth:`wait` completes the comparison before the operation's
        result is released. In ``debug`` mode a collective is compared before this
        returns, so a mismatched collective is never issued at all. ``message`` is a
        filled copy of ``Guard.message(fp)`` when the caller caches it (it is sent as it
        is and must not be changed afterwards); its SEQ and CSEQ slots are the operation's
        numbers, and ``fp`` may then be a shared template.
        """
        if self._failed is not None:  # the group is out of step: nothing more can be agreed
            raise self._failed_kind(f"the guard already failed: {self._failed}")
        msg = self.message(fp) if message is None else message
        msg[_SENDER] = self.rank
        a = msg[_FP]
        cseq = int(a[CSEQ])
        rec = (self.recorder.push(fp, int(a[SEQ]), cseq)
               if self.recorder is not None else -1)
        if self._control is None:
            return Ticket(self, fp, a, rec, None, 0)
        self._loud = True
        inflight = self._inflight
        while inflight and inflight[0][0]():
            inflight.popleft()
        op = int(a[OP])
        if op == _SEND or op == _RECV:
            peer = fp.dst if op == _SEND else fp.src
            if peer is None or peer == self.rank:
                return Ticket(self, fp, a, rec, None, 0)
            p = self._peers[int(peer)]
            if p is None:
                raise RuntimeError(f"guard: no control stream to peer {peer}")
            self._post(msg, p.rank)
            if op == _SEND:
                p.sends.append(a)
                n = 0
            else:
                p.recvs.append(a)
                n = p.recv_ok + len(p.recvs)
            self._meet_early(p, rec)
            self._advance(p, rec)
            return Ticket(self, fp, a, rec, p, n)
        self._colls_issued = n = self._colls_issued + 1
        for p in self._all:
            self._post(msg, p.rank)
            p.colls.append(a)
            if p.their_sends or p.their_recvs:  # it issued p2p before its fence I never met
                self._mismatch(a, p.rank, (p.their_sends or p.their_recvs)[0], rec)
        if self.mode == "debug":
            self._drive(lambda: self._colls_matched(n), self._all, a, rec, None)
        return Ticket(self, fp, a, rec, None, n, True, None, cseq)

    def wait(self, ticket: Ticket, work: Work, timeout: float | None = None) -> None:
        """Wait for ``work`` (issued with ``ticket``) and for its descriptors to agree."""
        rec = ticket.record
        try:
            p, n = ticket.peer, ticket.n
            if self._control is None or (p is None and not ticket.coll):
                work.wait(timeout)
            elif ticket.coll and self.mode == "default" and self._fast(work, ticket):
                pass  # matched inline
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
        if rec >= 0 and self.recorder is not None:
            self.recorder.mark(rec, "completed")

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

    def close(self) -> None:
        """Withdraw the control receives and free the requests (nothing is checked after)."""
        if self._all:
            self._channel.retire([r for p in self._all for r in p.ring],
                                 [r for reqs in self._slot_reqs for r in reqs])
        self._all = []
        self._slot_buf = []
        self._control = None
        if self._failed is None:
            self._failed, self._failed_kind = "it was closed", RuntimeError

    # -- the fast path ---------------------------------------------------------------------

    def _fast(self, work: Work, ticket: Ticket) -> bool:
        """The common case of a collective, inline: the data completes within one slice and
        every peer's next message is the agreeing descriptor. Return False to take the
        general path (nothing is lost: what was consumed here was fully matched)."""
        try:
            work.wait(_SLICE_S)
        except CommError:  # slow, or failed: the general path explains it
            return False
        a, n, same, rec = ticket.encoded, ticket.n, ticket.same, ticket.record
        peers = self._all
        arrived = False
        if len(peers) > 1 and same is not None:  # one Testall for every peer's next message
            arrived = self._channel.testall([p.ring[p.head] for p in peers])
        for p in peers:
            if p.coll_ok >= n:
                continue
            if (same is not None and not p.inbox and not p.sends and not p.recvs
                    and p.colls and p.colls[0] is a):
                head = p.head
                if not arrived and not p.ring[head].Test():
                    return False
                buf = p.bufs[head]
                p.head = (head + 1) % _DEPTH
                p.idle += 1
                if buf[_SAME].tobytes() == same and buf[_MSG_CSEQ] == ticket.cseq:
                    p.last = ticket
                    if p.idle >= _BATCH:
                        self._restart(p)
                    p.colls.popleft()
                    p.coll_ok += 1
                    continue
                p.inbox.append(buf.copy())
                self._loud = True
                self._restart(p)
            else:
                self._pump(p)
            if p.inbox:
                self._advance(p, rec)
            if p.coll_ok < n:
                return False
        return True
