"""The collective ops of the graph: rule, start/finish kernels and vjp side by side.

Every collective is an effectful :class:`~fuelspmd.graph.op.Op` whose attributes are a
named tuple starting ``(comm, nin, ...)``: the communicator (the op's stream), the number of
data inputs, then its own parameters; inputs past the data inputs are order tokens (never
read). Its ``start`` issues the transport operation and returns a :class:`Pending`;
``Pending.finish()`` waits (with the communicator's deadline) and returns the value. The
planner may put other steps between the two (a collective started as soon as its input is
ready, waited where its result is first needed); ``kernel`` is both at once.

Buffers: an in-place op (all_reduce, broadcast) works on a contiguous copy of its input
unless the planner lets it write the input (``donate``: a value the graph allocated, or a
leaf the caller donated, that dies here); ops that only read their input use it as it is
when contiguous. Arrays reach the transport through the backend's host staging
(:meth:`~fuelspmd.backend.Backend.to_transport`: array-api-strict arrays as host numpy;
numpy and cupy as they are).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import groupby
from typing import Any, NamedTuple

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, Shape
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError
from fuelspmd.graph import build as B
from fuelspmd.graph.node import Node
from fuelspmd.graph.op import Op, register
from fuelspmd.tensor import Tensor
from fuelspmd.transport import DONE, ReduceOp

__all__ = ["ALL_REDUCE", "AllGather", "AllReduce", "AllToAll", "Barrier", "Broadcast",
           "Pending", "Recv", "ReduceScatter", "Send"]

Rule = tuple[Shape, DType, Device]


class AllReduce(NamedTuple):
    comm: Any
    nin: int
    op: ReduceOp


class AllGather(NamedTuple):
    comm: Any
    nin: int
    axis: int


class ReduceScatter(NamedTuple):
    comm: Any
    nin: int
    axis: int
    op: ReduceOp


class Broadcast(NamedTuple):
    comm: Any
    nin: int
    root: int


class AllToAll(NamedTuple):
    comm: Any
    nin: int
    split_axis: int
    concat_axis: int


class Send(NamedTuple):
    comm: Any
    nin: int
    dst: int
    tag: int | None  # None: the count of earlier messages to dst (see Communicator)


class Recv(NamedTuple):
    comm: Any
    nin: int
    shape: Shape
    dtype: DType
    src: int
    tag: int | None


class Barrier(NamedTuple):
    comm: Any
    nin: int


class Pending:
    """A started collective: ``finish()`` waits for it and returns its value (once).
    Where the communicator keeps ``times``, it stamps the issue and the finish there."""

    __slots__ = ("comm", "count", "make", "stamp", "work")

    def __init__(self, comm: Any, work: Any, make: Callable[[], Any], count: int = 1) -> None:
        self.comm, self.work, self.make, self.count = comm, work, make, count
        self.stamp: list[float] | None = None
        if comm.times is not None:
            self.stamp = [time.perf_counter(), math.nan]
            comm.times.append(self.stamp)

    def test(self) -> bool:
        """Whether the transport operation completed (never blocks; progresses it)."""
        return bool(self.work.test())

    def finish(self) -> Any:
        self.work.wait(self.comm.timeout)
        if self.stamp is not None:
            self.stamp[1] = time.perf_counter()
        self.comm._issued(self.count)
        return self.make()


def _kernel(start: Callable[..., Pending]) -> Callable[..., Any]:
    def kernel(be: Any, attrs: Any, *xs: Any, donate: bool = False) -> Any:
        return start(be, attrs, *xs, donate=donate).finish()
    kernel.__doc__ = f"{start.__name__} and finish at once."
    return kernel


def _collective(name: str, rule: Callable[..., Rule], start: Callable[..., Pending],
                vjp: Callable[..., Any] | None, *, inplace: bool = False, serial: bool = True,
                bucket: Callable[..., Pending] | None = None) -> Op:
    return register(Op(name, rule, _kernel(start), vjp, inplace_ok=(0,) if inplace else None,
                       effectful=True, serial=serial, start=start, bucket=bucket,
                       bucket_bytes=(lambda attrs: attrs.comm.bucket_bytes) if bucket else None,
                       replay=lambda attrs, count: attrs.comm._replaying(count)))


# ---- staging ------------------------------------------------------------------------------
def _lib(be: Any) -> Any:
    return be.lib if be.kind == "cuda" else np


def _writable(be: Any, x: Any, donate: bool, comm: Any) -> Any:
    """A contiguous buffer the transport may overwrite: ``x`` itself only when donated,
    else a copy into one of the communicator's spare buffers (one of that shape and dtype
    that nothing refers to any more, :class:`~fuelspmd.backend.Spares`)."""
    if be.kind == "cuda":
        return x if donate and x.flags.c_contiguous else be.lib.array(x, order="C", copy=True)
    x = be.to_transport(x)
    if donate and be.kind == "cpu" and x.flags.c_contiguous and x.flags.writeable:
        return x
    buf = comm._spare.take(x.shape, x.dtype)
    np.copyto(buf, x)
    return buf


def _readable(be: Any, x: Any) -> Any:
    """A contiguous buffer the transport only reads (no copy when ``x`` already is one)."""
    return _lib(be).ascontiguousarray(be.to_transport(x))


def _blocks(lib: Any, x: Any, axis: int, n: int) -> Any:
    """``x`` as ``n`` contiguous blocks along a new leading axis (block r = part r)."""
    shp = x.shape
    y = lib.reshape(x, (*shp[:axis], n, shp[axis] // n, *shp[axis + 1:]))
    return lib.ascontiguousarray(lib.moveaxis(y, axis, 0))


def _unblocks(lib: Any, y: Any, axis: int) -> Any:
    """Inverse of :func:`_blocks`: concatenate the leading blocks along ``axis``."""
    n, shp = y.shape[0], y.shape[1:]
    z = lib.moveaxis(y, 0, axis)
    return lib.reshape(z, (*shp[:axis], n * shp[axis], *shp[axis + 1:]))


def _dt(arr: Any) -> DType:
    return as_dtype(str(arr.dtype).rpartition(".")[2])


def _same_rule(inputs: tuple[Node, ...], attrs: Any) -> Rule:
    x = inputs[0]
    return x.shape, x.dtype, x.device


def _rest(node: Node) -> list[None]:
    return [None] * (len(node.inputs) - 1)


def _differentiable(op: str, rop: ReduceOp) -> None:
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ConfigError(f"{op}(op='{rop.value}') has no gradient here; only sum and avg "
                          "are differentiable")


# ---- all_reduce ---------------------------------------------------------------------------
def _lent(comm: Any, nbytes: int, dt: Any) -> np.ndarray | None:
    """The transport's free shared area for an all_reduce of ``nbytes`` of ``dt`` (uint8),
    or None (its ``lend`` capability): an input placed there is reduced where it lies and
    its result stays there, so ``x = comm.all_reduce(x.donate())`` step after step, or a
    bucket, copies nothing in or out. The transport answers the same on every rank but
    whether the area is free, which only picks where the input goes."""
    return None if comm._lend is None else comm._lend(nbytes, dt)


def _all_reduce(be: Any, attrs: AllReduce, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, rop = attrs.comm, attrs.op
    if comm._shared is not None and be.kind != "cuda":
        out = comm._shared(be.to_transport(x), rop)
        return Pending(comm, DONE, lambda: be.from_transport(out))
    if type(x) is np.ndarray and not (donate and comm._lent is not None and comm._lent(x)):
        # an input already in a lent area is reduced where it lies (asking for an area
        # would only make the transport add one more)
        area = _lent(comm, x.nbytes, x.dtype)
        if area is not None:
            buf = area[:x.nbytes].view(x.dtype).reshape(x.shape)
            np.copyto(buf, x)
            return Pending(comm, comm.transport.all_reduce(buf, rop), lambda: buf)
    buf = _writable(be, x, donate, comm)
    return Pending(comm, comm.transport.all_reduce(buf, rop), lambda: be.from_transport(buf))


def _all_reduce_bucket(be: Any, attrs: AllReduce, xs: list[Any], shapes: list[Shape],
                       total: int) -> Pending:
    """Several all_reduces in one transport call (of ``total`` elements, the members of
    ``shapes``): concatenated flat (the one copy the in-place op needs anyway) into a lent
    shared area of the transport or a spare buffer (reused step after step once no result
    of the last step is held), reduced, and handed out as views of the result: nothing is
    copied out."""
    comm, rop = attrs.comm, attrs.op
    lib = _lib(be)
    if be.kind == "strict":
        xs = [be.to_transport(x) for x in xs]
    flat = None
    if lib is np:
        dt = xs[0].dtype
        area = _lent(comm, total * dt.itemsize, dt)
        flat = comm._spare.take((total,), dt) if area is None else (
            area[:total * dt.itemsize].view(dt))
    try:  # 1-D members (most gradients) concatenate as they are
        flat = lib.concatenate(xs, out=flat)
    except ValueError:  # numpy checks the dimensions before it copies anything
        flat = lib.concatenate([x.reshape(-1) for x in xs], out=flat)
    del xs  # the transport reads the bucket, not the inputs: let them go
    if comm._shared is not None and be.kind != "cuda":
        flat, work = comm._shared(flat, rop), DONE
    else:
        work = comm.transport.all_reduce(flat, rop)

    def split() -> list[Any]:
        outs: list[Any] = []
        lo = 0
        for shp, run in groupby(shapes):  # a run of one shape: the rows of one reshape
            k = len(list(run))
            hi = lo + k * math.prod(shp)
            rows = flat[lo:hi].reshape(k, *shp, *(() if shp else (1,)))
            outs.extend(rows if shp else (r.reshape(()) for r in rows))  # 0-d: arrays too
            lo = hi
        return outs if be.kind != "strict" else [be.from_transport(o) for o in outs]

    return Pending(comm, work, split, len(shapes))


def _vjp_all_reduce(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    attrs = node.attrs
    _differentiable("all_reduce", attrs.op)
    return (attrs.comm.all_reduce(Tensor(g), attrs.op).node, *_rest(node))


ALL_REDUCE = _collective("comm.all_reduce", _same_rule, _all_reduce, _vjp_all_reduce,
                         inplace=True, bucket=_all_reduce_bucket)


# ---- all_gather / reduce_scatter ----------------------------------------------------------
def _gather_rule(inputs: tuple[Node, ...], attrs: AllGather) -> Rule:
    x, n, ax = inputs[0], attrs.comm.size, attrs.axis
    return (*x.shape[:ax], x.shape[ax] * n, *x.shape[ax + 1:]), x.dtype, x.device


def _all_gather(be: Any, attrs: AllGather, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm = attrs.comm
    send = _readable(be, x)
    recv = be.transport_empty((comm.size, *send.shape), _dt(send))
    return Pending(comm, comm.transport.all_gather(send, recv),
                   lambda: be.from_transport(_unblocks(_lib(be), recv, attrs.axis)))


def _vjp_all_gather(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    attrs = node.attrs
    return (attrs.comm.reduce_scatter(Tensor(g), attrs.axis, "sum").node, *_rest(node))


_collective("comm.all_gather", _gather_rule, _all_gather, _vjp_all_gather)


def _scatter_rule(inputs: tuple[Node, ...], attrs: ReduceScatter) -> Rule:
    x, n, ax = inputs[0], attrs.comm.size, attrs.axis
    return (*x.shape[:ax], x.shape[ax] // n, *x.shape[ax + 1:]), x.dtype, x.device


def _reduce_scatter(be: Any, attrs: ReduceScatter, x: Any, *_: Any,
                    donate: bool = False) -> Pending:
    comm = attrs.comm
    send = _blocks(_lib(be), be.to_transport(x), attrs.axis, comm.size)
    recv = be.transport_empty(send.shape[1:], _dt(send))
    return Pending(comm, comm.transport.reduce_scatter(send, recv, attrs.op),
                   lambda: be.from_transport(recv))


def _vjp_reduce_scatter(g: Node, node: Node, wants: tuple[bool, ...]
                        ) -> tuple[Node | None, ...]:
    attrs = node.attrs
    _differentiable("reduce_scatter", attrs.op)
    gx = attrs.comm.all_gather(Tensor(g), attrs.axis).node
    if attrs.op is ReduceOp.AVG:
        gx = B.binary("div", gx, float(attrs.comm.size))
    return (gx, *_rest(node))


_collective("comm.reduce_scatter", _scatter_rule, _reduce_scatter, _vjp_reduce_scatter)


# ---- broadcast / all_to_all ---------------------------------------------------------------
def _broadcast(be: Any, attrs: Broadcast, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm = attrs.comm
    buf = _writable(be, x, donate, comm)
    return Pending(comm, comm.transport.broadcast(buf, attrs.root),
                   lambda: be.from_transport(buf))


def _vjp_broadcast(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    """Sum of the cotangents at the root, zero elsewhere (an all_reduce, then a mask: the
    ranks run the same collectives, so the backward needs no rooted reduce)."""
    comm, root = node.attrs.comm, node.attrs.root
    total = comm.all_reduce(Tensor(g), "sum").node
    return (total if comm.rank == root else B.binary("mul", total, 0.0), *_rest(node))


_collective("comm.broadcast", _same_rule, _broadcast, _vjp_broadcast, inplace=True)


def _a2a_rule(inputs: tuple[Node, ...], attrs: AllToAll) -> Rule:
    x, n = inputs[0], attrs.comm.size
    shape = list(x.shape)
    shape[attrs.split_axis] //= n
    shape[attrs.concat_axis] *= n
    return tuple(shape), x.dtype, x.device


def _all_to_all(be: Any, attrs: AllToAll, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm = attrs.comm
    lib = _lib(be)
    send = _blocks(lib, be.to_transport(x), attrs.split_axis, comm.size)
    recv = lib.empty_like(send)
    return Pending(comm, comm.transport.all_to_all(send, recv),
                   lambda: be.from_transport(_unblocks(lib, recv, attrs.concat_axis)))


def _vjp_all_to_all(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    attrs = node.attrs
    return (attrs.comm.all_to_all(Tensor(g), attrs.concat_axis, attrs.split_axis).node,
            *_rest(node))


_collective("comm.all_to_all", _a2a_rule, _all_to_all, _vjp_all_to_all)


# ---- send / recv / barrier ----------------------------------------------------------------
def _token_rule(inputs: tuple[Node, ...], attrs: Send | Barrier) -> Rule:
    dt = inputs[0].dtype if attrs.nin else as_dtype("float32")
    return (), dt, attrs.comm.device


def _send(be: Any, attrs: Send, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm = attrs.comm
    buf = _readable(be, x)
    work = comm.transport.send(buf, attrs.dst, comm._tag(comm._sent, attrs.dst, attrs.tag))
    return Pending(comm, work, lambda: be.zeros((), _dt(buf)))


def _vjp_send(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    attrs, x = node.attrs, node.inputs[0]
    return (attrs.comm.recv(x.shape, x.dtype, attrs.dst, tag=attrs.tag).node, *_rest(node))


_collective("comm.send", _token_rule, _send, _vjp_send, serial=False)


def _recv_rule(inputs: tuple[Node, ...], attrs: Recv) -> Rule:
    return attrs.shape, attrs.dtype, attrs.comm.device


def _recv(be: Any, attrs: Recv, *_: Any, donate: bool = False) -> Pending:
    comm = attrs.comm
    buf = be.transport_empty(attrs.shape, attrs.dtype)
    work = comm.transport.recv(buf, attrs.src, comm._tag(comm._received, attrs.src, attrs.tag))
    return Pending(comm, work, lambda: be.from_transport(buf))


def _vjp_recv(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    attrs = node.attrs
    attrs.comm.send(Tensor(g), attrs.src, tag=attrs.tag)  # joins the chain: issued later
    return tuple(None for _ in node.inputs)


_collective("comm.recv", _recv_rule, _recv, _vjp_recv, serial=False)


def _barrier(be: Any, attrs: Barrier, *_: Any, donate: bool = False) -> Pending:
    comm = attrs.comm
    return Pending(comm, comm.transport.barrier(), lambda: be.zeros((), "float32"))


_collective("comm.barrier", _token_rule, _barrier, None)
