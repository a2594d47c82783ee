"""The seam between fuelspmd and the libraries that move bytes.

Layer 1: imports ``errors``, ``dtypes`` and ``backend`` only. A :class:`Transport` is
eager and array-level: it takes contiguous buffers of one process group and starts an
operation, returning a :class:`Work` to wait on. It knows nothing of graphs. Transport
plugins (``fuelspmd_mpi``, ``fuelspmd_nccl``, or a third party's) import only this module,
``errors``, ``dtypes`` and ``backend``, and are found through the entry-point group
``fuelspmd.transports``: fuelspmd never imports them by name.

Buffer layout, the same for every transport (``n`` is the per-rank element count):

=================  ==================  ==================  ==============================
op                 send                recv                result
=================  ==================  ==================  ==============================
all_reduce         buf (n), in place   -                   buf = op over ranks
all_gather         n                   n * size            recv[r*n:(r+1)*n] = send of r
reduce_scatter     n * size            n                   recv = op over ranks of block
                                                           ``rank`` of their send
all_to_all         n * size            n * size            recv block r = send block
                                                           ``rank`` of rank r
broadcast          buf (n), in place   -                   buf = buf of root
=================  ==================  ==================  ==============================
"""

from __future__ import annotations

import enum
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np

from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    DTypeError,
    ShapeError,
    TransportUnavailableError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "CallCheck",
    "DoneWork",
    "ReduceOp",
    "SelfTransport",
    "Transport",
    "TransportPlugin",
    "Work",
    "check_buffers",
    "check_peer",
    "find_transports",
    "lend",
    "lent",
    "load_plugin",
    "poll_until",
]

ENTRY_POINT_GROUP = "fuelspmd.transports"


class ReduceOp(enum.Enum):
    """A reduction across ranks. AVG is SUM divided by the group size."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Return the ReduceOp named by ``op`` ('sum', 'prod', 'min', 'max', 'avg')."""
        if isinstance(op, ReduceOp):
            return op
        # the value map first: Enum's own lookup by value costs ~3 us, paid per collective
        hit = cls._value2member_map_.get(op) if isinstance(op, str) else None
        if hit is not None:
            return hit  # type: ignore[return-value]
        try:
            return cls(str(op).lower())
        except ValueError:
            raise ConfigError(
                f"unknown reduce op {op!r}; use one of {[o.value for o in cls]}") from None


