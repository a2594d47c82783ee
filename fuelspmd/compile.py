"""``fs.compile``: a step traced while it runs, then replayed from its plans (layer 3).

``step = fs.compile(fn)``; ``step(*args)`` runs ``fn`` lazily, as it would run
uncompiled, while recording every plan the executor runs for it (a realise inside ``fn``,
such as the optimiser's, is one *segment*; the outputs ``fn`` returns are realised at
its end, the last one) and where each leaf a plan reads comes from:

- an **argument**: a Tensor among ``args`` (nested in tuples, lists and dicts), read from
  the argument of each call. A donated argument (``Tensor.donate``, part of the
  signature) is given to the plan that reads it, as uncompiled: a replay may write its
  buffer in place and leaves the caller's tensor spent;
- an **output** of an earlier segment of the same call;
- **carried state**: a value an earlier call produced (a Parameter's new value, an
  optimiser's moments, its master weights), found because the node read is the one that
  call's segment output: there is no list of state to give, as with TinyJit (so a
  state no later call reads, written but never read inside ``fn``, is not updated by a
  replay: return it);
- **held state**: any other leaf that existed before the call (a weight no step changes),
  read from that node at each call;
- a **constant** of the trace: a leaf made inside ``fn`` (``fs.tensor(np.arange(n))``),
  baked in. If two traces give it different values, ``fn`` made per-call data inside
  itself, and compiling raises ConfigError instead of baking it;
- a **posted** transfer: a send or receive issued ahead of any plan
  (``Communicator.post``, as the pipeline posts its messages). The trace records where
  among the plans each was started and each was waited for, its op, attributes and
  data; a replay starts and waits for it again at those points, through the transport
  and its guard, and a receive's value is what that replay received.

When two consecutive calls of one signature ran the same plans from the same sources,
the step is captured (the first call usually differs: an optimiser makes its state
then), and every later call *replays*: each segment's plan runs on the buffers of the
new arguments and of the state, with no node or Tensor built per op, the collectives
issued by the same plan steps, in the same order (invariant 1), each through the
transport and its guard with the transport's fresh sequence numbers (collectives built
before the call are issued first, as the op table's ``replay`` hook asks). Carried state is
updated in place: the node that holds a Parameter's value gets the new value (so a
Tensor aliasing that node sees the new one, as a TinyJit buffer). The fs.compile call is
the explicit donation of that state: a cell's old value is dead once the step replaces
it, so the replay's plans take it as donated (as ``Tensor.donate``) and write the new
value into the old buffer. A buffer handed out keeps its value: ``.numpy()`` (which does
not copy) or a view of the value realised before the call (``w.T.realize()``) marks the
node escaped, and that call puts its new value in a fresh buffer instead (torch's
in-place step would change both). The returned tensors are new realised Tensors, and no
later replay writes their buffers.

What runs when, as ``jax.jit``: Python in ``fn`` runs while tracing only. Python that must
run on every call goes through :func:`fuelspmd.tensor.host` (the optimisers' step count
and learning rate do). Reading a value to the host inside ``fn`` (``.numpy()``,
``float(t)``) raises ConfigError, as its value would be baked into every replay.

The signature of a call is the shape, dtype and device of each Tensor argument and the
value of every other argument (hashable); a new one traces again (``retrace=True``) or
raises ConfigError naming both (``retrace=False``). A state node replaced from outside
(``p.assign(...)``, ``load_state_dict``) and held by nothing else is noticed and traced
again. Each thread (each device of a DeviceGroup) traces on its own, and the devices of
the arguments are part of the signature, so every device's replay is its own. A compiled
function called while another is being traced runs as part of that trace.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.backend import get_backend, to_host
from fuelspmd.errors import ConfigError
from fuelspmd.graph.executor import default_executor, recording
from fuelspmd.graph.node import TRACE, Node, consume, leaf
from fuelspmd.graph.plan import Memory, Start, donating
from fuelspmd.tensor import Tensor, realize

__all__ = ["Compiled", "compile"]

ARG, OUT, CARRY, HELD, CONST, POSTED = range(6)  # where a leaf a plan reads comes from
START, WAIT = range(2)  # a posted transfer's events: (before segment, START | WAIT, post)
TRACES = 5  # traces of one signature without two alike: the step cannot be captured


def compile(fn: Callable[..., Any] | None = None, *, retrace: bool = True
            ) -> Any:
    """Return ``fn`` compiled (see the module docstring); ``@fs.compile`` and
    ``@fs.compile(retrace=False)`` work as decorators."""
    if fn is None:
        return lambda f: Compiled(f, retrace=retrace)
    return Compiled(fn, retrace=retrace)


class Compiled:
    """A compiled function: one entry per signature; ``traces`` and ``replays`` count
    the calls that ran ``fn`` and those that replayed."""

    def __init__(self, fn: Callable[..., Any], *, retrace: bool = True) -> None:
        if not callable(fn):
            raise TypeError(f"fs.compile: expected a function, got {type(fn).__name__}")
        self.fn, self.retrace = fn, bool(retrace)
        self.traces = 0
        self.replays = 0
        self._entries: dict[Any, _Entry] = {}

    def __repr__(self) -> str:
        return (f"Compiled({getattr(self.fn, '__name__', self.fn)!r}, {len(self._entries)} "
                f"signatures, {self.traces} traces, {self.replays} replays)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if TRACE.recorder is not None:  # inside another compiled step's trace: part of it
            return self.fn(*args, **kwargs)
        tensors: list[Tensor] = []
        key = (_key(args, tensors), _key(kwargs, tensors))
        lazy = [t for t in tensors if t.node.buffer is None]
        if lazy:
            realize(*lazy)
        entry = self._entries.get(key)
        if entry is None:
            if not self.retrace and self._entries:
                (old,) = self._entries
                raise ConfigError(
                    f"fs.compile({_name(self.fn)}, retrace=False): called with {_show(key)}"
                    f" but compiled for {_show(old)}; call it with the arguments it was "
                    "compiled for, or compile with retrace=True (a trace per signature)")
            entry = self._entries.setdefault(key, _Entry())
        if entry.replay is not None:
            out = entry.replay.run(tensors)
            if out is not _STALE:
                self.replays += 1
                return out
            entry.replay = None  # state replaced from outside: capture it again
        return self._trace(entry, args, kwargs, tensors)

    def _trace(self, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any],
               tensors: list[Tensor]) -> Any:
        rec = _Recorder([t.node for t in tensors], entry.last)
        previous = recording(rec)
        try:
            out = self.fn(*args, **kwargs)
            flat: list[Tensor] = []
            tree = _flatten(out, flat)
            realize(*(t for t in flat if t.node.buffer is None))
            rec.outputs = [rec.source(t.node) for t in flat]
            rec.devices = [t.node.device for t in flat]
        finally:
            recording(previous)
        self.traces += 1
        entry.traces += 1
        cap = rec.capture(tree)
        if entry.last is not None and cap.same(entry.last, _name(self.fn)):
            entry.replay = _Replay(cap)
            entry.last = None  # the replay holds its state weakly: let go of the nodes
            entry.traces = 0
        elif entry.traces >= TRACES:
            raise ConfigError(
                f"fs.compile({_name(self.fn)}): {entry.traces} calls with one signature "
                "ran different graphs each time, so there is no step to replay. A Python "
                "number that changes per call became a constant (pass it as a Tensor, or "
                "compute it with fs.host), or the code takes another branch per call; run "
                "the function uncompiled")
        else:
            entry.last = cap.released()
        return out


_STALE = object()


class _Entry:
    __slots__ = ("last", "replay", "traces")

    def __init__(self) -> None:
        self.last: _Capture | None = None  # the previous trace, to compare the next with
        self.replay: _Replay | None = None
        self.traces = 0


class _Segment:
    """One plan the trace ran: the value slot of each leaf it reads and that leaf's
    source, and the nodes it realised (targets, then effectful nodes)."""

    __slots__ = ("outs", "plan", "slots", "srcs")

    def __init__(self, plan: Any, slots: list[int], srcs: list[tuple[Any, ...]],
                 outs: list[Node]) -> None:
        self.plan, self.slots, self.srcs, self.outs = plan, slots, srcs, outs


class _Recorder:
    """The executor's trace recorder for one call (``graph.executor.recording``)."""

    def __init__(self, args: list[Node], last: _Capture | None) -> None:
        self.args: dict[int, int] = {}
        for i, n in enumerate(args):
            self.args.setdefault(id(n), i)
        self.made_ids: set[int] = set()
        self.made_nodes: list[Node] = []  # alive while tracing, so ids are not reused
        self.outs: dict[int, tuple[int, int]] = {}
        self.segments: list[_Segment] = []
        self.prev = {} if last is None else last.prev_outs
        self.outputs: list[tuple[Any, ...]] = []
        self.devices: list[Any] = []
        self.posts: list[tuple[Any, Any, list[tuple[Any, ...]]]] = []  # op, attrs, data
        self.post_ids: dict[int, int] = {}
        self.events: list[tuple[int, int, int]] = []
        self.alias: dict[int, tuple[Any, ...]] = {}  # a filled placeholder: its value's source

    def posted(self, node: Node, data: tuple[Node, ...]) -> None:
        """``node`` (a send or receive, its op and attributes still on it) is started on
        the buffers of ``data`` ahead of any plan (``graph.node.post``)."""
        k = self.post_ids[id(node)] = len(self.posts)
        self.made_nodes.append(node)  # alive while tracing, so its id is not reused
        self.posts.append((node.op, node.attrs, [self.source(n) for n in data]))
        self.events.append((len(self.segments), START, k))

    def finished(self, node: Node) -> None:
        """Posted ``node`` is waited for (``graph.node.finish``): before the next plan."""
        k = self.post_ids.get(id(node))
        if k is None:
            raise ConfigError(
                "fs.compile: the function waited for a transfer posted before it was "
                "called (Communicator.post); a replay would not post it again. Post "
                "inside the function, or finish the transfer (Communicator.flush) before "
                "the call")
        self.events.append((len(self.segments), WAIT, k))

    def filled(self, node: Node, value: Node) -> None:
        """Placeholder ``node`` now holds ``value``'s buffer (``graph.node.fill``)."""
        self.alias[id(node)] = self.source(value)

    def made(self, node: Node) -> None:
        self.made_ids.add(id(node))
        self.made_nodes.append(node)

    def host_read(self, t: Tensor) -> None:
        raise ConfigError(
            f"fs.compile: the function read a {t.shape} {t.dtype} tensor's value to the "
            "host (numpy(), item(), float()) while being traced; every replay would use "
            "that first value. Return the tensor and read it after the call, keep the "
            "computation in tensors, or give the Python to fs.host (run on every call); "
            "a gradient clip by a host norm or a loss scaler cannot be compiled yet")

    def ran(self, plan: Any, feeds: list[Node], outs: list[Node], donated: list[Node]
            ) -> None:
        if any(id(n) not in self.args for n in donated):
            raise ConfigError("fs.compile: a tensor donated inside a compiled function "
                              "(Tensor.donate) has no value after the trace; donate an "
                              "argument before the call, or donate only in uncompiled code")
        srcs = [self.source(n) for n in feeds]
        k = len(self.segments)
        for j, n in enumerate(outs):
            self.outs[id(n)] = (k, j)
        self.segments.append(_Segment(plan, [v for _, v in plan.binding.feeds], srcs, outs))

    def source(self, n: Node) -> tuple[Any, ...]:
        i = self.args.get(id(n))
        if i is not None:
            return (ARG, i)
        i = self.post_ids.get(id(n))
        if i is not None:
            return (POSTED, i)
        a = self.alias.get(id(n))
        if a is not None:
            return a
        o = self.outs.get(id(n))
        if o is not None:
            return (OUT, *o)
        if id(n) in self.made_ids:
            return (CONST, n)
        o = self.prev.get(id(n))
        if o is not None and o[2]() is n:
            return (CARRY, o[0], o[1])
        return (HELD, n)

    def capture(self, tree: Any) -> _Capture:
        cap = _Capture(self.segments, self.outputs, self.devices, tree, self.outs)
        cap.posts, cap.events = self.posts, self.events
        return cap


