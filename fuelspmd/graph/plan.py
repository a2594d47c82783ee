"""From optimised IR to a Plan: fusion groups, a linear schedule of typed steps, memory plan.

A :class:`Plan` is a function of the graph's structure only; the executor binds leaf
buffers to its placeholder slots and runs ``steps`` in order, each ``step.run(vals, mem)``.
The steps are small typed objects: :class:`Kernel` (an op's Array API kernel),
:class:`Matmul` (numpy with an ``out=`` buffer), :class:`Fused` (a fused elementwise group;
:mod:`.fused` runs it on numpy, cupy or any Array API library), and :class:`Start` /
:class:`Wait` for an effectful op or a bucket of them: the start issues it when its input
is ready and the wait finishes it where its result is first needed, so independent steps
run while it is in flight.

Effectful ops (collectives) follow :class:`~fuelspmd.graph.op.Op`'s contract: each belongs
to a stream (``attrs.comm``); the streams' operations start in creation order, and of a
``serial`` op (a collective) one per stream is in flight at a time. Moving a collective
later never reorders a stream, so the transport order stays the creation order.

The one bucket rule (:func:`joins_bucket`): consecutive collectives of one bucketable op
with equal attributes (one stream, one reduce op), dtype and device, with no other
effectful op between them and no step between them reading a member's result, up to the
op's ``bucket_bytes``, are one transport call (a step's gradient all_reduces).

Memory plan, decided here once per plan:

- a value's *storage* is its own buffer, or for a view the storage it aliases; a storage
  is released after the last step that reads any of its aliases, never if an output or a
  leaf aliases it;
- the executor may write a buffer only when it owns it: a value it allocated, or a leaf the
  caller donated (``Tensor.donate``); an effectful op's result may be shared (an in-process
  group hands one array to every device), so it is never reused;
- released buffers go to a pool keyed by (elements, dtype) only when a later step will
  allocate that key (simulated here), else they are dropped at once;
- a fused step may write into an owned input that dies at that step, or into a reshape
  of one (all of its buffer, in order): a *donor*, whose buffer the root or an export
  may keep; an in-place collective or an op with an in-place kernel (``put``) may take
  over such an input's buffer;
- a fused step may also write members that later steps read (*exports*), so a chain of
  values saved for the backward is still one pass over memory.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuelspmd.backend import get_backend
from fuelspmd.dtypes import DType, to_numpy

from .fused import NumpyFused, Program, build_program, cupy_kernel, encode, run_generic, scalar_for
from .passes import Instr

__all__ = ["WHOLE_VIEWS", "Fused", "Kernel", "Matmul", "Memory", "Plan", "Start", "Step", "Wait",
           "donating", "joins_bucket", "make_plan"]

PoolKey = tuple[int, DType]
WHOLE_VIEWS = frozenset({"reshape", "detach"})  # a view that is all of its input, in order


class Memory:
    """Buffers of one run: a pool of released ones by (elements, dtype), and live bytes.

    With ``caps`` (a plan's :attr:`Plan.allocs`), the buffers of every run of one plan:
    each released contiguous buffer of a key the plan allocates is kept, up to the plan's
    allocations of that key per run, so a later run takes it instead of a fresh one (a
    compiled step's replays fault no page in again). A released buffer is dead for the
    plan (no output, no live value aliases it), so handing it out again is safe; outputs
    are never released. Kept this way, the pool holds at most one buffer per allocation
    the plan makes that was live at once, not one per run.
    """

    __slots__ = ("allocations", "caps", "kept", "live", "peak", "pool")

    def __init__(self, caps: dict[tuple[int, Any], int] | None = None) -> None:
        self.pool: dict[tuple[int, Any], list[Any]] = {}
        self.caps = caps
        self.kept = 0  # bytes in the pool
        self.live = 0
        self.peak = 0
        self.allocations = 0

    def start(self, given: int) -> None:
        """Count a new run: what the pool holds and the ``given`` bytes (of leaves the
        executor owns) are live, nothing is allocated yet."""
        self.live = self.peak = self.kept + given
        self.allocations = 0

    def alloc(self, shape: tuple[int, ...], dt: Any, nbytes: int) -> Any:
        size = nbytes // dt.itemsize if dt.itemsize else 0
        free = self.pool.get((size, dt))
        if free:
            buf = free.pop()
            self.kept -= buf.nbytes
            return buf if buf.shape == shape else buf.reshape(shape)
        self.own(nbytes)
        return np.empty(shape, dt)

    def own(self, nbytes: int) -> None:
        self.allocations += 1
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def release(self, arr: Any, pool: bool, nbytes: int) -> None:
        """Take back a dead buffer; ``pool``: a later step of this run allocates its key
        (the pool holds numpy arrays only: ``alloc`` hands them to numpy steps)."""
        caps = self.caps
        if (pool or caps is not None) and type(arr) is np.ndarray and arr.flags.c_contiguous:
            key = (arr.size, arr.dtype)
            free = self.pool.setdefault(key, [])
            if pool if caps is None else len(free) < caps.get(key, 0):
                free.append(arr)
                self.kept += arr.nbytes
                return
        self.live -= nbytes


class Step:
    """One step of the schedule: ``run`` computes value ``out`` from the values ``ins``.

    After it, ``release`` lists (slot, pool?) for storages whose life ends and ``drop``
    the slots whose references just go (the executor does both).
    """

    __slots__ = ("backend", "drop", "exports", "ins", "instr", "nbytes", "out", "release")
    kind = "step"  # what it is, for people and tests reading a plan (never dispatched on)
    prog: Program | None = None  # a fused step's program

    def __init__(self, out: int, ins: tuple[int, ...], instr: Instr, backend: Any) -> None:
        self.out, self.ins, self.instr, self.backend = out, ins, instr, backend
        self.nbytes = instr.size * instr.dtype.itemsize
        self.exports: list[int] = []  # values besides ``out`` that the step writes
        self.release: list[tuple[int, bool]] = []
        self.drop: list[int] = []

    def run(self, vals: list[Any], mem: Memory) -> None:
        raise NotImplementedError

    def allocs(self) -> list[PoolKey]:
        """The (elements, dtype) of each buffer this step takes from the pool, in order."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.instr.op.name} -> {self.out} <- {self.ins})"


class Kernel(Step):
    """An op's own Array API kernel; ``owns``: its output is a new buffer (not a view);
    ``donate``: the kernel writes its input 0, which dies here, and returns it (``put``)."""

    __slots__ = ("donate", "owns")
    kind = "kernel"

    def __init__(self, out: int, ins: tuple[int, ...], instr: Instr, backend: Any,
                 owns: bool) -> None:
        super().__init__(out, ins, instr, backend)
        self.owns = owns
        self.donate = False

    def run(self, vals: list[Any], mem: Memory) -> None:
        ins = self.instr
        if self.donate:  # the output is the input's buffer: nothing allocated
            vals[self.out] = ins.op.kernel(self.backend, ins.attrs,
                                           *[vals[i] for i in self.ins], donate=True)
            return
        out = ins.op.kernel(self.backend, ins.attrs, *[vals[i] for i in self.ins])
        if self.backend.kind == "cpu" and type(out) is not np.ndarray:
            out = np.asarray(out)  # numpy reduces to scalars; keep 0-d arrays
        vals[self.out] = out
        if self.owns:
            mem.own(self.nbytes)


def _merges_rows(a: np.ndarray) -> bool:
    """Whether ``a``'s axes but the last merge into one as a view (no copy)."""
    st, sh = a.strides, a.shape
    return all(sh[i + 1] == 1 or st[i] == st[i + 1] * sh[i + 1] for i in range(a.ndim - 2))


class Matmul(Step):
    """numpy's matmul into a buffer from the pool. A stacked ``a`` times a matrix whose
    rows merge as a view is one 2-d product (numpy's stacked matmul makes one BLAS call
    per matrix of the stack, packing ``b`` each time). numpy has no float16 BLAS: its
    float16 product is a loop some hundred times slower than float32's, so float16
    operands are multiplied in float32 and the result rounded once, as torch's CPU
    kernels accumulate half precision in float32."""

    __slots__ = ("np_dtype", "wide")
    kind = "matmul_out"

    def __init__(self, out: int, ins: tuple[int, ...], instr: Instr, backend: Any) -> None:
        super().__init__(out, ins, instr, backend)
        self.np_dtype = to_numpy(instr.dtype)
        self.wide = np.float32 if self.np_dtype == np.float16 else None

    def run(self, vals: list[Any], mem: Memory) -> None:
        a, b = vals[self.ins[0]], vals[self.ins[1]]
        buf = mem.alloc(self.instr.shape, self.np_dtype, self.nbytes)
        if self.wide is not None:
            np.copyto(buf, np.matmul(a.astype(self.wide), b.astype(self.wide)),
                      casting="same_kind")
            vals[self.out] = buf
            return
        if a.ndim > 2 and b.ndim == 2 and a.size and _merges_rows(a):
            np.matmul(a.reshape(-1, a.shape[-1]), b, out=buf.reshape(-1, buf.shape[-1]))
            vals[self.out] = buf
        else:
            vals[self.out] = np.matmul(a, b, out=buf)

    def allocs(self) -> list[PoolKey]:
        return [(self.instr.size, self.instr.dtype)]


class Fused(Step):
    """A fused elementwise group (its ``members``, root last; ``exports``: members later
    steps read too, in member order), compiled by :meth:`compile` once its donors are
    known. Equal groups of one plan share their program and runner; each step keeps its
    own scalars (``regs``)."""

    __slots__ = ("cuda_kernel", "export_bytes", "members", "prog", "regs", "runner",
                 "scratch_pool")

    def __init__(self, out: int, ins: tuple[int, ...], instr: Instr, backend: Any,
                 members: list[int], exports: list[int]) -> None:
        super().__init__(out, ins, instr, backend)
        self.members, self.exports = members, exports
        self.prog: Program | None = None
        self.runner: NumpyFused | None = None
        self.regs: list[Any] = []
        self.scratch_pool: list[bool] = []
        self.cuda_kernel: Any = None
        self.export_bytes: list[int] = []

    @property  # type: ignore[override]
    def kind(self) -> str:
        return {"cpu": "fused", "cuda": "fused_cupy"}.get(self.backend.kind, "fused_generic")

    def compile(self, ir: list[Instr], donors: set[int], compiled: dict[Any, Any]) -> None:
        """Take the program (donors only matter on numpy) and its runner from ``compiled``
        (the plan's, by group), or build them there."""
        exports = set(self.exports)
        self.exports = [m for m in self.members if m in exports]  # the program's order
        group, consts = encode(ir, self.members, list(self.ins), donors, exports)
        kind = self.backend.kind
        # a cupy kernel inlines its scalars (their Fill attributes tell -0.0 from 0.0)
        key = (kind, group, tuple(ir[u].attrs for u in consts) if kind == "cuda" else None)
        values = [ir[u].attrs[0] for u in consts]
        found = compiled.get(key)
        if found is None:
            p = build_program(group)
            found = compiled[key] = (p, NumpyFused(p) if kind == "cpu" else None,
                                     cupy_kernel(p, values) if kind == "cuda" else None)
        self.prog, self.runner, self.cuda_kernel = found
        prog = found[0]
        self.regs = [None] * prog.n_ext + [scalar_for(v, dt, self.backend)
                                           for v, dt in zip(values, prog.scalars)]
        self.regs += [None] * len(prog.temps)
        if kind != "cpu":
            self.export_bytes = [self.instr.size * prog.temps[t].itemsize for t in prog.exports]

    def run(self, vals: list[Any], mem: Memory) -> None:
        if self.runner is not None:
            vals[self.out] = self._numpy(vals, mem)
            return
        args = [vals[i] for i in self.ins]
        prog = self.prog
        assert prog is not None
        if self.cuda_kernel is not None:  # one kernel writes the root and every export
            be = self.backend
            outs = [be.lib.empty(self.instr.shape, dtype=be.dtype(prog.temps[t]))
                    for t in prog.outs]
            self.cuda_kernel(*args, *outs)
        else:  # any other Array API library: the members' own kernels, one by one
            regs = self.regs.copy()
            regs[:len(args)] = args
            outs = run_generic(prog, self.backend, regs)
        for v, arr, nbytes in zip([self.out, *self.exports], outs,
                                  [self.nbytes, *self.export_bytes]):
            vals[v] = arr
            mem.own(nbytes)

    def _numpy(self, vals: list[Any], mem: Memory) -> Any:
        """Run on numpy: donors lend their buffers, the rest come from the pool."""
        prog, runner = self.prog, self.runner
        assert prog is not None and runner is not None
        regs = self.regs.copy()
        for k, slot in enumerate(self.ins):
            regs[k] = vals[slot]
        base = runner.base
        for t, k in prog.donor_of.items():
            regs[base + t] = vals[self.ins[k]]
        dts = runner.np_dtypes
        for t in runner.full_new:
            regs[base + t] = mem.alloc(self.instr.shape, dts[t],
                                       self.instr.size * dts[t].itemsize)
        part = runner.scratch_shape
        size = math.prod(part)
        for t in runner.scratch:
            regs[base + t] = mem.alloc(part, dts[t], size * dts[t].itemsize)
        out = runner.run(regs)
        for v, t in zip(self.exports, prog.exports):
            vals[v] = regs[base + t]
        for t, pool in zip(runner.scratch, self.scratch_pool):
            arr = regs[base + t]
            mem.release(arr, pool, arr.nbytes)
        regs.clear()  # donors' buffers must go now, not when regs is next rebound
        return out

    def allocs(self) -> list[PoolKey]:
        if self.runner is None or self.prog is None:
            return []
        full = [(self.instr.size, self.prog.temps[t]) for t in self.runner.full_new]
        part = math.prod(self.runner.scratch_shape)
        return full + [(part, self.prog.temps[t]) for t in self.runner.scratch]


class Start(Step):
    """Issue an effectful op, or a bucket of them (``members``: their value slots, in
    order), once its data inputs are ready; the pending operation waits in ``out``'s slot
    for its :class:`Wait`. ``donate``: the op may overwrite its input 0, which dies here."""

    __slots__ = ("donate", "members", "pair", "shapes", "total")

    def __init__(self, out: int, ins: tuple[int, ...], instr: Instr, backend: Any,
                 members: list[int], shapes: list[tuple[int, ...]] | None = None) -> None:
        super().__init__(out, ins, instr, backend)
        self.members = members
        self.shapes = shapes or []  # a bucket's members' shapes, and their elements in all
        self.total = sum(math.prod(shp) for shp in self.shapes)
        self.donate = False
        self.pair = -1  # the index of its Wait in the schedule

    @property  # type: ignore[override]
    def kind(self) -> str:
        return "bucket_start" if len(self.members) > 1 else "start"

    def run(self, vals: list[Any], mem: Memory) -> None:
        ins = self.instr
        args = [vals[i] for i in self.ins]
        if len(self.members) > 1:
            vals[self.out] = ins.op.bucket(self.backend, ins.attrs, args, self.shapes,
                                           self.total)
        elif self.donate:
            vals[self.out] = ins.op.start(self.backend, ins.attrs, *args, donate=True)
        else:
            vals[self.out] = ins.op.start(self.backend, ins.attrs, *args)


class Wait(Step):
    """Finish the operation its :class:`Start` issued; its result (or each member's) goes
    to its slot. Lists the start's inputs, so they live until the transport is done."""

    __slots__ = ("members", "start")

    def __init__(self, start: Start) -> None:
        super().__init__(start.out, start.ins, start.instr, start.backend)
        self.members, self.start = start.members, start

    @property  # type: ignore[override]
    def kind(self) -> str:
        return "bucket_wait" if len(self.members) > 1 else "wait"

    def run(self, vals: list[Any], mem: Memory) -> None:
        result = vals[self.out].finish()
        if len(self.members) == 1:
            vals[self.out] = result
        else:
            for v, arr in zip(self.members, result):
                vals[v] = arr


@dataclass(eq=False)
class Plan:
    """A schedule for one graph structure (see the module docstring)."""

    n_values: int
    leaf_slots: tuple[int, ...]  # value slot of each leaf placeholder, -1 if unused
    presets: list[tuple[int, Any, Any]]  # folded constants: (slot, array, backend)
    steps: list[Step]
    outs: tuple[int, ...]
    nbytes: list[int]  # bytes of each value
    n_fused_ops: int
    ir: list[Instr]  # what it was made from (:func:`donating` plans it again)
    allocs: dict[tuple[int, Any], int]  # buffers a run takes from the pool, by (size, dtype)
    owned_leaves: tuple[int, ...]  # leaves whose buffers are the executor's (donating)
    owned_bytes: int  # their bytes
    out_storage: tuple[int, ...]  # per output, the value slot of the buffer it is (a view) of
    out_owned: tuple[bool, ...]  # per output, whether that buffer is one the plan allocated
    binding: Any = None  # how it finds its nodes in a graph (executor.Binding)

    def copy_preset(self, slot: int) -> Any | None:
        """A copy of the folded constant in ``slot`` (None if ``slot`` holds none)."""
        for v, arr, be in self.presets:
            if v == slot:
                return be.xp.asarray(arr, copy=True)
        return None


def _users(ir: list[Instr]) -> list[list[int]]:
    users: list[list[int]] = [[] for _ in ir]
    for i, ins in enumerate(ir):
        for u in set(ins.ins):
            users[u].append(i)
    return users


def _groups(ir: list[Instr], users: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Assign fusable values to groups, sweeping once from the outputs backwards.

    A group runs as one step at its root's place. A value joins a group that one of its
    users is in when it has the root's shape and device and every user outside that group
    comes after the root: then no step the group waits for can need the value, and the
    value is simply one more output of the step (an "export"). A value whose users are all
    inside is computed in registers and never gets a buffer.
    """
    group_of = [-1] * len(ir)
    members: list[list[int]] = []
    roots: list[int] = []
    for v in range(len(ir) - 1, -1, -1):
        ins = ir[v]
        if not ins.op.fusable:
            continue
        chosen = -1
        for g in sorted({group_of[u] for u in users[v] if group_of[u] >= 0},
                        key=roots.__getitem__):
            root = ir[roots[g]]
            if (root.shape == ins.shape and root.device == ins.device
                    and all(group_of[u] == g or u > roots[g] for u in users[v])):
                chosen = g
                break
        if chosen >= 0:
            group_of[v] = chosen
            members[chosen].append(v)
        else:
            group_of[v] = len(members)
            members.append([v])
            roots.append(v)
    return group_of, [list(reversed(m)) for m in members]


def _is_fill(ins: Instr) -> bool:
    return ins.op.kind == "const" and ins.value is None


def make_plan(ir: list[Instr], outs: tuple[int, ...], leaf_slots: tuple[int, ...],
              owned_leaves: tuple[int, ...] = ()) -> Plan:
    """Schedule ``ir``: one step per value that needs a buffer, in topological order;
    ``owned_leaves``: the value slots of leaves whose buffers are the executor's outright
    (see :func:`donating`)."""
    users = _users(ir)
    group_of, groups = _groups(ir, users)
    out_set = set(outs)
    n = len(ir)
    # a fill read only by fused members is a scalar inside them: it needs no step
    needed = [False] * n
    for o in outs:
        needed[o] = True
    for v in range(n - 1, -1, -1):
        g = group_of[v]
        if g >= 0 and groups[g][-1] != v:
            continue
        if needed[v] or g >= 0 or ir[v].op.effectful:
            needed[v] = True
            for m in groups[g] if g >= 0 else [v]:
                for u in ir[m].ins:
                    if g < 0 or (group_of[u] != g and not _is_fill(ir[u])):
                        needed[u] = True
    steps: list[Step] = []
    presets: list[tuple[int, Any, Any]] = []
    for v, ins in enumerate(ir):
        g = group_of[v]
        if not needed[v] or ins.op.kind == "leaf" or (g >= 0 and groups[g][-1] != v):
            continue
        if ins.value is not None:
            presets.append((v, ins.value, get_backend(ins.device.kind)))
            continue
        be = get_backend(ins.device.kind)
        if g >= 0:
            ext = list(dict.fromkeys(u for m in groups[g] for u in ir[m].ins
                                     if group_of[u] != g and not _is_fill(ir[u])))
            exports = sorted(m for m in groups[g][:-1] if m in out_set
                             or any(group_of[u] != g for u in users[m]))
            steps.append(Fused(v, tuple(ext), ins, be, groups[g], exports))
        elif ins.op.start is not None:
            steps.append(Start(v, ins.ins, ins, be, [v]))
        elif ins.op.name == "matmul" and be.kind == "cpu":
            steps.append(Matmul(v, ins.ins, ins, be))
        else:
            steps.append(Kernel(v, ins.ins, ins, be,
                                owns=ins.op.kind != "view" and not ins.op.effectful))
    steps = _schedule(_buckets(steps))
    storage, owned = _plan_memory(ir, steps, outs, owned_leaves)
    n_fused = sum(len(s.prog.code) for s in steps if isinstance(s, Fused) and s.prog)
    allocs = Counter((size, to_numpy(dt)) for s in steps for size, dt in s.allocs())
    return Plan(n, leaf_slots, presets, steps, outs, [i.size * i.dtype.itemsize for i in ir],
                n_fused, ir, dict(allocs), owned_leaves,
                sum(ir[v].size * ir[v].dtype.itemsize for v in owned_leaves),
                tuple(storage[o] for o in outs), tuple(owned[storage[o]] for o in outs))


def donating(plan: Plan, slots: list[int]) -> Plan:
    """``plan``'s graph planned again with the leaves in value ``slots`` owned by the
    executor, as the buffers it allocates (a compiled replay's values that die in the
    plan): it may write them, and one that dies untaken goes back to the pool. The value
    slots are the same, so the leaves are fed as they are to ``plan``."""
    bad = [v for v in slots if plan.ir[v].op.kind != "leaf"]
    if bad:
        raise RuntimeError(f"donating: values {bad} are not leaves")
    return make_plan(plan.ir, plan.outs, plan.leaf_slots, tuple(sorted(slots)))


def joins_bucket(head: Any, x: Any, nbytes: int) -> int:
    """The bytes of the bucket opened by ``head`` (holding ``nbytes``) once effectful ``x``
    joins it, or -1 when it may not: the same bucketable op with equal attributes (one
    stream, one reduce op), dtype and device, and the bucket within the op's size."""
    op = x.op
    if (op.bucket is None or op.bucket_bytes is None or head.op is not op
            or head.dtype is not x.dtype or head.device != x.device
            or (head.attrs is not x.attrs and head.attrs != x.attrs)):
        return -1
    total = nbytes + math.prod(x.shape) * x.dtype.itemsize
    return total if total <= op.bucket_bytes(x.attrs) else -1


def _data(s: Step) -> tuple[int, ...]:
    """A start's data inputs (its others are order tokens); any other step's inputs."""
    if isinstance(s, Start) and len(s.members) == 1:
        return s.ins[:s.instr.attrs.nin]
    return s.ins


def _buckets(steps: list[Step]) -> list[Step]:
    """Fuse runs of bucketable collectives into one :class:`Start` (see the module).

    The run becomes one step at its last member's place: every member's input is ready
    there, and no one needed a result earlier (a step between that reads one closes it).
    """
    out: list[Step] = []
    run: list[Start] = []
    members: set[int] = set()
    nbytes = 0

    def close() -> None:
        nonlocal run, nbytes
        if len(run) > 1:
            last = run[-1]
            ins = tuple(u for s in run for u in _data(s))
            out.append(Start(last.out, ins, last.instr, last.backend, [s.out for s in run],
                             [s.instr.shape for s in run]))
        else:
            out.extend(run)
        run, nbytes = [], 0
        members.clear()

    for s in steps:
        if isinstance(s, Start):
            fit = joins_bucket(run[0].instr, s.instr, nbytes) if run else -1
            if fit < 0 or any(u in members for u in _data(s)):
                close()
                fit = s.nbytes if s.instr.op.bucket is not None else -1
            if fit < 0:  # not bucketable: alone
                out.append(s)
                continue
            run.append(s)
            members.add(s.out)
            nbytes = fit
            continue
        if any(u in members for u in s.ins):
            close()
        out.append(s)  # with a run open, it runs before the bucket: it reads no member
    close()
    return out


def _schedule(steps: list[Step]) -> list[Step]:
    """Split every :class:`Start` into a start and a :class:`Wait`, and place them.

    A start goes right after the step that makes its last data input, but never before an
    earlier start: starts keep their order, so each stream's transport order is the
    creation order. A wait goes right before the first step that reads its result, or at
    the end; for a ``serial`` op (a collective), also before the next start on its stream
    (one in flight per stream). The positions are the steps' indices with fractions, so
    one sort places them all.
    """
    if not any(isinstance(s, Start) for s in steps):
        return steps
    readers: dict[int, list[int]] = {}
    for j, s in enumerate(steps):
        for u in _data(s):
            readers.setdefault(u, []).append(j)
    made_at: dict[int, float] = {}
    keyed: list[tuple[tuple[float, int], Step]] = []  # (position, tie-break), step
    serial: dict[int, int] = {}  # stream -> index in keyed of its last serial wait
    last_start = (-1.0, 0)
    for i, s in enumerate(steps):
        if not isinstance(s, Start):
            made_at[s.out] = i
            for e in s.exports:
                made_at[e] = i
            keyed.append(((float(i), 0), s))
            continue
        ready = max([-1.0, *(made_at.get(u, -1.0) + 0.1 for u in _data(s))])
        at = max((last_start[0], last_start[1] + 2), (ready, 2 * len(keyed) + 2))
        last_start = at
        first = min((j for u in s.members for j in readers.get(u, []) if j > i),
                    default=len(steps))
        wait = Wait(s)
        stream = id(s.instr.attrs.comm)
        prev = serial.get(stream) if s.instr.op.serial else None
        if prev is not None:  # the stream's last collective is finished before this starts
            keyed[prev] = (min(keyed[prev][0], (at[0], at[1] - 1)), keyed[prev][1])
        keyed.append((at, s))
        keyed.append(((first - 0.25, 1), wait))
        if s.instr.op.serial:
            serial[stream] = len(keyed) - 1
        for u in s.members:
            made_at[u] = first - 0.25
    keyed.sort(key=lambda k: k[0])
    order = [k[1] for k in keyed]
    for j, s in enumerate(order):
        if isinstance(s, Wait):
            s.start.pair = j
    return order


def _plan_memory(ir: list[Instr], steps: list[Step], outs: tuple[int, ...],
                 owned_leaves: tuple[int, ...]) -> tuple[list[int], list[bool]]:
    """Decide donors, releases, drops and pooling (see the module docstring); return each
    value's storage and whether each storage is a buffer the plan allocates."""
    n = len(ir)
    storage = list(range(n))
    owned = [False] * n  # buffers the executor allocated (or was given outright)
    for v in owned_leaves:
        owned[v] = True
    whole = [True] * n  # the value is all of its storage, in its order
    for s in steps:
        if s.instr.op.kind == "view":
            storage[s.out] = storage[s.ins[0]]
            whole[s.out] = whole[s.ins[0]] and s.instr.op.name in WHOLE_VIEWS
        elif not s.instr.op.effectful:  # a collective's result may be shared: never reused
            owned[s.out] = True
        for e in s.exports:
            owned[e] = True
    writable = [owned[v] or (ir[v].op.kind == "leaf" and ir[v].attrs == (True,))
                for v in range(n)]  # and the leaves the caller donated
    pinned = [False] * n
    for o in outs:
        pinned[storage[o]] = True
    last = [-1] * n
    for i, s in enumerate(steps):
        for u in s.ins:
            last[u] = i
    store_last = [-1] * n
    for v in range(n):
        store_last[storage[v]] = max(store_last[storage[v]], last[v])

    def may_write(u: int, at: int, s: Step) -> bool:
        """Whether step ``s`` (at ``at``) may write ``u``'s buffer: the executor owns it,
        no output aliases it, every alias of it is dead after ``at``, ``s`` reads it once
        and ``u`` is the whole of it (a write into ``u`` is a write into its storage)."""
        r = storage[u]
        return (writable[r] and not pinned[r] and store_last[r] == at and whole[u]
                and sum(storage[x] == r for x in s.ins) == 1)

    compiled: dict[Any, Any] = {}  # equal fused groups share a program (fused.Group)
    for i, s in enumerate(steps):
        if isinstance(s, Fused):
            donors: set[int] = set()
            if s.backend.kind == "cpu":
                donors = {u for u in s.ins if ir[u].shape == s.instr.shape
                          and may_write(u, i, s)}
            s.compile(ir, donors, compiled)
        elif (isinstance(s, Start) and len(s.members) == 1 and s.instr.op.inplace_ok
              and s.ins):
            s.donate = may_write(s.ins[0], s.pair, s)  # its input lives until the wait
        elif isinstance(s, Kernel) and s.owns and s.instr.op.writes_input:
            s.donate = may_write(s.ins[0], i, s)
    # simulate the pool: a released buffer is kept only for a later allocation of its key
    remaining: dict[PoolKey, int] = {}
    for s in steps:
        for k in s.allocs():
            remaining[k] = remaining.get(k, 0) + 1
    pooled: dict[PoolKey, int] = {}

    def keep(k: PoolKey, s: Step) -> bool:
        if s.backend.kind == "cpu" and remaining.get(k, 0) > pooled.get(k, 0):
            pooled[k] = pooled.get(k, 0) + 1
            return True
        return False

    def take_over(s: Step, u: int, drop: bool) -> None:
        """A result of ``s`` takes over ``u``'s buffer: its storage is never released
        (the result's own release frees it) and, when ``drop``, no slot keeps it."""
        r = storage[u]
        store_last[r] = -2
        if drop:
            s.drop.append(u)
            if r != u and ir[r].op.kind != "leaf":
                s.drop.append(r)

    for i, s in enumerate(steps):
        for k in s.allocs():
            remaining[k] -= 1
            if pooled.get(k, 0):
                pooled[k] -= 1
        if isinstance(s, (Start, Kernel)) and s.donate:
            take_over(s, s.ins[0], isinstance(s, Kernel))  # a start's input waits for it
        if isinstance(s, Fused) and s.runner is not None and s.prog is not None:
            prog = s.prog
            part = math.prod(s.runner.scratch_shape)
            s.scratch_pool = [keep((part, prog.temps[t]), s) for t in s.runner.scratch]
            for t in prog.outs:
                if t in prog.donor_of:  # the root or an export takes over a donor's buffer
                    take_over(s, s.ins[prog.donor_of[t]], True)
        for u in set(s.ins):
            r = storage[u]
            if store_last[r] == i and owned[r] and not pinned[r]:
                if r != u:
                    s.drop.append(u)
                s.release.append((r, keep((ir[r].size, ir[r].dtype), s)))
                store_last[r] = -3
            elif (last[u] == i and u not in outs and ir[u].op.kind != "leaf"
                  and i < len(steps) - 1 and not (
                      r == u and owned[u] and not pinned[u] and store_last[u] != -2)):
                # a reference that goes (a leaf's buffer is its node's; after the last step
                # the values go at once): owned storages are dropped by their release
                s.drop.append(u)
    return storage, owned
