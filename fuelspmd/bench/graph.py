"""``fuelspmd bench graph``: the lazy graph beside the same step in eager numpy.

One MLP training step (batch 64, 1024 -> 4096 -> 1024, GELU (tanh form), MSE loss,
forward and backward) is run lazily and as hand-written numpy, interleaved A, B, A, B in
one run with BLAS limited to one thread (threadpoolctl; setting OPENBLAS_NUM_THREADS after
numpy is loaded does nothing, and the CLI has loaded it). Reported: median times and their
ratio, the largest difference between the two results, the peak of traced bytes of each
step (tracemalloc sees numpy's allocations) and the executor's own live-bytes peak; then
the build-plus-optimise time of graphs of 1k and 10k nodes.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fuelspmd.functional as F
from fuelspmd import graph
from fuelspmd.autograd import grad
from fuelspmd.bench import Column, interleave, median, print_json, print_table
from fuelspmd.tensor import Tensor, realize, tensor

__all__ = ["main"]

_C = math.sqrt(2.0 / math.pi)
Arrays = tuple[np.ndarray, ...]


def make_inputs(*, batch: int = 64, d_in: int = 1024, d_hidden: int = 4096,
                seed: int = 0) -> Arrays:
    rng = np.random.default_rng(seed)
    f = np.float32
    return (rng.standard_normal((batch, d_in)).astype(f),
            rng.standard_normal((batch, d_in)).astype(f),
            (rng.standard_normal((d_in, d_hidden)) / math.sqrt(d_in)).astype(f),
            (rng.standard_normal(d_hidden) * 0.1).astype(f),
            (rng.standard_normal((d_hidden, d_in)) / math.sqrt(d_hidden)).astype(f),
            (rng.standard_normal(d_in) * 0.1).astype(f))


def eager_step(x: np.ndarray, t: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
               b2: np.ndarray) -> Arrays:
    """The step as anyone would write it in numpy: loss and the four gradients."""
    h = x @ w1 + b1
    th = np.tanh(_C * (h + 0.044715 * (h * h * h)))
    a = 0.5 * h * (1.0 + th)
    y = a @ w2 + b2
    d = y - t
    loss = np.mean(d * d)
    gy = d * np.float32(2.0 / d.size)
    gw2 = a.T @ gy
    gb2 = gy.sum(0)
    ga = gy @ w2.T
    gh = ga * (0.5 * (1.0 + th) + 0.5 * h * (1.0 - th * th) * _C * (1.0 + 3 * 0.044715 * h * h))
    gw1 = x.T @ gh
    gb1 = gh.sum(0)
    return loss, gw1, gb1, gw2, gb2


def lazy_step(x: np.ndarray, t: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
              b2: np.ndarray) -> Arrays:
    """The same step through fuelspmd: the graph is rebuilt every call, planned once."""
    xs, ts, params = tensor(x), tensor(t), [tensor(p) for p in (w1, b1, w2, b2)]
    W1, B1, W2, B2 = params
    y = F.gelu(xs @ W1 + B1) @ W2 + B2
    loss = F.mse_loss(y, ts)
    grads = grad(loss, params)
    realize(loss, *grads)
    return tuple(g.numpy() for g in (loss, *grads))


def traced_peak(fn: Callable[..., Any], args: Arrays) -> int:
    """Bytes allocated at the peak of ``fn(*args)`` above what was live before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = fn(*args)
        peak = tracemalloc.get_traced_memory()[1] - before
        del out
    finally:
        tracemalloc.stop()
    return peak


