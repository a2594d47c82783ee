"""The executor: one way from targets to values, and the plan cache.

:meth:`Executor.realize` finds the plan of the unrealised graph under its targets, runs it,
then hands each target its buffer and drops its inputs. Finding the plan:

- The cache holds plans by a cheap summary of the targets (their number, the first one's
  device, the first and the last one's op and shape) and, under it, the few structures
  seen with that summary.
- A cached plan *binds* the graph (:class:`Binding`): one walk over the edges of the
  unrealised graph, in the order the plan was made from, checks that every node is what
  the plan expects (op, attributes, number of inputs, realised or not; for a leaf its
  shape, dtype, device and donation) and that nodes are shared exactly where they were,
  and collects the leaves and the effectful nodes the plan computes. A graph that binds is
  the graph the plan was made for (lowering it would give the same IR); the walk costs a
  few list indexings per edge, where lowering builds a signature per node.
- A graph that binds to no cached plan is lowered, optimised and planned
  (:mod:`.passes`, :mod:`.plan`), and its plan cached with its binding.

Effectful nodes (collectives) under the targets are computed once: the plan also outputs
them and the executor marks them realised, so a later realise never issues them again. A
leaf the caller donated (``Tensor.donate``) may be written by the plan and is spent after
it; a leaf an output is a view of is marked ``escaped`` (its buffer is shared from then).
Live bytes are counted as the plan runs: buffers the executor allocated and still holds;
leaves belong to the caller. ``peak_bytes`` of the last run is on the executor.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from .node import TRACE, Node, consume, finish
from .passes import lower, optimise
from .plan import Memory, Plan, make_plan

__all__ = ["Binding", "Executor", "PlanCache", "default_executor", "realize", "recording"]

_MARKS = itertools.count(1)  # one per binding walk (see Binding.bind)


class Binding:
    """How a plan finds its nodes in a graph (see the module docstring).

    Slots ``0..T-1`` are the targets; ``edges`` are ``(parent slot, input index, child
    slot, expected)`` in breadth-first order from the targets, so a parent is bound before
    its children; ``expected`` is None for an edge to a node met before (it must be that
    very node) or what a node met for the first time must look like.
    """

    __slots__ = ("donated", "edges", "effects", "feeds", "leaves", "n", "targets", "viewed")

    def __init__(self, targets: list[Node], leaves: list[Node], effects: list[Node]) -> None:
        slot = {id(t): i for i, t in enumerate(targets)}
        nodes = list(targets)
        edges: list[tuple[int, int, int, tuple[Any, ...] | None]] = []
        i = 0
        while i < len(nodes):
            node = nodes[i]
            if node.buffer is None:
                for k, x in enumerate(node.inputs):
                    j = slot.get(id(x))
                    if j is not None:
                        edges.append((i, k, j, None))
                        continue
                    j = slot[id(x)] = len(nodes)
                    nodes.append(x)
                    edges.append((i, k, j, _expect(x)))
            i += 1
        self.n = len(nodes)
        self.edges = edges
        self.targets = [_expect(t) for t in targets]
        self.leaves = [slot[id(x)] for x in leaves]
        self.feeds: list[tuple[int, int]] = []  # (slot, value slot) of each leaf the plan reads
        self.donated = [slot[id(x)] for x in leaves if x.donated]  # spent after the run
        self.effects = [slot[id(x)] for x in effects]
        self.viewed: list[int] = []  # the leaves an output is a view of (set by the executor)

    def bind(self, targets: list[Node]) -> list[Node] | None:
        """This plan's nodes in the graph under ``targets`` (unrealised nodes), or None if
        it is another graph."""
        mark = next(_MARKS)
        if len(targets) != len(self.targets):
            return None
        for t, (_, op, attrs, nin) in zip(targets, self.targets):
            if t.mark == mark or t.op is not op or len(t.inputs) != nin or (
                    t.attrs is not attrs and t.attrs != attrs):
                return None  # (a target given twice is bound once, after its dedup)
            t.mark = mark
        nodes: list[Any] = [*targets, *([None] * (self.n - len(targets)))]
        for p, k, c, want in self.edges:
            x = nodes[p].inputs[k]
            if want is None:
                if nodes[c] is not x:
                    return None
                continue
            if x.mark == mark:  # shared here, where the plan's graph had two nodes
                return None
            if want[0]:  # a leaf
                if x.buffer is None and x.op.kind == "posted":
                    finish(x)  # issued earlier (Communicator.post): its value is needed now
                if (x.buffer is None or x.shape != want[1] or x.dtype is not want[2]
                        or (x.device is not want[3] and x.device != want[3])
                        or x.donated is not want[4]):
                    return None
            elif (x.buffer is not None or x.op is not want[1] or len(x.inputs) != want[3]
                  or (x.attrs is not want[2] and x.attrs != want[2])):
                return None
            x.mark = mark
            nodes[c] = x
        return nodes


def _expect(x: Node) -> tuple[Any, ...]:
    """What a node must look like to stand where ``x`` stands: a leaf's shape, dtype,
    device and donation; an unrealised node's op, attributes and number of inputs."""
    if x.buffer is not None:
        return (True, x.shape, x.dtype, x.device, x.donated)
    return (False, x.op, x.attrs, len(x.inputs))


