"""Reductions (sum, max over axes, with keepdims) and batched matmul."""

from __future__ import annotations

import math
from typing import Any

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, Shape, broadcast_shapes, int64
from fuelspmd.errors import DTypeError, ShapeError

from . import build as B
from .node import Node
from .op import Attrs, Op, register

Rule = tuple[Shape, DType, Device]


def _reduced(shape: Shape, axes: tuple[int, ...], keepdims: bool) -> Shape:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_rule(name: str) -> Any:
    def rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
        (x,), (axes, keepdims) = inputs, attrs
        if any(not 0 <= a < len(x.shape) for a in axes):
            raise ShapeError(f"{name}: axes {axes} out of range for shape {x.shape}; valid "
                             f"axes are 0..{len(x.shape) - 1}")
        if name == "max" and any(x.shape[a] == 0 for a in axes):
            raise ShapeError(f"max: cannot reduce an empty axis of shape {x.shape}")
        dt = int64 if name == "sum" and x.dtype.is_bool else x.dtype
        return _reduced(x.shape, axes, keepdims), dt, x.device
    return rule


def _sum(be: Any, attrs: Attrs, x: Any) -> Any:
    axes, keepdims = attrs
    if x.dtype == be.dtype("bool"):  # the standard sums numbers only: count as int64
        x = be.xp.astype(x, be.dtype(int64))
    return be.xp.sum(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _keep(g: Node, n: Node) -> Node:
    """Reshape the cotangent of a reduction to its keepdims shape, then broadcast back."""
    x, (axes, _) = n.inputs[0], n.attrs
    return B.broadcast_to(B.reshape(g, _reduced(x.shape, axes, True)), x.shape)


def _vjp_max(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    """Ties share the cotangent equally: g * (x == max) / count(x == max)."""
    x, (axes, _) = n.inputs[0], n.attrs
    top = B.broadcast_to(B.reshape(n, _reduced(x.shape, axes, True)), x.shape)
    mask = B.astype(B.binary("eq", x, top), x.dtype)
    count = B.sum_axes(mask, axes, keepdims=True)
    return (B.binary("mul", _keep(g, n), B.binary("div", mask, count)),)


register(Op("sum", _reduce_rule("sum"), _sum, lambda g, n, w: (_keep(g, n),), "reduce"))
register(Op("max", _reduce_rule("max"),
            lambda be, attrs, x: be.xp.max(x, axis=attrs[0], keepdims=attrs[1]), _vjp_max,
            "reduce"))


def _matmul_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    a, b = inputs
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ShapeError(f"matmul: needs 2-d or batched operands, got {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} do not match: the last axis "
                         f"of the first ({a.shape[-1]}) must equal the second-to-last of the "
                         f"second ({b.shape[-2]})")
    if a.dtype is not b.dtype or a.dtype.is_bool:
        raise DTypeError(f"matmul: operands {a.dtype} and {b.dtype}; need one numeric dtype")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], op="matmul (batch axes)")
    return (*batch, a.shape[-2], b.shape[-1]), a.dtype, a.device


def _swap(x: Node) -> Node:
    n = len(x.shape)
    return B.transpose(x, (*range(n - 2), n - 1, n - 2))


def _vjp_matmul(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    """``ga = g b^T`` and ``gb = a^T g``, each summed over the axes it was broadcast
    along. ``x @ W`` with a batched ``x`` and a 2-d ``W`` (every layer's weight) gives
    ``W``'s gradient as one product of the rows, ``x.reshape(-1, k)^T g.reshape(-1, n)``,
    instead of a batch of products and a sum over the batch: one BLAS call on a large
    operand instead of many on small ones, and no batch of partial products in memory."""
    a, b = n.inputs
    ga = B.unbroadcast(B.matmul(g, _swap(b)), a.shape) if w[0] else None
    if not w[1]:
        return ga, None
    if len(b.shape) == 2 and len(a.shape) > 2:
        rows = math.prod(a.shape[:-1])
        return ga, B.matmul(_swap(B.reshape(a, (rows, a.shape[-1]))),
                            B.reshape(g, (rows, g.shape[-1])))
    return ga, B.unbroadcast(B.matmul(_swap(a), g), b.shape)


register(Op("matmul", _matmul_rule, lambda be, attrs, a, b: be.xp.matmul(a, b), _vjp_matmul))