@runtime_checkable
class Work(Protocol):
    """A started transport operation."""

    def test(self) -> bool:
        """Return whether the operation has completed (never blocks)."""
        ...

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise CommTimeoutError after ``timeout`` seconds."""
        ...


class CallCheck(Protocol):
    """A caller's check riding on an all_reduce that meets its peers inside the call.

    A transport whose class says ``checks_all_reduce = True`` takes one as all_reduce's
    third argument. While the call waits for its peers it calls ``watch()`` every slice
    (the collective guard reads its control streams there: a peer in another operation
    never comes). Where the peers meet over a header they all read (the MPI transport's
    shared-memory path), the transport carries ``key``, ``cseq`` and ``oob`` in it and,
    after the meeting, either sets ``outcome`` (False: every rank's ``key`` and ``cseq``
    agree and no rank's ``oob`` is set; True: they agree and some rank's ``oob`` is set)
    or, when ``key`` or ``cseq`` differ, calls ``disagree(rows)`` with every rank's
    ``[key, cseq, oob]``, which raises. A path with no such meeting (MPI's own
    all-reduce) leaves ``outcome`` None: nothing was checked. Every rank reads the same
    headers, so every rank learns the same thing: that is what lets the guard skip its own
    control messages for an operation so checked (:mod:`fuelspmd.comm.guard`). A wait for
    the peers there ends at ``timeout`` seconds if that is before the transport's own
    deadline (the guard's deadline holds in-band too).
    """

    key: int
    cseq: int
    oob: int
    outcome: bool | None
    timeout: float

    def watch(self) -> None: ...
    def disagree(self, rows: list[list[int]]) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Eager collectives and point-to-point over contiguous buffers of one process group."""

    name: str
    rank: int
    size: int

    def all_reduce(self, buf: Any, op: ReduceOp) -> Work: ...
    def all_gather(self, send: Any, recv: Any) -> Work: ...
    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> Work: ...
    def broadcast(self, buf: Any, root: int) -> Work: ...
    def all_to_all(self, send: Any, recv: Any) -> Work: ...
    def send(self, buf: Any, peer: int, tag: int) -> Work: ...
    def recv(self, buf: Any, peer: int, tag: int) -> Work: ...
    def barrier(self) -> Work: ...
    def split(self, color: int, key: int) -> Transport: ...
    def abort(self, code: int = 1) -> NoReturn: ...


class TransportPlugin(Protocol):
    """What an entry point in ``fuelspmd.transports`` names."""

    name: str

    def unavailable_reason(self) -> str | None:
        """Return why this transport cannot run here, or None when it can."""
        ...

    def world(self, *, timeout: float) -> Transport:
        """Return the transport over every process of the job (the world group)."""
        ...


def find_transports() -> dict[str, EntryPoint]:
    """Return the installed transport plugins by name, from the entry-point group."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_plugin(name: str) -> TransportPlugin:
    """Load the plugin registered as ``name``; raise TransportUnavailableError if absent."""
    found = find_transports()
    if name not in found:
        raise TransportUnavailableError(
            f"no transport named {name!r} is installed; found {sorted(found) or 'none'}. "
            f"A transport registers itself under the entry-point group {ENTRY_POINT_GROUP!r}")
    return found[name].load()


def poll_until(done: Callable[[], bool], deadline: float, describe: Callable[[], str]) -> None:
    """Spin on ``done()`` until it holds or ``deadline`` (time.monotonic) passes.

    The first few thousand polls spin (a small message completes in microseconds); after
    that the wait sleeps a growing interval up to 1 ms, so a long wait costs no core.
    """
    if done():
        return
    spins = 0
    pause = 1e-6
    while not done():
        spins += 1
        if spins > 2000:
            if time.monotonic() > deadline:
                raise CommTimeoutError(describe())
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        elif spins % 256 == 0 and time.monotonic() > deadline:
            raise CommTimeoutError(describe())


class DoneWork:
    """A Work that completed when it was made (size-1 paths, empty buffers)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


DONE = DoneWork()


def _flat(buf: Any) -> int:
    return int(buf.size)


def check_buffers(op: str, size: int, send: Any, recv: Any | None = None, *,
                  recv_factor: int = 1, send_factor: int = 1) -> None:
    """Raise a typed error for buffers a transport cannot take.

    Both buffers must be C-contiguous and of one dtype; ``recv.size * send_factor`` must
    equal ``send.size * recv_factor`` (all_gather: recv = send * size; reduce_scatter:
    send = recv * size). Checked before any communication, so every rank fails alike.
    """
    for name, b in (("send", send), ("recv", recv)):
        if b is None:
            continue
        flags = getattr(b, "flags", None)
        if flags is None or not flags["C_CONTIGUOUS"]:
            raise ShapeError(f"{op}: the {name} buffer must be C-contiguous "
                             f"(shape {getattr(b, 'shape', '?')}); pass np.ascontiguousarray(buf)")
        as_dtype(b.dtype)  # raises DTypeError for an unsupported dtype
    if recv is None:
        return
    if send.dtype != recv.dtype:
        raise DTypeError(f"{op}: send is {send.dtype} but recv is {recv.dtype}; use one dtype")
    if send_factor > 1 and _flat(send) % send_factor:  # first: else "recv must have" is wrong
        raise ShapeError(f"{op}: send has {_flat(send)} elements, not divisible by the "
                         f"{send_factor} ranks; pad it to a multiple of {send_factor}")
    if _flat(recv) * send_factor != _flat(send) * recv_factor:
        want_recv = _flat(send) * recv_factor // send_factor
        raise ShapeError(
            f"{op}: send has {_flat(send)} elements and recv {_flat(recv)}, but with "
            f"{size} ranks recv must have {want_recv}; size recv accordingly")


def check_peer(op: str, peer: int, size: int, rank: int | None = None, *,
               what: str = "peer") -> None:
    """Raise ConfigError for a rank outside ``range(size)``."""
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < size:
        raise ConfigError(f"{op}: {what} {peer} is outside the group of {size} ranks "
                          f"(valid: 0..{size - 1})")


def lend(memory: np.ndarray) -> np.ndarray:
    """The area a transport lends out over ``memory`` (its optional ``window_buffer``
    capability): an array of its own (uint8) over a memoryview of ``memory``, so that
    every view handed out derives from this one object (its lender tracks it by a weak
    reference: alive while anyone holds part of the area) and :func:`lent` knows them."""
    return np.frombuffer(memoryview(memory), np.uint8)


def lent(buf: Any) -> bool:
    """Whether ``buf`` is a view of an area made by :func:`lend`."""
    base = getattr(buf, "base", None)
    return (type(base) is np.ndarray and isinstance(base.base, memoryview)
            and isinstance(base.base.obj, np.ndarray))


class _SelfRecv:
    """A receive on a size-1 transport: completes when a matching self-send is posted."""

    __slots__ = ("buf", "done", "tag", "transport")

    def __init__(self, transport: SelfTransport, buf: Any, tag: int) -> None:
        self.transport, self.buf, self.tag, self.done = transport, buf, tag, False

    def test(self) -> bool:
        if not self.done:
            self.done = self.transport._match(self)
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        if not self.test():
            raise CommTimeoutError(
                f"recv from rank 0 with tag {self.tag} on a size-1 group: no matching send "
                f"was posted, so it can never complete")


class SelfTransport:
    """The size-1 transport: every collective is the identity, send to self is a copy."""

    name = "self"
    rank = 0
    size = 1

    def __init__(self) -> None:
        self._sent: deque[tuple[int, Any]] = deque()

    def all_reduce(self, buf: Any, op: ReduceOp) -> Work:
        check_buffers("all_reduce", 1, buf)
        return DONE

    def all_gather(self, send: Any, recv: Any) -> Work:
        check_buffers("all_gather", 1, send, recv)
        recv.reshape(-1)[...] = send.reshape(-1)
        return DONE

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> Work:
        check_buffers("reduce_scatter", 1, send, recv)
        recv.reshape(-1)[...] = send.reshape(-1)
        return DONE

    def broadcast(self, buf: Any, root: int) -> Work:
        check_peer("broadcast", root, 1, what="root")
        check_buffers("broadcast", 1, buf)
        return DONE

    def all_to_all(self, send: Any, recv: Any) -> Work:
        check_buffers("all_to_all", 1, send, recv)
        recv.reshape(-1)[...] = send.reshape(-1)
        return DONE

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        check_peer("send", peer, 1)
        check_buffers("send", 1, buf)
        self._sent.append((tag, buf.copy()))
        return DONE

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        check_peer("recv", peer, 1)
        check_buffers("recv", 1, buf)
        work = _SelfRecv(self, buf, tag)
        work.test()
        return work

    def _match(self, work: _SelfRecv) -> bool:
        for i, (tag, data) in enumerate(self._sent):
            if tag == work.tag:
                if data.shape != work.buf.shape and data.size != work.buf.size:
                    raise CollectiveMismatchError(
                        f"send/recv tag {tag}: rank 0 sent {data.size} elements but rank 0 "
                        f"receives {work.buf.size}")
                work.buf.reshape(-1)[...] = data.reshape(-1)
                del self._sent[i]
                return True
        return False

    def barrier(self) -> Work:
        return DONE

    def split(self, color: int, key: int) -> SelfTransport:
        return SelfTransport()

    def abort(self, code: int = 1) -> NoReturn:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