class PlanCache:
    """Plans by their targets' summary, a few structures each, least recently used dropped
    first; counts hits (a cached plan bound the graph) and misses (one was made)."""

    VARIANTS = 8  # structures kept under one summary

    def __init__(self, *, capacity: int = 256) -> None:
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._plans: OrderedDict[Any, list[Plan]] = OrderedDict()

    def find(self, targets: list[Node], *, count: bool = True
             ) -> tuple[Plan, list[Node]] | None:
        """The cached plan that binds ``targets``' graph, and its nodes; None on a miss
        (counted unless ``count`` is False: a second look for the same realise)."""
        key = _summary(targets)
        found = self._plans.get(key)
        for i, plan in enumerate(found or ()):
            nodes = plan.binding.bind(targets)
            if nodes is not None:
                self.hits += 1
                if i:
                    found.insert(0, found.pop(i))  # type: ignore[union-attr]
                self._plans.move_to_end(key)
                return plan, nodes
        self.misses += count
        return None

    def put(self, targets: list[Node], plan: Plan) -> None:
        key = _summary(targets)
        variants = self._plans.setdefault(key, [])
        variants.insert(0, plan)
        del variants[self.VARIANTS:]
        self._plans.move_to_end(key)
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._plans.values())


def _summary(targets: list[Node]) -> tuple[Any, ...]:
    """The key of a graph's plans. The device is in it: the devices of a DeviceGroup run
    alike graphs in one process, and under one key their plans would crowd each other out
    of its ``VARIANTS`` (each planned again every step, and a compiled step never finding
    its plans twice)."""
    first, last = targets[0], targets[-1]
    return (len(targets), first.device, first.op, first.shape, last.op, last.shape)


