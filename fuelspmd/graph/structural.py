"""Shape-moving primitives: views (reshape, transpose, broadcast_to, slice), concat,
gather (``take``) with its scatter-add adjoint, the indexed write ``put`` (in place where
its destination is the graph's to overwrite), and the device move ``to``.

Views alias their input's memory: the memory planner frees a buffer only when every view
of it is dead, and never writes into a view.
"""

from __future__ import annotations

import math
from typing import Any

from fuelspmd.backend import Device, transfer
from fuelspmd.dtypes import DType, Shape, broadcast_shapes
from fuelspmd.errors import DTypeError, ShapeError

from . import build as B
from .node import Node, const, make
from .op import Attrs, Op, register

Rule = tuple[Shape, DType, Device]


def _reshape_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (x,), (shape,) = inputs, attrs
    if math.prod(shape) != math.prod(x.shape):
        raise ShapeError(f"reshape: cannot reshape {x.shape} ({math.prod(x.shape)} elements) "
                         f"to {shape} ({math.prod(shape)} elements); the element counts "
                         "must match")
    return shape, x.dtype, x.device


register(Op("reshape", _reshape_rule, lambda be, attrs, x: be.xp.reshape(x, attrs[0]),
            lambda g, n, w: (B.reshape(g, n.inputs[0].shape),), "view"))


def _transpose_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (x,), (perm,) = inputs, attrs
    if sorted(perm) != list(range(len(x.shape))):
        raise ShapeError(f"transpose: axes {perm} are not a permutation of "
                         f"{tuple(range(len(x.shape)))} for a tensor of shape {x.shape}; give "
                         "each axis once")
    return tuple(x.shape[p] for p in perm), x.dtype, x.device


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


register(Op("transpose", _transpose_rule, lambda be, attrs, x: be.xp.permute_dims(x, attrs[0]),
            lambda g, n, w: (B.transpose(g, _inverse(n.attrs[0])),), "view"))


def _broadcast_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (x,), (shape,) = inputs, attrs
    if broadcast_shapes(x.shape, shape, op="broadcast_to") != tuple(shape):
        raise ShapeError(f"broadcast_to: {x.shape} does not broadcast to {shape}; each axis "
                         "must be equal or 1")
    return shape, x.dtype, x.device


register(Op("broadcast_to", _broadcast_rule,
            lambda be, attrs, x: be.xp.broadcast_to(x, attrs[0]),
            lambda g, n, w: (B.unbroadcast(g, n.inputs[0].shape),), "view"))


# slice attrs: ((start, stop, step), ...) one triple per axis, already normalised by
# slice.indices, so every triple is valid for the axis it belongs to.
def _slice_shape(slices: tuple[tuple[int, int, int], ...]) -> Shape:
    return tuple(len(range(*s)) for s in slices)


def _slice_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (x,), (slices,) = inputs, attrs
    if len(slices) != len(x.shape):
        raise ShapeError(f"slice: {len(slices)} slices for a {len(x.shape)}-d tensor {x.shape}; "
                         "give one slice per axis")
    return _slice_shape(slices), x.dtype, x.device


