"""The collective guard: ranks that disagree on an operation raise; none hands MPI a
mismatched collective, and none hangs.

What the guard (``default`` and ``debug`` modes; ``off`` records and checks nothing)
guarantees, and how:

1. **A collective is compared before any data moves.** Every rank's words
   ``[digest, cseq, fence]`` must agree (:func:`agrees`): ``digest`` (of op, shape, dtype,
   reduce op, root and group: :func:`~fuelspmd.comm.fingerprint.digest`) and ``cseq`` (the
   group's collective number) alike on every rank, and the ``fence`` shares, each rank's
   part of ``sum over ordered pairs (a, b) of w(a, b) * (sends a issued to b - recvs b
   issued from a) mod P`` (random weights ``w``, alike on every rank), summing to zero:
   they do exactly when every pair issued as many recvs as sends before this collective
   (with probability ``1 - 1/P`` otherwise). The words ride where the transport makes the
   ranks meet anyway (the ``checked`` capability), else in one fixed-size all_gather on a
   private split of the transport (the *control* channel, :meth:`Guard.meet`). Every rank
   reads the same rows, so every rank decides the same; when they disagree, every rank
   raises :class:`~fuelspmd.errors.CollectiveMismatchError` (:meth:`Guard.explain`).
2. **A send meets its recv.** Each send's fingerprint follows it on the control channel
   (one ordered stream per pair, tag :data:`TAG_P2P`); a recv is released only once the
   sender's fingerprint is in and agrees (complementary op, epoch, tag, shape, dtype).
3. **Ranks waiting in different places find out within a slice.** A wait longer than
   :data:`~fuelspmd.transport.WATCH_S` sends each peer one *note* (tag :data:`TAG_NOTE`:
   the op it waits in, for a send or recv its number among the messages with that peer,
   and its pair counts with that peer) and reads the peers' (the ``probe`` capability). A
   note that cannot be squared with what this rank does raises here, and an *abort* note
   tells every peer, which raises within its next slice. A note about an operation already
   passed (an older collective, a message already sent) is ignored. A note may be read
   long after it was sent (when the reader's own wait passes a slice: the load and the
   collector's pauses decide), so a deadlock is concluded only from what it proves still
   holds: a peer in a recv of a message this rank has not sent is still in it, and one in
   a collective cannot leave it without this rank; a peer in a send may have left it (MPI
   may complete a send before its recv is posted), so two ranks each in a send to the
   other are left to the timeout. The message a peer waits for is the number its note
   carries, not its count of messages issued, which receives posted ahead make larger.
4. **A rank that finished is named at once.** A guard that closes (finalize, interpreter
   exit) sends each peer a *bye* note with its final counts; a rank waiting on it for what
   they show it never issued raises :class:`~fuelspmd.errors.PeerAbortedError`. A guard
   that failed sends its abort before its bye (also when it learnt the failure from a
   peer's abort), so a peer that reads this rank's notes first raises the same kind.
5. **A rank that never comes is named.** A wait gives up at the guard's ``timeout`` with
   :class:`~fuelspmd.errors.CommTimeoutError` naming the ranks whose notes do not show
   them in this operation, and what each was last seen doing.
6. Once the guard has failed, every later operation on it raises the same error class.

``debug`` mode also compares a CRC of every result that must be alike on all ranks
(all_reduce, all_gather, broadcast). The flight :class:`~fuelspmd.comm.recorder.Recorder`,
when given, records every operation and is dumped to ``trace_dir`` on a failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import zlib
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from fuelspmd.comm.fingerprint import (
    CSEQ,
    FP_LEN,
    OP,
    SEND,
    SEQ,
    Fingerprint,
    describe,
    diff,
    digest,
    peer,
    render,
)
from fuelspmd.comm.recorder import IN_FLIGHT, Recorder, caller
from fuelspmd.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    ConfigError,
    PeerAbortedError,
)
from fuelspmd.transport import WATCH_S, Check, Disagreement, Transport, Work, agree

__all__ = ["MODES", "TAG_NOTE", "TAG_P2P", "Guard", "agrees"]

MODES = ("default", "debug", "off")
TAG_P2P, TAG_NOTE = 1, 2  # the control channel's two streams
_P = (1 << 61) - 1  # the fence's modulus, a prime
_WAIT, _ABORT, _BYE = 1, 2, 3  # kinds of note
_TEXT = 2048  # bytes of an abort note's text
# [kind, wait: message no. with you (0: a collective) | abort: error code | bye: collectives
#  issued, sent to you, recvd from you, fp, text]
_NOTE = 4 + FP_LEN + _TEXT // 8
_KINDS = (CollectiveMismatchError, CommTimeoutError, PeerAbortedError, CommError)
_P2P = ("send", "recv")
_HINT = ("every rank must issue the same collectives in the same order, and every send "
         "must meet a recv with the same tag, shape and dtype")


def _weight(a: int, b: int) -> int:
    """The fence weight of the ordered pair (a, b): 61 pseudo-random bits, alike everywhere."""
    data = np.array([a, b], np.int64).tobytes()
    return ((zlib.crc32(data) << 32) | zlib.crc32(data[::-1])) % (_P - 1) + 1


def _text(note: np.ndarray) -> str:
    """The text of a note (an abort's message, how a rank that said bye ended)."""
    return bytes(note[4 + FP_LEN:].view(np.uint8)).rstrip(b"\0").decode(errors="replace")


def agrees(rows: list[list[int]]) -> bool:
    """Whether every rank's ``[digest, cseq, fence, ...]`` agree (see the module docstring)."""
    d, c = rows[0][0], rows[0][1]
    total = 0
    for r in rows:
        if r[0] != d or r[1] != c:
            return False
        total += r[2]
    return total % _P == 0


class Guard:
    """The checks of one group, driven by GuardedTransport. Creating one is collective over
    ``transport``: it splits the control channel; every rank must ask for one mode and group.
    """

    def __init__(self, transport: Transport, *, mode: str = "default", timeout: float = 600.0,
                 recorder: Recorder | None = None, group: int = 0, world_rank: int | None = None,
                 trace_dir: str | os.PathLike[str] | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"Guard(mode={mode!r}): use one of {MODES}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"Guard(timeout={timeout!r}): give a positive number of seconds")
        self.rank, self.size = transport.rank, transport.size
        self.mode, self.timeout, self.group = mode, float(timeout), int(group)
        self.recorder, self.trace_dir = recorder, trace_dir
        self.world_rank = self.rank if world_rank is None else int(world_rank)
        self.control: Transport | None = None
        if mode != "off" and self.size > 1:
            self.control = transport.split(0, transport.rank)
            agree(self.control, "GuardedTransport", timeout=self.timeout, mode=mode,
                  group=self.group, recording=recorder is not None)
        control = self.control
        self._probe = (control.probe if control is not None  # type: ignore[attr-defined]
                       and "probe" in control.capabilities else None)
        n, r = self.size, self.rank
        self.sent, self.recvd = [0] * n, [0] * n  # point-to-point ops issued, per peer
        self.fence = 0
        self._w_out = [_weight(r, q) for q in range(n)]
        self._w_in = [_weight(q, r) for q in range(n)]
        self._descs: list[dict[int, np.ndarray]] = [{} for _ in range(n)]  # by message no.
        self._desc_n = [0] * n  # send fingerprints received from each peer
        self._outbox: list[Work] = []
        self._notes: list[np.ndarray | None] = [None] * n  # each peer's last wait note
        # the operation this rank is in, set by the caller as it enters one (its notes
        # name it; a failure marks its record, or records its fingerprint first): (template,
        # seq, cseq, k, recorder ticket or -1, fingerprint to record when not recorded yet)
        self.cur: tuple[np.ndarray, int, int, int, int, Fingerprint | None] | None = None
        self._announced: tuple[Any, ...] | None = None  # the ``cur`` a note announced
        self._said_bye = False
        self._told = False  # whether the peers were told of this guard's failure
        self.dumped = False  # whether dump() wrote this rank's recorder out
        self.failed: str | None = None
        self._failed_kind: type[Exception] = CollectiveMismatchError
        self._pinned: tuple[Any, ...] | None = None  # the ``cur`` marked waiting, with its line
        if recorder is not None and control is not None:
            # the members, so that a trace knows who never arrived, with a dump or without
            members = self._gather([self.world_rank], "the members")[:, 0]
            recorder.groups[self.group] = [int(m) for m in members]

    @property
    def checks(self) -> bool:
        """Whether operations are compared at all (not in off mode, nor with one rank)."""
        return self.control is not None

    # -- around an operation ----------------------------------------------------------

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self._failed_kind(f"the guard already failed: {self.failed}")

    def meet(self, check: Check) -> None:
        """Compare ``check``'s words with every rank's on the control channel (one
        fixed-size all_gather); raise :class:`Disagreement` on every rank if they differ."""
        table = self._gather(check.words, "the check").tolist()
        if not check.agrees(table):
            raise Disagreement("the guard's check", table)

    def _gather(self, words: Any, what: str, limit: float | None = None) -> np.ndarray:
        """Every rank's int64 ``words`` (one row each), all_gathered on the control channel."""
        assert self.control is not None
        mine = np.asarray(words, np.int64)
        rows = np.empty((self.size, mine.size), np.int64)
        self.wait_work(self.control.all_gather(mine, rows), limit or self.timeout, what)
        return rows

    def sent_to(self, peer: int, encoded: np.ndarray) -> int:
        """Count a send to ``peer``, post its fingerprint after it; return its number (1, ...)."""
        self.sent[peer] += 1
        self.fence = (self.fence + self._w_out[peer]) % _P
        self.post(encoded, peer, TAG_P2P)
        return self.sent[peer]

    def recvd_from(self, peer: int) -> int:
        """Count a recv from ``peer``; return its number (1, 2, ...) among them."""
        self.recvd[peer] += 1
        self.fence = (self.fence - self._w_in[peer]) % _P
        return self.recvd[peer]

    def post(self, msg: np.ndarray, peer: int, tag: int) -> None:
        """Send a control message (kept unchanged until sent); finished sends are dropped."""
        assert self.control is not None
        self._outbox = [w for w in self._outbox if not w.test()]
        self._outbox.append(self.control.send(msg, peer, tag))

    # -- waiting ----------------------------------------------------------------------

    def wait_work(self, work: Work, limit: float, what: str) -> None:
        """Wait for ``work`` in slices of WATCH_S, watching in between, until ``limit`` s."""
        start = time.monotonic()
        while True:
            try:
                work.wait(min(WATCH_S, max(limit - (time.monotonic() - start), 1e-6)))
                return
            except CommTimeoutError:
                if time.monotonic() - start >= limit:
                    self.late(what, limit)
                self.watch()

    def descriptor(self, peer: int, k: int, limit: float) -> np.ndarray:
        """The fingerprint of ``peer``'s ``k``-th send to this rank (received in order)."""
        assert self.control is not None
        got = self._descs[peer]
        while k not in got:
            buf = np.empty(FP_LEN, np.int64)
            self.wait_work(self.control.recv(buf, peer, TAG_P2P), limit,
                           f"the fingerprint of message #{k} from rank {peer}")
            self._desc_n[peer] += 1
            got[self._desc_n[peer]] = buf
        return got.pop(k)

    def settle(self, rec: int = -1) -> None:
        """The operation this rank waited in completed (``rec``: its recorder ticket)."""
        self.cur = None
        if rec >= 0 and self.recorder is not None:
            self.recorder.mark(rec, "completed")

    def verify(self, result: Any, seq: int) -> None:
        """In debug mode, raise unless every rank holds the same ``result`` (a host array)."""
        if self.mode != "debug" or self.control is None:
            return
        crc = zlib.crc32(np.ascontiguousarray(result).view(np.uint8))
        every = self._gather([crc], "the debug check")[:, 0]
        odd = [r for r in range(self.size) if every[r] != every[0]]
        if odd:
            self.fail(f"debug check: after op #{seq} in group {self.group} the result differs "
                      f"between rank 0 (crc {every[0]}) and rank(s) {odd} (crc "
                      f"{[int(every[r]) for r in odd]}); the transport returned different "
                      f"data on different ranks", CollectiveMismatchError)

    # -- notes ------------------------------------------------------------------------

    def doing(self) -> str | None:
        """The operation this rank is in, described (None: in none of this group's)."""
        return None if self.cur is None else f"{describe(self._encoded())} (group {self.group})"

    def pin(self, frame: FrameType | None, state: str = "waiting") -> None:
        """Mark the operation this rank is in as ``state`` in the recorder, once, with the
        source line of the program's frame that issued it (from ``frame`` outwards)."""
        cur = self.cur
        if cur is None or cur is self._pinned or self.recorder is None or cur[4] < 0:
            return
        self._pinned = cur
        if self.recorder.state(cur[4]) in IN_FLIGHT:
            self.recorder.mark(cur[4], state, where=caller(frame))

    def watch(self) -> None:
        """Called every slice of a wait: mark the operation waiting (with the caller's
        line), announce it once, read the peers' notes; raise when they show the ranks out
        of step (see the module docstring)."""
        if self.cur is not self._pinned:
            self.pin(sys._getframe(1))
        if self._probe is None or self.failed is not None:
            return
        if self.cur is not None and self._announced is not self.cur:
            self._announced = self.cur
            self._tell(_WAIT, self.cur[3], self._encoded())
        self._read_notes()
        for q, note in enumerate(self._notes):  # a bye stands for every later operation
            if note is not None and note[0] == _BYE:
                self._square(q, note)

    def _tell(self, kind: int, arg: int, fp: np.ndarray | int = 0, text: str = "") -> None:
        """Post a note of ``kind`` to every peer (see ``_NOTE``)."""
        data = np.frombuffer(text.encode()[:_TEXT], np.uint8)
        for q in range(self.size):
            if q != self.rank:
                note = np.zeros(_NOTE, np.int64)
                note[:4] = (kind, arg, self.sent[q], self.recvd[q])
                note[4:4 + FP_LEN] = fp
                note[4 + FP_LEN:].view(np.uint8)[:data.size] = data
                self.post(note, q, TAG_NOTE)

    def _read_notes(self) -> None:
        assert self._probe is not None and self.control is not None
        while (q := self._probe(None, TAG_NOTE)) is not None:
            note = np.empty(_NOTE, np.int64)
            self.control.recv(note, q, TAG_NOTE).wait(self.timeout)
            if note[0] == _ABORT:
                self.fail(f"rank {q} aborted: {_text(note)}", _KINDS[int(note[1])], tell=False)
            self._notes[q] = note
            self._square(q, note)

    def _encoded(self) -> np.ndarray:
        assert self.cur is not None
        template, seq, cseq = self.cur[:3]
        a = template.copy()
        a[CSEQ], a[SEQ] = cseq, seq
        return a

    def _square(self, q: int, note: np.ndarray) -> None:
        """Raise if ``q``'s note (what it waits in, or its bye: its final counts) cannot be
        squared with what this rank is in."""
        if self.cur is None:
            return
        theirs, bye, r = note[4:4 + FP_LEN], note[0] == _BYE, self.rank
        mine, k = self._encoded(), self.cur[3]
        my_peer, q_peer = peer(mine), peer(theirs)
        gap = int(theirs[CSEQ]) - int(mine[CSEQ])
        if not bye and (gap < 0 or (gap > 0 and my_peer < 0)):
            # behind: a stale note (q has since passed the collective this rank passed);
            # ahead: q finished the collective this rank waits in (a broadcast's root, or
            # any rank whose share arrived, may finish early), which every rank compared
            # before it moved data; q's own next one is compared when this rank gets there
            return
        gone = (f"{describe(mine)} on rank {r} (group {self.group}): rank {q} "
                f"{_text(note) or 'finished normally'} (its guard said bye) after issuing")
        if my_peer >= 0:  # this rank waits in its message #k with my_peer
            q_issued = int(note[3] if mine[OP] == SEND else note[2])  # the other side
            if my_peer != q or q_issued >= k:
                return  # another peer's, or q issued the other side: this op completes
            if bye:
                self.fail(f"{gone} only {q_issued} matching ops with rank {r}, so this rank's "
                          f"message #{k} with it will never come. Fix: {_HINT}",
                          PeerAbortedError)
        elif bye:
            if int(note[1]) <= int(mine[CSEQ]):
                self.fail(f"{gone} {int(note[1])} collectives, so it will never join "
                          f"collective #{int(mine[CSEQ])}. Fix: {_HINT}", PeerAbortedError)
            return
        if q_peer >= 0:  # q waits in its message #need with q_peer (the note's number)
            need = int(note[1])
            r_issued = self.recvd[q] if theirs[OP] == SEND else self.sent[q]
            if q_peer != r or r_issued >= need:
                return  # q waits for another rank, or for what this rank issued already
            if theirs[OP] == SEND and my_peer >= 0:
                return  # q may have left its send (a buffered send completes unmatched)
            self.fail(self._unmatched(q, theirs, need, r, mine, r_issued))
        elif my_peer >= 0:  # q passed to a collective without the other side of this op
            self.fail(self._unmatched(r, mine, k, q, theirs, q_issued))
        elif digest(theirs) != digest(mine):
            self.fail(self.pair(r, mine, q, theirs))

    def _unmatched(self, a: int, fa: np.ndarray, k: int, b: int, fb: np.ndarray,
                   have: int) -> str:
        """The message of rank ``a`` waiting in ``fa``, its message #k with rank ``b``, which
        is in ``fb`` and issued only ``have`` of the other side."""
        return (f"point-to-point mismatch in group {self.group}: rank {a} waits in "
                f"{describe(fa)} (its message #{k} with rank {b}) but rank {b} is in "
                f"{describe(fb)} and issued only {have} matching ops with rank {a}: a send "
                f"or recv was skipped or is in the wrong order. Fix: {_HINT}")

    def pair(self, a: int, mine: np.ndarray, b: int, theirs: np.ndarray,
             kind: str = "collective") -> str:
        """The mismatch message of rank ``a``'s fingerprint against rank ``b``'s."""
        fields = diff(mine, theirs) or ["op"]
        what = "; ".join(f"{f}: rank {a} has {render(mine, f)}, rank {b} has "
                         f"{render(theirs, f)}" for f in fields)
        return (f"{kind} mismatch in group {self.group} at collective "
                f"#{int(mine[CSEQ])} between rank {a} ({describe(mine)}) and rank {b} "
                f"({describe(theirs)}): differing fields {fields}: {what}. Fix: {_HINT}")

    # -- failures ---------------------------------------------------------------------

    def explain(self, rows: list[list[int]]) -> None:
        """Every rank saw ``rows`` disagree: gather each rank's fingerprint and pair counts
        on the control channel and raise the mismatch, naming the ranks, the collective
        number and each differing field, or the pair whose sends and recvs do not match."""
        n = self.size
        try:
            table = self._gather(np.concatenate([self._encoded(), self.sent, self.recvd]),
                                 "the explanation", 2.0)
        except CommError:
            self.fail(f"collective mismatch in group {self.group}: the ranks' checks differ "
                      f"({rows}) and the fingerprints did not come within 2 s. Fix: {_HINT}")
        fps = table[:, :FP_LEN]
        sent, recvd = table[:, FP_LEN:FP_LEN + n], table[:, FP_LEN + n:]
        keys = [(digest(f), int(f[CSEQ])) for f in fps]
        ref = keys.index(Counter(keys).most_common(1)[0][0])
        odd = [b for b in range(n) if keys[b] != keys[ref]]
        if odd:
            self.fail("; ".join(self.pair(ref, fps[ref], b, fps[b]) for b in odd))
        pairs = [(a, b) for a in range(n) for b in range(n) if sent[a][b] != recvd[b][a]]
        text = "; ".join(
            f"rank {a} issued {sent[a][b]} sends to rank {b}, which issued {recvd[b][a]} "
            f"recvs from rank {a}" + (" (both sent: a send met a send, differing field op)"
                                      if sent[b][a] > recvd[a][b] and sent[a][b] > recvd[b][a]
                                      else "") for a, b in pairs)
        self.fail(f"point-to-point mismatch in group {self.group} before collective "
                  f"#{int(fps[0][CSEQ])}: {text or rows}; a send without its recv (or a recv "
                  f"without its send) was skipped. Fix: {_HINT}")

    def late(self, what: str, limit: float) -> None:
        """Raise the CommTimeoutError of a wait past ``limit`` s, naming the absent ranks."""
        mine = self._encoded() if self.cur is not None else None
        p2p = mine is not None and peer(mine) >= 0
        here = [q for q, note in enumerate(self._notes) if note is not None and mine is not None
                and note[0] == _WAIT and int(note[4 + CSEQ]) == int(mine[CSEQ])
                and p2p == (peer(note[4:4 + FP_LEN]) >= 0)]
        peers = [peer(mine)] if p2p else range(self.size)
        missing = [q for q in peers if q != self.rank and q not in here]
        seen = "; ".join(f"last seen from rank {q}: {self._last_seen(q, mine)}"
                         for q in missing)
        why = (f"rank(s) {missing} did not reach it within {limit:g} s ({seen}); they are "
               f"stuck in compute, dead, or waiting elsewhere" if missing else
               f"every rank is in it, but {what} did not complete within {limit:g} s: a rank "
               f"died or is stuck inside the transport")
        self.fail(f"{describe(mine) if mine is not None else what} on rank {self.rank} (group "
                  f"{self.group}): {why}; if it is only slow, raise the timeout",
                  CommTimeoutError)

    def _last_seen(self, q: int, mine: np.ndarray | None) -> str:
        """What rank ``q`` was last seen doing: its last note, or, when it sent none, the
        last operation it is known to have joined (it has not waited a slice since)."""
        note = self._notes[q]
        if note is not None:
            return "finished" if note[0] == _BYE else f"waiting in {describe(note[4:4 + FP_LEN])}"
        if mine is not None and peer(mine) >= 0:
            k = self._desc_n[q]
            known = (f"its message #{k} to this rank was the last it sent" if k else
                     "it has sent this rank nothing")
        else:
            c = -1 if mine is None else int(mine[CSEQ]) - 1
            known = (f"it joined collective #{c}{self._collective_text(c)}, the group's last "
                     "one every rank met" if c >= 0 else "it has joined no collective of "
                     "this group")
        return (f"{known}, and has not waited in an operation of this group since (it is in "
                "compute or stuck in Python, or waiting in another group)")

    def _collective_text(self, c: int) -> str:
        """`` (OP SHAPE DTYPE, completed here N s ago)`` from the recorder, or ""."""
        if self.recorder is None:
            return ""
        for rec in reversed(self.recorder.records()):
            if (rec.fp.group, rec.cseq) == (self.group, c) and rec.fp.op not in _P2P:
                ago = ("" if rec.t_done is None else
                       f", completed here {time.time() - rec.t_done:.1f} s ago")
                return f" ({rec.fp.op} {tuple(rec.fp.shape)} {rec.fp.dtype}{ago})"
        return ""

    def fail_with(self, e: CommError) -> None:
        """Fail the guard for ``e``, raised by an operation or its check: ranks that
        disagreed are explained (fields, ranks), a wait past the deadline names the absent
        ranks. Returns only if the guard had failed already (the caller re-raises ``e``)."""
        if self.failed is None:
            if isinstance(e, Disagreement):
                self.explain(e.rows)
            if isinstance(e, CommTimeoutError):
                self.late("the check", self.timeout)
            self.fail(str(e), type(e))

    def fail(self, text: str, kind: type[Exception] = CollectiveMismatchError, *,
             tell: bool = True, raise_now: bool = True) -> None:
        """Fail the guard (every later operation raises ``kind``), mark the operation this
        rank is in (recording it first if it was not), tell the peers, dump the flight
        recorder, and raise."""
        if self.failed is None:
            self.failed, self._failed_kind = text, kind
            if self.cur is not None and self.recorder is not None:
                _, seq, cseq, _, rec, fp = self.cur
                rec = self.recorder.push(fp, seq, cseq) if rec < 0 and fp is not None else rec
                self.recorder.mark(rec, {CollectiveMismatchError: "mismatch",
                                         CommTimeoutError: "timeout"}.get(kind, "failed"), text,
                                   where=caller(sys._getframe(1)))
            if tell:
                self._abort()
            try:
                self.dump(reason=text, where=caller(sys._getframe(1)))
            except OSError as e:  # a failed dump must not hide the failure itself
                self.failed = f"{text} (flight recorder dump failed: {e})"
        if raise_now:
            raise self._failed_kind(self.failed)

    def _abort(self) -> None:
        """Tell every peer (once) that this guard failed, and the kind of error to raise."""
        if not self._told and self.control is not None:
            self._told = True
            with contextlib.suppress(CommError):
                self._tell(_ABORT, next((i for i, k in enumerate(_KINDS)
                                         if issubclass(self._failed_kind, k)), 3),
                           text=self.failed or "")

    def dump(self, *, reason: str = "", where: str = "", final: bool = True) -> Path | None:
        """Write the flight recorder to ``trace_dir`` (see :meth:`Recorder.dump`); None
        without either."""
        if self.recorder is None or self.trace_dir is None:
            return None
        self.dumped = self.dumped or final
        return self.recorder.dump(self.trace_dir, self.world_rank, reason=reason, where=where,
                                  final=final)

    def bye(self, cseq: int, how: str = "") -> None:
        """Tell every peer (once) that this guard closes, after ``cseq`` collectives, and
        ``how`` the rank ended when it did not finish normally."""
        if self._probe is not None and not self._said_bye:
            self._said_bye = True
            # a failure learnt from a peer's abort is told now: a peer that reads this
            # bye before that abort must raise the same kind
            if self.failed is not None:
                self._abort()
            with contextlib.suppress(CommError):
                self._tell(_BYE, cseq, text=how)

    def close(self, cseq: int = 0) -> None:
        """Say bye; read each peer's notes up to its bye and the send fingerprints its bye
        counts, let the control messages in flight go (up to 2 s), then release the control
        channel; nothing is checked after. A channel that did not drain within the timeout
        is kept: a message still to come must not match in a later split given its context."""
        control, drained, end = self.control, self._probe is None, time.monotonic() + self.timeout
        self.bye(cseq)
        with contextlib.suppress(CommError):
            for q in range(0 if drained or control is None else self.size):
                while q != self.rank and ((note := self._notes[q]) is None or note[0] != _BYE):
                    self._notes[q] = note = np.empty(_NOTE, np.int64)
                    control.recv(note, q, TAG_NOTE).wait(max(end - time.monotonic(), 1e-3))
                for _ in range(self._desc_n[q], int(note[2]) if q != self.rank else 0):
                    buf = np.empty(FP_LEN, np.int64)
                    control.recv(buf, q, TAG_P2P).wait(max(end - time.monotonic(), 1e-3))
            drained = True
        deadline = time.monotonic() + 2.0
        while self._outbox and time.monotonic() < deadline:
            self._outbox = [w for w in self._outbox if not w.test()]
        self.control = self._probe = None
        if drained and control is not None and "finalize" in control.capabilities:
            control.finalize()  # type: ignore[attr-defined]
        if self.failed is None:
            self.failed, self._failed_kind = "it was closed", RuntimeError
