"""``fuelspmd bench pipeline``: the executor's measured bubble, step time and activation
memory beside the schedule's formula and simulator, in the same run.

    mpiexec -n P fuelspmd bench pipeline [--microbatches 8] [--hidden 512] [--batch 32]
        [--layers 2] [--steps 5] [--json]

``P`` ranks form one pipeline (``Mesh(world, pp=P)``); each stage is an input gain then
``--layers`` layers ``tanh(x @ W + b)`` of width ``--hidden`` on micro-batches of ``--batch``
rows, float32, mean squared error on the last; the gain and the MSE's ``d * d`` keep the
stages' F and B times equal, as the formula assumes (see ``_stage``). GPipe and 1F1B
steps alternate (A, B, A, B) after one warm-up step each; every figure is the median over
``--steps`` steps, from the measured timeline (``PipelineExecutor.timeline``):

- ``bubble`` against the formula ``(p-1)/(m+p-1)``: ``bubble/formula``; ``sim bubble`` is
  the simulator's bubble with the measured action times, so a gap between it and the
  formula is uneven action times (stage imbalance, a busy machine), and a gap between it
  and ``bubble`` is transfer and wait overhead;
- ``imbalance``: the slowest stage's mean F+B per micro-batch over the mean of the
  stages, minus 1 (the formula assumes 0; at p = 2 and m = 8 each 1% of it adds about
  0.0035 to the bubble); ``stage formula`` is the formula for unequal stages, the bubble
  of ``simulate()`` with each stage's mean F and B times (``(p-1)/(m+p-1)`` when they are
  equal), and ``bubble/stage`` the measured bubble against it: what is left is per-action
  jitter and transfer and wait overhead;
- ``step`` against ``simulate()`` fed with that step's measured per-action times (no
  communication time): ``step/sim``;
- ``peak saved`` activation bytes, the most over ranks: 1F1B against GPipe, with the
  bound ``p/m`` beside it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from fuelspmd.bench import Column, median, print_json, print_table
from fuelspmd.errors import ConfigError
from fuelspmd.launch import init
from fuelspmd.mesh import Mesh
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule, simulate
from fuelspmd.tensor import Tensor, tensor

__all__ = ["main", "run"]


def _stage(layers: int) -> Any:
    """One stage: an input gain ``g`` (a norm's scale), then ``layers`` of ``tanh(x @ W + b)``.

    The gain is what makes the stages equal. The formula ``(p-1)/(m+p-1)`` assumes every
    stage takes the same forward and the same backward time; without the gain, stage 0's
    input is a leaf nobody differentiates, so its backward skips ``dx = dy @ W1^T``, one of
    its ``3 * layers`` matmuls (measured at p = 2, ``--hidden 1024 --batch 64``: stage 0
    F+B 23 ms, stage 1 32 ms, bubble 0.21 against 0.111). With ``g`` a parameter every
    stage needs ``d(x * g)``, so each runs ``layers`` matmuls forward and ``2 * layers``
    backward; what is left uneven is elementwise (the last stage's loss, and ``dx = d(x *
    g) * g`` on stages > 0).
    """
    def fn(params: list[Tensor], x: Tensor) -> Tensor:
        x = x * params[0]
        for k in range(layers):
            x = (x @ params[1 + 2 * k] + params[2 + 2 * k]).tanh()
        return x
    return fn


def _mse(y: Tensor, t: Tensor) -> Tensor:
    """Mean squared error, the square as a product: ``** 2`` is a general power forward and
    backward, which made the last stage's F measurably slower than the others."""
    d = y - t
    return (d * d).mean()


