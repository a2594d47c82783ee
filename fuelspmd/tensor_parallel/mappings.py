"""The conjugate mappings of tensor parallelism, as graph ops with their vjps.

Megatron's convention, which differs on purpose from the Communicator's: after a
tensor-parallel region every rank holds the same activations and computes the same loss
``L`` (replicated), and the gradient wanted on every rank is dL/d(its own values), not the
derivative of the sum of every rank's copy of ``L``. So each mapping is paired with a
backward that is not the collective's own vjp:

| mapping          | forward                         | backward                     |
|------------------|---------------------------------|------------------------------|
| ``copy_to_tp``   | identity                        | all_reduce (sum)             |
| ``reduce_from_tp``| all_reduce (sum)               | identity                     |
| ``scatter_to_tp``| keep block ``rank`` of the last axis | all_gather, last axis   |
| ``gather_from_tp``| all_gather, last axis          | keep block ``rank``          |

``copy_to_tp`` and ``scatter_to_tp`` are view ops (no copy). The other two run the
Communicator's collective on a detached input and route the gradient around it through a
``tp.route`` node: its forward returns the collective's result, its vjp hands the
cotangent (or its block) to the undetached input. Every mapping of a size-1 communicator
returns its input: no node, no communication.
"""

from __future__ import annotations

from typing import Any

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, Shape
from fuelspmd.errors import ShapeError
from fuelspmd.graph.node import Node, make
from fuelspmd.graph.op import Attrs, Op, register
from fuelspmd.tensor import Tensor

__all__ = ["copy_to_tp", "gather_from_tp", "reduce_from_tp", "scatter_to_tp"]

Rule = tuple[Shape, DType, Device]


def _block(g: Node, comm: Any) -> Node:
    """Block ``comm.rank`` of ``g`` along its last axis (a slice view)."""
    k = g.shape[-1] // comm.size
    lo = comm.rank * k
    slices = (*((0, d, 1) for d in g.shape[:-1]), (lo, lo + k, 1))
    return make("slice", (g,), (slices,))


def _same(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    x = inputs[0]
    return x.shape, x.dtype, x.device


def _vjp_copy(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    return (node.attrs[0].all_reduce(Tensor(g)).node,)


def _scatter_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    x, comm = inputs[0], attrs[0]
    return (*x.shape[:-1], x.shape[-1] // comm.size), x.dtype, x.device


def _scatter(be: Any, attrs: Attrs, x: Any) -> Any:
    comm = attrs[0]
    k = x.shape[-1] // comm.size
    return x[..., comm.rank * k:(comm.rank + 1) * k]


def _vjp_scatter(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    return (node.attrs[0].all_gather(Tensor(g), axis=len(g.shape) - 1).node,)


def _route_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Rule:
    y = inputs[0]
    return y.shape, y.dtype, y.device


def _vjp_route(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    """The collective's result gets nothing; the input gets ``g`` (reduce) or its block
    of ``g`` (gather)."""
    comm, how = node.attrs
    return (None, g if how == "reduce" else _block(g, comm))


register(Op("tp.copy", _same, lambda be, attrs, x: x, _vjp_copy, "view"))
register(Op("tp.scatter", _scatter_rule, _scatter, _vjp_scatter, "view"))
# a view of input 0 (the collective's result); input 1 only carries the gradient
register(Op("tp.route", _route_rule, lambda be, attrs, y, x: y, _vjp_route, "view"))


def _last_axis_divides(op: str, t: Tensor, comm: Any) -> None:
    if t.ndim == 0 or t.shape[-1] % comm.size:
        last = t.shape[-1] if t.ndim else 0
        ok = [d for d in range(1, last + 1) if last % d == 0]
        raise ShapeError(f"{op}: the last axis of {t.shape} has {last} elements, not "
                         f"divisible by the TP size {comm.size}; TP sizes that divide it: "
                         f"{ok}")


def copy_to_tp(x: Tensor, *, comm: Any) -> Tensor:
    """Enter a TP region: identity forward, all_reduce of the gradient backward."""
    if comm.size == 1:
        return x
    return Tensor(make("tp.copy", (x.node,), (comm,)))


def reduce_from_tp(x: Tensor, *, comm: Any) -> Tensor:
    """Leave a TP region by summing partial results: all_reduce forward, identity backward."""
    if comm.size == 1:
        return x
    y = comm.all_reduce(x.detach(), "sum")
    return Tensor(make("tp.route", (y.node, x.node), (comm, "reduce")))


def scatter_to_tp(x: Tensor, *, comm: Any) -> Tensor:
    """Keep block ``rank`` of the last axis; backward all_gathers the gradient."""
    _last_axis_divides("scatter_to_tp", x, comm)
    if comm.size == 1:
        return x
    return Tensor(make("tp.scatter", (x.node,), (comm,)))


def gather_from_tp(x: Tensor, *, comm: Any) -> Tensor:
    """Concatenate every rank's ``x`` along the last axis; backward keeps block ``rank``."""
    if x.ndim == 0:
        raise ShapeError(f"gather_from_tp: a 0-d tensor (shape {x.shape}) has no last axis to "
                         "gather along; reshape it to (1,) first")
    if comm.size == 1:
        return x
    y = comm.all_gather(x.detach(), axis=x.ndim - 1)
    return Tensor(make("tp.route", (y.node, x.node), (comm, "gather")))