def _index(slices: tuple[tuple[int, int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, None if b < 0 else b, c) for a, b, c in slices)


register(Op("slice", _slice_rule, lambda be, attrs, x: x[_index(attrs[0])],
            lambda g, n, w: (make("unslice", (g,), (n.inputs[0].shape, n.attrs[0])),), "view"))


def _unslice_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (g,), (shape, slices) = inputs, attrs
    if _slice_shape(slices) != g.shape:
        raise ShapeError(f"unslice: gradient {g.shape} does not fit slices {slices} of {shape}; "
                         "give the gradient of the sliced shape")
    return shape, g.dtype, g.device


def _unslice(be: Any, attrs: Attrs, g: Any) -> Any:
    shape, slices = attrs
    out = be.xp.zeros(shape, dtype=g.dtype)
    out[_index(slices)] = g
    return out


register(Op("unslice", _unslice_rule, _unslice,
            lambda g, n, w: (make("slice", (g,), (n.attrs[1],)),)))


def _concat_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (axis,) = attrs
    first = inputs[0]
    for x in inputs[1:]:
        if x.dtype is not first.dtype:
            raise DTypeError(f"concat: dtypes {first.dtype} and {x.dtype} differ; cast first")
        if len(x.shape) != len(first.shape) or any(
                a != b for i, (a, b) in enumerate(zip(x.shape, first.shape)) if i != axis):
            raise ShapeError(f"concat: shapes {first.shape} and {x.shape} differ outside "
                             f"axis {axis}; all other sizes must match")
    shape = list(first.shape)
    shape[axis] = sum(x.shape[axis] for x in inputs)
    return tuple(shape), first.dtype, first.device


def _vjp_concat(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    (axis,), out, start = n.attrs, [], 0
    for x, want in zip(n.inputs, w):
        stop = start + x.shape[axis]
        sl = tuple((start, stop, 1) if i == axis else (0, d, 1) for i, d in enumerate(g.shape))
        out.append(make("slice", (g,), (sl,)) if want else None)
        start = stop
    return tuple(out)


register(Op("concat", _concat_rule, lambda be, attrs, *xs: be.xp.concat(list(xs), axis=attrs[0]),
            _vjp_concat))


# take: out = x indexed by integer ``idx`` (any shape) along ``axis``:
# out.shape = x.shape[:axis] + idx.shape + x.shape[axis+1:]. Its adjoint scatter-adds.
def _take_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (x, idx), (axis,) = inputs, attrs
    if not idx.dtype.is_integer:
        raise DTypeError(f"take: indices must be int32 or int64, got {idx.dtype}")
    return x.shape[:axis] + idx.shape + x.shape[axis + 1:], x.dtype, x.device


def _take(be: Any, attrs: Attrs, x: Any, idx: Any) -> Any:
    xp, (axis,) = be.xp, attrs
    flat = xp.reshape(idx, (-1,))
    out = xp.take(x, flat, axis=axis)
    return xp.reshape(out, tuple(x.shape[:axis]) + tuple(idx.shape) + tuple(x.shape[axis + 1:]))


def _vjp_take(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    x, idx = n.inputs
    return make("scatter_add", (g, idx), (n.attrs[0], x.shape)), None


register(Op("take", _take_rule, _take, _vjp_take))


def _scatter_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (g, idx), (axis, shape) = inputs, attrs
    want = tuple(shape[:axis]) + idx.shape + tuple(shape[axis + 1:])
    if g.shape != want:
        raise ShapeError(f"scatter_add: values {g.shape} do not match {want} for indices "
                         f"{idx.shape} into {shape} along axis {axis}; give values of shape {want}")
    return tuple(shape), g.dtype, g.device


def _scatter_add(be: Any, attrs: Attrs, g: Any, idx: Any) -> Any:
    """out[..., idx[j], ...] += g[..., j, ...]; repeated indices accumulate."""
    xp, (axis, shape) = be.xp, attrs
    pre, size, post = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    n = math.prod(idx.shape)
    g3 = xp.reshape(g, (pre, n, post))
    flat = xp.reshape(idx, (-1,))
    if be.kind == "cpu":
        out = be.lib.zeros((pre, size, post), dtype=g.dtype)
        be.lib.add.at(out, (slice(None), flat), g3)
    elif be.kind == "cuda":
        import cupyx

        out = be.lib.zeros((pre, size, post), dtype=g.dtype)
        cupyx.scatter_add(out, (slice(None), flat), g3)
    else:  # the standard has no scatter: a one-hot matmul, exact for sums
        onehot = xp.astype(flat[:, None] == xp.arange(size, dtype=flat.dtype)[None, :], g.dtype)
        out = xp.permute_dims(xp.matmul(xp.permute_dims(g3, (0, 2, 1)), onehot), (0, 2, 1))
    return xp.reshape(out, tuple(shape))


register(Op("scatter_add", _scatter_rule, _scatter_add,
            lambda g, n, w: (make("take", (g, n.inputs[1]), (n.attrs[0],)), None)))


# put: out = dest with out[..., idx[j], ...] = values[..., j, ...] along ``axis`` (indices
# distinct: a block table never repeats a slot). Written where ``dest``'s buffer is the
# graph's and dies here (the planner passes donate=True), the step costs O(values), not
# O(dest): the paged KV store's page writes.
def _put_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (dest, idx, values), (axis,) = inputs, attrs
    if not idx.dtype.is_integer:
        raise DTypeError(f"put: indices must be int32 or int64, got {idx.dtype}")
    want = dest.shape[:axis] + idx.shape + dest.shape[axis + 1:]
    if values.shape != want:
        raise ShapeError(f"put: values {values.shape} do not match {want} for indices "
                         f"{idx.shape} into {dest.shape} along axis {axis}; give values of "
                         f"shape {want}")
    if values.dtype is not dest.dtype:
        raise DTypeError(f"put: values are {values.dtype}, the destination {dest.dtype}; "
                         "cast the values first")
    return dest.shape, dest.dtype, dest.device


def _put(be: Any, attrs: Attrs, dest: Any, idx: Any, values: Any, *,
         donate: bool = False) -> Any:
    """``dest`` with the indexed rows replaced; into ``dest`` itself when ``donate``."""
    xp, (axis,) = be.xp, attrs
    flat = xp.reshape(idx, (-1,))
    rows = (*dest.shape[:axis], flat.shape[0], *dest.shape[axis + 1:])
    vals = xp.reshape(values, rows)
    if be.kind in ("cpu", "cuda"):
        out = dest if donate else be.lib.array(dest, copy=True)
        out[(*(slice(None),) * axis, flat)] = vals
        return out
    # the standard has no integer-array assignment: the scatter's one-hot form, exact
    # (each written element is one value plus zeros)
    hit = xp.any(flat[:, None] == xp.arange(dest.shape[axis], dtype=flat.dtype)[None, :], axis=0)
    hit = xp.reshape(hit, (*(1,) * axis, dest.shape[axis], *(1,) * (dest.ndim - axis - 1)))
    return xp.where(hit, _scatter_add(be, (axis, tuple(dest.shape)), vals, flat), dest)


def _vjp_put(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    _, idx, values = n.inputs
    zero = const(0, values.shape, g.dtype, g.device)
    return (make("put", (g, idx, zero), n.attrs) if w[0] else None, None,
            make("take", (g, idx), n.attrs) if w[2] else None)


register(Op("put", _put_rule, _put, _vjp_put, writes_input=True))


# to: attrs (dst, src); the node lives on dst.
def _to_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    (x,), (dst, src) = inputs, attrs
    if x.device != src:
        raise RuntimeError(f"to: input lives on {x.device}, attrs say {src}")
    if dst.kind == "strict" and x.dtype.name in ("float16", "bfloat16"):  # not standard
        raise DTypeError(f"to: a strict device holds the Array API standard's dtypes, which "
                         f"have no {x.dtype.name}; cast to float32 first")
    return x.shape, x.dtype, dst


def _to(be: Any, attrs: Attrs, x: Any) -> Any:
    dst, src = attrs
    return transfer(x, src, dst)


# "to" is a view for the memory planner: between host libraries it may hand back the
# very same memory, which must then never be reused or written in place.
register(Op("to", _to_rule, _to,
            lambda g, n, w: (make("to", (g,), (n.inputs[0].device, n.device)),), "view"))


# detach: the same value with no gradient (softmax's shift by the max, for instance).
register(Op("detach", lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype, inputs[0].device),
            lambda be, attrs, x: x, None, "view"))
