"""``fuelspmd bench calibrate``: measure this machine's shared-memory alpha, beta and gamma.

Run as ``mpiexec -n 4 fuelspmd bench calibrate`` (any size >= 2). For every group size
``n`` in ``--groups`` (sub-groups of the world, split off through the transport), every
collective (all_reduce, all_gather, reduce_scatter) and every size from 8 B to 64 MiB, the
world transport's collective is timed in repetitions that alternate between two sets, A
and B, so both see the same machine state (these machines switch between fast and slow
states for minutes at a time). Set A fits the model; set B checks it. The model of one
shared-memory node with ``c`` cores is :class:`fuelspmd.cost.CostModel`'s own: for each
algorithm the time is linear in its parameters,

    t = c_alpha * alpha + s * (c_beta / B + c_gamma / R),   s = max(1, n / c)

with alpha replaced by the oversubscribed latency when ``n > c`` (ranks wait to be
scheduled), and the prediction is the fastest algorithm. The coefficients come from the
CostModel itself, so the fitted numbers mean what the model means; alpha, B (bandwidth), R
(reduce bandwidth) and the oversubscribed latency minimise the mean absolute log error over
set A. The table compares set B with the fitted model; the parameters are saved where
:func:`fuelspmd.cost.load_calibration` finds them.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

from fuelspmd.cost.calibration import save_calibration
from fuelspmd.cost.collectives import CostModel
from fuelspmd.launch import init
from fuelspmd.topology import Link, Node, Topology, cpu_cores
from fuelspmd.transport import ReduceOp, Transport

__all__ = ["fit", "main", "measure"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = (8, 64, 512, 4096, 32768, 262144, 2**21, 2**24, 2**26)


def _iterations(nbytes: int) -> int:
    """Repeat small operations so a timing spans well above the clock's resolution."""
    return 50 if nbytes <= 4096 else 10 if nbytes <= 262144 else 3 if nbytes <= 2**21 else 1


def _buffers(collective: str, nbytes: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Send and receive float32 buffers for ``nbytes`` as the cost model counts them (the
    buffer of all_reduce, the whole output of all_gather, the whole input of
    reduce_scatter), rounded to whole elements per rank; returns the bytes used."""
    per_rank = max(1, round(nbytes / 4 / (1 if collective == "all_reduce" else n)))
    if collective == "all_reduce":
        buf = np.ones(per_rank, np.float32)
        return buf, buf, buf.nbytes
    small, big = np.ones(per_rank, np.float32), np.ones(per_rank * n, np.float32)
    return (small, big, big.nbytes) if collective == "all_gather" else (big, small, big.nbytes)


def _run(seam: Transport, collective: str, send: np.ndarray, recv: np.ndarray,
         timeout: float) -> None:
    if collective == "all_reduce":
        seam.all_reduce(send, ReduceOp.SUM).wait(timeout)
    elif collective == "all_gather":
        seam.all_gather(send, recv).wait(timeout)
    else:
        seam.reduce_scatter(send, recv, ReduceOp.SUM).wait(timeout)


def measure(seam: Transport, *, sizes: tuple[int, ...] = SIZES, reps: int = 4,
            timeout: float = 60.0) -> list[dict[str, Any]]:
    """Time each collective and size on ``seam``: ``2 * reps`` timings taken back to back and
    dealt A, B, A, B, so set A (fit) and set B (check) see the same machine state; each
    timing is the slowest rank's mean per operation."""
    n = seam.size
    out = []
    slowest = np.zeros(1, np.float64)
    for nbytes in sizes:
        for collective in COLLECTIVES:
            send, recv, actual = _buffers(collective, nbytes, n)
            _run(seam, collective, send, recv, timeout)  # warm: buffers, algorithms
            k = _iterations(nbytes)
            sets: tuple[list[float], list[float]] = ([], [])
            for rep in range(2 * reps):
                seam.barrier().wait(timeout)
                start = time.perf_counter()
                for _ in range(k):
                    _run(seam, collective, send, recv, timeout)
                slowest[0] = (time.perf_counter() - start) / k
                seam.all_reduce(slowest, ReduceOp.MAX).wait(timeout)
                sets[rep % 2].append(float(slowest[0]))
            out.append({"collective": collective, "ranks": n, "nbytes": actual,
                        "fit_s": statistics.median(sets[0]),
                        "check_s": statistics.median(sets[1])})
    return out


def _coefficients(records: list[dict[str, Any]], cores: int) -> list[np.ndarray]:
    """Per record, one row per algorithm: multipliers of (alpha, oversubscribed alpha,
    1/B, 1/R).

    With alpha = 1 s and bandwidths of 1 B/s on an uncrowded node, the model's latency,
    transfer and reduce terms *are* the multipliers; crowding moves the latency to the
    second column and scales the others by n / cores.
    """
    out = []
    models: dict[int, CostModel] = {}
    for r in records:
        n = r["ranks"]
        if n not in models:
            models[n] = CostModel(Topology.uniform(nodes=1, devices_per_node=n,
                                                   fabric=Link("shm", 1.0, 1.0),
                                                   reduce_bandwidth=1.0))
        model, crowded = models[n], n > cores
        slow = max(1.0, n / cores)
        rows = [((0.0, e.latency) if crowded else (e.latency, 0.0))
                + (e.transfer * slow, e.reduce * slow) for e in (
                    model.estimate(r["collective"], r["nbytes"], range(n), algorithm=a)
                    for a in model.algorithms(r["collective"], range(n)))]
        out.append(np.array(rows))
    return out


def _predict(coefs: list[np.ndarray], params: np.ndarray) -> np.ndarray:
    """Predicted seconds for each record under each parameter row."""
    return np.stack([(c @ params.T).min(axis=0) for c in coefs])  # [records, params]


def fit(records: list[dict[str, Any]], *, cores: int) -> dict[str, float]:
    """Alpha, oversubscribed alpha, bandwidth and reduce bandwidth minimising the mean
    |log(model / set A)|, by a log-spaced grid search refined twice around the best point.
    A parameter no record depends on (no crowded group, say) is left out of the file."""
    coefs = _coefficients(records, cores)
    meas = np.array([r["fit_s"] for r in records])[:, None]
    lo = np.log10([1e-8, 1e-7, 1e-12, 1e-12])  # alpha, crowded alpha (s), beta, gamma (s/B)
    hi = np.log10([1e-3, 1e-1, 1e-8, 1e-8])
    best = (lo + hi) / 2
    for width in (None, 0.4, 0.08):
        axes = [np.linspace(lo[i], hi[i], 13) if width is None else
                np.linspace(best[i] - width, best[i] + width, 9) for i in range(4)]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 4)
        err = np.abs(np.log(_predict(coefs, 10.0**grid) / meas)).mean(axis=0)
        best = grid[int(np.argmin(err))]
    alpha, crowded, beta, gamma = 10.0**best
    params = {"latency": float(alpha), "bandwidth": float(1 / beta),
              "reduce_bandwidth": float(1 / gamma)}
    if any(r["ranks"] > cores for r in records):
        params["oversubscribed_latency"] = float(crowded)
    return params