def chain_graph(n_nodes: int) -> Tensor:
    """A graph of about ``n_nodes`` nodes: matmul, scale, shift, tanh, repeated."""
    rng = np.random.default_rng(1)
    w = tensor(rng.standard_normal((16, 16)).astype(np.float32))
    y = tensor(rng.standard_normal((8, 16)).astype(np.float32))
    for i in range(n_nodes // 6):
        y = ((y @ w) * (1.0 + i * 1e-6) + i * 1e-6).tanh()
    return y.sum()


def build_times(sizes: Sequence[int], repeat: int) -> list[dict[str, float]]:
    """Seconds to build a graph of each size and optimise it (no plan-cache hit).

    Every round builds the same number of nodes for each size (ten 1k graphs beside one
    10k graph), sizes interleaved, so a change of machine state hits them alike. Returns
    the best round per graph (as timeit does: the least disturbed one; the machine's
    neighbours only ever add time), wall and CPU, and the node count.
    """
    most = max(sizes)
    wall: dict[int, list[float]] = {n: [] for n in sizes}
    cpu: dict[int, list[float]] = {n: [] for n in sizes}
    count: dict[int, int] = {}
    for _ in range(repeat):
        for n in sizes:
            k = max(1, most // n)
            gc.collect()  # the last graph's garbage is not this one's cost
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(k):
                out = chain_graph(n)
                graph.Executor().plan([out.node])
            wall[n].append((time.perf_counter() - t0) / k)
            cpu[n].append((time.process_time() - c0) / k)
            count[n] = len(graph.lower([out.node])[0])
            del out
    return [{"nodes": count[n], "ms": min(wall[n]) * 1e3, "cpu_ms": min(cpu[n]) * 1e3}
            for n in sizes]


def run(*, repeat: int, build_repeat: int, nodes: Sequence[int], batch: int, d_in: int,
        d_hidden: int) -> dict[str, Any]:
    """Measure everything the module docstring lists; return it as one JSON-able dict."""
    from threadpoolctl import threadpool_info, threadpool_limits

    args = make_inputs(batch=batch, d_in=d_in, d_hidden=d_hidden)
    ex = graph.default_executor()
    with threadpool_limits(limits=1, user_api="blas"):
        blas = sorted({i.get("num_threads") for i in threadpool_info()
                       if i.get("user_api") == "blas"})
        ref, got = eager_step(*args), lazy_step(*args)  # also warms the plan cache
        err = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30))
                  for a, b in zip(ref, got))

        cpu: dict[str, list[float]] = {"eager": [], "lazy": []}

        def timed(name: str, fn: Callable[..., Any]) -> Callable[[], float]:
            def once() -> float:
                t0, c0 = time.perf_counter(), time.process_time()
                fn(*args)
                cpu[name].append(time.process_time() - c0)
                return time.perf_counter() - t0
            return once

        times = interleave({"eager": timed("eager", eager_step),
                            "lazy": timed("lazy", lazy_step)}, count=repeat)
        eager_peak = traced_peak(eager_step, args)
        lazy_peak = traced_peak(lazy_step, args)
        executor_peak = ex.peak_bytes
    builds = build_times(nodes, build_repeat)
    ratios = [b / a for a, b in zip(times["eager"], times["lazy"])]
    cpu_ratios = [b / a for a, b in zip(cpu["eager"], cpu["lazy"])]
    return {
        "shape": {"batch": batch, "d_in": d_in, "d_hidden": d_hidden},
        "blas_threads": blas,
        "eager_ms": median(times["eager"]) * 1e3,
        "lazy_ms": median(times["lazy"]) * 1e3,
        "ratio_lazy_over_eager": median(ratios),
        "eager_cpu_ms": median(cpu["eager"]) * 1e3,
        "lazy_cpu_ms": median(cpu["lazy"]) * 1e3,
        "cpu_ratio_lazy_over_eager": median(cpu_ratios),
        "max_rel_error": err,
        "eager_peak_bytes": eager_peak,
        "lazy_peak_bytes": lazy_peak,
        "executor_peak_bytes": executor_peak,
        "plan_cache": {"hits": ex.cache.hits, "misses": ex.cache.misses},
        "build": builds,
        "build_ratio_last_over_first": builds[-1]["ms"] / builds[0]["ms"],
        "build_cpu_ratio_last_over_first": builds[-1]["cpu_ms"] / builds[0]["cpu_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print tables, or JSON with ``--json``. Returns the exit code."""
    p = argparse.ArgumentParser(prog="fuelspmd bench graph",
                                description="lazy graph vs eager numpy: an MLP training step")
    p.add_argument("--repeat", type=int, default=20, help="interleaved pairs timed")
    p.add_argument("--build-repeat", type=int, default=7,
                   help="rounds of graph building (each round builds as many nodes per size)")
    p.add_argument("--nodes", default="1000,10000", help="graph sizes for build+optimise")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--d-in", type=int, default=1024)
    p.add_argument("--d-hidden", type=int, default=4096)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    a = p.parse_args(argv)
    nodes = [int(n) for n in a.nodes.split(",")]
    r = run(repeat=a.repeat, build_repeat=a.build_repeat, nodes=nodes, batch=a.batch,
            d_in=a.d_in, d_hidden=a.d_hidden)
    if a.json:
        print_json(r)
        return 0
    mib = 1 / 2**20
    shape = r["shape"]
    print_table(
        f"MLP step {shape['batch']}x{shape['d_in']}->{shape['d_hidden']}->{shape['d_in']}, "
        f"GELU, MSE, fwd+bwd; BLAS threads {r['blas_threads']}; max rel diff "
        f"{r['max_rel_error']:.1e}",
        [Column("step", "name"), Column("wall ms", "ms", "{:.2f}"),
         Column("wall vs eager", "ratio", "{:.3f}x"), Column("cpu ms", "cpu", "{:.2f}"),
         Column("cpu vs eager", "cpu_ratio", "{:.3f}x"),
         Column("peak MiB (tracemalloc)", "peak", "{:.1f}")],
        [{"name": "eager numpy", "ms": r["eager_ms"], "ratio": 1.0, "cpu": r["eager_cpu_ms"],
          "cpu_ratio": 1.0, "peak": r["eager_peak_bytes"] * mib},
         {"name": "lazy fuelspmd", "ms": r["lazy_ms"], "ratio": r["ratio_lazy_over_eager"],
          "cpu": r["lazy_cpu_ms"], "cpu_ratio": r["cpu_ratio_lazy_over_eager"],
          "peak": r["lazy_peak_bytes"] * mib}])
    first = r["build"][0]
    print_table("build + optimise (no plan-cache hit), sizes interleaved, best round",
                [Column("nodes", "nodes"), Column("wall ms", "ms", "{:.1f}"),
                 Column("vs first", "ratio", "{:.2f}x"), Column("cpu ms", "cpu_ms", "{:.1f}"),
                 Column("cpu vs first", "cpu_ratio", "{:.2f}x"),
                 Column("cpu us/node", "per_node", "{:.1f}")],
                [{**b, "ratio": b["ms"] / first["ms"], "cpu_ratio": b["cpu_ms"] / first["cpu_ms"],
                  "per_node": b["cpu_ms"] * 1e3 / b["nodes"]} for b in r["build"]])
    return 0
