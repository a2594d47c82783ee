"""``fuelspmd plan``: rank tp x pp x dp x micro-batch layouts of a transformer on a cluster.

Example, the 1-trillion-parameter GPT of Megatron-LM (arXiv 2104.04473) on Selene::

    fuelspmd plan --layers 128 --hidden 25600 --heads 160 --seq 2048 --vocab 51200 \\
        --batch 3072 --gpus 3072 --topology a100-selene

The topology is a shipped declaration name or a JSON file (docs/topology.md); its node count
is set from ``--gpus``. Every layout that fits in memory is predicted with the cost model
(:mod:`fuelspmd.cost.transformer`) and the best are printed with the reasons.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from fuelspmd.bench import Column, parser, print_table
from fuelspmd.cli.arguments import count, number
from fuelspmd.cost.transformer import (
    Assumptions,
    Prediction,
    Transformer,
    candidates,
    memory_per_gpu,
    plan,
)
from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel.schedules import schedule
from fuelspmd.pipeline_parallel.simulate import simulate
from fuelspmd.topology import Topology, declared

__all__ = ["MAX_GPUS", "NEARBY", "main"]

MAX_GPUS = 1 << 20  # the layouts of a GPU count are found by trial division
MODEL_SIZE = 1 << 30  # a model dimension, a sequence or a batch: finite
NEARBY = 4096  # GPU counts tried on each side when a count has no layout


def _parser() -> argparse.ArgumentParser:
    p = parser("fuelspmd plan", __doc__)
    model = p.add_argument_group("model")
    for name in ("layers", "hidden", "heads", "seq", "vocab", "batch"):
        model.add_argument(f"--{name}", type=count(1, MODEL_SIZE), required=True,
                           help="global batch in sequences" if name == "batch" else None)
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=count(1, MAX_GPUS), required=True,
                         help=f"number of GPUs, at most {MAX_GPUS}")
    cluster.add_argument("--topology", required=True,
                         help=f"a JSON declaration file or one of {declared()}")
    cluster.add_argument("--peak-tflops", type=number(0, 1e6, above=True),
                         help="override the GPU's peak TFLOP/s")
    cluster.add_argument("--memory-gib", type=number(0, 1e6, above=True),
                         help="override the GPU's memory (GiB)")
    cluster.add_argument("--memory-bandwidth-gbs", type=number(0, 1e8, above=True),
                         help="override the GPU's memory bandwidth (GB/s)")
    how = p.add_argument_group("assumptions")
    defaults = Assumptions()
    share = number(0, 1, above=True)
    how.add_argument("--matmul-efficiency", type=share, default=defaults.matmul_efficiency,
                     help="share of peak FLOP/s large GEMMs reach (default %(default)s)")
    how.add_argument("--memory-efficiency", type=share, default=defaults.memory_efficiency,
                     help="share of memory bandwidth streaming kernels reach (default "
                          "%(default)s)")
    how.add_argument("--no-recompute", action="store_true",
                     help="keep activations instead of recomputing them in the backward")
    how.add_argument("--microbatches", default="1,2,4,8",
                     help="micro-batch sizes to try (default %(default)s)")
    p.add_argument("--simulate", action="store_true",
                   help="replay the best layout's pipeline schedule (the runtime's own "
                        "generator) in the event simulator and compare with the formula")
    p.add_argument("--top", type=count(1, 1000), default=5, help="how many layouts to print")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _topology(args: argparse.Namespace) -> Topology:
    base = Topology.load(args.topology)
    per_node = base.nodes[0].devices
    topo = Topology.load(args.topology, nodes=-(-args.gpus // per_node))
    acc = topo.nodes[0].accelerator
    changes = {k: v for k, v in (("peak_flops", args.peak_tflops and args.peak_tflops * 1e12),
                                 ("memory", args.memory_gib and args.memory_gib * 2**30),
                                 ("memory_bandwidth", args.memory_bandwidth_gbs
                                  and args.memory_bandwidth_gbs * 1e9)) if v}
    if not changes:
        return topo
    if acc is None:
        raise ConfigError(f"topology {args.topology!r} declares no accelerator to override; "
                          "give --peak-tflops, --memory-gib and --memory-bandwidth-gbs "
                          "together or declare one in the file")
    acc = dataclasses.replace(acc, **changes)
    nodes = [dataclasses.replace(n, accelerator=acc) for n in topo.nodes]
    return Topology(nodes, network=topo.network, name=topo.name)


def _layouts(gpus: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) whose product is ``gpus``."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    return [(t, p, gpus // (t * p)) for t in divisors for p in divisors if gpus % (t * p) == 0]


def why_no_layout(model: Transformer, gpus: int, microbatches: tuple[int, ...]) -> str:
    """Say why no (tp, pp, dp) layout of ``gpus`` GPUs suits the model's shapes, and which
    GPU counts nearby have one: tp must divide the heads, pp the layers, and dp times a
    micro-batch size the global batch (the rules of :func:`candidates`)."""
    reasons = []
    for t, p, d in _layouts(gpus):
        why = []
        if model.heads % t:
            why.append(f"tp {t} does not divide the {model.heads} heads")
        if model.layers % p:
            why.append(f"pp {p} does not divide the {model.layers} layers")
        if all(model.global_batch % (d * b) for b in microbatches):
            why.append(f"dp {d} x micro-batch {'/'.join(map(str, microbatches))} divides "
                       f"no batch of {model.global_batch}")
        reasons.append(f"  tp {t} x pp {p} x dp {d}: " + "; ".join(why))
    prime = gpus > 1 and len(_layouts(gpus)) == 3
    head = (f"no layout splits {gpus} GPUs for this model"
            + (f": {gpus} is prime, so one axis takes all {gpus} GPUs" if prime else "")
            + " (tp divides the heads, pp the layers, dp x micro-batch the batch):")
    if len(reasons) > 8:
        reasons = [*reasons[:8], f"  ... and {len(reasons) - 8} more layouts"]
    below = next((n for n in range(gpus - 1, max(gpus - NEARBY, 0), -1)
                  if candidates(model, n, microbatches=microbatches)), None)
    above = next((n for n in range(gpus + 1, min(gpus + NEARBY, 2 * gpus) + 1)
                  if candidates(model, n, microbatches=microbatches)), None)
    fix = " or ".join(str(n) for n in (below, above) if n is not None)
    tail = (f"use a GPU count that has a layout, e.g. --gpus {fix}" if fix else
            f"no GPU count within {NEARBY} of this one has a layout either: check --heads, "
            "--layers, --batch and --microbatches")
    return "\n".join([head, *reasons, tail])


def simulate_pipeline(pred: Prediction, model: Transformer) -> tuple[float, float, float]:
    """Replay ``pred``'s pipeline with the runtime's schedule and simulator.

    Returns (simulated pipeline seconds, the formula's pipeline seconds, simulated idle
    share of the ranks). The schedule is the one the executor runs (``interleaved`` with chunks > 1,
    ``1f1b`` otherwise), with the prediction's per-chunk forward and backward times, the
    logits on the last virtual stage and the stage-to-stage send as the hop time. The
    formula counts the send on every step's critical path, the simulator only where a
    rank waits for it, so the two bracket the truth.
    """
    c, t = pred.config, pred.chunk_times
    m = model.global_batch // (c.dp * c.microbatch)
    kind = "interleaved" if c.chunks > 1 else "1f1b"
    sched = schedule(kind, c.pp, m, c.chunks)
    stages = c.pp * c.chunks
    fwd = [t["forward"] + (t["logits_forward"] if v == stages - 1 else 0.0)
           for v in range(stages)]
    bwd = [t["backward"] + (t["logits_backward"] if v == stages - 1 else 0.0)
           for v in range(stages)]
    timeline = simulate(sched, fwd, bwd, t["hop"])
    formula = sum(pred.parts[k] for k in ("compute", "tp_comm", "pp_comm", "bubble",
                                          "imbalance"))
    return timeline.makespan, formula, timeline.bubble


def _row(rank: int, pr: Prediction, peak: float) -> dict[str, object]:
    c = pr.config
    return {"rank": rank, "tp": c.tp, "pp": c.pp, "dp": c.dp, "microbatch": c.microbatch,
            "chunks": c.chunks, "step_s": pr.step_time,
            "tflops_per_gpu": pr.flops_per_gpu / 1e12, "peak_share": pr.flops_per_gpu / peak,
            "memory_gib": pr.memory / 2**30,
            "parts": {k: v / pr.step_time for k, v in pr.parts.items()},
            "reasons": list(pr.reasons)}


def main(argv: list[str]) -> int:
    """Print the ranked plans; 0 on success, 2 on a bad argument or when nothing fits."""
    args = _parser().parse_args(argv)
    try:
        model = Transformer(layers=args.layers, hidden=args.hidden, heads=args.heads,
                            seq=args.seq, vocab=args.vocab, global_batch=args.batch)
        mbs = tuple(count(1, args.batch)(x) for x in args.microbatches.split(",") if x.strip())
        a = Assumptions(matmul_efficiency=args.matmul_efficiency,
                        memory_efficiency=args.memory_efficiency,
                        recompute=not args.no_recompute, microbatches=mbs)
        topo = _topology(args)
        ranked = plan(model, args.gpus, topo, assumptions=a)
    except argparse.ArgumentTypeError as e:
        print(f"fuelspmd plan: --microbatches {args.microbatches}: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"fuelspmd plan: {e}", file=sys.stderr)
        return 2
    acc = topo.nodes[0].accelerator
    assert acc is not None  # plan() raised otherwise
    rows = [_row(i + 1, pr, acc.peak_flops) for i, pr in enumerate(ranked[: args.top])]
    if args.json:
        print(json.dumps({"params": model.params, "fitting": len(ranked), "plans": rows},
                         indent=2))
        return 0 if ranked else 2
    total = len(candidates(model, args.gpus, microbatches=mbs))
    print(f"model     GPT {model.params / 1e9:.1f}B parameters (l {model.layers}, h "
          f"{model.hidden}, a {model.heads}, s {model.seq}, V {model.vocab}), batch "
          f"{model.global_batch}")
    print(f"cluster   {args.gpus} x {acc.model} ({acc.peak_flops / 1e12:.0f} TFLOP/s, "
          f"{acc.memory / 2**30:.0f} GiB) on {topo.name or args.topology}, "
          f"{len(topo.nodes)} node(s) of {topo.nodes[0].devices}")
    print(f"assume    GEMMs at {a.matmul_efficiency:.0%} of peak, memory-bound kernels at "
          f"{a.memory_efficiency:.0%} of HBM, {'recompute' if a.recompute else 'no recompute'}"
          f", {a.state_bytes_per_param:g} B/param of state, {a.memory_reserve:.0%} memory "
          "kept free")
    if not total:
        print(f"fuelspmd plan: {why_no_layout(model, args.gpus, mbs)}", file=sys.stderr)
        return 2
    if not ranked:
        need = min(memory_per_gpu(model, c, assumptions=a)
                   for c in candidates(model, args.gpus, microbatches=mbs))
        usable = acc.memory * (1 - a.memory_reserve)
        print(f"fuelspmd plan: nothing fits: none of the {total} layouts fits in a GPU's "
              f"memory (the smallest needs {need / 2**30:.1f} GiB per GPU, "
              f"{usable / 2**30:.2f} GiB usable of {acc.memory / 2**30:.2f}); add GPUs, "
              "use GPUs with more memory, or keep recomputation on", file=sys.stderr)
        return 2
    print(f"{len(ranked)} (tp, pp, dp) layouts fit of {total} candidates; best first:\n")
    parts = ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm")
    columns = [Column("#", "rank"), *(Column(k, k) for k in ("tp", "pp", "dp")),
               Column("mb", "microbatch"), Column("v", "chunks"),
               Column("step s", "step_s", "{:.2f}"), Column("TFLOP/s", "tflops_per_gpu", "{:.0f}"),
               Column("%peak", "peak_share", "{:.0%}"), Column("GiB", "memory_gib", "{:.1f}"),
               *(Column(k.replace("_", "-"), k, "{:.1%}") for k in parts)]
    print_table(None, columns, [{**r, **r["parts"]} for r in rows])  # type: ignore[dict-item]
    if args.simulate and ranked[0].config.pp > 1:
        sim, formula, bubble = simulate_pipeline(ranked[0], model)
        c = ranked[0].config
        print(f"\n#1 pipeline replayed with fuelspmd.pipeline_parallel "
              f"({'interleaved' if c.chunks > 1 else '1f1b'}, p {c.pp}, v {c.chunks}): "
              f"{sim:.2f} s simulated, {formula:.2f} s by the formula "
              f"({sim / formula - 1:+.1%}); idle share {bubble:.1%} (bubble, the slower "
              "last stage, waits for sends)")
    for r in rows[:3]:
        print(f"\n#{r['rank']} why:")
        reasons = r["reasons"]
        assert isinstance(reasons, list)
        for reason in reasons:
            print(f"  - {reason}")
    return 0
