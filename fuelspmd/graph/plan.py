"""From optimised IR to a Plan: fusion groups, a linear schedule of steps, memory plan.

A :class:`Plan` is a function of the graph's structure only; the executor binds leaf
buffers to its placeholder slots and runs ``steps`` in order. The schedule is a plain list,
so a later "start"/"wait" pair (a collective started when its input is ready and waited
where its result is first needed) is just two more steps in it. A collective (an
effectful op) is a ``collective`` step: its result is never pooled or donated (an
in-process group shares one result array between devices), and it may itself take over
its input's buffer when that input dies at the step (``donate``).

Memory plan, decided here once per plan:

- a value's *storage* is its own buffer, or for a view the storage it aliases; a storage
  is released after the last step that reads any of its aliases, never if an output or a
  leaf aliases it;
- released buffers go to a pool keyed by (elements, dtype) only when a later step will
  allocate that key (simulated here), else they are dropped at once;
- a fused step may write into an input buffer that dies at that step (a "donor");
- a fused step may also write members that later steps read ("exports"), so a chain of
  values saved for the backward is still one pass over memory.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from fuelspmd.backend import get_backend
from fuelspmd.dtypes import DType, to_numpy

from .fused import NumpyFused, Program, build_program, cupy_kernel, scalar_for
from .passes import Instr

__all__ = ["Plan", "Step", "joins_bucket", "make_plan", "take_bucket"]

PoolKey = tuple[int, DType]


@dataclass(eq=False)
class Step:
    """One step of the schedule.

    ``kind``: ``kernel`` (an op's Array API kernel), ``matmul_out`` and ``fused`` (numpy
    with out= buffers from the pool), ``fused_generic`` (members' kernels one by one, any
    Array API library), ``fused_cupy`` (one generated kernel). ``owns``: the output is a
    new buffer the executor counts. After the step, ``release`` lists (slot, pool?) for
    storages whose life ends and ``drop`` the slots whose references just go.
    """

    kind: str
    out: int
    ins: tuple[int, ...]
    instr: Instr
    backend: Any
    owns: bool = True
    members: list[int] = field(default_factory=list)
    exports: list[int] = field(default_factory=list)  # members later steps read too
    prog: Program | None = None
    runner: NumpyFused | None = None
    regs: list[Any] = field(default_factory=list)  # fused: template with scalars filled in
    np_dtypes: list[Any] = field(default_factory=list)  # numpy dtype of output / each temp
    scratch_pool: list[bool] = field(default_factory=list)  # per scratch temp: pool it?
    cuda_kernel: Any = None
    out_dtypes: list[DType] = field(default_factory=list)  # fused_cupy: root, then exports
    release: list[tuple[int, bool]] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)
    donate: bool = False  # collective: its in-place input dies here, so it may be overwritten
    pair: int = -1  # start: the index of its wait step


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


def _exports(members: list[int], group_of: list[int], g: int, users: list[list[int]],
             outs: set[int]) -> set[int]:
    """Members of group ``g`` that an output or a later step reads."""
    return {m for m in members[:-1] if m in outs or any(group_of[u] != g for u in users[m])}


def make_plan(ir: list[Instr], outs: tuple[int, ...], leaf_slots: tuple[int, ...]) -> Plan:
    """Schedule ``ir``: one step per value that needs a buffer, in topological order."""
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
            exports = _exports(groups[g], group_of, g, users, out_set)
            steps.append(Step("fused", v, tuple(ext), ins, be, members=groups[g],
                              exports=sorted(exports)))
        elif ins.op.effectful:
            steps.append(Step("collective", v, ins.ins, ins, be, owns=False))
        elif ins.op.name == "matmul" and be.kind == "cpu":
            steps.append(Step("matmul_out", v, ins.ins, ins, be,
                              np_dtypes=[to_numpy(ins.dtype)]))
        else:
            steps.append(Step("kernel", v, ins.ins, ins, be, owns=ins.op.kind != "view"))
    steps = _overlap(_buckets(ir, steps))
    _plan_memory(ir, steps, outs)
    n_fused = sum(len(s.prog.code) for s in steps if s.prog is not None)
    nbytes = [ins.size * ins.dtype.itemsize for ins in ir]
    return Plan(n, leaf_slots, presets, steps, outs, nbytes, n_fused)


def _buckets(ir: list[Instr], steps: list[Step]) -> list[Step]:
    """Fuse runs of bucketable collectives that are ready together into ``bucket`` steps.

    A run is collective steps of one op with equal attributes (so one communicator and
    reduce op), dtype and device, up to the op's bucket size, with no other collective
    between them and no step between them reading a member's result (a member's only
    member input is the previous member, as its order token). The run becomes one step at
    its last member's place: every member's input is ready there, and no one needed a
    result earlier. Moving a collective later never reorders one communicator's
    collectives, so the transport order stays the creation order.
    """
    out: list[Step] = []
    run: list[Step] = []
    members: set[int] = set()
    run_bytes = 0

    def close() -> None:
        nonlocal run, run_bytes
        if len(run) > 1:
            last = run[-1]
            ins = tuple(s.ins[k] for s in run for k in range(s.instr.attrs[1]))
            out.append(Step("bucket", last.out, ins, last.instr, last.backend, owns=False,
                            members=[s.out for s in run]))
        else:
            out.extend(run)
        run, run_bytes = [], 0
        members.clear()

    for s in steps:
        op = s.instr.op
        if s.kind == "collective" and op.bucket is not None and op.bucket_bytes is not None:
            fit = joins_bucket(run[0].instr, s.instr, run_bytes) if run else -1
            if fit < 0 or any(u in members for u in s.ins[:s.instr.attrs[1]]):
                close()
                fit = s.instr.size * s.instr.dtype.itemsize
            run.append(s)
            members.add(s.out)
            run_bytes = fit
            continue
        if s.kind == "collective" or any(u in members for u in s.ins):
            close()
        out.append(s)  # with a run open, it runs before the bucket: it reads no member
    close()
    return out


def joins_bucket(head: Any, x: Any, run_bytes: int) -> int:
    """The bytes of the bucket opened by ``head`` (holding ``run_bytes``) once collective
    ``x`` joins it, or -1 when ``x`` may not join: it must be the same bucketable op with
    equal attributes (one communicator, one reduce op), dtype and device, and the bucket
    must stay within the op's size.

    ``head`` and ``x`` are IR values or graph nodes (both carry op, attrs, shape, dtype and
    device): the planner and the executor's direct path bucket by this one rule.
    """
    op = x.op
    if not (op.bucket_bytes is not None and _alike(head, x)):
        return -1
    total = run_bytes + math.prod(x.shape) * x.dtype.itemsize
    return total if total <= op.bucket_bytes(x.attrs) else -1


def _alike(head: Any, x: Any) -> bool:
    """The bucket rule's test: the same op, equal attributes (one communicator, one reduce
    op), dtype and device (each compared by identity first, as a tuple compares)."""
    return _ALIKE(head) == _ALIKE(x)


_ALIKE = attrgetter("op", "attrs", "dtype", "device")


def take_bucket(head: Any, todo: list[Any]) -> list[Any]:
    """Take from the end of ``todo`` the graph nodes that join the bucket ``head`` opens
    (the rule of :func:`joins_bucket`, for the executor's direct path); return the run,
    ``head`` first. The limit is read once and counted down in elements, and a member
    whose op, attrs, dtype and device are ``head``'s own objects, as one communicator's
    all_reduces are, skips the call to the test; the members are sliced off at the end
    (measured, 256 members: 33 us against 89 us popping them one by one).
    """
    op = head.op
    if op.bucket_bytes is None or not todo:
        return [head]
    attrs, dt, dev = head.attrs, head.dtype, head.device
    room = op.bucket_bytes(attrs) // dt.itemsize - math.prod(head.shape)  # elements left
    prod = math.prod
    i = len(todo)
    for x in reversed(todo):
        if not ((x.op is op and x.attrs is attrs and x.dtype is dt and x.device is dev)
                or _alike(head, x)):
            break
        room -= prod(x.shape)
        if room < 0:
            break
        i -= 1
    run = [head, *todo[i:][::-1]]
    del todo[i:]
    return run


def _overlap(steps: list[Step]) -> list[Step]:
    """Split every collective (and bucket) step into a start and a wait, and move them.

    A start goes right after the step that computes its last data input (order tokens do
    not count), but never before an earlier start: starts keep their order, so each
    communicator's transport order is still the creation order. A wait goes right before
    the first step that reads its result, or at the end, but before the next start on the
    same communicator: one operation in flight per communicator (the collective guard
    settles operations one at a time; buckets give the many-at-once case one call). The
    wait lists the same inputs as the start, so the memory plan keeps them alive while the
    transport may still read them.
    Positions are the original indices with fractions, so the sort is one pass.
    """
    if not any(s.kind in ("collective", "bucket") and s.instr.op.start is not None
               for s in steps):
        return steps
    readers: dict[int, list[int]] = {}
    for j, s in enumerate(steps):
        data = s.ins
        if s.kind == "collective":
            data = s.ins[:s.instr.attrs[1]]
        for u in data:
            readers.setdefault(u, []).append(j)
    made_at: dict[int, float] = {}
    keyed: list[tuple[tuple[float, int], Step]] = []  # (position, tie-break), step
    in_flight: dict[int, int] = {}  # communicator -> index in keyed of its last wait
    last_start = (-1.0, 0)
    for i, s in enumerate(steps):
        op = s.instr.op
        if s.kind not in ("collective", "bucket") or op.start is None:
            made_at[s.out] = i
            for e in s.exports:
                made_at[e] = i
            keyed.append(((float(i), 0), s))
            continue
        data = s.ins if s.kind == "bucket" else s.ins[:s.instr.attrs[1]]
        ready = max([-1.0, *(made_at.get(u, -1.0) + 0.1 for u in data)])
        at = max((last_start[0], last_start[1] + 2), (ready, 2 * len(keyed) + 2))  # in order
        last_start = at
        outs = s.members if s.kind == "bucket" else [s.out]
        first = min((j for u in outs for j in readers.get(u, []) if j > i),
                    default=len(steps))
        kind = "bucket_" if s.kind == "bucket" else ""
        start = Step(f"{kind}start", s.out, s.ins, s.instr, s.backend, owns=False,
                     members=s.members)
        wait = Step(f"{kind}wait", s.out, s.ins, s.instr, s.backend, owns=False,
                    members=s.members)
        prev = in_flight.get(id(s.instr.attrs[0]))
        if prev is not None:  # one operation in flight per communicator: its wait goes
            # before the next start there (the collective guard settles them one by one)
            keyed[prev] = (min(keyed[prev][0], (at[0], at[1] - 1)), keyed[prev][1])
        keyed.append((at, start))
        keyed.append(((first - 0.25, 1), wait))
        in_flight[id(s.instr.attrs[0])] = len(keyed) - 1
        for u in outs:
            made_at[u] = first - 0.25
    keyed.sort(key=lambda k: k[0])
    order = [k[1] for k in keyed]
    pos = {id(s): j for j, s in enumerate(order)}
    waits = {s.out: pos[id(s)] for s in order if s.kind in ("wait", "bucket_wait")}
    for s in order:
        if s.kind in ("start", "bucket_start"):
            s.pair = waits[s.out]
    return order


def _is_fill(ins: Instr) -> bool:
    return ins.op.kind == "const" and ins.value is None


def _compile_fused(ir: list[Instr], s: Step, donors: set[int]) -> None:
    """Compile a fused step for its backend (donors only matter on numpy)."""
    s.prog = prog = build_program(ir, s.members, list(s.ins), donors, set(s.exports))
    s.exports = [v for v, _ in prog.exports]  # the program's order
    if s.backend.kind == "cpu":
        s.runner = NumpyFused(prog, [ir[u].shape for u in s.ins])
        s.np_dtypes = [to_numpy(dt) for dt in prog.temps]
    elif s.backend.kind == "cuda":
        s.kind = "fused_cupy"
        s.cuda_kernel = cupy_kernel(prog, ir)
        s.out_dtypes = [s.instr.dtype, *(ir[e].dtype for e in s.exports)]
    else:
        s.kind = "fused_generic"
    s.regs = [None] * prog.n_ext + [scalar_for(v, dt, s.backend) for v, dt in prog.scalars]
    s.regs += [None] * len(prog.temps)


def _allocs(s: Step) -> list[PoolKey]:
    """The (elements, dtype) of each buffer step ``s`` takes from the pool, in order."""
    if s.kind == "matmul_out":
        return [(s.instr.size, s.instr.dtype)]
    if s.kind == "fused" and s.runner is not None and s.prog is not None:
        full = [(s.instr.size, s.prog.temps[t]) for t in s.runner.full_new]
        part = math.prod(s.runner.scratch_shape)
        return full + [(part, s.prog.temps[t]) for t in s.runner.scratch]
    return []


def _plan_memory(ir: list[Instr], steps: list[Step], outs: tuple[int, ...]) -> None:
    """Decide donors, releases, drops and pooling (see the module docstring)."""
    n = len(ir)
    storage = list(range(n))
    owned = [False] * n
    donated = [ins.op.kind == "leaf" and ins.attrs == (True,) for ins in ir]  # may be written
    for s in steps:
        if s.instr.op.kind == "view":
            storage[s.out] = storage[s.ins[0]]
        elif not s.instr.op.effectful:  # a collective's result may be shared: never reused
            owned[s.out] = True
        for e in s.exports:
            owned[e] = True
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
    for i, s in enumerate(steps):
        if s.kind == "fused":
            donors: set[int] = set()
            if s.backend.kind == "cpu":
                aliases = Counter(storage[u] for u in s.ins)
                donors = {u for u in s.ins if storage[u] == u and (owned[u] or donated[u])
                          and not pinned[u]
                          and store_last[u] == i and aliases[u] == 1
                          and ir[u].shape == s.instr.shape}
            _compile_fused(ir, s, donors)
        elif s.kind in ("collective", "start") and s.instr.op.inplace_ok and s.ins:
            u = s.ins[0]
            ends = s.pair if s.kind == "start" else i  # the input lives until the wait
            s.donate = (storage[u] == u and (owned[u] or donated[u]) and not pinned[u]
                        and store_last[u] == ends and sum(storage[x] == u for x in s.ins) == 1)
    # simulate the pool: a released buffer is kept only for a later allocation of its key
    remaining: dict[PoolKey, int] = {}
    for s in steps:
        for k in _allocs(s):
            remaining[k] = remaining.get(k, 0) + 1
    pooled: dict[PoolKey, int] = {}

    def keep(k: PoolKey, s: Step) -> bool:
        if s.backend.kind == "cpu" and remaining.get(k, 0) > pooled.get(k, 0):
            pooled[k] = pooled.get(k, 0) + 1
            return True
        return False

    for i, s in enumerate(steps):
        for k in _allocs(s):
            remaining[k] -= 1
            if pooled.get(k, 0):
                pooled[k] -= 1
        if s.donate:  # the collective's result takes over its input's buffer
            store_last[s.ins[0]] = -2
        if s.runner is not None and s.prog is not None:
            part = math.prod(s.runner.scratch_shape)
            s.scratch_pool = [keep((part, s.prog.temps[t]), s) for t in s.runner.scratch]
            if s.prog.root_temp in s.prog.donor_of:  # the output takes over the donor's buffer
                donor = s.ins[s.prog.donor_of[s.prog.root_temp]]
                store_last[donor] = -2
                s.drop.append(donor)
        for u in set(s.ins):
            r = storage[u]
            if store_last[r] == i and owned[r] and not pinned[r]:
                if r != u:
                    s.drop.append(u)
                s.release.append((r, keep((ir[r].size, ir[r].dtype), s)))
                store_last[r] = -3
            elif last[u] == i and u not in outs and not (
                    r == u and owned[u] and not pinned[u] and store_last[u] != -2):
                s.drop.append(u)  # owned storages are dropped by their release instead
