"""The optimiser: lowering to a flat IR, then simplify + CSE + constant folding, and DCE.

The IR is a list of :class:`Instr` in topological order; inputs are indices into it.
Leaves (realised nodes) are placeholders: their signature holds only shape, dtype and
device, so the IR of a step rebuilt from new data has the same key as the last one's and
the plan cache finds it. Every pass is one linear sweep.
"""

from __future__ import annotations

import math
from typing import Any

from fuelspmd.backend import Device, get_backend
from fuelspmd.dtypes import DType, Shape

from .node import Node, array_dtype, check_live, finish
from .op import Attrs, Fill, Op, get_op

__all__ = ["FOLD_LIMIT", "Instr", "lower", "optimise"]

FOLD_LIMIT = 4096  # largest non-fill constant (elements) the plan keeps precomputed

Sig = tuple[Op, tuple[int, ...], Attrs, Shape, DType, Device]


class Instr:
    """One IR value: ``op(ins; attrs)``; ``value`` holds a folded constant array."""

    __slots__ = ("attrs", "device", "dtype", "ins", "op", "shape", "value")

    def __init__(self, op: Op, ins: tuple[int, ...], attrs: Attrs, shape: Shape, dtype: DType,
                 device: Device, value: Any = None) -> None:
        self.op, self.ins, self.attrs = op, ins, attrs
        self.shape, self.dtype, self.device, self.value = shape, dtype, device, value

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"{self.op.name}{self.ins} {self.shape} {self.dtype}"


def lower(targets: list[Node], effects: list[Node] | None = None
          ) -> tuple[list[Sig], list[Node], tuple[int, ...]]:
    """Walk the unrealised graph under ``targets`` (iteratively: graphs may be deep).

    Returns the signatures in topological order, the leaf nodes (in the order of their
    placeholder slots), and the indices of the targets. When ``effects`` is a list, the
    effectful nodes met on the way are appended to it (a collective that runs must be
    marked realised, or a later realise would issue it again).
    """
    index: dict[int, int] = {}
    sigs: list[Sig] = []
    leaves: list[Node] = []
    leaf_op = get_op("leaf")
    add_sig, add_leaf = sigs.append, leaves.append
    # The hot loop of every realise, plan-cache hit or not: a node sits on the stack until
    # its inputs are indexed, then is emitted (depth-first post-order, first input first).
    # Plain pushes and list comprehensions: no per-node tuples, no generators.
    for target in targets:
        if id(target) in index:
            continue
        stack: list[Node] = [target]
        pop = stack.pop
        while stack:
            node = stack[-1]
            if id(node) in index:
                pop()
                continue
            if node.buffer is not None:
                pop()
                index[id(node)] = len(sigs)
                add_sig((leaf_op, (), (True,) if node.donated else (), node.shape, node.dtype,
                         node.device))
                add_leaf(node)
                continue
            if node.op.kind == "posted":
                finish(node)  # issued earlier (Communicator.post): a leaf once done
                continue
            if not node.inputs:
                check_live(node)
            ins = node.inputs
            waiting = [x for x in ins if id(x) not in index]
            if waiting:
                waiting.reverse()
                stack += waiting
                continue
            pop()
            if effects is not None and node.op.effectful:
                effects.append(node)
            index[id(node)] = len(sigs)
            add_sig((node.op, tuple([index[id(x)] for x in ins]), node.attrs, node.shape,
                     node.dtype, node.device))
    return sigs, leaves, tuple(index[id(t)] for t in targets)


def _const_value(ir: list[Instr], i: int) -> Any:
    ins = ir[i]
    return ins.attrs[0] if ins.op.name == "const" else None


def _simplify(ir: list[Instr], ins: Instr) -> int | Instr | None:
    """Algebraic rules: an index to use instead, a rewritten instr, or None (no rule)."""
    name, x = ins.op.name, ins.ins[0] if ins.ins else -1
    if name == "detach":  # only autograd, which works on the nodes, tells it from its input
        return x
    if name in ("reshape", "broadcast_to") and ir[x].shape == ins.shape:
        return x
    if name == "reshape" and ir[x].op.name == "reshape":
        return Instr(ins.op, ir[x].ins, ins.attrs, ins.shape, ins.dtype, ins.device)
    if name == "astype" and ir[x].dtype is ins.dtype:
        return x
    if name == "transpose":
        perm = ins.attrs[0]
        if ir[x].op.name == "transpose":
            inner = ir[x].attrs[0]
            perm = tuple(inner[p] for p in perm)
            x = ir[x].ins[0]
        if perm == tuple(range(len(perm))):
            return x
        if perm != ins.attrs[0]:
            return Instr(ins.op, (x,), (perm,), ins.shape, ins.dtype, ins.device)
    if name in ("add", "sub", "mul", "div", "pow"):
        a, b = ins.ins
        unit = 0 if name in ("add", "sub") else 1
        for keep, other in ((a, b), (b, a)) if name in ("add", "mul") else ((a, b),):
            if (_const_value(ir, other) == unit and ir[keep].shape == ins.shape
                    and ir[keep].dtype is ins.dtype):
                return keep
    return None


