"""One step of :class:`~fuelspmd.pipeline_parallel.executor.PipelineExecutor` on one rank:
each micro-batch's forward, saved activations, backward and gradient accumulation.

Layer 7; split from ``executor.py``, which owns the transfers and the schedule walk (see its
module docs for the saved-activation and recompute rules this implements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fuelspmd.autograd import grad, vjp
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.graph.node import Node, leaf, mark_realised
from fuelspmd.pipeline_parallel.actions import Action
from fuelspmd.tensor import Tensor, realize

if TYPE_CHECKING:
    from fuelspmd.pipeline_parallel.executor import PipelineExecutor

__all__ = ["Key", "StepResult", "StepRun"]

Key = tuple[str, int, int]

@dataclass
class StepResult:
    """What one :meth:`PipelineExecutor.step` gives every rank of the pipeline.

    ``loss``: the mean over micro-batches of ``loss(y_i, target_i)`` (and over ``dp``).
    ``grads[j][k]``: d loss / d ``params[j][k]`` of this rank's chunk ``j``, realised.
    ``times[a]``: (start, end) of action ``a``'s compute, seconds after the step's barrier.
    ``peak_saved_bytes``: the most bytes of saved activations this rank held at once.
    ``reduces``: ``(chunk, bucket, issued, done)`` of each dp gradient all-reduce, seconds
    after the step's barrier (empty without ``dp``); ``done`` is when its wait returned.
    """

    loss: float
    grads: list[list[Tensor]]
    times: dict[Action, tuple[float, float]] = field(default_factory=dict)
    peak_saved_bytes: int = 0
    reduces: list[tuple[int, int, float, float]] = field(default_factory=list)


@dataclass
class _Saved:
    """One micro-batch on one virtual stage, from its forward to its backward."""

    x: Tensor
    grads: list[Tensor] | None  # the lazy backward (None until built, with recompute)
    ct: Node | None  # the cotangent leaf, filled at the backward (None on the last stage)
    nbytes: int


class StepRun:
    """The state of one step on one rank: saved activations, gradients, transfers."""

    def __init__(self, ex: PipelineExecutor, xs: list[Tensor] | None,
                 ts: list[Tensor] | None) -> None:
        self.ex, self.xs, self.ts = ex, xs, ts
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.inbox: dict[Key, Any] = {}   # received, not yet used
        self.outbox: dict[Key, Any] = {}  # made here for a stage on this rank
        self.acc: list[list[Tensor] | None] = [None] * ex.schedule.chunks
        self.count = [0] * ex.schedule.chunks  # micro-batches accumulated per chunk
        self.t0 = 0.0
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
        """Add one micro-batch's weight gradients (realising ``more`` with them); at the
        chunk's last micro-batch, start the dp bucket all-reduces in the same graph."""
        prev = self.acc[chunk]
        new = list(grads) if prev is None else [a + g for a, g in zip(prev, grads)]
        self.count[chunk] += 1
        red = self.ex._reducer
        if red is None or self.count[chunk] < self.ex.schedule.microbatches:
            realize(*more, *new)
            self.acc[chunk] = new
            return
        flats = red.start(chunk, new)
        realize(*flats, *more)  # buckets first: see buckets.py on the order
        self.acc[chunk] = red.unpack(chunk, flats, new)

    def finish(self) -> StepResult:
        """Share the loss over the pipeline, average over dp, and package the result."""
        ex, s = self.ex, self.ex.schedule
        total = np.zeros(1, np.float64)
        if self.losses:
            total[0] = sum(float(t.item()) for t in self.losses) / s.microbatches
        ex._wait([ex._p2p.broadcast(total, s.rank_of(s.virtual_stages - 1))])
        grads = [list(g) if g is not None else [] for g in self.acc]
        loss, reduces = float(total[0]), []
        if ex._reducer is not None:
            if any(c != s.microbatches for c in self.count):
                raise RuntimeError(f"pipeline step accumulated {self.count} micro-batches "
                                   f"per chunk, not {s.microbatches}: buckets not reduced")
            reduces = ex._reducer.stamps(self.t0)
            loss = ex._reducer.average(total)
        return StepResult(loss, grads, self.times, self.peak, reduces)


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
