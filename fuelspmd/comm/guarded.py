"""GuardedTransport: any Transport, with every operation checked by a :class:`Guard` first.

It is a Transport itself (same methods, same buffer layout), so code written against the
seam runs guarded unchanged; the lazy Communicator can either wrap its transport in one or
call :meth:`Guard.check` / :meth:`Guard.wait` itself. It numbers the group's operations
(``seq``, from 0, every op counts) and builds each one's fingerprint from its buffers.
The encoded fingerprint of each distinct (op, shape, dtype, reduce op, root, peer, tag) is
cached, so the steady state costs a dict lookup and a 128-byte copy per operation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from fuelspmd.comm.fingerprint import CSEQ, SEQ, Fingerprint, group_id
from fuelspmd.comm.guard import Guard, Ticket
from fuelspmd.comm.recorder import Recorder
from fuelspmd.transport import ReduceOp, Transport, Work

__all__ = ["GuardedTransport", "GuardedWork"]

_NOTHING = np.empty(0, np.int8)  # a barrier's "buffer", for its fingerprint
_SEQ, _CSEQ = 2 + SEQ, 2 + CSEQ  # their slots in a control message (after kind, sender)


class GuardedWork:
    """The Work of a guarded operation: waiting settles it with the guard."""

    __slots__ = ("_done", "_guard", "_result", "_ticket", "_work")

    def __init__(self, guard: Guard, ticket: Ticket, work: Work, result: Any = None) -> None:
        self._guard, self._ticket, self._work, self._result = guard, ticket, work, result
        self._done = False

    def test(self) -> bool:
        """Return whether the data operation completed (never blocks)."""
        return self._done or self._work.test()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the operation and its match; CommTimeoutError after ``timeout`` s."""
        if self._done:
            return
        self._guard.wait(self._ticket, self._work, timeout)
        if self._result is not None:
            self._guard.verify(self._ticket, self._result)
        self._done = True


class GuardedTransport:
    """A Transport whose every operation is agreed by all participants before it is issued.

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
        self.name = f"guarded-{transport.name}"
        self.rank, self.size = transport.rank, transport.size
        self.seq = 0   # the next operation's number (every op counts)
        self.cseq = 0  # the next collective's number
        self._debug = mode == "debug"
        self._cache: dict[tuple[Any, ...], tuple[Fingerprint, np.ndarray]] = {}

    def _check(self, op: str, buf: Any, reduce_op: str | None = None, root: int | None = None,
               src: int | None = None, dst: int | None = None,
               tag: int | None = None) -> Ticket:
        shape = buf.shape
        seq = self.seq
        self.seq = seq + 1
        cseq = self.cseq
        if src is None:
            self.cseq = cseq + 1
        key = (op, shape, buf.dtype, reduce_op, root, src, dst, tag)
        hit = self._cache.get(key)
        if hit is None:  # once per distinct operation: str(dtype) alone costs ~1.5 us
            fp = Fingerprint(0, op, tuple(shape), str(buf.dtype), reduce_op, root,
                             self.guard.group, src, dst, tag, 0)
            hit = (fp, Guard.message(fp))
            if len(self._cache) < 4096:
                self._cache[key] = hit
        msg = hit[1].copy()
        msg[_SEQ] = seq
        msg[_CSEQ] = cseq
        return self.guard.check(hit[0], message=msg)

    def _run(self, start: Callable[[], Work], op: str, buf: Any, result: Any = None,
             **fields: Any) -> GuardedWork:
        """Issue the operation and announce its fingerprint; in debug mode, check first.

        In default mode the data operation goes out first and the descriptor right after,
        so the exchange overlaps the transfer instead of adding a round trip before it
        (the comparison still completes before ``wait`` returns; see :mod:`.guard`).
        """
        if self._debug:
            t = self._check(op, buf, **fields)
            return GuardedWork(self.guard, t, start(), result)
        work = start()
        return GuardedWork(self.guard, self._check(op, buf, **fields), work)

    def all_reduce(self, buf: Any, op: ReduceOp | str) -> Work:
        """Guarded ``Transport.all_reduce`` (in place)."""
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        if self._debug:
            return self._run(lambda: self.inner.all_reduce(buf, op), "all_reduce", buf, buf,
                             reduce_op=op._value_)
        work = self.inner.all_reduce(buf, op)  # the hot path, inlined: see _run
        return GuardedWork(self.guard, self._check("all_reduce", buf, op._value_), work)

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