def _fold(ir: list[Instr], ins: Instr) -> Instr | None:
    """Evaluate an op whose inputs are all constants, at plan time."""
    if ins.op.effectful or ins.op.kind in ("leaf", "const") or ins.op.kernel is None:
        return None
    srcs = [ir[i] for i in ins.ins]
    if not srcs or any(s.op.name != "const" and s.value is None for s in srcs):
        return None
    fills = all(s.op.name == "const" and s.value is None for s in srcs)
    if not fills and ins.size > FOLD_LIMIT:
        return None
    if fills and ins.op.kind != "elementwise" and ins.size > FOLD_LIMIT:
        return None
    be = get_backend(ins.device.kind)

    def materialise(s: Instr, scalar: bool) -> Any:
        if s.value is not None:
            return s.value
        return be.xp.full(() if scalar else s.shape, s.attrs[0], dtype=be.dtype(s.dtype))

    scalar = fills and ins.op.kind == "elementwise"
    out = ins.op.kernel(be, ins.attrs, *(materialise(s, scalar) for s in srcs))
    if scalar:  # elementwise over fills is a fill: keep it as structure, any size
        value: Any = (bool(out) if ins.dtype.is_bool else int(out) if ins.dtype.is_integer
                      else float(out))
        attrs = Fill(value, ins.shape, ins.dtype, ins.device,
                     isinstance(value, float) and math.copysign(1.0, value) < 0)
        return Instr(get_op("const"), (), attrs, ins.shape,
                     ins.dtype, ins.device)
    if array_dtype(out) is not ins.dtype or tuple(out.shape) != ins.shape:
        raise RuntimeError(f"folding {ins.op.name} gave {out.shape} {out.dtype}, expected "
                           f"{ins.shape} {ins.dtype}")
    return Instr(get_op("const"), (), Fill("array", ins.shape, ins.dtype, ins.device), ins.shape,
                 ins.dtype, ins.device, value=out)


def optimise(sigs: list[Sig], outs: tuple[int, ...]) -> tuple[list[Instr], tuple[int, ...],
                                                               tuple[int, ...]]:
    """Simplify, merge common subexpressions, fold constants, then drop dead code.

    Returns the new IR, the output indices in it, and for every leaf placeholder (in slot
    order) its index in the new IR or -1 when no output needs it.
    """
    ir: list[Instr] = []
    remap: list[int] = []
    seen: dict[tuple[Any, ...], int] = {}
    leaf_slots: list[int] = []
    for op, ins_old, attrs, shape, dt, dev in sigs:
        if op.kind == "leaf":
            remap.append(len(ir))
            leaf_slots.append(len(ir))
            ir.append(Instr(op, (), attrs, shape, dt, dev))  # attrs (True,): donated
            continue
        ins = Instr(op, tuple(remap[i] for i in ins_old), attrs, shape, dt, dev)
        for _ in range(4):  # a rewrite may enable another (reshape of reshape of reshape)
            found = _simplify(ir, ins)
            if found is None or isinstance(found, int):
                break
            ins = found
        if isinstance(found, int):
            remap.append(found)
            continue
        folded = None if op.effectful else _fold(ir, ins)
        if folded is not None:
            ins = folded
        key = None
        if not ins.op.effectful and ins.value is None:
            key = (ins.op, ins.ins, ins.attrs, ins.device)
            if key in seen:
                remap.append(seen[key])
                continue
        if key is not None:
            seen[key] = len(ir)
        remap.append(len(ir))
        ir.append(ins)
    new_outs = tuple(remap[o] for o in outs)
    live = [False] * len(ir)
    for o in new_outs:
        live[o] = True
    for i in range(len(ir) - 1, -1, -1):
        if ir[i].op.effectful:
            live[i] = True
        if live[i]:
            for j in ir[i].ins:
                live[j] = True
    pos: list[int] = []
    kept: list[Instr] = []
    for i, ins in enumerate(ir):
        pos.append(len(kept) if live[i] else -1)
        if live[i]:
            ins.ins = tuple(pos[j] for j in ins.ins)
            kept.append(ins)
    return kept, tuple(pos[o] for o in new_outs), tuple(pos[s] for s in leaf_slots)
