"""The collective ops of the graph: rule, start/finish kernels and vjp side by side.

Every collective is an effectful :class:`~fuelspmd.graph.op.Op` whose attributes are
``(communicator, number of data inputs, *static params)``; inputs past the data inputs are
order tokens (never read). Its ``start`` issues the transport operation and returns a
:class:`Pending`; ``Pending.finish()`` waits (with the communicator's deadline) and returns
the value. The planner may put other steps between the two (a collective started as soon
as its input is ready, waited where its result is first needed); ``kernel`` is both at once.

Buffers: an in-place op (all_reduce, broadcast) gets a contiguous copy of its input unless
the planner proved the input dies at this step, or the executor found it a leaf nothing else
refers to (``donate``); ops that only read their input
use it as it is when contiguous. ``strict`` (array-api-strict) arrays are staged through
host numpy; cupy arrays go to the transport as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate, groupby
from typing import Any

import numpy as np

from fuelspmd.backend import Device, to_host
from fuelspmd.dtypes import DType, Shape, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError
from fuelspmd.graph import build as B
from fuelspmd.graph.node import Node
from fuelspmd.graph.op import Attrs, Op, register
from fuelspmd.tensor import Tensor
from fuelspmd.transport import DONE, ReduceOp

__all__ = ["ALL_REDUCE", "Pending"]

Rule = tuple[Shape, DType, Device]


class Pending:
    """A started collective: ``finish()`` waits for it and returns its value (once)."""

    __slots__ = ("comm", "count", "make", "work")

    def __init__(self, comm: Any, work: Any, make: Callable[[], Any], count: int = 1) -> None:
        self.comm, self.work, self.make, self.count = comm, work, make, count

    def finish(self) -> Any:
        self.work.wait(self.comm.timeout)
        self.comm._issued(self.count)
        return self.make()


def _kernel(start: Callable[..., Pending]) -> Callable[..., Any]:
    def kernel(be: Any, attrs: Attrs, *xs: Any, donate: bool = False) -> Any:
        return start(be, attrs, *xs, donate=donate).finish()
    kernel.__doc__ = f"{start.__name__} and finish at once."
    return kernel


def _collective(name: str, rule: Callable[..., Rule], start: Callable[..., Pending],
                vjp: Callable[..., Any] | None, *, inplace: bool = False,
                bucket: Callable[..., Pending] | None = None) -> Op:
    return register(Op(name, rule, _kernel(start), vjp, inplace_ok=(0,) if inplace else None,
                       effectful=True, start=start, bucket=bucket,
                       bucket_bytes=(lambda attrs: attrs[0].bucket_bytes) if bucket else None))


# ---- staging ------------------------------------------------------------------------------
def _lib(be: Any) -> Any:
    return be.lib if be.kind == "cuda" else np


def _writable(be: Any, x: Any, donate: bool, comm: Any) -> Any:
    """A contiguous buffer the transport may overwrite: ``x`` itself only when donated.

    Otherwise a copy, into one of the communicator's spare buffers (one of that shape and
    dtype that nothing refers to any more, :class:`~fuelspmd.backend.Spares`).
    """
    if be.kind == "cuda":
        return x if donate and x.flags.c_contiguous else be.lib.array(x, order="C", copy=True)
    if be.kind == "strict":
        x = to_host(x)  # staged through the host
    elif donate and type(x) is np.ndarray and x.flags.c_contiguous and x.flags.writeable:
        return x
    buf = _spare(comm, x.shape, x.dtype)
    np.copyto(buf, x)
    return buf


def _spare(comm: Any, shape: Shape, dt: Any) -> np.ndarray:
    return comm._spare.take(shape, dt)


def _readable(be: Any, x: Any) -> Any:
    """A contiguous buffer the transport only reads (no copy when ``x`` already is one)."""
    if be.kind == "strict":
        return np.ascontiguousarray(to_host(x))
    return _lib(be).ascontiguousarray(x)


def _host(be: Any, x: Any) -> Any:
    return to_host(x) if be.kind == "strict" else x


def _back(be: Any, arr: Any) -> Any:
    return be.asarray(arr) if be.kind == "strict" else arr


def _empty(be: Any, shape: Shape, dt: DType) -> Any:
    lib = _lib(be)
    return lib.empty(shape, dtype=to_numpy(dt) if lib is np else be.dtype(dt))


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


def _same_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
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
    or None (the transport's ``lend`` capability): an input placed there is reduced
    where it lies and its result stays there, so ``x = comm.all_reduce(x)`` step after
    step, or a bucket, copies nothing in or out. The transport answers the same on every
    rank but whether the area is free, which only picks where the input goes."""
    return None if comm._lend is None else comm._lend(nbytes, dt)


