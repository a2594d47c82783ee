"""Reverse-mode differentiation that builds more lazy graph (layer 3).

:func:`vjp` walks the unrealised graph under the outputs in reverse topological order and
calls each op's vjp rule (beside its forward in the op table), summing cotangents where a
value is used twice. The gradients are lazy tensors in the same graph as the forward, so
``fs.realize(loss, *grads)`` optimises and runs forward and backward together.

Gradients flow through unrealised history only: a realised tensor has dropped its inputs
and is a leaf. Build the backward first, then realise.
"""

from __future__ import annotations

from collections.abc import Sequence

from fuelspmd import graph
from fuelspmd.errors import DTypeError, ShapeError
from fuelspmd.graph import build as B
from fuelspmd.graph.node import Node
from fuelspmd.tensor import Tensor, tensor

__all__ = ["grad", "vjp"]


def _topo(outputs: list[Node]) -> list[Node]:
    order: list[Node] = []
    seen: set[int] = set()
    for out in outputs:
        stack: list[tuple[Node, bool]] = [(out, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((x, False) for x in node.inputs if id(x) not in seen)
    return order


def vjp(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
        cotangents: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """Return sum over outputs of cotangent · d(output)/d(input), one tensor per input.

    Inputs the outputs do not depend on get zeros. Integer and bool inputs get zeros too
    (they have no gradient).
    """
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    cts = [cotangents] if isinstance(cotangents, Tensor) else list(cotangents)
    if len(cts) != len(outs):
        raise ShapeError(f"vjp: {len(outs)} outputs but {len(cts)} cotangents; give one each")
    order = _topo([o.node for o in outs])
    wanted = {id(x.node) for x in ins}
    needs: dict[int, bool] = {}
    for node in order:
        needs[id(node)] = id(node) in wanted or any(needs[id(x)] for x in node.inputs)
    ct: dict[int, Node] = {}
    for o, c in zip(outs, cts):
        c = c if isinstance(c, Tensor) else tensor(c, device=o.device, dtype=o.dtype)
        if c.shape != o.shape:
            raise ShapeError(f"vjp: cotangent {c.shape} does not match output {o.shape}; "
                             "give a cotangent of the output's shape")
        if not o.dtype.is_floating:
            raise DTypeError(f"vjp: output dtype {o.dtype} is not floating; cast it first")
        _add(ct, o.node, B.astype(c.node, o.dtype))
    for node in reversed(order):
        g = ct.get(id(node))
        if g is None or not node.inputs or node.op.vjp is None:
            continue
        wants = tuple(needs[id(x)] and x.dtype.is_floating for x in node.inputs)
        if not any(wants):
            continue
        for x, gx, want in zip(node.inputs, node.op.vjp(g, node, wants), wants):
            if want and gx is not None:
                _add(ct, x, B.astype(gx, x.dtype))
    result = []
    for x in ins:
        g = ct.get(id(x.node))
        result.append(Tensor(g) if g is not None else
                      Tensor(graph.const(0, x.shape, x.dtype, x.device)))
    return result


def _add(ct: dict[int, Node], node: Node, g: Node) -> None:
    prev = ct.get(id(node))
    ct[id(node)] = g if prev is None else B.binary("add", prev, g)


def grad(output: Tensor, inputs: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """Return d(output)/d(input) for each input (lazily); ``output`` must be a scalar."""
    if output.shape != ():
        raise ShapeError(f"grad: output has shape {output.shape}; it must be a scalar (shape "
                         "()). Reduce it (.sum(), .mean()) or use fs.vjp with a cotangent")
    one = Tensor(graph.const(1, (), output.dtype, output.device))
    return vjp([output], inputs, [one])