class _Capture:
    """What one traced call ran (see :class:`_Recorder`)."""

    def __init__(self, segments: list[_Segment], outputs: list[tuple[Any, ...]],
                 devices: list[Any], tree: Any, out_ids: dict[int, tuple[int, int]]) -> None:
        self.segments, self.outputs, self.devices = segments, outputs, devices
        self.tree, self.out_ids = tree, out_ids
        self.prev_outs: dict[int, tuple[int, int, Any]] = {}
        self.posts: list[tuple[Any, Any, list[tuple[Any, ...]]]] = []
        self.events: list[tuple[int, int, int]] = []

    def released(self) -> _Capture:
        """This capture kept only to compare the next call with: its outputs held weakly
        (``prev_outs``: id -> segment, index, weak reference), so a trace that is never
        replayed keeps no value it made alive (a decode step's written pages, say)."""
        self.prev_outs = {i: (k, j, weakref.ref(self.segments[k].outs[j]))
                          for i, (k, j) in self.out_ids.items()}
        for seg in self.segments:
            seg.outs = []
        return self

    def same(self, other: _Capture, name: str) -> bool:
        """Whether this call ran what ``other`` (the call before) ran; a constant that
        differs between two such calls raises ConfigError (per-call data made in fn)."""
        if (len(self.segments) != len(other.segments) or self.tree != other.tree
                or any(s.plan is not t.plan for s, t in zip(self.segments, other.segments))
                or self.events != other.events or len(self.posts) != len(other.posts)
                or any(a[0] is not b[0] or len(a[2]) != len(b[2])
                       or (a[1] is not b[1] and a[1] != b[1])
                       for a, b in zip(self.posts, other.posts))):
            return False
        pairs = [(a, b) for s, t in zip(self.segments, other.segments)
                 for a, b in zip(s.srcs, t.srcs)]
        pairs += [(a, b) for p, q in zip(self.posts, other.posts) for a, b in zip(p[2], q[2])]
        pairs += list(zip(self.outputs, other.outputs))
        consts = []
        for a, b in pairs:
            if a[0] != b[0]:
                return False
            if a[0] == HELD and a[1] is not b[1]:
                return False
            if a[0] == CONST:
                consts.append((a[1], b[1]))
            elif a[0] != HELD and a[1:] != b[1:]:
                return False
        for a, b in consts:
            if not np.array_equal(to_host(a.buffer), to_host(b.buffer)):
                raise ConfigError(
                    f"fs.compile({name}): a {a.shape} {a.dtype} tensor made inside the "
                    "function from host data differs from one call to the next (a batch, "
                    "a dropout mask, a random draw); a replay would use the first one. "
                    "Pass it as an argument")
        return True


