"""GuardedTransport: any Transport, with every operation checked by a :class:`Guard`.

It is a Transport itself (same methods, same buffer layout), so code written against the
seam runs guarded unchanged; the lazy Communicator can either wrap its transport in one or
call :meth:`Guard.check` / :meth:`Guard.wait` itself. It numbers the group's operations
(``seq``, from 0, every op counts) and builds each one's fingerprint from its buffers.
The fingerprint and control message of each distinct (op, shape, dtype, reduce op, root,
peer, tag) are built once and cached (a :class:`~fuelspmd.comm.guard.Call`). The steady
state of an all_reduce on a transport that checks it in its own header (the MPI
transport's shared-memory path) is six comparisons and two stores around the transport's
call (see *In-band* in :mod:`.guard`); elsewhere a dict lookup, two numbers written into
one of the guard's preallocated send slots (:meth:`Guard.stage`), one MPI call to send it
(:meth:`Guard.post`) just before the data operation is issued, and the match after it
completes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from fuelspmd.comm.fingerprint import CSEQ, SEQ, Fingerprint, group_id
from fuelspmd.comm.guard import Call, Guard, Ticket
from fuelspmd.comm.recorder import Recorder
from fuelspmd.transport import ReduceOp, Transport, Work

__all__ = ["GuardedTransport", "GuardedWork"]

_ndarray = np.ndarray
_NOTHING = np.empty(0, np.int8)  # a barrier's "buffer", for its fingerprint
_SEQ, _CSEQ = 2 + SEQ, 2 + CSEQ  # their slots in a control message (after sender, kind)


GuardedWork = Ticket
"""The Work of a guarded operation: its :class:`~fuelspmd.comm.guard.Ticket`, whose
``wait`` settles it with the guard (one object per operation)."""


def _issued(ticket: Ticket, work: Work, result: Any = None) -> Ticket:
    ticket.work = work
    ticket.result = result
    return ticket


class GuardedTransport:
    """A Transport whose every operation is checked against all participants' (see .guard).

    Creating one is collective over ``transport`` (the guard splits its control channel).
    ``seq`` is the number the next operation gets, ``cseq`` the next collective's (see
    :mod:`fuelspmd.comm.fingerprint`); a rank that skips an operation shows up at the
    group's next collective.
    """

    def __init__(self, transport: Transport, *, mode: str = "default", timeout: float = 600.0,
                 recorder: Recorder | None = None, group: int | None = None,
                 trace_dir: str | os.PathLike[str] | None = None) -> None:
        self.inner = transport
        self.guard = Guard(transport, mode=mode, timeout=timeout, recorder=recorder,
                           group=group, trace_dir=trace_dir)
        # an optional capability, passed through: the shared area the transport lends an
        # all_reduce input (the graph places inputs there; the all_reduce is guarded as any)
        lend = getattr(transport, "window_buffer", None)
        if lend is not None:
            self.window_buffer = lend
        self.name = f"guarded-{transport.name}"
        self.rank, self.size = transport.rank, transport.size
        self.seq = 0   # the next operation's number (every op counts)
        self.cseq = 0  # the next collective's number
        self._debug = mode == "debug"
        self._cache: dict[tuple[Any, ...], Call] = {}
        # all_reduce's entries again, under a shorter key: (shape, dtype, reduce op name)
        self._ar_cache: dict[tuple[Any, ...], Call] = {}
        # A transport whose all_reduce may block inside the call (the MPI transport's
        # shared-memory path) takes a CallCheck: the guard reads its streams from there (a
        # peer in another operation is found within a slice, not at the transport's
        # deadline), and the header the ranks meet over carries the descriptor. Asked of
        # the class, which a wrapper forwarding attributes to such a transport does not
        # inherit. In default mode with no flight recorder such an all_reduce is checked
        # in-band when the guard is settled (see .guard).
        self._checks = bool(getattr(type(transport), "checks_all_reduce", False))
        self._inband = (self._checks and mode == "default" and recorder is None
                        and self.guard.checks)
        # the all_reduce last checked in-band: the next of its kind skips the cache lookup
        self._last = Call(self.guard, Fingerprint(0, "barrier", ()),
                          Guard.message(Fingerprint(0, "barrier", ())), self)

    def _entry(self, op: str, buf: Any, reduce_op: str | None, root: int | None,
               src: int | None, dst: int | None, tag: int | None) -> Call:
        """Return the cached :class:`Call` (template fingerprint and message) of this op."""
        key = (op, buf.shape, buf.dtype, reduce_op, root, src, dst, tag)
        hit = self._cache.get(key)
        if hit is None:  # once per distinct operation: str(dtype) alone costs ~1.5 us
            fp = Fingerprint(0, op, tuple(buf.shape), str(buf.dtype), reduce_op, root,
                             self.guard.group, src, dst, tag, 0)
            hit = Call(self.guard, fp, Guard.message(fp), self)
            if len(self._cache) < 4096:
                self._cache[key] = hit
        return hit

    def _issue(self, buf: Any, op: ReduceOp, call: Call) -> Work:
        """The inner all_reduce of an announced call (``oob`` 1 in a header that carries it:
        every rank then announces the call; see .guard)."""
        if not self._checks:
            return self.inner.all_reduce(buf, op)
        call.oob, call.outcome = 1, None
        try:
            work = self.inner.all_reduce(buf, op, call)  # type: ignore[call-arg]
        finally:
            call.oob = 0
        # whether the next of its kind may go in-band
        call.inband = self._inband and call.outcome is not None
        return work

    def _run(self, start: Callable[[], Work], op: str, buf: Any, result: Any = None,
             reduce_op: str | None = None, root: int | None = None, src: int | None = None,
             dst: int | None = None, tag: int | None = None) -> GuardedWork:
        """Issue the operation with its descriptor (see :mod:`.guard` for the order).

        The data operation is issued first, so a caller's mistake (a bad buffer) raises
        from the transport before anything is sent or counted; the descriptor follows at
        once. A collective in default mode is staged into a send slot before the issue
        and posted by one call after it (nothing else runs while it is in flight). In
        debug mode the descriptors are compared first and the operation issued after.
        """
        if getattr(buf, "shape", None) is None or getattr(buf, "dtype", None) is None:
            start()  # not an array: the transport raises its typed error for it
            raise RuntimeError(f"guarded {op}: the transport accepted a buffer of type "
                               f"{type(buf).__name__}, which has no shape and dtype")
        e = self._entry(op, buf, reduce_op, root, src, dst, tag)
        fp, template = e.fp, e.template
        seq, cseq = self.seq, self.cseq
        e.cseq = cseq  # what an all_reduce's header carries (_issue)
        g = self.guard
        if self._debug:
            ticket = g.check(fp, message=self._filled(template, seq, cseq))
            self._count(src)
            return _issued(ticket, start(), result)
        staged = g.stage(fp, template, seq, cseq) if src is None else None
        if staged is None:
            work = start()
            self._count(src)
            if not g.checks:
                return _issued(g.note(fp, seq, cseq), work)
            return _issued(g.check(fp, message=self._filled(template, seq, cseq)), work)
        try:
            work = start()
        except BaseException:
            g.unstage(staged)
            raise
        g.post(staged)
        staged.work = work
        self._count(src)
        return staged

    @staticmethod
    def _filled(template: np.ndarray, seq: int, cseq: int) -> np.ndarray:
        msg = template.copy()
        msg[_SEQ] = seq
        msg[_CSEQ] = cseq
        return msg

    def _count(self, src: int | None) -> None:
        self.seq += 1
        if src is None:  # a collective
            self.cseq += 1

    def all_reduce(self, buf: Any, op: ReduceOp | str) -> Work:
        """Guarded ``Transport.all_reduce`` (in place).

        The hot path, written out here (every bytecode of it runs with the caches cold
        after a large reduction, and is time a peer waits): the kind of all_reduce checked
        in-band last time, again, on a settled guard. It sends no control message: the
        descriptor rides in the header of the transport's own call (see .guard).
        """
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        e = self._last
        if (op is e.op and type(buf) is _ndarray and buf.dtype is e.dtype
                and buf.shape == e.shape and e.inband and not self.guard._loud):
            cseq = self.cseq
            e.cseq, e.outcome = cseq, None
            try:
                work = self.inner.all_reduce(buf, op, e)  # type: ignore[call-arg]
            except BaseException as x:
                self.guard.end(e, x)
                raise
            if e.outcome is False and not e.oob:  # every rank agreed in the header
                self.seq += 1
                self.cseq = cseq + 1
                return work
            work = self.guard.finish(e, work)  # announced: matched as any collective
            self.seq += 1
            self.cseq = cseq + 1
            return work
        return self._all_reduce(buf, op)

    def _all_reduce(self, buf: Any, op: ReduceOp) -> Work:
        """all_reduce beyond the hot path: the first of its kind, an unsettled guard, a
        kind the transport does not check in-band, debug or off mode."""
        e = (self._ar_cache.get((buf.shape, buf.dtype, op._value_))
             if type(buf) is np.ndarray and not self._debug else None)
        if e is None:
            e = self._entry("all_reduce", buf, op._value_, None, None, None, None)
            out = self._run(lambda: self._issue(buf, op, e), "all_reduce", buf,
                            buf if self._debug else None, op._value_)
            if not self._debug and type(buf) is np.ndarray and len(self._ar_cache) < 4096:
                e.shape, e.dtype, e.op = buf.shape, buf.dtype, op
                self._ar_cache[(buf.shape, buf.dtype, op._value_)] = e
            return out
        g = self.guard
        seq, cseq = self.seq, self.cseq
        if e.inband and self._inband and g.settled():
            # the hot path, surely: the memo takes this buffer's own dtype object and shape
            # (a dtype equal to the cached one need not be the same object), and settled()
            # cleared ``_loud``
            e.shape, e.dtype = buf.shape, buf.dtype
            self._last = e
            return self.all_reduce(buf, op)
        staged = g.stage(e.fp, e.template, seq, cseq)
        if staged is None:
            if g.checks:  # no free send slot: the general path
                return self._run(lambda: self._issue(buf, op, e), "all_reduce", buf, None,
                                 op._value_)
            work = self.inner.all_reduce(buf, op)  # off mode: record, check nothing
            self.seq, self.cseq = seq + 1, cseq + 1
            return _issued(g.note(e.fp, seq, cseq), work)
        if not buf.flags.c_contiguous:  # the transport refuses it: raise before announcing
            g.unstage(staged)
            return self._run(lambda: self._issue(buf, op, e), "all_reduce", buf, None,
                             op._value_)
        # A contiguous array of a (shape, dtype, op) the transport accepted before: it
        # accepts it again, so the descriptor goes out first and reaches every peer before
        # this rank's data does; a peer whose data operation completes then finds it
        # already there (with the descriptor second, a rank descheduled between issue and
        # post left its peers to the slow path, and on a busy machine to a lost time slice)
        g.post(staged)
        e.cseq = cseq
        try:
            staged.work = self._issue(buf, op, e)
        except BaseException as x:
            g.abandon(staged, x)
            raise
        self.seq, self.cseq = seq + 1, cseq + 1
        return staged

    def all_gather(self, send: Any, recv: Any) -> Work:
        """Guarded ``Transport.all_gather``."""
        return self._run(lambda: self.inner.all_gather(send, recv), "all_gather", send, recv)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp | str) -> Work:
        """Guarded ``Transport.reduce_scatter``."""
        rop = ReduceOp.parse(op)
        return self._run(lambda: self.inner.reduce_scatter(send, recv, rop), "reduce_scatter",
                         send, reduce_op=rop.value)

    def broadcast(self, buf: Any, root: int) -> Work:
        """Guarded ``Transport.broadcast``."""
        return self._run(lambda: self.inner.broadcast(buf, root), "broadcast", buf, buf,
                         root=int(root))

    def all_to_all(self, send: Any, recv: Any) -> Work:
        """Guarded ``Transport.all_to_all``."""
        return self._run(lambda: self.inner.all_to_all(send, recv), "all_to_all", send)

    def barrier(self) -> Work:
        """Guarded ``Transport.barrier``."""
        return self._run(self.inner.barrier, "barrier", _NOTHING)

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        """Guarded ``Transport.send``: matched with the peer's recv as the streams move."""
        return self._run(lambda: self.inner.send(buf, peer, tag), "send", buf,
                         src=self.rank, dst=int(peer), tag=int(tag))

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        """Guarded ``Transport.recv``: complete once the data and the matching send arrive."""
        return self._run(lambda: self.inner.recv(buf, peer, tag), "recv", buf,
                         src=int(peer), dst=self.rank, tag=int(tag))

    def split(self, color: int, key: int) -> GuardedTransport:
        """Split the inner transport and guard the part (collective; shares the recorder)."""
        inner = self.inner.split(color, key)
        g = self.guard
        members = getattr(inner, "world_ranks", range(inner.size))
        return GuardedTransport(inner, mode=g.mode, timeout=g.timeout, recorder=g.recorder,
                                group=group_id(members, color), trace_dir=g.trace_dir)

    def close(self) -> None:
        """Withdraw the guard's control receives."""
        self.guard.close()

    def abort(self, code: int = 1) -> NoReturn:
        """Dump the flight recorder (if a trace_dir is set), then abort the inner transport."""
        try:
            self.guard.dump(reason=f"abort({code})")
        finally:
            self.inner.abort(code)