class Executor:
    """Runs plans; holds the plan cache and the figures of the last run."""

    def __init__(self, *, cache_capacity: int = 256) -> None:
        self.cache = PlanCache(capacity=cache_capacity)
        self.peak_bytes = 0      # live-bytes peak of the last run
        self.allocations = 0     # buffers the last run allocated (pool reuses not counted)
        self.runs = 0

    def plan(self, nodes: list[Node]) -> tuple[Plan, list[Node]]:
        """The plan of the graph under ``nodes`` (cached, or made now) and its leaves, in
        the plan's placeholder order (for reading a plan; realize runs it)."""
        targets = [n for n in nodes if n.buffer is None]
        found = self.cache.find(targets)
        plan, bound = found if found is not None else (self._compile(targets), None)
        bound = bound or plan.binding.bind(targets)
        return plan, [bound[s] for s in plan.binding.leaves]

    def realize(self, nodes: Iterable[Node]) -> None:
        """Compute every unrealised node of ``nodes`` as one graph."""
        targets = [n for n in nodes if n.buffer is None]
        if not targets:
            return
        found = self.cache.find(targets)
        if found is None:  # before a plan is made: a node given twice, a posted node
            for n in targets:
                if n.op.kind == "posted":  # issued earlier (Communicator.post): finish it
                    finish(n)
            unique = list({id(n): n for n in targets if n.buffer is None}.values())
            if not unique:
                return
            if len(unique) != len(targets):
                targets = unique
                found = self.cache.find(targets, count=False)
        if found is None:
            plan = self._compile(targets)
            bound = plan.binding.bind(targets)
            if bound is None:
                raise RuntimeError("a plan does not bind the graph it was made from")
        else:
            plan, bound = found
        binding = plan.binding
        vals: list[Any] = [None] * plan.n_values
        for s, v in binding.feeds:
            vals[v] = bound[s].buffer
        rec = TRACE.recorder
        if rec is not None:  # a compiled step is being traced: report the plan and its nodes
            rec.ran(plan, [bound[s] for s, _ in binding.feeds],
                    targets + [bound[s] for s in binding.effects],
                    [bound[s] for s in binding.donated])
        self.execute(plan, vals)
        for s in binding.donated:
            consume(bound[s])
        for s in binding.viewed:  # the view shares the leaf's buffer: it escaped
            bound[s].escaped = True
        outs = [plan.copy_preset(o) for o in plan.outs] if plan.presets else None
        for k, node in enumerate(targets + [bound[s] for s in binding.effects]):
            node.buffer = vals[plan.outs[k]] if outs is None or outs[k] is None else outs[k]
            node.inputs = ()  # mark_realised, inlined

    def _compile(self, targets: list[Node]) -> Plan:
        """Lower, optimise and plan ``targets`` (and the effectful nodes under them)."""
        effects: list[Node] = []
        sigs, leaves, outs = lower(targets, effects)
        known = {id(t) for t in targets}
        extra = [e for e in effects if id(e) not in known]
        if extra:
            sigs, leaves, outs = lower(targets + extra)
        ir, new_outs, leaf_pos = optimise(sigs, outs)
        plan = make_plan(ir, new_outs, leaf_pos)
        plan.binding = binding = Binding(targets, leaves, extra)
        binding.feeds = [(s, v) for s, v in zip(binding.leaves, plan.leaf_slots) if v >= 0]
        leaf_of = {v: s for s, v in binding.feeds}
        binding.viewed = [leaf_of[st] for st in plan.out_storage if st in leaf_of]
        self.cache.put(targets, plan)
        return plan

    def run(self, plan: Plan, leaves: list[Node]) -> list[Any]:
        """Execute ``plan`` with the leaves' buffers; return the output arrays."""
        vals: list[Any] = [None] * plan.n_values
        for slot, node in zip(plan.leaf_slots, leaves):
            if slot >= 0:
                vals[slot] = node.buffer
        return self.run_values(plan, vals)

    def run_values(self, plan: Plan, vals: list[Any], mem: Memory | None = None
                   ) -> list[Any]:
        """Execute ``plan`` over ``vals`` (the leaves' buffers already in their value slots,
        as ``plan.binding.feeds`` places them); return the outputs: the targets, then the
        effectful nodes. No node is read or made (a compiled step's replay, which passes
        the ``mem`` it keeps for the plan)."""
        self.execute(plan, vals, mem)
        if not plan.presets:
            return [vals[o] for o in plan.outs]
        # a folded constant belongs to the plan: hand out a copy the caller may modify
        return [vals[o] if (c := plan.copy_preset(o)) is None else c for o in plan.outs]

    def execute(self, plan: Plan, vals: list[Any], mem: Memory | None = None) -> None:
        """Run ``plan``'s steps over ``vals`` (its leaves' buffers in their slots), with the
        buffers of ``mem`` (a pool kept across runs of this plan) or of this run alone."""
        for slot, arr, _ in plan.presets:
            vals[slot] = arr
        if mem is None:
            mem = Memory()
            mem.live = mem.peak = plan.owned_bytes
        else:
            mem.start(plan.owned_bytes)
        _steps(plan, vals, mem)
        self.peak_bytes = mem.peak
        self.allocations = mem.allocations
        self.runs += 1


def _steps(plan: Plan, vals: list[Any], mem: Memory) -> None:
    nbytes = plan.nbytes
    for s in plan.steps:
        s.run(vals, mem)
        for slot, pool in s.release:
            mem.release(vals[slot], pool, nbytes[slot])
            vals[slot] = None
        for slot in s.drop:
            vals[slot] = None


_DEFAULT: list[Executor] = []


def default_executor() -> Executor:
    """The process's executor (made on first use, so importing starts nothing)."""
    if not _DEFAULT:
        _DEFAULT.append(Executor())
    return _DEFAULT[0]


def realize(nodes: Iterable[Node]) -> None:
    """Realise ``nodes`` as one graph on the default executor."""
    default_executor().realize(nodes)


def recording(recorder: Any) -> Any:
    """Make ``recorder`` this thread's trace recorder (None: stop); return the previous one.

    While one is set, every realise reports ``recorder.ran(plan, feeds, outputs, donated)``
    (the leaf nodes it read in ``binding.feeds`` order, the nodes it realised: targets then
    effectful nodes, and the donated leaves it reads) before it runs, and every leaf made
    reports ``recorder.made(node)``: what ``fs.compile`` needs to replay the step."""
    previous = TRACE.recorder
    TRACE.recorder = recorder
    return previous