class _Replay:
    """A captured step: its segments' plans, how each finds its leaves, the state cells
    it updates (weakly held: a cell nobody else holds was replaced from outside).

    Each segment's plan is made again with the leaves donated whose buffers die in it
    (:func:`_donations`); ``plain`` keeps the plan as traced, run instead while a cell
    such a plan would write has escaped (``Node.escaped``). ``memory`` keeps the buffers
    the segments release for the next replay (:class:`~fuelspmd.graph.plan.Memory`)."""

    def __init__(self, cap: _Capture) -> None:
        cells: dict[tuple[int, int], int] = {}
        held: list[Node] = []
        self.segments: list[tuple[Any, list[tuple[int, int, Any, int]]]] = []
        self.plain: list[tuple[Any, list[int]] | None] = []  # (plan as traced, cells)

        def compiled(src: tuple[Any, ...]) -> tuple[int, Any, int]:
            kind = src[0]
            if kind == ARG:
                return ARG, src[1], 0
            if kind == OUT:
                return OUT, src[1], src[2]
            if kind == CARRY:
                return CARRY, cells.setdefault((src[1], src[2]), len(cells)), 0
            if kind == HELD:
                held.append(src[1])
                return HELD, len(held) - 1, 0
            if kind == POSTED:
                return POSTED, src[1], 0
            return CONST, src[1].buffer, 0

        streams: dict[int, list[Any]] = {}  # per stream: [replay hook, attrs, count]
        for seg, slots in zip(cap.segments, _donations(cap)):
            feeds = [(v, *compiled(src)) for v, src in zip(seg.slots, seg.srcs)]
            if slots:
                watch = [b for v, kind, b, _ in feeds if kind == CARRY and v in slots]
                self.segments.append((donating(seg.plan, sorted(slots)), feeds))
                self.plain.append((seg.plan, watch))
            else:
                self.segments.append((seg.plan, feeds))
                self.plain.append(None)
            for step in seg.plan.steps:
                op = step.instr.op
                if isinstance(step, Start) and op.replay is not None:
                    hook = streams.setdefault(id(step.instr.attrs.comm),
                                              [op.replay, step.instr.attrs, 0])
                    hook[2] += len(step.members)
        self.streams = [tuple(h) for h in streams.values()]
        # the posted transfers: (op, attrs, backend, data sources), and per segment (one
        # more: after the last) the starts and waits that came before it, in trace order
        self.posts = [(op, attrs, get_backend(attrs.comm.device.kind),
                       [compiled(src) for src in data]) for op, attrs, data in cap.posts]
        self.events: list[list[tuple[int, int]]] = [[] for _ in range(len(cap.segments) + 1)]
        for at, what, k in cap.events:
            self.events[at].append((what, k))
        caps: Counter[tuple[int, Any]] = Counter()
        for plan, _ in self.segments:
            caps.update(plan.allocs)
        self.memory = Memory(dict(caps))  # one pool: a segment's outputs die in a later one
        self.outputs = [compiled(src) for src in cap.outputs]
        self.devices = cap.devices
        order = sorted(cells, key=cells.__getitem__)
        self.cell_keys = order
        self.cells = [weakref.ref(cap.segments[s].outs[k]) for s, k in order]
        self.held = [weakref.ref(n) for n in held]
        self.tree = cap.tree

    def run(self, tensors: list[Tensor], run_values: Any = None) -> Any:
        """The step's outputs for these arguments, or ``_STALE`` (nothing run) when a
        state node is gone. ``run_values(plan, vals, memory)`` runs a plan (the default
        executor's; a bench passes a stand-in to time the rest alone)."""
        cells = [r() for r in self.cells]
        held = [r() for r in self.held]
        if None in cells or None in held or any(n.buffer is None for n in held):  # type: ignore[union-attr]
            return _STALE
        for hook, attrs, count in self.streams:  # each stream counts what it will issue
            hook(attrs, count)
        args = [t.node.buffer for t in tensors]
        cell_bufs = [c.buffer for c in cells]  # type: ignore[union-attr]
        held_bufs = [n.buffer for n in held]  # type: ignore[union-attr]
        run_values = run_values or default_executor().run_values
        results: list[list[Any]] = []
        pending: list[Any] = [None] * len(self.posts)
        got: list[Any] = [None] * len(self.posts)

        def value(kind: int, a: Any, b: int) -> Any:
            return (args[a] if kind == ARG else results[a][b] if kind == OUT else
                    cell_bufs[a] if kind == CARRY else held_bufs[a] if kind == HELD else
                    got[a] if kind == POSTED else a)

        escaped: list[Node] = []
        for s, ((plan, feeds), plain) in enumerate(zip(self.segments, self.plain)):
            self._transfers(s, value, pending, got)
            mem: Memory | None = self.memory
            if plain is not None:
                seen = [c for c in (cells[a] for a in plain[1]) if c.escaped]  # type: ignore[union-attr]
                if seen:  # someone holds such a buffer: this time, fresh buffers
                    plan, mem = plain[0], None
                    escaped += seen  # type: ignore[arg-type]
            vals: list[Any] = [None] * plan.n_values
            for v, kind, a, b in feeds:
                vals[v] = value(kind, a, b)
            results.append(run_values(plan, vals, mem))
        self._transfers(len(self.segments), value, pending, got)
        for cell, (s, k) in zip(cells, self.cell_keys):
            cell.buffer = results[s][k]  # type: ignore[union-attr]
        for c in escaped:  # its new buffer is one nobody else has seen
            c.escaped = False
        for t in tensors:  # the plans were made for these leaves donated: they are spent
            if t.node.donated:
                consume(t.node)
        flat: list[Any] = []
        for (kind, a, b), dev in zip(self.outputs, self.devices):
            if kind == ARG:
                flat.append(tensors[a])
                continue
            flat.append(Tensor(leaf(value(kind, a, b), dev)))
        return _unflatten(self.tree, iter(flat))

    def _transfers(self, s: int, value: Callable[[int, Any, int], Any], pending: list[Any],
                   got: list[Any]) -> None:
        """Start and wait for the posted transfers the trace met before segment ``s``
        (counted as built on their communicator first, as a replayed collective is)."""
        for what, k in self.events[s]:
            op, attrs, be, data = self.posts[k]
            if what == START:
                op.replay(attrs, 1)
                pending[k] = op.start(be, attrs, *(value(*src) for src in data))
            else:
                got[k] = pending[k].finish()


