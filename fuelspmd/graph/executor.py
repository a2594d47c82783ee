"""The executor and the plan cache.

:func:`realize` lowers the unrealised graph under its targets, looks the structure up in
the plan cache (optimising only on a miss), runs the plan's steps with the leaves' buffers,
then hands each target its buffer and drops its inputs. Live bytes are counted as the plan
runs: buffers the executor allocated and still holds (in use or pooled for a later step);
leaves, which belong to the caller, are not counted. ``peak_bytes`` of the last run is on
the :class:`Executor`.

The direct path: when the targets need nothing but collectives of realised values (a
step's gradient all_reduces after its backward was realised, ``x = comm.all_reduce(x)``),
there is nothing to optimise, and lowering plus the plan-cache key would cost more than
the collectives themselves (for 256 small all_reduces, more than the one bucketed call).
They are issued straight from the nodes, in the planner's order and under its bucket
rule (:func:`~fuelspmd.graph.plan.joins_bucket`, as
:func:`~fuelspmd.graph.plan.take_bucket` applies it); such a realise is not a plan run,
so it leaves ``runs``, ``peak_bytes`` and the cache counters as they were.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from fuelspmd.backend import get_backend

from .fused import run_generic
from .node import Node, consume, mark_realised
from .passes import lower, optimise
from .plan import Plan, Step, make_plan, take_bucket

__all__ = ["Executor", "PlanCache", "default_executor", "realize"]


class PlanCache:
    """Plans by graph structure, least recently used dropped first; counts hits and misses."""

    def __init__(self, *, capacity: int = 256) -> None:
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._plans: OrderedDict[Any, Plan] = OrderedDict()

    def get(self, key: Any) -> Plan | None:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
            self._plans.move_to_end(key)
        return plan

    def put(self, key: Any, plan: Plan) -> None:
        self._plans[key] = plan
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)


class _Key:
    """A plan-cache key whose hash is computed once.

    A key is the lowered graph, one signature per value; a tuple recomputes its hash on
    every lookup (the cache looks up, then moves the entry to the end), and a signature's
    op and device hash in Python. The hash here is over the cheap part of each signature
    (its input indices and shape): equal keys still have equal hashes, so the cache stays
    exact (equality compares the whole key), and keys that differ only in ops or attributes
    merely share a bucket.
    """

    __slots__ = ("h", "key")

    def __init__(self, sigs: list[Any], outs: tuple[int, ...]) -> None:
        self.key = (tuple(sigs), outs)
        self.h = hash((tuple([(s[1], s[3]) for s in sigs]), outs))

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Key) and self.h == other.h
                                 and self.key == other.key)


def _direct(targets: list[Node]) -> list[Node] | None:
    """The collectives to issue, in order, when ``targets`` need nothing else run.

    That is when every unrealised node under the targets is a collective whose data
    inputs are realised (the gradients' all_reduces after the backward was realised, a
    parameter's broadcast, ``x = comm.all_reduce(x)``): there is nothing to optimise or
    plan, so lowering, the plan-cache key and the step loop are skipped. A collective's
    other inputs are order tokens, each the previous unrealised collective of its
    communicator, so walking the token chain back from each target and emitting it oldest
    first is the order :func:`~fuelspmd.graph.passes.lower` would give (creation order per
    communicator, targets in the order given). Returns None as soon as any other node is
    met; the planner then handles the graph.
    """
    if _chain(targets):
        return targets
    order: list[Node] = []
    seen: set[Node] = set()  # nodes hash by identity
    add, append = seen.add, order.append
    for node in targets:
        start = len(order)
        cur: Node | None = node
        while cur is not None and cur not in seen:
            if cur.op.start is None:
                return None
            k = cur.attrs[1]
            prev = None
            for x in cur.inputs:
                if x.buffer is None:
                    if k > 0 or prev is not None:
                        return None
                    prev = x
                k -= 1
            add(cur)
            append(cur)
            cur = prev
        if len(order) > start + 1:  # walked back: oldest first (targets in creation order
            order[start:] = order[start:][::-1]  # walk one node each)
    return order


def _chain(targets: list[Node]) -> bool:
    """Whether ``targets`` are, in order, collectives with one realised data input each,
    every one's order token (if any) the target before it: one communicator's
    all_reduces of a step's gradients, the common case of :func:`_direct`, whose walk
    then gives ``targets`` as they are (one pass, about half the walk's Python)."""
    prev = None
    for node in targets:
        if node.op.start is None or node.attrs[1] != 1:
            return False
        ins = node.inputs
        if ins[0].buffer is None:
            return False
        if len(ins) == 2:
            token = ins[1]
            if token is not prev and token.buffer is None:
                return False
        elif len(ins) != 1:
            return False
        prev = node
    return True


def _inputs_realised(node: Node) -> bool:
    for x in node.inputs:
        if x.buffer is None:
            return False
    return True


def _run_direct(order: list[Node], backends: dict[str, Any]) -> None:
    """Issue the collectives of ``order`` as the planner would schedule them: each starts
    in turn (its inputs are ready), one operation in flight per communicator (a start
    first finishes the previous one there), the rest finished at the end in start order,
    so two communicators' collectives overlap. Runs that
    :func:`~fuelspmd.graph.plan.joins_bucket` admits are one ``bucket`` call whose results
    are views of one reduced buffer. A node is marked realised when its operation finishes.

    A lone collective may overwrite its input when that input is a leaf nothing else can
    see (:func:`_dead_leaf`); a bucket copies its inputs into the bucket anyway.
    """
    in_flight: dict[int, tuple[Any, list[Node]]] = {}  # id(communicator) -> (Pending, nodes)
    todo = order[::-1]  # popped as started
    while todo:
        node = todo.pop()
        op = node.op
        be = backends.get(node.device.kind)
        if be is None:
            be = backends[node.device.kind] = get_backend(node.device.kind)
        run = take_bucket(node, todo) if op.bucket is not None else [node]
        comm = id(node.attrs[0])
        prev = in_flight.pop(comm, None)
        if prev is not None:
            _finish(*prev)
        if len(run) > 1:
            k = node.attrs[1]
            data = ([m.inputs[0].buffer for m in run] if k == 1 else
                    [x.buffer for m in run for x in m.inputs[:k]])
            in_flight[comm] = (op.bucket(be, node.attrs, data), run)
            del data
            _consume_donated(run)
        else:
            ins = node.inputs
            donate = bool(op.inplace_ok) and bool(ins) and ins[0].donated
            args = [x.buffer for x in ins]
            pending = (op.start(be, node.attrs, *args, donate=True) if donate
                       else op.start(be, node.attrs, *args))
            del args
            for x in ins:
                if x.donated:
                    consume(x)
            del ins
            in_flight[comm] = (pending, run)
        del run
    for pending, run in in_flight.values():
        _finish(pending, run)


def _one_bucket(targets: list[Node]) -> tuple[list[Any], list[Any], int] | None:
    """``targets`` as one bucket, found in one pass: (input buffers, shapes, total
    elements) when they are a strict chain of one communicator's all_reduces of one dtype,
    as a step's gradients are: every node the first's kind by identity (op, attrs, dtype,
    device) with one realised data input, each after the first ordered after the one
    before it (its order token is that node: so no node comes twice), and together they
    fit its bucket; else None (:func:`_direct` and the loop of :func:`_run_direct` take
    them). The pass replaces the realise's check for repeated nodes, the chain walk, the
    loop's bucket walk and the bucket's walks over its members for shapes and sizes
    (measured, ``fuelspmd bench bucketing`` at 2 ranks, this and the tree before it
    alternately: 0.454-0.484 of the raw mpi4py time against 0.487-0.518)."""
    head = targets[0]
    op = head.op
    if op.bucket is None or op.bucket_bytes is None:
        return None
    attrs, dt, dev = head.attrs, head.dtype, head.device
    if attrs[1] != 1 or head.inputs[0].buffer is None:
        return None
    room = op.bucket_bytes(attrs) // dt.itemsize
    total = room
    prod = math.prod
    bufs, shapes = [], []
    add_buf, add_shape = bufs.append, shapes.append
    prev = None
    for x in targets:
        if x.op is not op or x.attrs is not attrs or x.dtype is not dt or x.device is not dev:
            return None
        ins = x.inputs
        if prev is not None and (len(ins) != 2 or ins[1] is not prev):
            return None
        buf = ins[0].buffer
        if buf is None:
            return None
        shp = x.shape
        room -= prod(shp)
        if room < 0:
            return None
        add_buf(buf)
        add_shape(shp)
        prev = x
    return bufs, shapes, total - room


def _run_bucket(targets: list[Node], backends: dict[str, Any]) -> bool:
    """Issue and finish ``targets`` as the one bucket :func:`_one_bucket` finds; False
    (nothing done) when it finds none."""
    one = _one_bucket(targets)
    if one is None:
        return False
    bufs, shapes, total = one
    del one
    head = targets[0]
    be = backends.get(head.device.kind)
    if be is None:
        be = backends[head.device.kind] = get_backend(head.device.kind)
    pending = head.op.bucket(be, head.attrs, bufs, shapes, total)
    del bufs  # the transport reads the bucket, not the inputs: let them go
    _consume_donated(targets)
    _finish(pending, targets)
    return True


def _consume_donated(run: list[Node]) -> None:
    """Invalidate the donated leaves the collectives of ``run`` read (see node.consume)."""
    for m in run:
        for x in m.inputs:
            if x.donated:
                consume(x)


def _finish(pending: Any, run: list[Node]) -> None:
    """Wait for a started collective (or bucket) and mark its nodes realised."""
    if len(run) == 1:
        mark_realised(run[0], pending.finish())
        return
    for m, arr in zip(run, pending.finish()):
        if m.key is None:  # mark_realised inlined: a collective is never hash-consed
            m.buffer = arr
            m.inputs = ()
        else:
            mark_realised(m, arr)


class _Memory:
    """Buffers of one run: a pool of released ones by (elements, dtype), and live bytes."""

    __slots__ = ("allocations", "live", "peak", "pool")

    def __init__(self) -> None:
        self.pool: dict[tuple[int, Any], list[Any]] = {}
        self.live = 0
        self.peak = 0
        self.allocations = 0

    def alloc(self, shape: tuple[int, ...], dt: Any, nbytes: int) -> Any:
        size = nbytes // dt.itemsize if dt.itemsize else 0
        free = self.pool.get((size, dt))
        if free:
            buf = free.pop()
            return buf if buf.shape == shape else buf.reshape(shape)
        self.own(nbytes)
        return np.empty(shape, dt)

    def own(self, nbytes: int) -> None:
        self.allocations += 1
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def release(self, arr: Any, pool: bool, nbytes: int) -> None:
        if pool and arr.flags.c_contiguous:
            self.pool.setdefault((arr.size, arr.dtype), []).append(arr)
        else:
            self.live -= nbytes


class Executor:
    """Runs plans; holds the plan cache and the figures of the last run."""

    def __init__(self, *, cache_capacity: int = 256) -> None:
        self.cache = PlanCache(capacity=cache_capacity)
        self.peak_bytes = 0      # live-bytes peak of the last run
        self.allocations = 0     # buffers the last run allocated (pool reuses not counted)
        self.runs = 0
        # device kind -> Backend, for the direct path (a Backend is a stateless view)
        self._backends: dict[str, Any] = {}

    def plan(self, targets: list[Node]) -> tuple[Plan, list[Node]]:
        """Return the plan of ``targets`` (from the cache when the structure was seen).

        Effectful nodes (collectives) under the targets become targets too, appended to
        ``targets`` in place: each runs once, so each must keep its result.
        """
        effects: list[Node] = []
        sigs, leaves, outs = lower(targets, effects)
        if effects:
            known = {id(t) for t in targets}
            extra = [e for e in effects if id(e) not in known]
            if extra:
                targets.extend(extra)
                sigs, leaves, outs = lower(targets)
        key = _Key(sigs, outs)
        plan = self.cache.get(key)
        if plan is None:
            ir, new_outs, leaf_pos = optimise(sigs, outs)
            plan = make_plan(ir, new_outs, leaf_pos)
            self.cache.put(key, plan)
        return plan, leaves

    def realize(self, nodes: Iterable[Node]) -> None:
        """Compute every unrealised node of ``nodes`` as one graph."""
        if type(nodes) is list and len(nodes) == 1:  # Tensor.realize: skip the dedup
            targets = [nodes[0]] if nodes[0].buffer is None else []
        else:
            targets = [n for n in nodes if n.buffer is None]
            if len(targets) > 1 and _run_bucket(targets, self._backends):
                return
            if len(set(map(id, targets))) != len(targets):  # a node given twice runs once
                targets = list({id(n): n for n in targets}.values())
        if not targets:
            return
        t = targets[0]
        if len(targets) == 1 and t.op.start is not None and _inputs_realised(t):
            order: list[Node] | None = targets  # one collective over realised values
        else:
            order = _direct(targets)
        if order is not None:
            _run_direct(order, self._backends)
            return
        plan, leaves = self.plan(targets)
        arrays = self.run(plan, leaves)
        for node in leaves:
            if node.donated:
                consume(node)
        for node, arr in zip(targets, arrays):
            mark_realised(node, arr)

    @staticmethod
    def _fused(s: Step, vals: list[Any], mem: _Memory) -> Any:
        """Run a numpy fused step: donors lend buffers, the rest come from the pool."""
        prog, runner = s.prog, s.runner
        regs = s.regs.copy()
        for k, slot in enumerate(s.ins):
            regs[k] = vals[slot]
        base = runner.base
        for t, k in prog.donor_of.items():
            regs[base + t] = vals[s.ins[k]]
        dts = s.np_dtypes
        for t in runner.full_new:
            regs[base + t] = mem.alloc(s.instr.shape, dts[t], s.instr.size * dts[t].itemsize)
        part = runner.scratch_shape
        size = math.prod(part)
        for t in runner.scratch:
            regs[base + t] = mem.alloc(part, dts[t], size * dts[t].itemsize)
        out = runner.run(regs)
        for v, t in prog.exports:
            vals[v] = regs[base + t]
        for t, pool in zip(runner.scratch, s.scratch_pool):
            arr = regs[base + t]
            mem.release(arr, pool, arr.nbytes)
        regs.clear()  # donors' buffers must go now, not when regs is next rebound
        return out

    def run(self, plan: Plan, leaves: list[Node]) -> list[Any]:
        """Execute ``plan`` with the leaves' buffers; return the output arrays."""
        vals: list[Any] = [None] * plan.n_values
        for slot, node in zip(plan.leaf_slots, leaves):
            if slot >= 0:
                vals[slot] = node.buffer
        for slot, arr, _ in plan.presets:
            vals[slot] = arr
        mem = _Memory()
        nbytes = plan.nbytes
        for s in plan.steps:
            kind = s.kind
            if kind == "kernel":
                ins = s.instr
                out = ins.op.kernel(s.backend, ins.attrs, *[vals[i] for i in s.ins])
                if s.backend.kind == "cpu" and type(out) is not np.ndarray:
                    out = np.asarray(out)  # numpy reduces to scalars; keep 0-d arrays
                vals[s.out] = out
                if s.owns:
                    mem.own(nbytes[s.out])
            elif kind == "collective":
                ins = s.instr
                args = [vals[i] for i in s.ins]
                # only an op that declares inplace_ok is ever told it may overwrite input 0
                vals[s.out] = (ins.op.kernel(s.backend, ins.attrs, *args, donate=True)
                               if s.donate else ins.op.kernel(s.backend, ins.attrs, *args))
            elif kind == "start":  # the pending operation waits in the output's slot
                ins = s.instr
                args = [vals[i] for i in s.ins]
                vals[s.out] = (ins.op.start(s.backend, ins.attrs, *args, donate=True)
                               if s.donate else ins.op.start(s.backend, ins.attrs, *args))
            elif kind == "wait":
                vals[s.out] = vals[s.out].finish()
            elif kind == "bucket_start":
                ins = s.instr
                vals[s.out] = ins.op.bucket(s.backend, ins.attrs, [vals[i] for i in s.ins])
            elif kind == "bucket_wait":
                for v, arr in zip(s.members, vals[s.out].finish()):
                    vals[v] = arr
            elif kind == "bucket":  # several collectives in one call; results in order
                ins = s.instr
                outs = ins.op.bucket(s.backend, ins.attrs, [vals[i] for i in s.ins]).finish()
                for v, arr in zip(s.members, outs):
                    vals[v] = arr
            elif kind == "matmul_out":
                buf = mem.alloc(s.instr.shape, s.np_dtypes[0], nbytes[s.out])
                vals[s.out] = np.matmul(vals[s.ins[0]], vals[s.ins[1]], out=buf)
            elif kind == "fused":
                vals[s.out] = self._fused(s, vals, mem)
            elif kind == "fused_generic":
                regs = s.regs.copy()
                for k, slot in enumerate(s.ins):
                    regs[k] = vals[slot]
                outs = run_generic(s.prog, s.backend, regs)
                for v, arr in zip([s.out, *s.exports], outs):
                    vals[v] = arr
                    mem.own(nbytes[v])
            else:  # fused_cupy: one kernel writes the root and every export
                args = [vals[i] for i in s.ins]
                res = [s.backend.lib.empty(s.instr.shape, dtype=s.backend.dtype(ir_dt))
                       for ir_dt in s.out_dtypes]
                s.cuda_kernel(*args, *res)
                for v, arr in zip([s.out, *s.exports], res):
                    vals[v] = arr
                    mem.own(nbytes[v])
            for slot, pool in s.release:
                mem.release(vals[slot], pool, nbytes[slot])
                vals[slot] = None
            for slot in s.drop:
                vals[slot] = None
        self.peak_bytes = mem.peak
        self.allocations = mem.allocations
        self.runs += 1
        # a folded constant belongs to the plan: hand out a copy the caller may modify
        outs = []
        for o in plan.outs:
            copy = plan.copy_preset(o) if plan.presets else None
            outs.append(vals[o] if copy is None else copy)
        return outs


_DEFAULT: list[Executor] = []


def default_executor() -> Executor:
    """The process's executor (made on first use, so importing starts nothing)."""
    if not _DEFAULT:
        _DEFAULT.append(Executor())
    return _DEFAULT[0]


def realize(nodes: Iterable[Node]) -> None:
    """Realise ``nodes`` as one graph on the default executor."""
    default_executor().realize(nodes)
