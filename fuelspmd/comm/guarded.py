"""GuardedTransport: any Transport, with every operation checked by a :class:`Guard`.

It is a Transport itself (same methods, same buffer layout), so code written against the
seam runs guarded unchanged; ``fs.init()`` hands out the world transport so wrapped. It
numbers the group's operations (``seq``: every op; ``cseq``: collectives) and checks each
one's buffers before anything is sent, so a caller's mistake raises the transport's typed
error before any communication; what is compared, and where, is in :mod:`.guard`. Guards
still open at interpreter exit or ``World.finalize`` say bye then (:func:`bye_all`).
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any, NoReturn

import numpy as np

from fuelspmd.comm.fingerprint import CSEQ, SEQ, TAG, Fingerprint, diff, digest, group_id
from fuelspmd.comm.guard import Guard, agrees
from fuelspmd.comm.recorder import Recorder
from fuelspmd.errors import CommError
from fuelspmd.transport import (
    DONE,
    Check,
    ReduceOp,
    Transport,
    Work,
    check_buffers,
    check_peer,
)

__all__ = ["GuardedTransport", "GuardedWork", "bye_all", "pin_all"]

_ndarray = np.ndarray
_NOTHING = np.empty(0, np.int8)  # a barrier's "buffer", for its fingerprint
# what a guarded transport passes on of the inner one's capabilities (the checks and the
# probe are the guard's own business)
_PASSED = frozenset({"lend", "route", "finalize"})


class _Call:
    """One kind of operation (op, shape, dtype, reduce op, root, peers): its fingerprint
    template, encoding and check words ``[digest, cseq, fence]``, built once."""

    __slots__ = ("check", "encoded", "fp")

    def __init__(self, fp: Fingerprint, guard: Guard) -> None:
        self.fp, self.encoded = fp, fp.encode()
        self.check = (Check([digest(self.encoded), 0, 0], agrees, guard.watch,
                            guard.timeout) if guard.checks else None)


class GuardedWork:
    """The Work of a guarded operation, settled with the guard by ``wait``. ``encoded`` is
    its fingerprint (a collective's template: its numbers are ``seq`` and ``cseq``); ``k``
    its message number with ``peer`` (point-to-point)."""

    __slots__ = ("cseq", "done", "encoded", "guard", "k", "peer", "rec", "recv", "result",
                 "seq", "work")

    def __init__(self, guard: Guard, work: Work, encoded: np.ndarray, seq: int, cseq: int,
                 rec: int, *, peer: int = -1, k: int = 0, recv: bool = False,
                 result: Any = None) -> None:
        self.guard, self.work, self.encoded, self.seq, self.cseq = guard, work, encoded, seq, cseq
        self.rec, self.peer, self.k, self.recv, self.result = rec, peer, k, recv, result
        self.done = False

    def test(self) -> bool:
        """Return whether the data operation completed (never blocks)."""
        return self.done or self.work.test()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the operation (and, for a recv, its match); CommTimeoutError after
        ``timeout`` s (default: the guard's)."""
        if self.done:
            return
        g = self.guard
        limit = g.timeout if timeout is None else timeout
        if not g.checks:
            self.work.wait(limit)
        elif self.recv or not self.work.test():  # a wait: watched, a recv matched first
            g.raise_if_failed()
            g.cur = (self.encoded, self.seq, self.cseq, self.k, self.rec, None)
            try:
                if self.recv:  # released only once the sender's fingerprint agrees
                    theirs = g.descriptor(self.peer, self.k, limit)
                    if diff(self.encoded, theirs):
                        g.fail(g.pair(g.rank, self.encoded, self.peer, theirs, "send/recv"))
                g.wait_work(self.work, limit, "the transport")
            except CommError as e:
                g.fail_with(e)
                raise
        if self.result is not None:
            g.verify(self.result, self.seq)
        self.done = True
        g.settle(self.rec)


class GuardedTransport:
    """A Transport whose every operation is checked against all participants' (collective
    to create). ``seq`` is the number the next operation gets, ``cseq`` the next collective's.
    """

    def __init__(self, transport: Transport, *, mode: str = "default", timeout: float = 600.0,
                 recorder: Recorder | None = None, group: int | None = None,
                 world_rank: int | None = None,
                 trace_dir: str | os.PathLike[str] | None = None) -> None:
        self.inner = transport
        self.name = f"guarded-{transport.name}"
        self.rank, self.size = transport.rank, transport.size
        self.tag_bound = transport.tag_bound
        self.capabilities = frozenset(transport.capabilities & _PASSED)
        self.group = group_id(range(transport.size)) if group is None else int(group)
        self.guard = Guard(transport, mode=mode, timeout=timeout, recorder=recorder,
                           group=self.group, world_rank=world_rank, trace_dir=trace_dir)
        self.seq = self.cseq = 0
        self._calls: dict[tuple[Any, ...], _Call] = {}
        # the inner transport's check-and-issue, where it has one and checks are on
        self._checked: Callable[..., Work] | None = (
            transport.checked if "checked" in transport.capabilities  # type: ignore[attr-defined]
            and self.guard.checks else None)
        self._memo: tuple[Any, ...] = ((), None, None, None, None)
        self._debug = mode == "debug"
        self._bare = recorder is None and not self._debug  # a completed op leaves nothing
        self._inner_all_reduce = transport.all_reduce
        if self.guard.checks:  # the hook runs before MPI_Finalize, which registered earlier
            _OPEN.add(self)
            atexit.unregister(_at_exit)
            atexit.register(_at_exit)
        if "lend" in self.capabilities:
            self.lend = transport.lend  # type: ignore[attr-defined]
            self.lent = transport.lent  # type: ignore[attr-defined]
        if "route" in self.capabilities:
            self.set_all_reduce_policy = transport.set_all_reduce_policy  # type: ignore[attr-defined]
            self.explain_all_reduce = transport.explain_all_reduce  # type: ignore[attr-defined]
            self.all_reduce_algorithm = transport.all_reduce_algorithm  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"GuardedTransport({self.inner!r}, mode={self.guard.mode!r})"

    def _call(self, op: str, buf: Any, reduce_op: str | None = None, root: int | None = None,
              src: int | None = None, dst: int | None = None) -> _Call:
        key = (op, buf.shape, buf.dtype, reduce_op, root, src, dst)
        hit = self._calls.get(key)
        if hit is None:  # once per distinct operation: str(dtype) is the costly part
            fp = Fingerprint(0, op, tuple(buf.shape), str(buf.dtype), reduce_op, root,
                             self.group, src, dst, None if src is None else 0, 0)
            hit = _Call(fp, self.guard)
            if len(self._calls) < 4096:
                self._calls[key] = hit
        return hit

    def _collective(self, call: _Call, name: str, method: Callable[..., Work],
                    args: tuple[Any, ...], result: Any = None) -> Work:
        """Compare, then issue ``method(*args)``, the inner transport's collective ``name``
        (over a ``checked`` transport, in its own meeting)."""
        g = self.guard
        if g.failed is not None:
            g.raise_if_failed()
        seq, cseq, check = self.seq, self.cseq, call.check
        # recorded before it can block (a trace then names what a stuck rank is in); a
        # caller's mistake, raised before anything is issued, takes the record back
        rec = -1 if g.recorder is None else g.recorder.push(call.fp, seq, cseq)
        if check is None:  # off mode, or one rank
            try:
                work = method(*args)
            except Exception as e:
                if not isinstance(e, CommError) and rec >= 0:
                    g.recorder.retract(rec)  # type: ignore[union-attr]
                raise
        else:
            g.cur = (call.encoded, seq, cseq, 0, rec, call.fp)
            w = check.words
            w[1], w[2] = cseq, g.fence
            try:
                if self._checked is not None:  # a caller's mistake raises before it
                    try:
                        work = self._checked(check, name, *args)
                    except Exception as e:
                        if not isinstance(e, CommError) and rec >= 0:
                            g.recorder.retract(rec)  # type: ignore[union-attr]
                        raise
                else:
                    g.meet(check)
                    try:
                        work = method(*args)
                    except Exception as e:  # all agreed on it: a refusal puts them out of step
                        if not isinstance(e, CommError):
                            g.fail(f"{call.fp.op} #{seq} was agreed by every rank of group "
                                   f"{self.group}, but rank {self.rank}'s transport refused "
                                   f"to issue it ({type(e).__name__}: {e}); the job must end",
                                   CommError, raise_now=False)
                        raise
            except CommError as e:
                g.fail_with(e)
                raise
        self.seq, self.cseq = seq + 1, cseq + 1
        return self._issued(call, work, seq, cseq, rec, result)

    def _issued(self, call: _Call, work: Work, seq: int, cseq: int, rec: int,
                result: Any) -> Work:
        """The Work of collective ``seq`` (recorder ticket ``rec``), just issued: the inner
        one where it completed with nothing left to settle (no recorder, not debug), else a
        GuardedWork."""
        g = self.guard
        if self._bare and (work is DONE or work.test()):
            g.cur = None
            return work
        return GuardedWork(g, work, call.encoded, seq, cseq, rec,
                           result=result if self._debug else None)

    def all_reduce(self, buf: Any, op: ReduceOp | str) -> Work:
        """Guarded ``Transport.all_reduce`` (in place)."""
        m = self._memo  # the kind of the last all_reduce: a repeated one skips the lookup
        if (op is m[2] and buf.__class__ is _ndarray and buf.dtype is m[1]
                and buf.shape == m[0] and buf.flags.c_contiguous):
            rop, call = m[3], m[4]
            g = self.guard
            if self._checked is not None and g.failed is None:
                # _collective's steps on a checked transport, inline: the call a training
                # step issues most reaches the transport's meeting one frame sooner (what
                # the other ranks wait on; docs/reliability.md, the guard's cost)
                seq, cseq, check = self.seq, self.cseq, call.check
                assert check is not None  # _checked: checks are on
                recorder = g.recorder
                rec = -1 if recorder is None else recorder.push(call.fp, seq, cseq)
                g.cur = (call.encoded, seq, cseq, 0, rec, call.fp)
                w = check.words
                w[1], w[2] = cseq, g.fence
                try:
                    work = self._checked(check, "all_reduce", buf, rop)
                except CommError as e:
                    g.fail_with(e)
                    raise
                except Exception:
                    if recorder is not None:
                        recorder.retract(rec)
                    raise
                self.seq, self.cseq = seq + 1, cseq + 1
                if work is DONE and self._bare:
                    g.cur = None
                    return work
                return self._issued(call, work, seq, cseq, rec, buf)
        else:
            rop = op if op.__class__ is ReduceOp else ReduceOp.parse(op)
            check_buffers("all_reduce", self.size, buf)
            call = self._call("all_reduce", buf, rop._value_)  # type: ignore[union-attr]
            if buf.__class__ is np.ndarray:
                self._memo = (buf.shape, buf.dtype, op, rop, call)
        return self._collective(call, "all_reduce", self._inner_all_reduce, (buf, rop), buf)

    def all_gather(self, send: Any, recv: Any) -> Work:
        """Guarded ``Transport.all_gather``."""
        check_buffers("all_gather", self.size, send, recv, recv_factor=self.size)
        return self._collective(self._call("all_gather", send), "all_gather",
                                self.inner.all_gather, (send, recv), recv)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp | str) -> Work:
        """Guarded ``Transport.reduce_scatter``."""
        rop = ReduceOp.parse(op)
        check_buffers("reduce_scatter", self.size, send, recv, send_factor=self.size)
        return self._collective(self._call("reduce_scatter", send, rop.value),
                                "reduce_scatter", self.inner.reduce_scatter, (send, recv, rop))

    def broadcast(self, buf: Any, root: int) -> Work:
        """Guarded ``Transport.broadcast``."""
        check_peer("broadcast", root, self.size, what="root")
        check_buffers("broadcast", self.size, buf)
        return self._collective(self._call("broadcast", buf, root=int(root)), "broadcast",
                                self.inner.broadcast, (buf, root), buf)

    def all_to_all(self, send: Any, recv: Any) -> Work:
        """Guarded ``Transport.all_to_all``."""
        check_buffers("all_to_all", self.size, send, recv)
        return self._collective(self._call("all_to_all", send), "all_to_all",
                                self.inner.all_to_all, (send, recv))

    def barrier(self) -> Work:
        """Guarded ``Transport.barrier``."""
        return self._collective(self._call("barrier", _NOTHING), "barrier",
                                self.inner.barrier, ())

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        """Guarded ``Transport.send``: its fingerprint follows it to the peer."""
        return self._p2p("send", buf, int(peer), tag, self.rank, int(peer))

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        """Guarded ``Transport.recv``: complete once the data and the matching send's
        fingerprint are in and agree."""
        return self._p2p("recv", buf, int(peer), tag, int(peer), self.rank)

    def _p2p(self, op: str, buf: Any, peer: int, tag: int, src: int, dst: int) -> Work:
        g = self.guard
        g.raise_if_failed()
        check_peer(op, peer, self.size)
        check_buffers(op, self.size, buf)
        work = (self.inner.send if op == "send" else self.inner.recv)(buf, peer, tag)
        call = self._call(op, buf, src=src, dst=dst)
        seq, cseq = self.seq, self.cseq
        self.seq = seq + 1
        encoded = call.encoded.copy()
        encoded[TAG], encoded[CSEQ], encoded[SEQ] = int(tag), cseq, seq
        rec = -1 if g.recorder is None else g.recorder.push(replace(call.fp, tag=int(tag)),
                                                            seq, cseq)
        k = 0
        if g.checks:
            k = g.sent_to(peer, encoded) if op == "send" else g.recvd_from(peer)
        return GuardedWork(g, work, encoded, seq, cseq, rec, peer=peer, k=k, recv=op == "recv")

    def split(self, color: int, key: int) -> GuardedTransport:
        """Split the inner transport and guard the part (collective; shares the recorder)."""
        inner = self.inner.split(color, key)
        g = self.guard
        return GuardedTransport(inner, mode=g.mode, timeout=g.timeout, recorder=g.recorder,
                                group=group_id([self.group], int(color)),
                                world_rank=g.world_rank, trace_dir=g.trace_dir)

    def close(self) -> None:
        """Stop checking: say bye to the peers, drain and release the guard's channel."""
        self.guard.close(self.cseq)

    def finalize(self) -> None:
        """Close the guard, then release the inner transport (collective)."""
        self.close()
        if "finalize" in self.inner.capabilities:
            self.inner.finalize()  # type: ignore[attr-defined]

    def abort(self, code: int = 1) -> NoReturn:
        """Dump the flight recorder (if a trace_dir is set and nothing dumped it yet), then
        abort the inner transport."""
        try:
            if not self.guard.dumped:
                self.guard.dump(reason=f"abort({code})")
        finally:
            self.inner.abort(code)


_OPEN: weakref.WeakSet[GuardedTransport] = weakref.WeakSet()


def pin_all(frame: FrameType | None) -> list[str]:
    """Mark the operation each open guard is in as waiting, with the program's line from
    ``frame`` (a signal's: where the main thread was), unless a slice of its wait did;
    return those operations, described."""
    ops = []
    for t in list(_OPEN):
        doing = t.guard.doing()
        if doing is not None:
            t.guard.pin(frame)
            ops.append(doing)
    return ops


def bye_all(how: str = "") -> None:
    """Say bye on every guard still open (at interpreter exit and ``World.finalize``).
    None is closed: a close is collective (it frees shared windows), and a guard collected
    on one rank only would hold the others; unfreed, no late bye matches in a split."""
    for t in list(_OPEN):
        t.guard.bye(t.cseq, how)


def _at_exit() -> None:
    """:func:`bye_all`, saying so when the interpreter ends on an unhandled exception."""
    e = getattr(sys, "last_value", None)  # set as the interpreter prints it, before exit
    bye_all("" if e is None else f"died of an unhandled {type(e).__name__} ({e})")
