"""GPU figures for issue 11: a fused elementwise chain against the same chain in eager
cupy, and a tensor-parallel layer's matmul against the GPU's measured cuBLAS peak.

Run by tests/gpu/run.sh (``python tests/gpu/bench_gpu.py --json FILE``); prints a table.
Every comparison interleaves baseline and candidate (A, B, A, B ...) in one run and
reports medians and their ratio. Exit status 0 when every figure was measured, whatever
its value (the targets are printed beside them, not asserted: a figure is a
measurement); 1 when any raised instead (its figure is then the error), so the step fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from workloads import bench_chain

import fuelspmd as fs
from fuelspmd import graph
from fuelspmd.tensor_parallel import ColumnParallelLinear


def _interleave(fns: dict[str, Callable[[], Any]], sync: Callable[[], None], *,
                reps: int, warm: int = 3) -> dict[str, float]:
    """Median seconds of each fn, measured in turns (A, B, A, B ...)."""
    for _ in range(warm):
        for fn in fns.values():
            fn()
        sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _chain_cupy(cp: Any, x: Any) -> Any:
    return cp.sqrt(cp.abs(cp.tanh(x * 1.5 + 0.5) * x - (x * x) * 0.25 + cp.exp(x) * 0.125))


def bench_fused(cp: Any, n: int, reps: int) -> dict[str, Any]:
    """``workloads.bench_chain`` (12 elementwise ops) on ``n`` float32 elements against the
    same chain in eager cupy."""
    rng = np.random.default_rng(0)
    host = rng.standard_normal(n).astype(np.float32)
    xc = cp.asarray(host)
    xt = fs.tensor(xc, device="cuda:0")
    plan, _ = graph.Executor().plan([bench_chain(xt).node])
    kinds = [s.kind for s in plan.steps]
    got = bench_chain(xt).numpy()
    want = np.sqrt(np.abs(np.tanh(host * 1.5 + 0.5) * host - host * host * 0.25
                          + np.exp(host) * 0.125))
    err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-6)))

    def lazy() -> None:
        fs.realize(bench_chain(xt))

    def eager() -> None:
        _chain_cupy(cp, xc)

    med = _interleave({"fused": lazy, "eager": eager}, cp.cuda.Device(0).synchronize,
                      reps=reps)
    return {"elements": n, "fused_ms": med["fused"] * 1e3, "eager_ms": med["eager"] * 1e3,
            "speedup": med["eager"] / med["fused"], "target": 1.5,
            "fused_cupy_steps": kinds.count("fused_cupy"), "plan_steps": kinds,
            "max_rel_err": err}


def _matmul_dtype(cp: Any) -> tuple[Any, str | None]:
    """bfloat16 when this cupy multiplies it (cupy >= 14 with ml_dtypes), else float16 and
    the reason bfloat16 could not be used."""
    try:
        from fuelspmd.dtypes import bfloat16, to_numpy

        bf16 = to_numpy(bfloat16)
        a = cp.ones((8, 8), dtype=cp.float32).astype(bf16)
        float((a @ a).astype(cp.float32)[0, 0])
        return bf16, None
    except Exception as e:  # recorded; float16 is measured instead
        return np.dtype(np.float16), f"{type(e).__name__}: {str(e)[:200]}"


def bench_matmul(cp: Any, size: int, reps: int) -> dict[str, Any]:
    """ColumnParallelLinear's matmul (one TP rank: the local X A_r, no bias) against the
    measured cuBLAS peak: the better of cuBLAS's matmul of the same shape and of twice
    the size, in the same dtype."""
    dt, why = _matmul_dtype(cp)
    name = "bfloat16" if why is None else "float16"
    out: dict[str, Any] = {"m=n=k": size, "dtype": name}
    if why is not None:
        out["bfloat16"] = f"unsupported here: {why}"
    comm = fs.DeviceGroup(["cuda:0"]).comms[0]
    layer = ColumnParallelLinear(size, size, comm=comm, bias=False, seed=1, dtype=name,
                                 device="cuda:0")
    rnd = cp.random.default_rng(2)
    x = fs.tensor((rnd.standard_normal((size, size), dtype=cp.float32) * 0.1).astype(dt),
                  device="cuda:0")
    a = (rnd.standard_normal((size, size), dtype=cp.float32) * 0.1).astype(dt)
    b = (rnd.standard_normal((size, size), dtype=cp.float32) * 0.1).astype(dt)
    big = 2 * size  # the peak is the better of this shape and the layer's
    a2 = (rnd.standard_normal((big, big), dtype=cp.float32) * 0.1).astype(dt)
    b2 = (rnd.standard_normal((big, big), dtype=cp.float32) * 0.1).astype(dt)
    y = layer(x).numpy().astype(np.float32)[:4, :4]
    ref = (x.numpy().astype(np.float32)[:4] @ layer.weight.numpy().astype(np.float32)[:, :4])
    out["max_abs_err_4x4"] = float(np.max(np.abs(y - ref)))
    flops = 2.0 * size ** 3

    def lay() -> None:
        layer(x).realize()

    def raw() -> None:
        cp.matmul(a, b)

    def raw_big() -> None:
        cp.matmul(a2, b2)

    med = _interleave({"layer": lay, "cublas": raw, "cublas_big": raw_big},
                      cp.cuda.Device(0).synchronize, reps=reps)
    out.update({"layer_tflops": flops / med["layer"] / 1e12,
                "cublas_same_shape_tflops": flops / med["cublas"] / 1e12,
                f"cublas_{big}_tflops": 2.0 * big ** 3 / med["cublas_big"] / 1e12})
    out["cublas_tflops"] = max(out["cublas_same_shape_tflops"], out[f"cublas_{big}_tflops"])
    out["fraction_of_peak"] = out["layer_tflops"] / out["cublas_tflops"]
    out["target"] = 0.6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here as JSON")
    p.add_argument("--elements", type=int, default=1 << 27)
    p.add_argument("--matmul", type=int, default=8192)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    import cupy as cp

    figures: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"]
                               .decode(errors="replace"),
                               "cupy": cp.__version__}
    for name, run in (("fused_elementwise", lambda: bench_fused(cp, args.elements, args.reps)),
                      ("tp_matmul", lambda: bench_matmul(cp, args.matmul, args.reps))):
        try:
            figures[name] = run()
        except Exception as e:  # one failed figure must not hide the other
            figures[name] = {"error": f"{type(e).__name__}: {e}"}
    f, m = figures["fused_elementwise"], figures["tp_matmul"]
    print(f"GPU figures on {figures['device']} (cupy {figures['cupy']})")
    if "error" not in f:
        print(f"  fused chain of 12 ops, {f['elements']} float32: fused {f['fused_ms']:.3f} ms"
              f", eager cupy {f['eager_ms']:.3f} ms, speedup {f['speedup']:.2f}x "
              f"(target >= 1.5x; {f['fused_cupy_steps']} fused kernel(s), max rel err "
              f"{f['max_rel_err']:.1e})")
    else:
        print(f"  fused chain: FAILED {f['error']}")
    if "error" not in m:
        print(f"  TP layer matmul {m['m=n=k']}^3 {m['dtype']}: {m['layer_tflops']:.1f} TFLOP/s"
              f" vs cuBLAS {m['cublas_tflops']:.1f} TFLOP/s = {m['fraction_of_peak']:.0%} "
              f"(target >= 60%)" + (f"; bfloat16: {m['bfloat16']}" if "bfloat16" in m else ""))
    else:
        print(f"  TP matmul: FAILED {m['error']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2, default=str)
    return 1 if "error" in f or "error" in m else 0


if __name__ == "__main__":
    sys.exit(main())
