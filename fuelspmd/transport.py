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

Besides the methods of the protocol, a transport states ``tag_bound`` (the largest tag its
``send`` and ``recv`` take) and, in ``capabilities``, what else it offers. Each capability
is one documented name with its optional methods; code above this layer asks
``"name" in transport.capabilities`` and never probes for attributes:

=============  ========================================================================
capability     methods and contract
=============  ========================================================================
``checked``    ``checked(check, op, *args) -> Work``: the collective ``op(*args)`` (a
               method name of the protocol) whose ranks first compare ``check.words``
               (:data:`CHECK_WORDS` int64s) where they meet anyway (a header, or one
               fixed-size exchange that may carry a small collective whole): no data
               moves unless ``check.agrees(rows)`` holds for every rank's words, else
               every rank raises :class:`Disagreement` with the same rows. While it
               waits it calls ``check.watch()`` every :data:`WATCH_S`, and gives up at
               ``check.timeout``.
``probe``      ``probe(peer, tag) -> int | None``: the rank of a peer (``peer``, or any
               when None) whose message with ``tag`` has arrived, without receiving it.
``lend``       ``lend(nbytes, dtype) -> ndarray | None``: a free area of the transport's
               own memory (uint8) where an all_reduce input of that size reduces fastest,
               or None; ``lent(buf) -> bool``: whether ``buf`` lies in such an area.
``shared``     ``all_reduce_shared(buf, op) -> array``: the reduction as one read-only
               array that every rank of the (in-process) group receives.
``route``      ``set_all_reduce_policy(**how) -> str`` (collective),
               ``all_reduce_algorithm(nbytes, dtype=None) -> str`` and
               ``explain_all_reduce(nbytes, dtype=None) -> str``: how the transport
               chooses its all-reduce algorithm per size, and why.