def _donations(cap: _Capture) -> list[set[int]]:
    """Per segment, the value slots of the leaves a replay may donate to its plan.

    A replay owns two kinds of buffer: a carried cell's value at the start of the call
    (the call replaces it) and an output of an earlier segment of the call. Each value a
    plan reads or returns has a *root*, the buffer it is (a view of): an argument, a held
    or constant node, a cell's value at the start (``old``), or a buffer a segment
    allocated (``new``; an output that is a view of a leaf has that leaf's root, a
    collective's result is ``shared``: another device may hold it). A root is donated to
    the last segment that reads it when that segment reads it through one leaf, and

    - a ``new`` root only when nothing the call keeps (a cell's new value, a returned
      tensor) has it and no posted transfer reads it: the buffer dies in that segment;
    - a cell's ``old`` root only when the cell's value is a ``new`` root that no other cell
      and no returned tensor has (so the buffer is the cell's alone) and nothing the call
      keeps is a view of the old value; at run time also only while the cell's node has
      not escaped (``Tensor.numpy``, a realised view of it: the caller holds the buffer).
    """
    out_roots: list[list[tuple[Any, ...]]] = []
    feed_roots: list[list[tuple[Any, ...]]] = []

    def root(src: tuple[Any, ...]) -> tuple[Any, ...]:
        kind = src[0]
        if kind == OUT:
            return out_roots[src[1]][src[2]]
        if kind == CARRY:
            return ("old", src[1], src[2])
        return (kind, src[1]) if kind in (ARG, POSTED) else (kind, id(src[1]))

    for s, seg in enumerate(cap.segments):
        roots = [root(src) for src in seg.srcs]
        of_leaf = dict(zip(seg.slots, roots))
        plan = seg.plan
        out_roots.append([of_leaf[st] if st in of_leaf else
                          ("new" if owned else "shared", s, st)
                          for st, owned in zip(plan.out_storage, plan.out_owned)])
        feed_roots.append(roots)
    carried = [src for seg in cap.segments for src in seg.srcs if src[0] == CARRY]
    cell_roots = {(src[1], src[2]): out_roots[src[1]][src[2]] for src in carried}
    kept = Counter(cell_roots.values())
    kept.update(root(src) for src in cap.outputs)
    kept.update(root(src) for _, _, data in cap.posts for src in data)  # read while in flight
    free = {r for seg in out_roots for r in seg if r[0] == "new" and not kept[r]}
    for (s, k), r in cell_roots.items():
        buf = cap.segments[s].outs[k].buffer
        flags = getattr(buf, "flags", None)
        if (r[0] == "new" and kept[r] == 1 and not kept[("old", s, k)]
                and flags is not None and flags.c_contiguous and getattr(flags, "writeable", True)):
            free.add(("old", s, k))
    last: dict[tuple[Any, ...], tuple[int, list[int]]] = {}
    for s, (seg, roots) in enumerate(zip(cap.segments, feed_roots)):
        here: dict[tuple[Any, ...], list[int]] = {}
        for v, r in zip(seg.slots, roots):
            here.setdefault(r, []).append(v)
        last.update((r, (s, vs)) for r, vs in here.items())
    donate: list[set[int]] = [set() for _ in cap.segments]
    for r, (s, vs) in last.items():
        if r in free and len(vs) == 1:
            donate[s].add(vs[0])
    return donate


