"""``fuelspmd bench pipeline``: the executor's measured bubble, step time and activation
memory beside the schedule's formula and simulator, in the same run.

    mpiexec -n P fuelspmd bench pipeline [--microbatches 8] [--hidden 1024] [--batch 64]
        [--layers 16] [--steps 5] [--dp 1] [--trace out.json] [--json]

The model: an input gain ``x * g`` (a norm's scale), ``--layers`` layers ``tanh(x @ W + b)``
of width ``--hidden`` on micro-batches of ``--batch`` rows, float32, and a mean squared
error. It is cut into ``p = P / dp`` stages as a user would: each rank first times one
layer's, the gain's and the loss's forward + backward alone (no communication), the ranks
average the times, and :func:`~fuelspmd.pipeline_parallel.partition` splits the layers
with the gain as ``first_extra`` and the loss as ``last_extra``.

Default sizes. A stage's compute per micro-batch must dominate a hop, which the formula
counts as free: one activation (``batch * hidden * 4`` bytes, 256 KiB by default) takes
about 0.2 ms between two ranks of one node under MPICH, and in 1F1B's steady state a hop
sits on the critical path once per micro-batch. With 8 layers of width 1024 per stage a
micro-batch's F + B on a CPU core is hundreds of hops long, so the hops are a small share of
the step (``step/sim`` in the output says how small).

Sensitivity. At p = 2 the step follows the slower rank while the busy time is the mean of
both, so a rank ``e`` (relative) slower than the other raises bubble/formula by about
``(m/2 - m/(m+1)) e``: 3.1 e at m = 8, 1.2 e at m = 4. Identical actions vary from one
micro-batch to the next (``jitter``) and the ranks' speeds differ (``imbalance``), so the
measured ``sim bubble``, which has no transfer time in it, is already above the formula;
``stage formula`` and ``bubble/stage`` separate that from the executor's own overhead.

GPipe and 1F1B steps alternate (A, B, A, B) after one warm-up step each; every figure is
the median over ``--steps`` steps of the measured timeline (``PipelineExecutor.timeline``:
each action's compute, timed with ``time.perf_counter`` on its rank):

- ``bubble`` = ``1 - sum(busy) / (p * step)``, busy the ranks' summed action times and
  step the first action's start to the last one's end (the formula's meaning: the idle
  share of ``p`` ranks over the step), against ``(p-1)/(m+p-1)``: ``bubble/formula``;
- ``sim bubble``: the simulator's bubble with the measured action times (no transfer
  time), so a gap between it and the formula is uneven action times, and a gap between it
  and ``bubble`` is transfer and wait overhead;
- ``jitter``: how much identical actions vary, the median over ranks and kinds of the
  standard deviation of the micro-batches' F (or B) times over their mean (docs/pipeline.md);
- ``imbalance``: the slowest stage's mean F+B per micro-batch over the mean of the
  stages, minus 1 (at p = 2 it is e/2 above: each 1% adds about 6% to bubble/formula at m = 8);
  ``stage formula`` is ``simulate()`` with each stage's mean F and B times (the formula
  for unequal stages) and ``bubble/stage`` the measured bubble against it;
- ``step`` against ``simulate()`` fed with that step's measured per-action times:
  ``step/sim``;
- ``peak saved`` activation bytes, the most over ranks: 1F1B against GPipe, with the
  bound ``p/m`` beside it.

With ``--dp D`` the world is ``D`` pipelines whose gradients are averaged over ``dp`` in
buckets (``--bucket-bytes``) started inside each stage's last backward; the table then
also lists, for rank 0's pipeline, when each bucket's all-reduce was issued and done
against that last backward, and ``--trace`` writes the last 1F1B step as a Chrome trace
(actions per rank, and the dp all-reduces of this rank on their own row).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from fuelspmd.autograd import grad, vjp
from fuelspmd.bench import Column, median, parser, print_json, print_table
from fuelspmd.comm import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.launch import init
from fuelspmd.mesh import Mesh
from fuelspmd.nn import Module, Parameter
from fuelspmd.pipeline_parallel import PipelineExecutor, partition, schedule, simulate
from fuelspmd.pipeline_parallel.buckets import DP_BUCKET_BYTES
from fuelspmd.pipeline_parallel.render import chrome_trace
from fuelspmd.tensor import Tensor, realize, tensor

__all__ = ["main", "run"]


def _layer(w: Tensor, b: Tensor, x: Tensor) -> Tensor:
    return (x @ w + b).tanh()


class _Stage(Module):
    """A stage: on the first, the gain ``x * g``; then layers of ``tanh(x @ W + b)``.

    ``params`` are ``[g]`` (first stage only) then ``W, b`` per layer. Every stage computes
    the gradient of its first layer's input: on stages > 0 it goes to the previous stage,
    on the first it gives ``dg`` (the gain is why the first stage is not lighter by one of
    its ``3 * layers`` matmuls).
    """

    def __init__(self, first: bool, params: list[np.ndarray], device: Any) -> None:
        self.first = first
        self.params = [Parameter(a, device=device) for a in params]

    def forward(self, x: Tensor) -> Tensor:
        ps, k = self.params, int(self.first)
        if self.first:
            x = x * ps[0]
        for j in range((len(ps) - k) // 2):
            x = _layer(ps[k + 2 * j], ps[k + 2 * j + 1], x)
        return x


def _mse(y: Tensor, t: Tensor) -> Tensor:
    """Mean squared error, the square as a product (``** 2`` is a general power)."""
    d = y - t
    return (d * d).mean()


def _timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, after one untimed call."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return median(out)


def measure_costs(*, hidden: int, batch: int, device: Any, reps: int = 5
                  ) -> tuple[float, float, float]:
    """Forward + backward seconds of one layer, of the gain and of the loss on one
    micro-batch, each realised alone on this rank (what a user profiles before cutting)."""
    rng = np.random.default_rng(11)
    x = tensor(rng.standard_normal((batch, hidden)).astype(np.float32), device=device)
    ct = tensor(rng.standard_normal((batch, hidden)).astype(np.float32), device=device)
    w = tensor((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
               device=device)
    b = tensor(np.zeros(hidden, np.float32), device=device)
    g = tensor(np.ones(hidden, np.float32), device=device)

    def layer() -> None:
        y = _layer(w, b, x)
        realize(y, *vjp(y, [x, w, b], ct))

    def gain() -> None:
        y = x * g
        realize(y, *vjp(y, [g], ct))

    def loss() -> None:
        out = _mse(x, ct)
        realize(out, *grad(out, [x]))

    return _timed(layer, reps), _timed(gain, reps), _timed(loss, reps)


def run(*, microbatches: int, hidden: int, batch: int, layers: int, steps: int, dp: int = 1,
        bucket_bytes: int = DP_BUCKET_BYTES) -> dict[str, Any]:
    """Run GPipe and 1F1B interleaved over the world; return the figures (every rank)."""
    world = init()
    load = [os.getloadavg()[0]]
    if dp < 1 or world.size % dp:
        ok = [d for d in range(1, world.size + 1) if world.size % d == 0]
        raise ConfigError(f"bench pipeline: --dp {dp} does not divide the {world.size} ranks; "
                          f"use one of {ok}")
    mesh = Mesh(world, pp=world.size // dp, dp=dp)
    pp, dpc = mesh.comm("pp"), mesh.comm("dp")
    p, m = pp.size, microbatches
    costs = measure_costs(hidden=hidden, batch=batch, device=world.device)
    mean = world.comm.all_reduce(tensor(np.array(costs), device=world.device), "avg").numpy()
    layer_s, gain_s, loss_s = (float(c) for c in mean)
    part = partition([layer_s] * layers, p, first_extra=gain_s, last_extra=loss_s)
    mine = part[pp.rank]
    rng = np.random.default_rng([3, pp.rank])
    params: list[np.ndarray] = [np.ones(hidden, np.float32)] if pp.rank == 0 else []
    for _ in mine:
        params += [(rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
                   np.zeros(hidden, np.float32)]
    data = np.random.default_rng([7, mesh.coord("dp")])
    xs = [data.standard_normal((batch, hidden)).astype(np.float32) for _ in range(m)]
    execs = {kind: PipelineExecutor(schedule(kind, p, m), comm=pp,
                                    stages=[_Stage(pp.rank == 0, params, world.device)],
                                    loss=_mse, dp=dpc, bucket_bytes=bucket_bytes)
             for kind in ("gpipe", "1f1b")}
    figures: dict[str, dict[str, list[float]]] = {k: {} for k in execs}
    trace: dict[str, Any] = {}
    for n in range(steps + 1):
        for kind, ex in execs.items():
            out = _step(ex, xs if pp.rank == 0 else None, xs if pp.rank == p - 1 else None)
            tl = ex.timeline()
            peak = _max(pp, float(out.peak_saved_bytes))
            if n == 0:
                continue  # warm-up: plans made, buffers faulted in
            if kind == "1f1b":
                trace = _trace(tl, out, pp.rank)
            took = {a: tl.end[a] - tl.start[a] for a in tl.start}
            sim = simulate(ex.schedule, took)
            t_f, t_b = _stage_means(ex.schedule, took)
            stage = simulate(ex.schedule, t_f, t_b)
            per = [f + b for f, b in zip(t_f, t_b)]
            f = figures[kind]
            f.setdefault("stage_bubble", []).append(stage.bubble)
            for r in range(p):
                f.setdefault(f"f{r}", []).append(t_f[r] * 1e3)
                f.setdefault(f"b{r}", []).append(t_b[r] * 1e3)
            f.setdefault("imbalance", []).append(max(per) / (sum(per) / len(per)) - 1.0)
            f.setdefault("jitter", []).append(_jitter(ex.schedule, took))
            f.setdefault("step_ms", []).append(tl.makespan * 1e3)
            f.setdefault("bubble", []).append(tl.bubble)
            f.setdefault("sim_ms", []).append(sim.makespan * 1e3)
            f.setdefault("sim_bubble", []).append(sim.bubble)
            f.setdefault("peak", []).append(peak)
    load.append(os.getloadavg()[0])
    formula = (p - 1) / (m + p - 1)
    rows = []
    for kind, f in figures.items():
        rows.append({
            "kind": kind, "stages": p, "microbatches": m,
            "step_ms": median(f["step_ms"]), "sim_ms": median(f["sim_ms"]),
            "step_vs_sim": median([a / b for a, b in zip(f["step_ms"], f["sim_ms"])]),
            "bubble": median(f["bubble"]), "sim_bubble": median(f["sim_bubble"]),
            "formula": formula,
            "bubble_vs_formula": median(f["bubble"]) / formula if formula else float("nan"),
            "imbalance": median(f["imbalance"]), "jitter": median(f["jitter"]),
            "stage_bubble": median(f["stage_bubble"]),
            "bubble_vs_stage": (median([a / b for a, b in zip(f["bubble"], f["stage_bubble"])])
                                if formula else float("nan")),
            "stage_f_ms": [median(f[f"f{r}"]) for r in range(p)],
            "stage_b_ms": [median(f[f"b{r}"]) for r in range(p)],
            "peak_saved_bytes": int(max(f["peak"])),
        })
    ratio = rows[1]["peak_saved_bytes"] / rows[0]["peak_saved_bytes"]
    return {"rank": world.rank, "rows": rows, "peak_1f1b_vs_gpipe": ratio, "bound": p / m,
            "dp": dp, "layers_per_stage": [len(r) for r in part],
            "costs_ms": {"layer": layer_s * 1e3, "gain": gain_s * 1e3, "loss": loss_s * 1e3},
            "trace": trace, "load": load}


def _step(ex: PipelineExecutor, xs: Any, ts: Any) -> Any:
    """One step with Python's cycle collector run before it and kept out of it (as
    ``timeit`` does): a collection inside an action would be charged to that action."""
    gc.collect()
    gc.disable()
    try:
        return ex.step(xs, ts)
    finally:
        gc.enable()


def _max(comm: Communicator, value: float) -> float:
    return float(comm.all_reduce(tensor(np.array([value]), device=comm.device), "max").numpy()[0])


def _trace(tl: Any, out: Any, rank: int) -> dict[str, Any]:
    """The step as a Chrome trace, with this rank's dp bucket all-reduces (issued to done)
    on a row of their own, and those stamps against this rank's last backward."""
    doc = chrome_trace(tl)
    events = doc["traceEvents"]
    assert isinstance(events, list)
    row = tl.schedule.stages + rank
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": row,
                   "args": {"name": f"rank {rank} dp all-reduce"}})
    for chunk, bucket, issued, done in out.reduces:
        events.append({"name": f"dp bucket {bucket}", "cat": "dp", "ph": "X", "pid": 0,
                       "tid": row, "ts": issued * 1e6, "dur": (done - issued) * 1e6,
                       "args": {"chunk": chunk}})
    last = [a for a in tl.schedule.actions[rank] if a.kind in ("B", "W")][-1]
    start, end = out.times[last]
    return {"chrome": doc, "last_backward": str(last), "backward_ms": [start * 1e3, end * 1e3],
            "reduces_ms": [[b, i * 1e3, d * 1e3] for _, b, i, d in out.reduces]}


