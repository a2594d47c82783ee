"""One step of a pipeline on one rank: each micro-batch's forward, saved activations,
backward and gradient accumulation (the transfers and the schedule walk are the
executor's; see :mod:`fuelspmd.pipeline_parallel.executor` for the rules implemented here).

Layer 7; imports nothing of the executor: a :class:`StepRun` gets the stages, their
parameters and the data-parallel communicator it needs, and values as tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fuelspmd.autograd import grad, vjp
from fuelspmd.backend import get_backend
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.graph.node import Node, fill, leaf
from fuelspmd.pipeline_parallel.actions import Action, Schedule
from fuelspmd.tensor import Tensor, realize

__all__ = ["Key", "ReduceFn", "StepResult", "StepRun"]

Key = tuple[str, int, int]
StageFn = Callable[[Tensor], Tensor]  # a stage Module's forward
LossFn = Callable[[Tensor, Tensor], Tensor]
ReduceFn = Callable[[int, list[Tensor]], list[Tensor]]  # (chunk, its gradients) -> lazy


@dataclass
class StepResult:
    """What one :meth:`PipelineExecutor.step` gives every rank of the pipeline.

    ``loss``: the mean over micro-batches of ``loss(y_i, target_i)`` (and over ``dp``), a
    realised float64 0-d tensor (``float(res.loss)``), the same on every rank.
    ``grads[j][k]``: d loss / d ``params[j][k]`` of this rank's chunk ``j``, realised (or,
    with the executor's ``reduce``, what it gave for chunk ``j``).
    ``times[a]``: (start, end) of action ``a``'s compute, seconds after the step's barrier.
    ``peak_saved_bytes``: the most bytes of saved activations this rank held at once.
    ``peak_run_bytes``: the most bytes the graph executor held inside one action's realise
    (its working set, beside the saved activations; the process's executor, so a
    DeviceGroup's devices share one figure).
    ``started``: ``time.perf_counter()`` at the barrier ``times`` count from (to place
    other perf_counter stamps, such as a Communicator's ``record_times``, on them).
    ``reduces``: ``(chunk, call, issued, done)`` of each dp gradient all-reduce call (a
    bucket is one call), seconds after the step's barrier (empty without ``dp``).
    """

    loss: Tensor | None
    grads: list[list[Tensor]]
    times: dict[Action, tuple[float, float]] = field(default_factory=dict)
    peak_saved_bytes: int = 0
    reduces: list[tuple[int, int, float, float]] = field(default_factory=list)
    peak_run_bytes: int = 0
    started: float = 0.0


@dataclass
class _Saved:
    """One micro-batch on one virtual stage, from its forward to its backward."""

    x: Tensor
    grads: list[Tensor] | None  # the lazy backward (None until built, with recompute)
    ct: Node | None  # the cotangent leaf, filled at the backward (None on the last stage)
    nbytes: int


class StepRun:
    """The state of one step on one rank: saved activations and accumulated gradients.

    ``stages[j]``/``params[j]`` are chunk ``j`` of this rank (its Module and that Module's
    parameters, which it reads when called); ``xs``/``ts`` the micro-batch
    inputs (rank of virtual stage 0) and targets (rank of the last one). With ``dp``, the
    chunk's gradients are averaged over it as its last micro-batch accumulates them: one
    all_reduce per gradient, last parameter first, in that action's graph, so the planner
    buckets them (``dp.bucket_bytes``) and starts each as soon as it is ready.
    """

    def __init__(self, schedule: Schedule, stages: Sequence[StageFn],
                 params: Sequence[Sequence[Tensor]], loss: LossFn, *, recompute: bool,
                 dp: Any, xs: list[Tensor] | None, ts: list[Tensor] | None,
                 reduce: ReduceFn | None = None, dropout: Any = None) -> None:
        self.schedule, self.stages, self.params, self.loss = schedule, stages, params, loss
        self.recompute, self.dp, self.xs, self.ts = recompute, dp, xs, ts
        self.reduce = reduce
        self.dropout = dropout
        self.peak_run = 0
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.acc: list[list[Tensor] | None] = [None] * schedule.chunks
        self.count = [0] * schedule.chunks  # micro-batches accumulated per chunk
        self.reduced: list[tuple[int, int]] = []  # (chunk, first dp time index) per chunk
        self.losses: list[Tensor] = []
        self.live = self.peak = 0

    def action(self, a: Action, inputs: dict[Key, Tensor]) -> dict[Key, Tensor]:
        """Run ``a`` on the values it needs (``inputs``, by key); return what it made for
        other stages, realised, by key."""
        s = self.schedule
        v, i = s.vstage(a), a.microbatch
        if a.kind == "F":
            return self._forward(v, i, a.chunk, inputs.get(("act", v - 1, i)))
        sv = self.saved[(v, i)]
        if a.kind in ("B", "I"):
            self._complete(v, i, a.chunk, sv, inputs.get(("grad", v + 1, i)))
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
            return {("grad", v, i): gx}
        return {}

    def _forward(self, v: int, i: int, chunk: int, x: Tensor | None) -> dict[Key, Tensor]:
        s = self.schedule
        if v == 0:
            assert self.xs is not None
            x = self.xs[i]
        assert x is not None
        x = x.realize()
        y = self._call(chunk, i, x)
        last = v == s.virtual_stages - 1
        out = self._loss(y, i) if last else y
        if last:
            self.losses.append(out)
        sv = _Saved(x, None, None, _nbytes(x.node) if v else 0)
        if self.recompute:
            realize(out)
        else:
            forward = _unrealised([out.node])
            # a collective (an op the transport starts); a host value is no collective
            effectful = [n for n in forward.values() if n.op.start is not None]
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
        return {} if last else {("act", v, i): y}

    def _call(self, chunk: int, i: int, x: Tensor) -> Tensor:
        """Chunk ``chunk``'s stage on micro-batch ``i``'s input, its Dropout keyed by ``i``."""
        if self.dropout is not None:
            self.dropout.set_step(self.dropout.step, i)
        return self.stages[chunk](x)

    def _loss(self, y: Tensor, i: int) -> Tensor:
        assert self.ts is not None
        out = self.loss(y, self.ts[i])
        if out.shape != ():
            raise ShapeError(f"PipelineExecutor: loss gave shape {out.shape}; it must "
                             "return a scalar (reduce with .mean() or .sum())")
        return out

    def _build(self, v: int, sv: _Saved, y: Tensor, loss: Tensor | None,
               ct: Node | None = None) -> None:
        """Build the lazy backward of one micro-batch on virtual stage ``v``: gradients of
        ``loss / m`` on the last stage, else the vjp with cotangent ``ct`` (a leaf to be
        filled at the backward when not given)."""
        chunk = v // self.schedule.stages
        wrt = ([sv.x] if v else []) + list(self.params[chunk])
        if loss is not None:
            sv.grads = grad(loss * (1.0 / self.schedule.microbatches), wrt)
            return
        if ct is None:  # a placeholder of the cotangent, given its buffer at the backward
            ct = sv.ct = leaf(_empty_like(y), y.device)
        sv.grads = vjp(y, wrt, Tensor(ct))

    def _complete(self, v: int, i: int, chunk: int, sv: _Saved, g: Tensor | None) -> None:
        """Make the backward of ``(v, i)`` runnable: fill the cotangent leaf built at the
        forward with ``g`` (the gradient of ``v + 1``), or (recompute) run the forward
        again and build the backward now."""
        last = v == self.schedule.virtual_stages - 1
        if sv.grads is not None:
            if sv.ct is not None:
                assert g is not None
                fill(sv.ct, g.realize().node)
                sv.ct = None
            return
        y = self._call(chunk, i, sv.x)
        if last:
            self._build(v, sv, y, self._loss(y, i))
        else:
            assert g is not None
            self._build(v, sv, y, None, g.realize().node)

    def _accumulate(self, chunk: int, grads: Sequence[Tensor], *more: Tensor) -> None:
        """Add one micro-batch's weight gradients (realising ``more`` with them); at the
        chunk's last micro-batch, ``reduce`` them, or average them over dp, in the same
        graph."""
        prev = self.acc[chunk]
        new = list(grads) if prev is None else [a + g for a, g in zip(prev, grads)]
        self.count[chunk] += 1
        dp = self.dp
        if self.count[chunk] < self.schedule.microbatches:
            realize(*more, *new)
        elif self.reduce is not None:
            new = self.reduce(chunk, new)
            realize(*more, *new)
        elif dp is not None:
            first = len(dp.times)
            new = [dp.all_reduce(g, "avg") for g in reversed(new)][::-1]
            realize(*more, *new)
            self.reduced.append((chunk, first))
        else:
            realize(*more, *new)
        self.acc[chunk] = new

    def finish(self, t0: float) -> StepResult:
        """Package the step's gradients and dp stamps (the loss is the executor's to share)."""
        grads = [list(g) if g is not None else [] for g in self.acc]
        reduces: list[tuple[int, int, float, float]] = []
        if self.dp is not None:
            if any(c != self.schedule.microbatches for c in self.count):
                raise RuntimeError(f"pipeline step accumulated {self.count} micro-batches "
                                   f"per chunk, not {self.schedule.microbatches}")
            ends = [f for _, f in self.reduced[1:]] + [len(self.dp.times)]
            for (chunk, first), end in zip(self.reduced, ends):
                for b, (issued, done) in enumerate(self.dp.times[first:end]):
                    reduces.append((chunk, b, issued - t0, done - t0))
        return StepResult(None, grads, {}, self.peak, reduces, self.peak_run)


def _empty_like(y: Tensor) -> Any:
    return get_backend(y.device.kind).empty(y.shape, y.dtype)


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
    return 0 if n.buffer is None else math.prod(n.shape) * n.dtype.itemsize
