"""Activation recomputation: a block's forward runs again in the backward instead of its
intermediates being kept from the forward to the backward.

``checkpoint(fn, *args, params=...)`` builds the forward from *detached* inputs, so
nothing of the backward reads its intermediates and the planner frees each after its last
forward use, then joins the result to the inputs and parameters through an
``nn.recompute`` node (a view of the result). That node's vjp builds the forward once
more, from the inputs held back by ``nn.after`` nodes that also read the incoming
cotangent: the copy cannot run before the backward reaches the block, and its nodes
differ from the forward's, so common-subexpression elimination does not merge them. The
gradients are the vjp of that copy; the cotangents handed on to the earlier blocks are
ordered (``nn.after`` again) after the block's parameter gradients, so the copy's values
die inside the block's backward instead of waiting for a later target. Only the block's
inputs (and output) stay alive between forward and backward.

The block must compute the same function twice: its collectives run twice, in the same
order on every rank, and Dropout redraws the same mask (its key does not change between
building the forward and the backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fuelspmd.autograd import vjp
from fuelspmd.errors import ConfigError
from fuelspmd.graph.node import Node, make
from fuelspmd.graph.op import Attrs, Op, register
from fuelspmd.tensor import Tensor

from .parameter import Parameter

__all__ = ["checkpoint"]


class _Block:
    """The recompute node's attributes: the block to rerun. Equal to every other block,
    so a step rebuilt with a new closure keeps its plan-cache key (the node's kernel never
    reads it)."""

    __slots__ = ("fn", "n")

    def __init__(self, fn: Callable[..., Tensor], n: int) -> None:
        self.fn, self.n = fn, n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Block)

    def __hash__(self) -> int:
        return 0


def _first(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Any, Any, Any]:
    x = inputs[0]
    return x.shape, x.dtype, x.device


def _vjp_after(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    return (g, None)


def _vjp_recompute(g: Node, node: Node, wants: tuple[bool, ...]) -> tuple[Node | None, ...]:
    block: _Block = node.attrs[0]
    ins = node.inputs[1:]
    xs = [Tensor(make("nn.after", (x, g))) for x in ins[:block.n]]
    y = block.fn(*xs)
    wrt = [i for i, w in enumerate(wants[1:]) if w]
    every = [*xs, *(Tensor(p) for p in ins[block.n:])]
    grads: list[Node | None] = [None] * len(ins)
    for i, gr in zip(wrt, vjp([y], [every[i] for i in wrt], [Tensor(g)])):
        grads[i] = gr.node
    for gp in grads[block.n:]:  # the block's parameter gradients first: its copy dies here
        if gp is not None:
            grads[:block.n] = [None if gx is None else make("nn.after", (gx, gp))
                               for gx in grads[:block.n]]
    return (None, *grads)


# input 0 of each is the value; nn.after's input 1 only orders it after the cotangent
register(Op("nn.after", _first, lambda be, attrs, x, g: x, _vjp_after, "view"))
register(Op("nn.recompute", _first, lambda be, attrs, y, *rest: y, _vjp_recompute, "view"))


def checkpoint(fn: Callable[..., Tensor], *args: Any, params: Sequence[Parameter]) -> Tensor:
    """``fn(*args)`` whose intermediates are recomputed in the backward; ``params`` are the
    parameters ``fn`` reads (their gradients come from the recomputed copy). Tensor
    arguments are the block's inputs; any others are passed through as constants."""
    slots = [i for i, a in enumerate(args) if isinstance(a, Tensor)]

    def call(*xs: Tensor) -> Tensor:
        full = list(args)
        for i, x in zip(slots, xs):
            full[i] = x
        out = fn(*full)
        if not isinstance(out, Tensor):
            raise ConfigError(f"recompute: the block returned {type(out).__name__}; a "
                              "recomputed block must return one Tensor")
        return out

    y = call(*(args[i].detach() for i in slots))
    inputs = (y.node, *(args[i].node for i in slots), *(p.node for p in params))
    return Tensor(make("nn.recompute", inputs, (_Block(call, len(slots)),)))
