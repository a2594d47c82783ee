"""The op table: one :class:`Op` per primitive.

Each entry holds everything the graph knows about a primitive, side by side:

- ``rule(inputs, attrs) -> (shape, dtype, device)``: runs when a node is built, so a bad
  shape or dtype raises there (``ShapeError``/``DTypeError`` naming the op and the shapes),
  never at run time;
- ``kernel(backend, *arrays, attrs)``: written once against the Array API namespace
  ``backend.xp``, so the same kernel serves numpy, cupy and array-api-strict;
- ``vjp(g, node, wants)``: the backward, built as more graph nodes (``wants[i]`` says
  whether input ``i`` needs a cotangent; the rule returns ``None`` where it does not);
- ``kind``: how the optimiser may treat it. ``elementwise`` ops may be fused (``ufunc`` names
  the numpy ufunc of the CPU out= path, ``cexpr`` the C expression of the cupy kernel);
  ``view`` ops return an alias of their input's memory.

Effectful ops (collectives, added by the communicator layer) are never merged, folded or
dropped. Their attributes are a named tuple whose fields ``comm`` (the op's *stream*:
whatever orders its operations, compared by identity) and ``nin`` (how many leading
inputs are data; the rest are order tokens) the planner reads; ``start(backend, attrs,
*arrays, donate=False)`` issues the op and returns an object whose ``finish()`` waits and
gives the value, so the planner can put steps between the two. A ``serial`` op (a
collective) has one operation per stream in flight at a time; point-to-point ops do not
wait for each other. One with a ``bucket(backend, attrs, arrays, shapes, total)`` kernel
may have consecutive nodes of equal attributes (of these shapes, ``total`` elements in
all) issued as one call of at most ``bucket_bytes(attrs)`` bytes, whose ``finish()`` gives
the list of results. ``replay(attrs, count)`` is called before a compiled step's replay
(``fs.compile``) issues ``count`` of them on that stream without building their nodes, so
the stream can issue what it built before (creation order) and count them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["OPS", "Fill", "Op", "get_op", "register"]

Attrs = tuple[Any, ...]


class Fill(NamedTuple):
    """A constant's attributes: ``value`` everywhere of ``shape``, ``dtype``, ``device``.
    ``negative`` is the sign bit of a float value, so that -0.0 and 0.0, equal as Python
    numbers, are two constants (``1 / -0.0`` is ``-inf``)."""

    value: Any
    shape: tuple[int, ...]
    dtype: Any
    device: Any
    negative: bool = False


@dataclass(frozen=True, eq=False)
class Op:
    """A primitive: shape/dtype rule, Array API kernel and vjp, beside each other."""

    name: str
    rule: Callable[..., Any]
    kernel: Callable[..., Any] | None
    vjp: Callable[..., Any] | None = None
    kind: str = "other"  # elementwise | view | reduce | other | leaf | const
    ufunc: str | None = None
    cexpr: str | None = None
    inplace_ok: tuple[int, ...] | None = None  # operands a fused CPU step may overwrite
    # the kernel writes operand 0 and returns it when the planner calls it with
    # donate=True (that operand is the graph's and dies there): ``put``
    writes_input: bool = False
    effectful: bool = False  # the rest: effectful ops only (see the module docstring)
    serial: bool = True
    start: Callable[..., Any] | None = None
    bucket: Callable[..., Any] | None = None
    bucket_bytes: Callable[[Attrs], int] | None = None
    replay: Callable[[Attrs, int], None] | None = None

    @property
    def fusable(self) -> bool:
        return self.kind == "elementwise" and self.ufunc is not None and not self.effectful

    def __repr__(self) -> str:
        return f"Op({self.name})"


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Add ``op`` to the table; a name is registered once."""
    if op.name in OPS:
        raise RuntimeError(f"op {op.name!r} is registered twice")
    OPS[op.name] = op
    return op


def get_op(name: str) -> Op:
    """Return the op called ``name``."""
    try:
        return OPS[name]
    except KeyError:
        raise RuntimeError(f"no op {name!r} in the table; known: {sorted(OPS)}") from None