``finalize``   ``finalize() -> None``: release what the transport holds (collective).
``device``     ``device: Device``: the device whose buffers the transport takes (a
               transport bound to one GPU, as NCCL's is).
=============  ========================================================================
"""

from __future__ import annotations

import enum
import os
import sys
import time
import zlib
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
    "CAPABILITIES",
    "CHECK_WORDS",
    "ENTRY_POINT_GROUP",
    "WATCH_S",
    "Check",
    "Disagreement",
    "DoneWork",
    "ReduceOp",
    "SelfTransport",
    "Transport",
    "TransportPlugin",
    "Work",
    "agree",
    "check_buffers",
    "check_peer",
    "digest62",
    "disagreement",
    "find_transports",
    "load_plugin",
    "poll_until",
]

ENTRY_POINT_GROUP = "fuelspmd.transports"
CAPABILITIES = frozenset({"checked", "probe", "lend", "shared", "route", "finalize",
                          "device"})
CHECK_WORDS = 3  # the int64 words of a Check
# How often a wait inside a transport call (or the guard's own) lets the caller look
# around (``Check.watch``): the slice within which a disagreement between ranks waiting in
# different places is found.
WATCH_S = 0.05


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
        # the value map first: Enum's own lookup by value is Python code, paid per collective
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


class Check:
    """What a caller asks a ``checked`` transport to compare before any data moves.

    ``words`` are this rank's (:data:`CHECK_WORDS` int64s); the transport hands every
    rank's words, in rank order, to ``agrees(rows)``, whose answer, and whatever it notes
    of them, must be a pure function of ``rows`` (every rank reads the same rows, so every
    rank decides the same). ``watch`` is called every
    :data:`WATCH_S` while the call waits for its peers; ``timeout`` bounds that wait.
    """

    __slots__ = ("agrees", "timeout", "watch", "words")

    def __init__(self, words: list[int], agrees: Callable[[list[list[int]]], bool],
                 watch: Callable[[], None] | None = None, timeout: float = 600.0) -> None:
        self.words, self.agrees, self.watch, self.timeout = words, agrees, watch, timeout


class Disagreement(CollectiveMismatchError):
    """A ``checked`` call whose ranks' words did not agree; raised on every rank, before
    any data moved, with every rank's words (``rows``, the same on every rank)."""

    def __init__(self, what: str, rows: list[list[int]]) -> None:
        super().__init__(f"{what}: the ranks' descriptors differ ({rows})")
        self.rows = rows


@runtime_checkable
class Transport(Protocol):
    """Eager collectives and point-to-point over contiguous buffers of one process group."""

    name: str
    rank: int
    size: int
    tag_bound: int  # the largest tag send and recv take
    capabilities: frozenset[str]  # see CAPABILITIES; methods of a capability are optional

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

    def world(self, *, timeout: float, device: Any = None) -> Transport:
        """Return the transport over every process of the job (the world group);
        ``device`` is the one ``fs.init(device=...)`` named (None: "auto")."""
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


AGREE_FIELDS = 15  # fields one agree() compares at most (its record has a fixed size)
_SHOWN = 64  # bytes of each field's value that an agree() mismatch message shows


def digest62(data: bytes) -> int:
    """62 bits of ``data``, alike on every rank (CRC-32 and Adler-32, not the per-process
    salted ``hash``)."""
    return (zlib.crc32(data) << 30) ^ zlib.adler32(data)


def disagreement(what: str, rows: list[dict[str, Any]], labels: list[str] | None = None
                 ) -> str | None:
    """The message naming every field on which ``rows`` (one dict per rank) differ from
    the first, and the ranks (``labels``, default ``rank i``); None when all agree."""
    labels = labels or [f"rank {i}" for i in range(len(rows))]
    first, parts = rows[0], []
    for i, row in enumerate(rows[1:], 1):
        fields = sorted(k for k in {*first, *row} if row.get(k) != first.get(k))
        if fields:
            parts.append("; ".join(f"{k}: {labels[0]} has {first.get(k, 'nothing')}, "
                                   f"{labels[i]} has {row.get(k, 'nothing')}" for k in fields))
    if not parts:
        return None
    return (f"{what}: the ranks disagree ({'; '.join(parts)}); every rank must make the same "
            f"call with the same arguments at the same point")


def agree(t: Transport, what: str, *, timeout: float | None = None,
          error: type[Exception] = CollectiveMismatchError, **fields: Any) -> None:
    """Raise ``error`` on every rank of ``t`` unless every rank passed equal ``fields``
    (compared by their ``repr``), naming the fields and ranks that differ. ``error`` is
    ConfigError where the fields are the caller's input (a caller's mistake).

    Collective: one all_gather of a fixed-size record (digests of the names and of each
    value), so ranks that pass different fields still meet in one well-formed exchange;
    when they differ, a second one carries the values' text to name them.
    """
    if len(fields) > AGREE_FIELDS:
        raise ConfigError(f"agree({what!r}): {len(fields)} fields; compare at most "
                          f"{AGREE_FIELDS} (group the rest into one)")
    if t.size == 1:
        return
    names = sorted(fields)
    texts = [",".join(names), *(repr(fields[k]) for k in names)]
    mine = np.full(1 + AGREE_FIELDS, -1, np.int64)
    mine[:len(texts)] = [digest62(x.encode()) for x in texts]
    every = np.empty(t.size * mine.size, np.int64)
    try:
        t.all_gather(mine, every).wait(timeout)
    except CommTimeoutError as e:
        raise CommTimeoutError(f"{what}: not every rank came to agree ({e})") from None
    if (every.reshape(t.size, -1) == mine).all():
        return
    shown = np.zeros((1 + AGREE_FIELDS, _SHOWN), np.uint8)
    for i, x in enumerate(texts):
        b = x.encode()[:_SHOWN]
        shown[i, :len(b)] = np.frombuffer(b, np.uint8)
    words = shown.view(np.int64)  # the transports move numbers, not bytes
    table = np.empty((t.size, *words.shape), np.int64)
    t.all_gather(words, table).wait(timeout)
    rows = []
    for r in range(t.size):
        text = [bytes(x).rstrip(b"\0").decode(errors="replace")
                for x in table[r].view(np.uint8)]
        keys = text[0].split(",") if text[0] else []
        rows.append(dict(zip(keys, text[1:], strict=False)))
    raise error(disagreement(what, rows) or f"{what}: the ranks' arguments differ in a way "
                                            f"their first {_SHOWN} characters do not show")


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
    tag_bound = 2**31 - 1
    capabilities: frozenset[str] = frozenset()

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
