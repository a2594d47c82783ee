"""``PipelineExecutor``: run any :class:`Schedule` for real over a pipeline Communicator.

Layer 7. One executor per rank of the pipeline group; each holds the stage functions and
parameters of its chunks (virtual stage ``j * p + rank`` is chunk ``j``). A stage is a
callable ``(params, x) -> y`` built from lazy Tensors; the last virtual stage's output goes
into ``loss(y, target) -> scalar``. :meth:`PipelineExecutor.step` walks
``schedule.steps(rank)`` and returns the mean loss over the micro-batches and the gradients
of that mean, accumulated over micro-batches (and averaged over ``dp`` when given).

Saved activations. The backward of a micro-batch is built at its forward, while the lazy
history is still there: ``fs.vjp(y, [x, *params], ct)`` with the cotangent ``ct`` a leaf
whose buffer arrives at the backward (the gradient received from the next stage). The
forward realises the output together with every forward value the backward graph reads
(the *residuals*), so those are the saved activations; the backward realises the
gradients from them without recomputing anything, then drops them. ``recompute=True``
saves only the stage input and runs the forward again at the backward (activation
recomputation), which is also what a stage with collectives inside (tensor parallelism)
needs: its backward collectives must be created at the backward, in the same order on
every rank of its group.

Transfers. Activations and input gradients go point to point over a private channel split
off the pipeline Communicator once (so its tags, ``Message.tag``, meet nothing else).
They use the transport directly rather than lazy send/recv nodes because the schedule's
discipline needs several transfers posted at once: with ``schedule.sends == "blocking"``
the sends of an action are posted with the receives of the next one and waited for as one
batch (Megatron's ``send_forward_recv_backward``), with ``"nonblocking"`` each send is
posted right after its action and waited for at the end of the step. A blocking step with
no receives waits for nothing: its sends are carried to the next step that receives (or
the end). Waiting there only stalled the sender: MPI moves a large message only while the
receiver is inside MPI, so the last GPipe stage sat 3-27 ms before B actions whose inputs
were ready until the previous stage next waited. Every wait still comes at or after the
point the blocking model puts it, with at least as much posted, so no deadlock is added.
Every wait has the Communicator's deadline. The activation shapes are found once, at the
first step, by passing (shape, dtype) along the virtual stages.

Timing. After a barrier on the channel, each action's compute (receives done, sends not
started) is timed with ``time.perf_counter``; :meth:`timeline` gathers every rank's times
into a :class:`~fuelspmd.pipeline_parallel.simulate.Timeline` (``Timeline.measured``), which
:func:`~fuelspmd.pipeline_parallel.render.chrome_trace` turns into a Chrome trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fuelspmd.autograd import grad, vjp
from fuelspmd.backend import get_backend, to_host
from fuelspmd.comm import Communicator
from fuelspmd.dtypes import DType, Shape
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.graph.node import Node, leaf, mark_realised
from fuelspmd.pipeline_parallel.actions import Action, Schedule
from fuelspmd.pipeline_parallel.simulate import Timeline
from fuelspmd.pipeline_parallel.validate import validate
from fuelspmd.tensor import Tensor, realize, tensor, zeros
from fuelspmd.transport import Work

__all__ = ["PipelineExecutor", "StepResult"]

StageFn = Callable[[Sequence[Tensor], Tensor], Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
Key = tuple[str, int, int]
_META = 32  # int64 words of a shape message: ndim, up to 15 dims, dtype name


@dataclass
class StepResult:
    """What one :meth:`PipelineExecutor.step` gives every rank of the pipeline.

    ``loss``: the mean over micro-batches of ``loss(y_i, target_i)`` (and over ``dp``).
    ``grads[j][k]``: d loss / d ``params[j][k]`` of this rank's chunk ``j``, realised.
    ``times[a]``: (start, end) of action ``a``'s compute, seconds after the step's barrier.
    ``peak_saved_bytes``: the most bytes of saved activations this rank held at once.
    """

    loss: float
    grads: list[list[Tensor]]
    times: dict[Action, tuple[float, float]] = field(default_factory=dict)
    peak_saved_bytes: int = 0


@dataclass
class _Saved:
    """One micro-batch on one virtual stage, from its forward to its backward."""

    x: Tensor
    grads: list[Tensor] | None  # the lazy backward (None until built, with recompute)
    ct: Node | None  # the cotangent leaf, filled at the backward (None on the last stage)
    nbytes: int


class PipelineExecutor:
    """Runs ``schedule`` on this rank of ``comm`` (the pipeline group); see the module docs.

    ``stages[j]`` and ``params[j]`` are chunk ``j`` of this rank (``schedule.chunks`` of
    each). Collective: every rank of ``comm`` constructs its executor at the same point.
    """

    def __init__(self, schedule: Schedule, *, comm: Communicator, stages: Sequence[StageFn],
                 params: Sequence[Sequence[Any]], loss: LossFn,
                 dp: Communicator | None = None, recompute: bool = False) -> None:
        validate(schedule)
        if comm.size != schedule.stages:
            raise ConfigError(
                f"PipelineExecutor: the schedule has {schedule.stages} stages but the "
                f"pipeline Communicator has {comm.size} ranks; build the schedule with "
                f"stages={comm.size} (e.g. mesh.comm('pp').size)")
        for name, items in (("stages", stages), ("params", params)):
            if len(items) != schedule.chunks:
                raise ConfigError(
                    f"PipelineExecutor: {len(items)} {name} given but the schedule has "
                    f"{schedule.chunks} chunk(s) per rank; give one per chunk")
        self.schedule = schedule
        self.comm = comm
        self.dp = dp
        self.loss = loss
        self.recompute = bool(recompute)
        self.stages = list(stages)
        self.params: list[list[Tensor]] = [[self._leaf(p) for p in ps] for ps in params]
        self._backend = get_backend(comm.device.kind)
        self._p2p = comm.split(0, comm.rank).transport  # collective: a private channel
        self._steps = schedule.steps(comm.rank)
        self._io: list[tuple[Shape, DType] | None] | None = None  # (shape, dtype) of each
        # virtual stage's input as far as this rank needs to know it (found at step 1)
        self._last: StepResult | None = None

    # ---- helpers ----------------------------------------------------------------------
    def _leaf(self, x: Any) -> Tensor:
        t = x if isinstance(x, Tensor) else tensor(x, device=self.comm.device)
        if t.device != self.comm.device:
            raise ConfigError(f"PipelineExecutor: a tensor is on {t.device} but the "
                              f"pipeline runs on {self.comm.device}; move it with .to()")
        return t.realize()

    def _wait(self, works: list[Work]) -> None:
        for w in works:
            w.wait(self.comm.timeout)

    def _outgoing(self, arr: Any) -> Any:
        """A buffer the transport can send (strict arrays are staged through the host)."""
        return np.ascontiguousarray(to_host(arr)) if self.comm.device.kind == "strict" else arr

    def _incoming(self, shape: Shape, dt: DType) -> Any:
        if self.comm.device.kind == "cuda":
            return self._backend.empty(shape, dt)
        return np.empty(shape, np.dtype(dt.name))

    def _on_device(self, buf: Any) -> Any:
        return self._backend.asarray(buf) if self.comm.device.kind == "strict" else buf

    # ---- shapes -----------------------------------------------------------------------
    def _discover(self, x0: Tensor | None) -> list[tuple[Shape, DType] | None]:
        """Pass (shape, dtype) of each virtual stage's input along the pipeline, building
        each stage lazily on a constant (shape rules only, nothing runs)."""
        s, rank = self.schedule, self.comm.rank
        V, base = s.virtual_stages, 2 * s.virtual_stages * s.microbatches
        io: list[tuple[Shape, DType] | None] = [None] * (V + 1)
        sends: list[Work] = []
        keep: list[np.ndarray] = []
        for v in range(V):
            if s.rank_of(v) != rank:
                continue
            if v == 0:
                assert x0 is not None
                io[0] = (x0.shape, x0.dtype)
            elif io[v] is None:
                meta = np.zeros(_META, np.int64)
                self._wait([self._p2p.recv(meta, s.rank_of(v - 1), base + v)])
                io[v] = _decode(meta)
            shape, dt = io[v]  # type: ignore[misc]
            y = self.stages[v // s.stages](self.params[v // s.stages],
                                           zeros(shape, device=self.comm.device, dtype=dt))
            io[v + 1] = (y.shape, y.dtype)
            if v + 1 < V and s.rank_of(v + 1) != rank:
                keep.append(_encode(y.shape, y.dtype))
                sends.append(self._p2p.send(keep[-1], s.rank_of(v + 1), base + v + 1))
        self._wait(sends)
        return io

    def _boundary(self, index: int) -> tuple[Shape, DType]:
        """(shape, dtype) of virtual stage ``index``'s input, known to this rank."""
        assert self._io is not None
        found = self._io[index]
        if found is None:
            raise RuntimeError(f"rank {self.comm.rank} has no shape for the input of virtual "
                               f"stage {index}, which it should have received")
        return found

    # ---- one step ---------------------------------------------------------------------
    def step(self, inputs: Sequence[Any] | None = None,
             targets: Sequence[Any] | None = None) -> StepResult:
        """Run the schedule once over ``microbatches`` micro-batches and return the mean
        loss and its gradients on every rank of the pipeline.

        ``inputs`` (one per micro-batch) are needed on the rank of virtual stage 0,
        ``targets`` on the rank of the last virtual stage; other ranks may pass None.
        """
        s, rank = self.schedule, self.comm.rank
        V = s.virtual_stages
        xs = self._batch("inputs", inputs) if rank == s.rank_of(0) else None
        ts = self._batch("targets", targets) if rank == s.rank_of(V - 1) else None
        if self._io is None:
            self._io = self._discover(xs[0] if xs else None)
        elif xs and (xs[0].shape, xs[0].dtype) != self._boundary(0):
            shape, dt = self._boundary(0)
            raise ShapeError(f"PipelineExecutor.step: micro-batch input {xs[0].shape} "
                             f"{xs[0].dtype}, but the first step had {shape} {dt}; keep "
                             "the micro-batch shape fixed")
        run = _Run(self, xs, ts)
        self._wait([self._p2p.barrier()])
        t0 = time.perf_counter()
        blocking = s.sends == "blocking"
        pending: list[Work] = []
        for st in self._steps:
            works = []
            for msg in st.recvs:
                shape, dt = self._boundary(msg.vstage + (msg.what == "act"))
                buf = self._incoming(shape, dt)
                run.inbox[(msg.what, msg.vstage, msg.microbatch)] = buf
                works.append(self._p2p.recv(buf, msg.src, msg.tag))
            if blocking and st.recvs:  # a step without receives carries the sends on
                works, pending = pending + works, []
            self._wait(works)
            start = time.perf_counter()
            out = run.action(st.action)
            run.times[st.action] = (start - t0, time.perf_counter() - t0)
            for msg in st.sends:
                buf = self._outgoing(out.pop((msg.what, msg.vstage, msg.microbatch)))
                pending.append(self._p2p.send(buf, msg.dst, msg.tag))
            run.outbox.update(out)  # for a stage on this rank
        self._wait(pending)
        if run.saved or run.inbox or run.outbox:
            raise RuntimeError(f"pipeline step left {len(run.saved)} saved activations and "
                               f"{len(run.inbox) + len(run.outbox)} transfers unused")
        self._last = run.finish()
        return self._last

    def _batch(self, name: str, items: Sequence[Any] | None) -> list[Tensor]:
        m = self.schedule.microbatches
        if items is None or len(items) != m:
            got = "None" if items is None else f"{len(items)}"
            raise ConfigError(f"PipelineExecutor.step: rank {self.comm.rank} needs {name}, "
                              f"one per micro-batch: {m}, got {got}")
        return [self._leaf(x) for x in items]

    def timeline(self) -> Timeline:
        """Gather every rank's measured action times of the last step into a Timeline
        (collective over the pipeline group)."""
        if self._last is None:
            raise ConfigError("PipelineExecutor.timeline: run step() first")
        s = self.schedule
        n = max(len(acts) for acts in s.actions)
        mine = np.zeros((n, 2), np.float64)
        for k, a in enumerate(s.actions[self.comm.rank]):
            mine[k] = self._last.times[a]
        every = np.zeros((s.stages, n, 2), np.float64)
        self._wait([self._p2p.all_gather(mine, every)])
        start = {a: float(every[r, k, 0]) for r, acts in enumerate(s.actions)
                 for k, a in enumerate(acts)}
        end = {a: float(every[r, k, 1]) for r, acts in enumerate(s.actions)
               for k, a in enumerate(acts)}
        return Timeline.measured(s, start, end)


