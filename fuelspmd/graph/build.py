"""Node builders shared by the vjp rules and the Tensor front.

Type promotion and Python scalars are settled here, once: a binary op casts both sides to
``result_type`` with explicit ``astype`` nodes (so every kernel sees equal dtypes, as the
Array API requires), and a Python scalar becomes a ``const`` node of the other side's dtype
(a float scalar with an integer or bool tensor gives float32).
"""

from __future__ import annotations

from collections.abc import Sequence

from fuelspmd.dtypes import DType, Shape, bool_, float32, int64, result_type

from .node import Node, const, make

__all__ = [
    "astype", "binary", "broadcast_to", "lift", "matmul", "reshape", "sum_axes", "transpose",
    "unary", "unbroadcast", "where",
]

Scalar = float | int | bool


def _scalar_dtype(value: Scalar, other: DType) -> DType:
    """The dtype a Python scalar takes beside a tensor of dtype ``other`` (Array API's rule)."""
    if isinstance(value, bool):
        return other
    if isinstance(value, float) and not other.is_floating:
        return float32
    if isinstance(value, int) and other.is_bool:
        return int64
    return other


def lift(x: Node | Scalar, like: Node) -> Node:
    """Return ``x`` as a node; a Python scalar becomes a 0-d const on ``like``'s device."""
    if isinstance(x, Node):
        return x
    if not isinstance(x, (bool, int, float)):
        raise TypeError(f"cannot combine a tensor with {type(x).__name__}; use a number or "
                        "a Tensor")
    return const(x, (), _scalar_dtype(x, like.dtype), like.device)


def astype(x: Node, dt: DType) -> Node:
    """Cast ``x`` to ``dt`` (no node when it already has it)."""
    return x if x.dtype is dt else make("astype", (x,), (dt,))


def binary(name: str, a: Node | Scalar, b: Node | Scalar) -> Node:
    """Apply the elementwise binary op ``name`` with numpy broadcasting and promotion."""
    if not isinstance(a, Node):
        if not isinstance(b, Node):
            raise TypeError(f"{name}: at least one operand must be a Tensor")
        a = lift(a, b)
    b = lift(b, a)
    dt = result_type(a.dtype, b.dtype)
    return make(name, (astype(a, dt), astype(b, dt)))


def unary(name: str, a: Node) -> Node:
    return make(name, (a,))


def where(c: Node, a: Node | Scalar, b: Node | Scalar) -> Node:
    """``a`` where ``c`` holds, else ``b`` (broadcast together)."""
    if not isinstance(a, Node):
        if not isinstance(b, Node):
            a = const(a, (), float32 if isinstance(a, float) else c.dtype, c.device)
        else:
            a = lift(a, b)
    b = lift(b, a)
    dt = result_type(a.dtype, b.dtype)
    return make("where", (astype(c, bool_), astype(a, dt), astype(b, dt)))


def reshape(x: Node, shape: Sequence[int]) -> Node:
    shape = tuple(shape)
    return x if shape == x.shape else make("reshape", (x,), (shape,))


def transpose(x: Node, perm: Sequence[int]) -> Node:
    perm = tuple(perm)
    return x if perm == tuple(range(len(perm))) else make("transpose", (x,), (perm,))


def broadcast_to(x: Node, shape: Sequence[int]) -> Node:
    shape = tuple(shape)
    return x if shape == x.shape else make("broadcast_to", (x,), (shape,))


def sum_axes(x: Node, axes: Sequence[int], keepdims: bool = False) -> Node:
    return make("sum", (x,), (tuple(sorted(axes)), keepdims))


def unbroadcast(g: Node, shape: Shape) -> Node:
    """Sum ``g`` down to ``shape``: the adjoint of broadcasting ``shape`` up to ``g.shape``."""
    if g.shape == tuple(shape):
        return g
    lead = len(g.shape) - len(shape)
    axes = list(range(lead))
    axes += [lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1]
    out = sum_axes(g, axes, keepdims=False) if axes else g
    return reshape(out, shape)


def matmul(a: Node, b: Node) -> Node:
    dt = result_type(a.dtype, b.dtype)
    return make("matmul", (astype(a, dt), astype(b, dt)))