def check(records: list[dict[str, Any]], params: dict[str, float], *,
          cores: int) -> list[dict[str, Any]]:
    """Each record with the fitted model's prediction, its algorithm and its error against
    set B (the model built as ``detect`` builds it for a job of this size)."""
    out = []
    for n in sorted({r["ranks"] for r in records}):
        node = Node("here", n, Link("shm", params["bandwidth"], params["latency"]),
                    reduce_bandwidth=params["reduce_bandwidth"], cores=cores,
                    oversubscribed_latency=params.get("oversubscribed_latency"))
        model = CostModel(Topology([node]))
        for r in (r for r in records if r["ranks"] == n):
            est = model.estimate(r["collective"], r["nbytes"], range(n))
            out.append({**r, "predicted_s": est.seconds, "algorithm": est.algorithm,
                        "error": abs(est.seconds - r["check_s"]) / r["check_s"]})
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'collective':<15}{'n':>2}{'bytes':>10}{'measured':>12}{'predicted':>12}"
             f"{'error':>8}  algorithm"]
    for r in rows:
        lines.append(f"{r['collective']:<15}{r['ranks']:>2}{r['nbytes']:>10}"
                     f"{r['check_s'] * 1e6:>10.1f}us{r['predicted_s'] * 1e6:>10.1f}us"
                     f"{r['error']:>8.1%}  {r['algorithm']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Measure, fit, print the check table and save; 0 on success, 2 on bad use."""
    p = argparse.ArgumentParser(prog="fuelspmd bench calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="2,3,4", help="group sizes to measure (default %(default)s)")
    p.add_argument("--reps", type=int, default=4, help="timings per set and point")
    p.add_argument("--max-bytes", type=int, default=2**26, help="largest size (default 64 MiB)")
    p.add_argument("--out", help="calibration file (default: where load_calibration looks)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    world = init(timeout=120.0)
    groups = sorted({int(x) for x in args.groups.split(",") if x.strip()})
    if world.size < 2 or not groups or min(groups) < 2:
        print(f"fuelspmd bench calibrate: run under mpiexec with >= 2 ranks and group sizes "
              f">= 2 (world {world.size}, groups {groups}): mpiexec -n 4 fuelspmd bench "
              "calibrate", file=sys.stderr)
        return 2
    groups = [g for g in groups if g <= world.size]
    sizes = tuple(s for s in SIZES if s <= args.max_bytes)
    records: list[dict[str, Any]] = []
    for n in groups:
        member = world.rank < n
        sub = world.transport.split(0 if member else 1, world.rank)
        if member:
            records += measure(sub, sizes=sizes, reps=args.reps)
        world.transport.barrier().wait(world.timeout)
    if world.rank != 0:
        return 0
    cores = cpu_cores()
    params = fit(records, cores=cores)
    rows = check(records, params, cores=cores)
    median = statistics.median(r["error"] for r in rows)
    data = {"version": 1, "host": socket.gethostname(), "world": world.size, "cores": cores,
            "shm": params, "fit": {"median_abs_error_check": median, "points": rows}}
    if not args.no_save:
        data["path"] = str(save_calibration(data, args.out))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_table(rows))
    print(f"\nfitted: alpha {params['latency'] * 1e6:.2f} us, bandwidth "
          f"{params['bandwidth'] / 1e9:.2f} GB/s, reduce {params['reduce_bandwidth'] / 1e9:.2f}"
          f" GB/s, oversubscribed alpha "
          f"{params.get('oversubscribed_latency', float('nan')) * 1e6:.0f} us ({cores} cores)"
          f"; median |error| on the check set {median:.1%}")
    if "path" in data:
        print(f"saved to {data['path']}")
    return 0