# ---- arguments and outputs -------------------------------------------------------------
def _key(x: Any, tensors: list[Tensor]) -> Any:
    """The signature of ``x`` (Tensors collected into ``tensors``, in order)."""
    if isinstance(x, Tensor):
        tensors.append(x)
        return ("T", x.shape, x.dtype, x.device, x.node.donated)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_key(v, tensors) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v, tensors)) for k, v in x.items()))
    try:
        hash(x)
    except TypeError:
        raise ConfigError(f"fs.compile: an argument of type {type(x).__name__} is neither a "
                          "Tensor nor hashable, so calls cannot be told apart; pass arrays "
                          "as fs.tensor(...), other values as numbers, strings or tuples"
                          ) from None
    return ("V", x)


def _show(key: Any) -> str:
    """A signature as a person reads it: ``(4, 8) float32 cpu:0`` per tensor."""
    def one(k: Any) -> str:
        tag = k[0]
        if tag == "T":
            return f"{k[1]} {k[2]} {k[3]}" + (" donated" if k[4] else "")
        if tag == "V":
            return repr(k[1])
        if tag == "dict":
            return "{" + ", ".join(f"{n}: {one(v)}" for n, v in k[1]) + "}"
        return "(" + ", ".join(one(v) for v in k[1]) + ")"
    args, kwargs = key
    return f"args {one(args)}" + (f", kwargs {one(kwargs)}" if kwargs[1] else "")


def _flatten(x: Any, out: list[Tensor]) -> Any:
    """The structure of ``fn``'s result, its Tensors collected into ``out``."""
    if isinstance(x, Tensor):
        out.append(x)
        return ("T",)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_flatten(v, out) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _flatten(v, out)) for k, v in x.items()))
    return ("V", x)


def _unflatten(tree: Any, flat: Any) -> Any:
    tag = tree[0]
    if tag == "T":
        return next(flat)
    if tag == "V":
        return tree[1]
    if tag is dict:
        return {k: _unflatten(v, flat) for k, v in tree[1]}
    return tag(_unflatten(v, flat) for v in tree[1])


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