def _all_reduce(be: Any, attrs: Attrs, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, rop = attrs[0], attrs[2]
    if comm._shared is not None and be.kind != "cuda":
        out = comm._shared(x if be.kind == "cpu" else to_host(x), rop)
        return Pending(comm, DONE, lambda: _back(be, out))
    if type(x) is np.ndarray and not (donate and comm._lent is not None and comm._lent(x)):
        # an input already in a lent area is donated as it is (asking for an area would
        # only make the transport add one more)
        area = _lent(comm, x.nbytes, x.dtype)
        if area is not None:
            buf = area[:x.nbytes].view(x.dtype).reshape(x.shape)
            np.copyto(buf, x)
            return Pending(comm, comm.transport.all_reduce(buf, rop), lambda: buf)
    buf = _writable(be, x, donate, comm)
    return Pending(comm, comm.transport.all_reduce(buf, rop), lambda: _back(be, buf))


def _all_reduce_bucket(be: Any, attrs: Attrs, xs: list[Any], shapes: list[Any] | None = None,
                       total: int = 0) -> Pending:
    """Several all_reduces in one transport call: concatenate flat (the one copy the
    in-place op needs anyway) into a lent shared area of the transport, or the
    communicator's spare bucket (reused step after step once no result of the last step
    is held), reduce, and hand out views of the result: nothing is copied out. Per member
    the Python is a few list entries (measured: about a third of the time of the 4 MiB
    concatenation for 256 members of 16 KiB). ``shapes`` and ``total`` (elements), when
    the caller has them from its own walk over the members, save this one's."""
    comm, rop = attrs[0], attrs[2]
    lib = _lib(be)
    if be.kind == "strict":
        xs = [_host(be, x) for x in xs]
    if shapes is None:
        shapes = [x.shape for x in xs]
        total = sum(math.prod(s) for s in shapes)
    flat = None
    if lib is np:
        dt = xs[0].dtype
        area = _lent(comm, total * dt.itemsize, dt)
        flat = (_spare(comm, (total,), dt) if area is None else
                area[:total * dt.itemsize].view(dt))
    one_d = flat is not None
    if one_d:
        try:  # 1-D members (most gradients) concatenate as they are into the 1-D bucket
            lib.concatenate(xs, out=flat)
        except ValueError:  # numpy checks the dimensions before it copies anything
            one_d = False
    if not one_d:
        flat = lib.concatenate([x.reshape(-1) for x in xs], out=flat)
    del xs  # the transport reads the bucket, not the inputs: let them go
    if comm._shared is not None and be.kind != "cuda":
        flat, work = comm._shared(flat, rop), DONE
    else:
        work = comm.transport.all_reduce(flat, rop)

    def split() -> list[Any]:
        runs = [(s, len(list(g))) for s, g in groupby(shapes)]
        if len(runs) * 4 <= len(shapes) and all(s for s, _ in runs):
            # runs of one shape (a stack of alike layers): each run's views are the rows
            # of one reshape, made in C (about half the time of a slice per member)
            outs: list[Any] = []
            lo = 0
            for shp, k in runs:
                hi = lo + k * math.prod(shp)
                outs.extend(flat[lo:hi].reshape(k, *shp))
                lo = hi
        else:
            ends = list(accumulate([math.prod(s) for s in shapes]))
            outs = [flat[lo:hi] for lo, hi in zip([0, *ends], ends)]
            if not one_d:
                outs = [o if len(s) == 1 else o.reshape(s) for o, s in zip(outs, shapes)]
        if be.kind == "strict":
            return [_back(be, part) for part in outs]
        return outs

    return Pending(comm, work, split, len(shapes))


def _vjp_all_reduce(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    comm, rop = node.attrs[0], node.attrs[2]
    _differentiable("all_reduce", rop)
    return (comm.all_reduce(Tensor(g), rop).node, *_rest(node))


ALL_REDUCE = _collective("comm.all_reduce", _same_rule, _all_reduce, _vjp_all_reduce,
                         inplace=True, bucket=_all_reduce_bucket)


# ---- all_gather / reduce_scatter ----------------------------------------------------------
def _gather_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    x, n, ax = inputs[0], attrs[0].size, attrs[2]
    return (*x.shape[:ax], x.shape[ax] * n, *x.shape[ax + 1:]), x.dtype, x.device


def _all_gather(be: Any, attrs: Attrs, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, ax = attrs[0], attrs[2]
    send = _readable(be, x)
    recv = _empty(be, (comm.size, *send.shape), _dt(send))
    return Pending(comm, comm.transport.all_gather(send, recv),
                   lambda: _back(be, _unblocks(_lib(be), recv, ax)))


def _vjp_all_gather(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    comm, ax = node.attrs[0], node.attrs[2]
    return (comm.reduce_scatter(Tensor(g), ax, "sum").node, *_rest(node))


_collective("comm.all_gather", _gather_rule, _all_gather, _vjp_all_gather)


def _scatter_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    x, n, ax = inputs[0], attrs[0].size, attrs[2]
    return (*x.shape[:ax], x.shape[ax] // n, *x.shape[ax + 1:]), x.dtype, x.device


def _reduce_scatter(be: Any, attrs: Attrs, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, ax, rop = attrs[0], attrs[2], attrs[3]
    send = _blocks(_lib(be), _host(be, x), ax, comm.size)
    recv = _empty(be, send.shape[1:], _dt(send))
    return Pending(comm, comm.transport.reduce_scatter(send, recv, rop),
                   lambda: _back(be, recv))


def _vjp_reduce_scatter(g: Node, node: Node, wants: tuple[bool, ...]
                        ) -> tuple[Node | None, ...]:
    comm, ax, rop = node.attrs[0], node.attrs[2], node.attrs[3]
    _differentiable("reduce_scatter", rop)
    gx = comm.all_gather(Tensor(g), ax).node
    if rop is ReduceOp.AVG:
        gx = B.binary("div", gx, float(comm.size))
    return (gx, *_rest(node))


_collective("comm.reduce_scatter", _scatter_rule, _reduce_scatter, _vjp_reduce_scatter)


# ---- broadcast / all_to_all ---------------------------------------------------------------
def _broadcast(be: Any, attrs: Attrs, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, root = attrs[0], attrs[2]
    buf = _writable(be, x, donate, comm)
    return Pending(comm, comm.transport.broadcast(buf, root), lambda: _back(be, buf))


def _vjp_broadcast(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    """Sum of the cotangents at the root, zero elsewhere (an all_reduce, then a mask: the
    ranks run the same collectives, so the backward needs no rooted reduce)."""
    comm, root = node.attrs[0], node.attrs[2]
    total = comm.all_reduce(Tensor(g), "sum").node
    return (total if comm.rank == root else B.binary("mul", total, 0.0), *_rest(node))


_collective("comm.broadcast", _same_rule, _broadcast, _vjp_broadcast, inplace=True)


def _a2a_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    x, n, sa, ca = inputs[0], attrs[0].size, attrs[2], attrs[3]
    shape = list(x.shape)
    shape[sa] //= n
    shape[ca] *= n
    return tuple(shape), x.dtype, x.device


def _all_to_all(be: Any, attrs: Attrs, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, sa, ca = attrs[0], attrs[2], attrs[3]
    lib = _lib(be)
    send = _blocks(lib, _host(be, x), sa, comm.size)
    recv = lib.empty_like(send)
    return Pending(comm, comm.transport.all_to_all(send, recv),
                   lambda: _back(be, _unblocks(lib, recv, ca)))


def _vjp_all_to_all(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    comm, sa, ca = node.attrs[0], node.attrs[2], node.attrs[3]
    return (comm.all_to_all(Tensor(g), ca, sa).node, *_rest(node))


_collective("comm.all_to_all", _a2a_rule, _all_to_all, _vjp_all_to_all)


# ---- send / recv / barrier ----------------------------------------------------------------
def _token_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    dt = inputs[0].dtype if attrs[1] else as_dtype("float32")
    return (), dt, attrs[0].device


def _send(be: Any, attrs: Attrs, x: Any, *_: Any, donate: bool = False) -> Pending:
    comm, dst = attrs[0], attrs[2]
    buf = _readable(be, x)
    work = comm.transport.send(buf, dst, comm._tag(comm._sent, dst))
    return Pending(comm, work, lambda: be.zeros((), _dt(buf)))


def _vjp_send(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    comm, dst, x = node.attrs[0], node.attrs[2], node.inputs[0]
    return (comm.recv(x.shape, x.dtype, dst).node, *_rest(node))


_collective("comm.send", _token_rule, _send, _vjp_send)


def _recv_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    return attrs[2], attrs[3], attrs[0].device


def _recv(be: Any, attrs: Attrs, *_: Any, donate: bool = False) -> Pending:
    comm, shape, dt, src = attrs[0], attrs[2], attrs[3], attrs[4]
    buf = (be.lib.empty(shape, dtype=be.dtype(dt)) if be.kind == "cuda"
           else np.empty(shape, to_numpy(dt)))
    work = comm.transport.recv(buf, src, comm._tag(comm._received, src))
    return Pending(comm, work, lambda: _back(be, buf))


def _vjp_recv(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    comm, src = node.attrs[0], node.attrs[4]
    comm.send(Tensor(g), src)  # joins the chain: issued with the next collective or flush
    return tuple(None for _ in node.inputs)


_collective("comm.recv", _recv_rule, _recv, _vjp_recv)


def _barrier(be: Any, attrs: Attrs, *_: Any, donate: bool = False) -> Pending:
    comm = attrs[0]
    return Pending(comm, comm.transport.barrier(), lambda: be.zeros((), "float32"))


_collective("comm.barrier", _token_rule, _barrier, None)