def run(*, microbatches: int, hidden: int, batch: int, layers: int, steps: int) -> dict[str, Any]:
    """Run GPipe and 1F1B interleaved over the world; return the figures (every rank)."""
    world = init()
    pp = Mesh(world, pp=world.size).comm("pp")
    p, m = pp.size, microbatches
    rng = np.random.default_rng([3, pp.rank])
    params = [np.ones(hidden, np.float32)] + [
        rng.standard_normal((hidden, hidden)).astype(np.float32) / np.sqrt(hidden)
        if k % 2 == 0 else np.zeros(hidden, np.float32) for k in range(2 * layers)]
    data = np.random.default_rng(7)
    xs = [data.standard_normal((batch, hidden)).astype(np.float32) for _ in range(m)]
    execs = {kind: PipelineExecutor(schedule(kind, p, m), comm=pp, stages=[_stage(layers)],
                                    params=[params], loss=_mse) for kind in ("gpipe", "1f1b")}
    figures: dict[str, dict[str, list[float]]] = {k: {} for k in execs}
    for n in range(steps + 1):
        for kind, ex in execs.items():
            out = ex.step(xs if pp.rank == 0 else None, xs if pp.rank == p - 1 else None)
            tl = ex.timeline()
            mine = tensor(np.array([float(out.peak_saved_bytes)]), device=pp.device)
            peak = float(pp.all_reduce(mine, "max").numpy()[0])
            if n == 0:
                continue  # warm-up: plans made, buffers faulted in
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
            f.setdefault("step_ms", []).append(tl.makespan * 1e3)
            f.setdefault("bubble", []).append(tl.bubble)
            f.setdefault("sim_ms", []).append(sim.makespan * 1e3)
            f.setdefault("sim_bubble", []).append(sim.bubble)
            f.setdefault("peak", []).append(peak)
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
            "imbalance": median(f["imbalance"]), "stage_bubble": median(f["stage_bubble"]),
            "bubble_vs_stage": (median([a / b for a, b in zip(f["bubble"], f["stage_bubble"])])
                                if formula else float("nan")),
            "stage_f_ms": [median(f[f"f{r}"]) for r in range(p)],
            "stage_b_ms": [median(f[f"b{r}"]) for r in range(p)],
            "peak_saved_bytes": int(max(f["peak"])),
        })
    ratio = rows[1]["peak_saved_bytes"] / rows[0]["peak_saved_bytes"]
    return {"rank": pp.rank, "rows": rows, "peak_1f1b_vs_gpipe": ratio, "bound": p / m}


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
    ap = argparse.ArgumentParser(prog="fuelspmd bench pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (8)")
    ap.add_argument("--hidden", type=int, default=512, help="layer width (512)")
    ap.add_argument("--batch", type=int, default=32, help="rows per micro-batch (32)")
    ap.add_argument("--layers", type=int, default=2, help="layers per stage (2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per schedule (5)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        for name in ("microbatches", "hidden", "batch", "layers", "steps"):
            if getattr(args, name) < 1:
                raise ConfigError(f"bench pipeline: --{name} must be >= 1, got "
                                  f"{getattr(args, name)}")
        res = run(microbatches=args.microbatches, hidden=args.hidden, batch=args.batch,
                  layers=args.layers, steps=args.steps)
    except ConfigError as e:
        print(f"fuelspmd bench pipeline: {e}", file=sys.stderr, flush=True)
        return 2
    if res["rank"] != 0:
        return 0
    if args.json:
        print_json({"bench": "pipeline", **res})
        return 0
    print_table(f"pipeline executor, {res['rows'][0]['stages']} stages, "
                f"{args.microbatches} micro-batches (median of {args.steps} interleaved steps)",
                [Column("schedule", "kind"), Column("step ms", "step_ms", "{:.2f}"),
                 Column("sim ms", "sim_ms", "{:.2f}"),
                 Column("step/sim", "step_vs_sim", "{:.3f}"),
                 Column("bubble", "bubble", "{:.3f}"),
                 Column("sim bubble", "sim_bubble", "{:.3f}"),
                 Column("formula", "formula", "{:.3f}"),
                 Column("bubble/formula", "bubble_vs_formula", "{:.3f}"),
                 Column("imbalance", "imbalance", "{:.3f}"),
                 Column("stage formula", "stage_bubble", "{:.3f}"),
                 Column("bubble/stage", "bubble_vs_stage", "{:.3f}"),
                 Column("peak saved B", "peak_saved_bytes", "{}")], res["rows"])
    print(f"peak saved activations 1F1B/GPipe = {res['peak_1f1b_vs_gpipe']:.3f} "
          f"(bound p/m = {res['bound']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