class _Run:
    """The state of one step on one rank: saved activations, gradients, transfers."""

    def __init__(self, ex: PipelineExecutor, xs: list[Tensor] | None,
                 ts: list[Tensor] | None) -> None:
        self.ex, self.xs, self.ts = ex, xs, ts
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.inbox: dict[Key, Any] = {}   # received, not yet used
        self.outbox: dict[Key, Any] = {}  # made here for a stage on this rank
        self.acc: list[list[Tensor] | None] = [None] * ex.schedule.chunks
        self.losses: list[Tensor] = []
        self.times: dict[Action, tuple[float, float]] = {}
        self.live = self.peak = 0

    def _take(self, key: Key) -> Any:
        box = self.inbox if key in self.inbox else self.outbox
        return self.ex._on_device(box.pop(key))

    def action(self, a: Action) -> dict[Key, Any]:
        """Run ``a``; return what it made for other stages, by key."""
        s = self.ex.schedule
        v, i = s.vstage(a), a.microbatch
        if a.kind == "F":
            return self._forward(v, i, a.chunk)
        sv = self.saved[(v, i)]
        if a.kind in ("B", "I"):
            self._complete(v, i, a.chunk, sv)
        assert sv.grads is not None
        gx = sv.grads[0] if v else None
        weights = sv.grads[1:] if v else sv.grads
        if a.kind == "B":
            self._accumulate(a.chunk, weights, *([gx] if gx is not None else []))
        elif a.kind == "I" and gx is not None:
            gx.realize()
        elif a.kind == "W":
            self._accumulate(a.chunk, weights)
        if a.kind in ("B", "W"):  # the saved activations go now
            self.live -= sv.nbytes
            del self.saved[(v, i)]
        if gx is not None and a.kind in ("B", "I"):
            return {("grad", v, i): gx.node.buffer}
        return {}

    def _forward(self, v: int, i: int, chunk: int) -> dict[Key, Any]:
        ex, s = self.ex, self.ex.schedule
        assert self.xs is not None or v > 0
        x = self.xs[i] if self.xs is not None and v == 0 else Tensor(
            leaf(self._take(("act", v - 1, i)), ex.comm.device))
        fn, ps = ex.stages[chunk], ex.params[chunk]
        last = v == s.virtual_stages - 1
        y = fn(ps, x)
        out = self._loss(y, i) if last else y
        if last:
            self.losses.append(out)
        sv = _Saved(x, None, None, _nbytes(x.node) if v else 0)
        if ex.recompute:
            realize(out)
        else:
            forward = _unrealised([out.node])
            effectful = [n for n in forward.values() if n.op.effectful]
            if effectful:
                raise ConfigError(
                    f"PipelineExecutor: virtual stage {v} has a collective "
                    f"({effectful[0].op.name}) in its forward; its backward must be built at "
                    "the backward, in order: use PipelineExecutor(..., recompute=True)")
            self._build(v, sv, y, out if last else None)
            assert sv.grads is not None
            residuals = _residuals(forward, [g.node for g in sv.grads])
            realize(out, *(Tensor(n) for n in residuals))
            sv.nbytes += sum(_nbytes(n) for n in residuals)
        self.saved[(v, i)] = sv
        self.live += sv.nbytes
        self.peak = max(self.peak, self.live)
        return {} if last else {("act", v, i): y.node.buffer}

    def _loss(self, y: Tensor, i: int) -> Tensor:
        assert self.ts is not None
        out = self.ex.loss(y, self.ts[i])
        if out.shape != ():
            raise ShapeError(f"PipelineExecutor: loss gave shape {out.shape}; it must "
                             "return a scalar (reduce with .mean() or .sum())")
        return out

    def _build(self, v: int, sv: _Saved, y: Tensor, loss: Tensor | None,
               ct: Node | None = None) -> None:
        """Build the lazy backward of one micro-batch on virtual stage ``v``: gradients of
        ``loss / m`` on the last stage, else the vjp with cotangent ``ct`` (a leaf to be
        filled at the backward when not given)."""
        ex = self.ex
        chunk = v // ex.schedule.stages
        wrt = ([sv.x] if v else []) + list(ex.params[chunk])
        if loss is not None:
            sv.grads = grad(loss * (1.0 / ex.schedule.microbatches), wrt)
            return
        if ct is None:
            ct = sv.ct = leaf(ex._backend.empty(y.shape, y.dtype), ex.comm.device)
        sv.grads = vjp(y, wrt, Tensor(ct))

    def _complete(self, v: int, i: int, chunk: int, sv: _Saved) -> None:
        """Make the backward of ``(v, i)`` runnable: fill the cotangent leaf built at the
        forward, or (recompute) run the forward again and build the backward now."""
        last = v == self.ex.schedule.virtual_stages - 1
        if sv.grads is not None:
            if sv.ct is not None:
                mark_realised(sv.ct, self._take(("grad", v + 1, i)))
                sv.ct = None
            return
        y = self.ex.stages[chunk](self.ex.params[chunk], sv.x)
        if last:
            self._build(v, sv, y, self._loss(y, i))
        else:
            self._build(v, sv, y, None,
                        leaf(self._take(("grad", v + 1, i)), self.ex.comm.device))

    def _accumulate(self, chunk: int, grads: Sequence[Tensor], *more: Tensor) -> None:
        prev = self.acc[chunk]
        new = list(grads) if prev is None else [a + g for a, g in zip(prev, grads)]
        realize(*more, *new)
        self.acc[chunk] = new

    def finish(self) -> StepResult:
        """Share the loss over the pipeline, average over dp, and package the result."""
        ex, s = self.ex, self.ex.schedule
        total = np.zeros(1, np.float64)
        if self.losses:
            total[0] = sum(float(t.item()) for t in self.losses) / s.microbatches
        ex._wait([ex._p2p.broadcast(total, s.rank_of(s.virtual_stages - 1))])
        grads = [list(g) if g is not None else [] for g in self.acc]
        loss = float(total[0])
        if ex.dp is not None and ex.dp.size > 1:
            flat = [ex.dp.all_reduce(g, "avg") for gs in grads for g in gs]
            lt = ex.dp.all_reduce(tensor(total, device=ex.comm.device), "avg")
            realize(lt, *flat)
            loss = float(lt.numpy()[0])
            it = iter(flat)
            grads = [[next(it) for _ in gs] for gs in grads]
        return StepResult(loss, grads, self.times, self.peak)


