"""The lazy :class:`Communicator`: collectives as effectful graph nodes over any Transport.

Layer 4: imports the graph, the Tensor front and the transport seam. A Communicator builds
nodes only; the transport is called when the graph runs. The rules:

- **Order (invariant 1).** Each collective node takes the communicator's previous
  still-unrealised collective as one more input (a *token*; its value is never read), so
  the topological order of any graph is the creation order and realising collective ``k``
  realises ``k - 1`` first. The op's attributes (``comm.ops``) hold the communicator and
  static parameters only, never a sequence number, so the next training step's graph has
  the same structure and its plan is found again; the transport numbers operations when
  they are issued. The communicator keeps the tail of its chain, so :meth:`flush`,
  :meth:`barrier` and :meth:`split` can issue everything built so far.
- **No clobbering.** A transport op that writes in place works on a contiguous copy of
  its input unless the graph owns that input and it dies there, or the caller donated it
  (``x = comm.all_reduce(x.donate())`` copies nothing, as ``MPI_Allreduce(MPI_IN_PLACE)``).
- **Bucketing (opt-in).** With ``bucket_bytes > 0``, all_reduces of one communicator with
  the same reduce op and dtype that the planner finds ready together in one realise are
  one transport call of at most ``bucket_bytes`` (the planner's one bucket rule,
  ``graph.plan.joins_bucket``): the same numbers, one latency instead of many. Which calls
  are fused depends on what is realised together, so turn it on only where every rank
  realises these collectives at the same points (a training step realised as one graph).
  If ranks differ, the guard (or a DeviceGroup) raises CollectiveMismatchError on every
  rank; nothing hangs. A bucket is one copy in and no copy out: the results are views.
- **Overlap.** The planner starts a collective right after its input is computed and
  waits for it right before its result is first read, so independent compute runs while
  it is in flight: one collective per communicator at a time, any number of sends and
  receives. :meth:`post` issues sends and receives now and finishes them when a later
  realise first needs them (a pipeline posts the next step's receives early).
- **Size 1 costs nothing.** Every collective of a size-1 communicator returns its input
  (send/recv to self pair up at build time); no node, no transport call.

A transport that offers ``shared`` (the in-process transport of a DeviceGroup) reduces once
for every device and returns one read-only array shared by all; one that offers ``lend``
(the MPI transport's shared windows) gets all_reduce inputs placed in its areas.

Send/recv tags: without ``tag=``, the count of earlier messages to (from) that peer on this
communicator, taken at issue time and kept within the transport's ``tag_bound``: issue order
is creation order on both sides, so the k-th send of rank a to b meets the k-th recv of b
from a. An explicit tag must lie in ``0..tag_bound``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from fuelspmd.backend import Device, Spares, get_backend
from fuelspmd.backend import device as as_device
from fuelspmd.dtypes import DType, Shape, normalize_axis
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, DeviceError, ShapeError
from fuelspmd.graph.node import Node, canonical, const, post
from fuelspmd.graph.op import get_op
from fuelspmd.tensor import Tensor, realize
from fuelspmd.transport import ReduceOp, Transport, check_peer

from . import ops as _ops  # registers the collective ops
from .ops import AllGather, AllReduce, AllToAll, Barrier, Broadcast, Recv, ReduceScatter, Send

__all__ = ["Communicator"]

BUCKET_BYTES = 4 << 20  # a good bucket size when bucketing is turned on
_ALL_REDUCE = _ops.ALL_REDUCE
_SUM = "sum"  # all_reduce's default op: a call that leaves it finds its attrs by identity


class Communicator:
    """Lazy collectives over ``transport`` for tensors on ``device``; see the module docs."""

    def __init__(self, transport: Transport, *, device: Device | str, timeout: float = 600.0,
                 bucket_bytes: int = 0, record_times: bool = False) -> None:
        if not timeout > 0:
            raise ConfigError(f"Communicator(timeout={timeout}): give a positive number of "
                              "seconds, e.g. 600")
        if bucket_bytes < 0:
            raise ConfigError(f"Communicator(bucket_bytes={bucket_bytes}): give 0 (no "
                              "bucketing) or a positive byte count, e.g. 4 << 20")
        self.bucket_bytes = int(bucket_bytes)
        # [issued, finished] (time.perf_counter) of every transport call, with record_times
        self.times: list[list[float]] | None = [] if record_times else None
        self.transport = transport
        self.device = canonical(as_device(device))
        self.timeout = float(timeout)
        self.rank: int = transport.rank
        self.size: int = transport.size
        self._tail: Node | None = None
        self._built = 0  # collectives built, and issued: equal when nothing is pending
        self._done = 0
        self._self_sent: deque[Node] = deque()  # size 1: sends waiting for their recv
        self._sent: dict[int, int] = {}       # peer -> messages sent so far (issue time)
        self._received: dict[int, int] = {}   # peer -> messages received so far
        self._posted: list[Node] = []  # issued by post(), not finished yet
        caps = transport.capabilities
        self._shared = transport.all_reduce_shared if "shared" in caps else None  # type: ignore[attr-defined]
        self._spare = Spares()  # staging copies, reused once unreferenced (ops.py)
        self._lend = transport.lend if "lend" in caps else None  # type: ignore[attr-defined]
        self._lent = transport.lent if "lend" in caps else None  # type: ignore[attr-defined]
        self._reduce_attrs: dict[Any, AllReduce] = {}  # op as given -> node attrs
        self._sum_attrs = self._reduce_attrs[_SUM] = AllReduce(self, 1, ReduceOp.SUM)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, device='{self.device}', "
                f"transport={self.transport.name!r})")

    # ---- building ---------------------------------------------------------------------
    def _check(self, t: Tensor, op: str) -> Node:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected a fuelspmd Tensor, got {type(t).__name__}")
        node = t.node
        if node.device is not self.device and node.device != self.device:  # canonical: `is`
            raise DeviceError(f"{op}: the tensor is on {t.device} but this communicator's "
                              f"device is {self.device}; move it with .to('{self.device}')")
        return node

    def _node(self, name: str, inputs: tuple[Node, ...], attrs: Any) -> Node:
        """Build collective ``name`` chained after the previous unrealised one (directly:
        every input is on this communicator's device, so only the rule is left to run)."""
        tail = self._tail
        ins = inputs + ((tail,) if tail is not None and tail.buffer is None else ())
        op = get_op(name)
        shape, dt, dev = op.rule(ins, attrs)
        node = Node(op, ins, attrs, tuple(shape), dt, dev)
        self._tail = node
        self._built += 1
        return node

    def _reset(self) -> None:
        """Forget pending collectives and message counts (the group failed and restarts)."""
        self._tail = None
        self._built = self._done = 0
        self._sent.clear()
        self._received.clear()
        self._self_sent.clear()
        self._posted.clear()

    def _issued(self, k: int = 1) -> None:
        """Count ``k`` collectives issued; once all built ones are, let go of the tail (it
        would pin its result: an in-process group reuses a result's memory once free)."""
        self._done += k
        if self._done == self._built:
            self._tail = None

    def _replaying(self, k: int) -> None:
        """A compiled step's replay is about to issue ``k`` collectives it did not build:
        issue those built before (creation order), and count the ``k`` as built."""
        if self._tail is not None and self._tail.buffer is None:
            realize(Tensor(self._tail))
        self._built += k

    def _token(self, dt: DType) -> Tensor:
        return Tensor(const(0, (), dt, self.device))

    def _tag(self, counts: dict[int, int], peer: int, tag: int | None) -> int:
        """The tag of the next message with ``peer`` (its count there, unless given)."""
        n = counts.get(peer, 0)
        counts[peer] = n + 1
        return n % (self.transport.tag_bound + 1) if tag is None else tag

    def _check_tag(self, op: str, tag: int | None) -> int | None:
        bound = self.transport.tag_bound
        if tag is not None and not (isinstance(tag, int) and 0 <= tag <= bound):
            raise ConfigError(f"{op}: tag {tag!r} is outside 0..{bound}, the tags this "
                              f"communicator's transport takes; use a smaller tag, or none "
                              f"(the count of earlier messages with that peer)")
        return tag

    def flush(self) -> None:
        """Issue every collective built on this communicator that has not run yet, and
        finish every posted one."""
        if self._tail is not None and self._tail.buffer is None:
            realize(Tensor(self._tail))  # the chain: every earlier unrealised one runs too
        realize(*(Tensor(n) for n in self._posted))
        self._posted.clear()
        self._tail = None
        self._done = self._built

    def post(self, *tensors: Tensor) -> None:
        """Issue these sends (their tokens) and receives now, without waiting for them.

        Each finishes when a later realise first needs it (its value, or its token), or at
        :meth:`flush`; :meth:`poll` lets MPI move them along meanwhile. The data a send
        reads is realised first. Only this communicator's sends and receives can be
        posted, and only after every earlier collective of it was issued (the token chain
        is cut here)."""
        be = get_backend(self.device.kind)
        for t in tensors:
            node = t.node
            if node.buffer is not None or node.op.kind == "posted":
                continue
            if node.op.name not in ("comm.send", "comm.recv") or node.attrs.comm is not self:
                raise ConfigError(f"post: {node.op.name} is not a send or recv of this "
                                  f"communicator; post only its sends' tokens and receives")
            data = node.inputs[:node.attrs.nin]
            # the data, and earlier collectives not issued yet (a posted one is)
            realize(*(Tensor(x) for x in node.inputs if x.op.kind != "posted"))
            pending = node.op.start(be, node.attrs, *(x.buffer for x in data))
            post(node, pending, data)
            self._posted.append(node)
            if self._tail is node:
                self._tail = None

    def poll(self) -> None:
        """Let the transport progress every posted send and receive (never blocks)."""
        for node in self._posted:
            if node.op.kind == "posted":
                node.attrs.test()
        self._posted = [n for n in self._posted if n.op.kind == "posted"]

    # ---- collectives ------------------------------------------------------------------
    def all_reduce(self, t: Tensor, op: ReduceOp | str = _SUM) -> Tensor:
        """Return ``op`` over ranks of ``t`` (every rank gets the result)."""
        # The per-gradient cost of a step: _check and _node inlined for the common case
        # (the rule is the identity), one attrs tuple per reduce op (found by identity for
        # the default), so the planner's bucket rule compares attributes by identity.
        node = t.node if t.__class__ is Tensor else None
        if node is None or node.device is not self.device:
            node = self._check(t, "all_reduce")
        attrs = self._sum_attrs if op is _SUM else None
        if attrs is None:
            cls = op.__class__  # keyed by name: an Enum member hashes in Python
            key = op._value_ if cls is ReduceOp else op if cls is str else None  # type: ignore[union-attr]
            attrs = self._reduce_attrs.get(key) if key is not None else None
            if attrs is None:
                attrs = AllReduce(self, 1, ReduceOp.parse(op))
                if key is not None:
                    self._reduce_attrs[key] = attrs
        if self.size == 1:
            return t
        tail = self._tail
        node = Node(_ALL_REDUCE, (node,) if tail is None or tail.buffer is not None
                    else (node, tail), attrs, node.shape, node.dtype, node.device)
        self._tail = node
        self._built += 1
        return Tensor(node)

    def all_gather(self, t: Tensor, axis: int = 0) -> Tensor:
        """Return the ranks' ``t`` concatenated along ``axis`` in rank order."""
        node = self._check(t, "all_gather")
        ax = normalize_axis(axis, len(t.shape), op="all_gather")
        if self.size == 1:
            return t
        return Tensor(self._node("comm.all_gather", (node,), AllGather(self, 1, ax)))

    def reduce_scatter(self, t: Tensor, axis: int = 0, op: ReduceOp | str = "sum") -> Tensor:
        """Reduce ``t`` over ranks and return block ``rank`` of it along ``axis``."""
        node, rop = self._check(t, "reduce_scatter"), ReduceOp.parse(op)
        ax = normalize_axis(axis, len(t.shape), op="reduce_scatter")
        _divisible("reduce_scatter", t.shape, ax, self.size)
        if self.size == 1:
            return t
        return Tensor(self._node("comm.reduce_scatter", (node,), ReduceScatter(self, 1, ax, rop)))

    def broadcast(self, t: Tensor, root: int = 0) -> Tensor:
        """Return rank ``root``'s ``t`` on every rank."""
        node = self._check(t, "broadcast")
        check_peer("broadcast", root, self.size, what="root")
        if self.size == 1:
            return t
        return Tensor(self._node("comm.broadcast", (node,), Broadcast(self, 1, int(root))))

    def all_to_all(self, t: Tensor, split_axis: int, concat_axis: int) -> Tensor:
        """Split ``t`` in ``size`` blocks along ``split_axis``, send block r to rank r, and
        concatenate the blocks received, in rank order, along ``concat_axis``."""
        node = self._check(t, "all_to_all")
        sa = normalize_axis(split_axis, len(t.shape), op="all_to_all")
        ca = normalize_axis(concat_axis, len(t.shape), op="all_to_all")
        _divisible("all_to_all", t.shape, sa, self.size)
        if self.size == 1:
            return t
        return Tensor(self._node("comm.all_to_all", (node,), AllToAll(self, 1, sa, ca)))

    def send(self, t: Tensor, dst: int, *, tag: int | None = None) -> Tensor:
        """Send ``t`` to rank ``dst``; return a 0-d token (realising it issues the send).

        A send also runs when any later collective of this communicator runs, or on
        :meth:`flush`. Its vjp is a recv of the cotangent from ``dst``, so a backward
        reaches it when the token takes part in the loss (``loss + 0 * token``).
        """
        node = self._check(t, "send")
        check_peer("send", dst, self.size, what="dst")
        tag = self._check_tag("send", tag)
        if self.size == 1:
            self._self_sent.append(node)
            return self._token(t.dtype)
        return Tensor(self._node("comm.send", (node,), Send(self, 1, int(dst), tag)))

    def recv(self, shape: Shape, dtype: DType | str, src: int, *,
             tag: int | None = None) -> Tensor:
        """Return the tensor of ``shape`` and ``dtype`` that rank ``src`` sends next (with
        ``tag``, when given)."""
        check_peer("recv", src, self.size, what="src")
        tag = self._check_tag("recv", tag)
        shp = tuple(int(d) for d in shape)
        dt = as_dtype(dtype)
        if self.size == 1:
            if not self._self_sent:
                raise ConfigError("recv from rank 0 on a size-1 communicator: nothing was "
                                  "sent to self before it; call send(t, 0) first")
            node = self._self_sent.popleft()
            if node.shape != shp or node.dtype is not dt:
                raise ShapeError(f"recv({shp}, {dt}) from self, but the matching send was "
                                 f"{node.shape} {node.dtype}; use the sent shape and dtype")
            return Tensor(node)
        return Tensor(self._node("comm.recv", (), Recv(self, 0, shp, dt, int(src), tag)))

    def barrier(self) -> None:
        """Issue every collective built so far, then wait until every rank gets here."""
        if self.size == 1:
            self.flush()
            return
        realize(Tensor(self._node("comm.barrier", (), Barrier(self, 0))))

    def split(self, color: int, key: int = 0) -> Communicator:
        """Return the communicator of the ranks with the same ``color``, ordered by ``key``.

        Collective over this communicator and eager: it first issues every pending
        collective (so all ranks see the same transport order), then splits.
        """
        self.flush()
        return Communicator(self.transport.split(int(color), int(key)), device=self.device,
                            timeout=self.timeout, bucket_bytes=self.bucket_bytes)


def _divisible(op: str, shape: Shape, axis: int, n: int) -> None:
    if shape[axis] % n:
        ok = [d for d in range(1, shape[axis] + 1) if shape[axis] % d == 0]
        raise ShapeError(f"{op}: axis {axis} of shape {shape} has {shape[axis]} elements, "
                         f"not divisible by the {n} ranks; group sizes that divide it: {ok}, "
                         f"or pad axis {axis} to a multiple of {n}")