def _jitter(sched: Any, took: dict[Any, float]) -> float:
    """The spread of identical actions: for each rank and kind (F, B), the standard
    deviation of its micro-batches' times over their mean; the median of those. The
    formula assumes every F (and every B) takes the same time; a jitter ``j`` raises the
    simulated bubble above it even with the stages balanced on average."""
    spreads = []
    for kind in ("F", "B"):
        for acts in sched.actions:
            ts = [took[a] for a in acts if a.kind == kind]
            if len(ts) > 1:
                mean = sum(ts) / len(ts)
                spreads.append(statistics.pstdev(ts) / mean if mean > 0 else 0.0)
    return median(spreads) if spreads else 0.0


def _stage_means(sched: Any, took: dict[Any, float]) -> tuple[list[float], list[float]]:
    """Each rank's mean forward and backward time per micro-batch (seconds): the uniform
    per-stage times the formula takes, here one pair per stage."""
    means = []
    for kind in ("F", "B"):
        per = []
        for acts in sched.actions:
            ts = [took[a] for a in acts if a.kind == kind]
            per.append(sum(ts) / len(ts))
        means.append(per)
    return means[0], means[1]


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table (or JSON) on rank 0. Returns the exit code."""
    ap = parser("fuelspmd bench pipeline", __doc__)
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (8)")
    ap.add_argument("--hidden", type=int, default=1024, help="layer width (1024)")
    ap.add_argument("--batch", type=int, default=64, help="rows per micro-batch (64)")
    ap.add_argument("--layers", type=int, default=16,
                    help="layers of the whole model, cut into stages by partition() (16)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per schedule (5)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel pipelines (1)")
    ap.add_argument("--bucket-bytes", type=int, default=DP_BUCKET_BYTES,
                    help=f"dp gradient bucket size in bytes ({DP_BUCKET_BYTES})")
    ap.add_argument("--trace", default=None, help="write the last 1F1B step here (Chrome trace)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        for name in ("microbatches", "hidden", "batch", "layers", "steps", "dp",
                     "bucket_bytes"):
            if getattr(args, name) < 1:
                raise ConfigError(f"bench pipeline: --{name.replace('_', '-')} must be >= 1, "
                                  f"got {getattr(args, name)}")
        res = run(microbatches=args.microbatches, hidden=args.hidden, batch=args.batch,
                  layers=args.layers, steps=args.steps, dp=args.dp,
                  bucket_bytes=args.bucket_bytes)
    except ConfigError as e:
        print(f"fuelspmd bench pipeline: {e}", file=sys.stderr, flush=True)
        return 2
    if res["rank"] != 0:
        return 0
    trace = res.pop("trace")
    if args.trace:
        with open(args.trace, "w") as fh:
            json.dump(trace["chrome"], fh)
    if args.json:
        print_json({"bench": "pipeline", **res,
                    "dp_reduces": {k: v for k, v in trace.items() if k != "chrome"}})
        return 0
    c = res["costs_ms"]
    print_table(f"pipeline executor, {res['rows'][0]['stages']} stages x dp {res['dp']}, "
                f"{args.microbatches} micro-batches, layers per stage "
                f"{res['layers_per_stage']} (partition of measured F+B: layer {c['layer']:.2f} "
                f"ms, gain {c['gain']:.2f}, loss {c['loss']:.2f}; median of {args.steps} "
                "interleaved steps)",
                [Column("schedule", "kind"), Column("step ms", "step_ms", "{:.2f}"),
                 Column("sim ms", "sim_ms", "{:.2f}"),
                 Column("step/sim", "step_vs_sim", "{:.3f}"),
                 Column("bubble", "bubble", "{:.3f}"),
                 Column("sim bubble", "sim_bubble", "{:.3f}"),
                 Column("formula", "formula", "{:.3f}"),
                 Column("bubble/formula", "bubble_vs_formula", "{:.3f}"),
                 Column("imbalance", "imbalance", "{:.3f}"),
                 Column("jitter", "jitter", "{:.3f}"),
                 Column("stage formula", "stage_bubble", "{:.3f}"),
                 Column("bubble/stage", "bubble_vs_stage", "{:.3f}"),
                 Column("peak saved B", "peak_saved_bytes", "{}")], res["rows"])
    print(f"peak saved activations 1F1B/GPipe = {res['peak_1f1b_vs_gpipe']:.3f} "
          f"(bound p/m = {res['bound']:.3f}); 1-min load average {res['load'][0]:.2f} "
          f"before, {res['load'][1]:.2f} after (the bubble needs one idle core per rank)")
    if trace["reduces_ms"]:
        b0, b1 = trace["backward_ms"]
        print(f"rank 0, last 1F1B step: last backward {trace['last_backward']} ran "
              f"{b0:.2f}-{b1:.2f} ms; dp bucket all-reduces (issued-done, ms): "
              + ", ".join(f"#{b} {i:.2f}-{d:.2f}" for b, i, d in trace["reduces_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