def _unrealised(outs: Any) -> dict[int, Node]:
    """The unrealised nodes under ``outs`` (the forward graph), by id."""
    seen: dict[int, Node] = {}
    stack = [n for n in outs if n.buffer is None]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen[id(n)] = n
        stack.extend(x for x in n.inputs if x.buffer is None and id(x) not in seen)
    return seen


def _residuals(forward: dict[int, Node], backward: list[Node]) -> list[Node]:
    """The forward values the backward graph reads: walk the backward from its outputs and
    stop at forward nodes (those are what the forward must keep)."""
    found: dict[int, Node] = {}
    seen: set[int] = set()
    stack = list(backward)
    while stack:
        n = stack.pop()
        if id(n) in seen or n.buffer is not None:
            continue
        seen.add(id(n))
        if id(n) in forward:
            found[id(n)] = n
            continue
        stack.extend(n.inputs)
    return list(found.values())


def _nbytes(n: Node) -> int:
    return int(getattr(n.buffer, "nbytes", 0) or 0)


def _encode(shape: Shape, dt: DType) -> np.ndarray:
    name = dt.name.encode()
    if len(shape) > 15 or len(name) > _META - 16:
        raise ShapeError(f"PipelineExecutor: activation {shape} {dt} has {len(shape)} axes; "
                         "reshape it to at most 15")
    meta = np.zeros(_META, np.int64)
    meta[0] = len(shape)
    meta[1:1 + len(shape)] = shape
    meta[16:16 + len(name)] = list(name)
    return meta


def _decode(meta: np.ndarray) -> tuple[Shape, DType]:
    ndim = int(meta[0])
    name = bytes(int(c) for c in meta[16:] if c).decode()
    return tuple(int(d) for d in meta[1:1 + ndim]), as_dtype(name)
