"""``fuelspmd bench calibrate``: measure this machine's shared-memory alpha, beta and gamma.

Run as ``mpiexec -n 4 fuelspmd bench calibrate`` (any size >= 2). For every group size
``n`` in ``--groups`` (sub-groups of the world, split off through the transport; the ranks
outside the group sleep, so a group of 2 on 2 cores is not measured oversubscribed), every
collective (all_reduce, all_gather, reduce_scatter) and every size from 8 B to 64 MiB, the
world transport's collective is timed in repetitions that alternate between two sets, A
and B, so both see the same machine state (a loaded or clock-changing machine switches
between fast and slow states for minutes at a time). A repetition is the slowest rank's
median operation.

Set A fits the model; set B, which the fit never saw, judges it (the printed table: error
per point, median per collective and group size, ranks per core). The model of one
shared-memory node with ``c`` cores is :class:`fuelspmd.cost.CostModel`'s own; for each
algorithm the time is linear in its parameters,

    t = c_alpha * alpha + s * (c_beta / B + c_gamma / R),   s = max(1, n / c)

with alpha replaced by the crowded latency of the ratio ``n / c`` when ``n > c`` (a message
waits for its receiver to be scheduled), and the prediction is the fastest
algorithm. The coefficients come from the CostModel itself, so the fitted numbers mean
what the model means. What is fitted is a few *regimes* (:mod:`fuelspmd.cost.regimes`):
at most three bands of sizes, each of at least two measured sizes, with their own alpha,
B, R and crowded latency per ranks-per-core ratio, chosen together to minimise the
summed |log error| (a relative error: least squares on absolute time would let 64 MiB
decide everything).
MPICH's eager and rendezvous protocols and its size switches between algorithms are why
one line cannot fit.

The fit is bounded by physics (:class:`Bounds`): no latency below ``MIN_LATENCY_S`` (a
message between two cores moves at least a cache line through the coherence fabric) and no
bandwidth, of a transfer or of a reduction, above what one core of this machine copies
(measured in the same run: a message between ranks is at least one copy by one core).
Without them a band of large sizes, whose times the latency hardly changes, fits any
latency down to zero, and a few fast points fit a bandwidth no memory has. The output says
how good the fit is on set B: the median and worst |error|, R^2 of log(time), and which
parameters sit on a bound (there the measurements did not determine them). The
parameters are saved where :func:`fuelspmd.cost.load_calibration` finds them (``shm``:
the one-link view ``detect`` reads; ``regimes``: what :func:`fuelspmd.cost.calibrated_model`
uses); ``--points FILE`` refits a saved file's measurements without MPI.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.bench import parser
from fuelspmd.cost.calibration import save_calibration
from fuelspmd.cost.collectives import CostModel
from fuelspmd.cost.regimes import Regime, regimes_to_dict
from fuelspmd.errors import CommTimeoutError
from fuelspmd.launch import init
from fuelspmd.topology import Link, Node, Topology, cpu_cores
from fuelspmd.transport import ReduceOp, Transport

__all__ = ["MIN_LATENCY_S", "Bounds", "check", "copy_bandwidth", "fit", "main", "measure",
           "model_for", "quality", "summary"]

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
    dealt A, B, A, B, so set A (fit) and set B (check) see the same machine state.

    A timing is ``k`` operations after a barrier, each timed alone; its value is the slowest
    rank's median operation. The median, not the mean: on a shared 2-core machine one
    preemption (a 4 ms time slice) in 50 operations of 6 us would otherwise make the 8 B
    point 80 us, and the model predicts the typical operation, not the scheduler's.
    """
    n = seam.size
    out = []
    slowest = np.zeros(1, np.float64)
    clock = time.perf_counter
    for nbytes in sizes:
        for collective in COLLECTIVES:
            send, recv, actual = _buffers(collective, nbytes, n)
            _run(seam, collective, send, recv, timeout)  # warm: buffers, algorithms
            k = _iterations(nbytes)
            each = [0.0] * k
            sets: tuple[list[float], list[float]] = ([], [])
            for rep in range(2 * reps):
                seam.barrier().wait(timeout)
                for i in range(k):
                    start = clock()
                    _run(seam, collective, send, recv, timeout)
                    each[i] = clock() - start
                slowest[0] = statistics.median(each)
                seam.all_reduce(slowest, ReduceOp.MAX).wait(timeout)
                sets[rep % 2].append(float(slowest[0]))
            out.append({"collective": collective, "ranks": n, "nbytes": actual,
                        "nominal": nbytes, "fit_s": statistics.median(sets[0]),
                        "check_s": statistics.median(sets[1])})
    return out


def _idle_barrier(seam: Transport, timeout: float) -> None:
    """Meet every rank without holding a core: ranks outside the measured group sleep here.

    A spinning wait would make a group of 2 on a 2-core machine share its cores with the
    idle ranks, so "2 ranks" would be measured oversubscribed (it was: 8 B collectives
    scattered from 6 us to 160 us between repetitions). The 20 ms naps wake rarely enough
    not to preempt the measured ranks often.
    """
    work = seam.barrier()
    deadline = time.monotonic() + timeout
    while not work.test():
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"calibrate: a rank did not reach the barrier between "
                                   f"groups within {timeout} s")
        time.sleep(0.02)


def _coefficients(records: list[dict[str, Any]], cores: int) -> list[np.ndarray]:
    """Per record, one row per algorithm: multipliers of (latency, 1/B, 1/R).

    With alpha = 1 s and bandwidths of 1 B/s on an uncrowded node, the model's latency,
    transfer and reduce terms *are* the multipliers; crowding (``n > cores``) scales the
    last two by ``n / cores``, and the latency is then the crowded one of that ratio.
    """
    out = []
    models: dict[int, CostModel] = {}
    for r in records:
        n = r["ranks"]
        if n not in models:
            models[n] = CostModel(Topology.uniform(nodes=1, devices_per_node=n,
                                                   fabric=Link("shm", 1.0, 1.0),
                                                   reduce_bandwidth=1.0))
        slow = max(1.0, n / cores)
        rows = [(e.latency, e.transfer * slow, e.reduce * slow) for e in (
            models[n].estimate(r["collective"], r["nbytes"], range(n), algorithm=a)
            for a in models[n].algorithms(r["collective"], range(n)))]
        out.append(np.array(rows))
    return out


# A cache line between two cores of one socket takes tens of nanoseconds; an MPI message
# moves a header and a payload through shared memory and polls a flag: at least 100 ns.
MIN_LATENCY_S = 1e-7
# the slowest rates and longest latency the fit considers (a link slower than this is not
# shared memory)
_MAX_LATENCY_S, _MIN_BANDWIDTH = 1e-2, 1e7


@dataclass(frozen=True)
class Bounds:
    """What physics allows the fitted parameters: a latency floor (s) and a ceiling on the
    transfer and reduce bandwidths (B/s)."""

    min_latency: float = MIN_LATENCY_S
    max_bandwidth: float = 1e12

    def grid(self) -> tuple[np.ndarray, np.ndarray, float, float]:
        """log10 ranges of (alpha, beta, gamma) and of the crowded latency."""
        lo = np.log10([self.min_latency, 1 / self.max_bandwidth, 1 / self.max_bandwidth])
        hi = np.log10([_MAX_LATENCY_S, 1 / _MIN_BANDWIDTH, 1 / _MIN_BANDWIDTH])
        return lo, hi, float(np.log10(self.min_latency)), float(np.log10(0.1))

    def at_bound(self, regime: Regime) -> list[str]:
        """The parameters of ``regime`` that sit on a bound (within 1%)."""
        out = []
        if regime.latency <= self.min_latency * 1.01:
            out.append(f"alpha at the {self.min_latency * 1e6:g} us floor")
        for name, value in (("bandwidth", regime.bandwidth),
                            ("reduce bandwidth", regime.reduce_bandwidth)):
            if value >= self.max_bandwidth / 1.01:
                out.append(f"{name} at the {self.max_bandwidth / 1e9:.3g} GB/s ceiling")
        return out


def copy_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Bytes per second one core copies between two buffers of ``nbytes`` (the best of
    ``reps``): the ceiling of any one-copy transfer on this machine."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault the pages in before timing
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _errors(coefs: list[np.ndarray], meas: np.ndarray, lat: np.ndarray,
            bw: np.ndarray) -> np.ndarray:
    """Summed |log error| over records for each (latency, [beta, gamma]) pair of grids:
    ``lat`` [L] latencies, ``bw`` [G, 2]; returns [G, L]."""
    err = np.zeros((len(bw), len(lat)))
    for c, m in zip(coefs, meas, strict=True):
        pred = (c[:, 1:] @ bw.T)[:, :, None] + c[:, :1, None] * lat[None, None, :]
        err += np.abs(np.log(pred.min(axis=0) / m))
    return err


def _fit_band(coefs: list[np.ndarray], meas: np.ndarray, levels: list[float | None],
              bounds: Bounds) -> tuple[np.ndarray, dict[float, float], float]:
    """Alpha, beta, gamma and one crowded latency per ranks-per-core level minimising the
    summed |log(model / measured)| over one band's points, and that sum.

    A grid over (alpha, beta, gamma) inside ``bounds``, refined twice around the best point
    (never past a bound); the crowded latency of each level touches only that level's
    points, so for every grid point it is its own 1-D search (summed in, not multiplied
    into the grid).
    """
    lo, hi, clo, chi = bounds.grid()
    groups: dict[float | None, list[int]] = {}
    for k, lv in enumerate(levels):
        groups.setdefault(lv, []).append(k)
    best = (lo + hi) / 2
    crowd = {lv: (clo + chi) / 2 for lv in groups if lv is not None}
    total = np.zeros(1)
    for width in (None, 0.5, 0.1):
        axes = [np.linspace(lo[i], hi[i], 13) if width is None else
                np.clip(np.linspace(best[i] - width, best[i] + width, 9), lo[i], hi[i])
                for i in range(3)]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
        total = np.zeros(len(grid))
        picks: dict[float, np.ndarray] = {}
        for lv, idx in groups.items():
            if lv is None:
                params = 10.0**grid
                for k in idx:
                    total += np.abs(np.log((coefs[k] @ params.T).min(axis=0) / meas[k]))
                continue
            line = (np.linspace(clo, chi, 13) if width is None else
                    np.clip(np.linspace(crowd[lv] - width, crowd[lv] + width, 9), clo, chi))
            err = _errors([coefs[k] for k in idx], meas[idx], 10.0**line, 10.0**grid[:, 1:])
            picks[lv] = line[err.argmin(axis=1)]
            total += err.min(axis=1)
        g = int(np.argmin(total))
        best = grid[g]
        crowd = {lv: float(picks[lv][g]) for lv in picks}
    return 10.0**best, {lv: 10.0**v for lv, v in crowd.items()}, float(total.min())


def fit(records: list[dict[str, Any]], *, cores: int, max_regimes: int = 3,
        min_sizes: int = 2, bounds: Bounds | None = None) -> list[Regime]:
    """Fit set A: at most ``max_regimes`` size bands of at least ``min_sizes`` measured sizes
    each, and per band the alpha, crowded latencies, bandwidth and reduce bandwidth
    (:mod:`fuelspmd.cost.regimes`) inside ``bounds`` minimising the summed |log error|.

    Bands and their parameters are chosen together: every contiguous run of sizes is
    fitted once and a dynamic programme picks the partition with the least total error.
    A band edge lies halfway (geometrically) between the sizes it separates. The crowded
    latency is fitted per ranks-per-core ratio measured (none when no group outnumbers
    the cores).
    """
    sizes = sorted({r["nominal"] for r in records})
    coefs = _coefficients(records, cores)
    meas = np.array([r["fit_s"] for r in records])
    levels = [r["ranks"] / cores if r["ranks"] > cores else None for r in records]
    index = {s: i for i, s in enumerate(sizes)}
    where = [index[r["nominal"]] for r in records]
    bands: dict[tuple[int, int], tuple[np.ndarray, dict[float, float], float]] = {}
    width = min(min_sizes, len(sizes))
    for i in range(len(sizes)):
        for j in range(i + width, len(sizes) + 1):
            pick_ = [k for k, w in enumerate(where) if i <= w < j]
            bands[i, j] = _fit_band([coefs[k] for k in pick_], meas[pick_],
                                    [levels[k] for k in pick_], bounds or Bounds())
    # best[k][j]: least error covering sizes[:j] with k bands, and the cut that gave it
    inf = float("inf")
    best: list[list[tuple[float, int]]] = [[(inf, -1)] * (len(sizes) + 1)
                                           for _ in range(max_regimes + 1)]
    best[0][0] = (0.0, -1)
    for k in range(1, max_regimes + 1):
        for j in range(1, len(sizes) + 1):
            best[k][j] = min(((best[k - 1][i][0] + bands[i, j][2], i) for i in range(j)
                              if (i, j) in bands and best[k - 1][i][0] < inf),
                             default=(inf, -1))
    k = min(range(1, max_regimes + 1), key=lambda k: best[k][len(sizes)][0])
    cuts, j = [], len(sizes)
    while k > 0:
        i = best[k][j][1]
        cuts.append((i, j))
        j, k = i, k - 1
    out = []
    for i, j in reversed(cuts):
        (alpha, beta, gamma), crowd, _ = bands[i, j]
        upto = math.inf if j == len(sizes) else math.sqrt(sizes[j - 1] * sizes[j])
        out.append(Regime(upto, float(alpha), float(1 / beta), float(1 / gamma),
                          tuple(sorted(crowd.items()))))
    return out


def model_for(n: int, regimes: list[Regime], *, cores: int) -> CostModel:
    """The cost model of ``n`` ranks on this node with the fitted regimes (as ``detect``
    and :func:`fuelspmd.cost.calibrated_model` build it for a job of this size)."""
    first = regimes[0]
    node = Node("here", n, Link("shm", first.bandwidth, first.latency),
                reduce_bandwidth=first.reduce_bandwidth, cores=cores)
    return CostModel(Topology([node]), regimes=regimes)


def check(records: list[dict[str, Any]], regimes: list[Regime], *,
          cores: int) -> list[dict[str, Any]]:
    """Each record with the fitted model's prediction, its algorithm and its error against
    set B, the timings the fit never saw."""
    out = []
    for n in sorted({r["ranks"] for r in records}):
        model = model_for(n, regimes, cores=cores)
        for r in (r for r in records if r["ranks"] == n):
            est = model.estimate(r["collective"], r["nbytes"], range(n))
            out.append({**r, "predicted_s": est.seconds, "algorithm": est.algorithm,
                        "error": abs(est.seconds - r["check_s"]) / r["check_s"]})
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median |error| per ``collective@ranks``, per ranks, and over all points."""
    out: dict[str, float] = {}
    for c in COLLECTIVES:
        for n in sorted({r["ranks"] for r in rows}):
            errs = [r["error"] for r in rows if r["collective"] == c and r["ranks"] == n]
            if errs:
                out[f"{c}@{n}"] = statistics.median(errs)
    for n in sorted({r["ranks"] for r in rows}):
        out[f"all@{n}"] = statistics.median(r["error"] for r in rows if r["ranks"] == n)
    out["all"] = statistics.median(r["error"] for r in rows)
    return out


def quality(rows: list[dict[str, Any]]) -> dict[str, float]:
    """How well the model predicts set B: the median and worst |relative error| and R^2 of
    log(time) (1 - residual / total sum of squares; 1 is a perfect fit, 0 no better than
    one time for every point)."""
    meas = np.log([r["check_s"] for r in rows])
    pred = np.log([r["predicted_s"] for r in rows])
    total = float(((meas - meas.mean()) ** 2).sum())
    r2 = 1.0 - float(((meas - pred) ** 2).sum()) / total if total > 0 else 1.0
    errors = [r["error"] for r in rows]
    return {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "r2_log_time": r2}


def _table(rows: list[dict[str, Any]], cores: int) -> str:
    lines = [f"{'collective':<15}{'n':>2}{'n/core':>7}{'bytes':>10}{'measured':>12}"
             f"{'predicted':>12}{'error':>8}  algorithm"]
    for r in rows:
        lines.append(f"{r['collective']:<15}{r['ranks']:>2}{r['ranks'] / cores:>7.2g}"
                     f"{r['nbytes']:>10}{r['check_s'] * 1e6:>10.1f}us"
                     f"{r['predicted_s'] * 1e6:>10.1f}us{r['error']:>8.1%}  {r['algorithm']}")
    med = summary(rows)
    ranks = sorted({r["ranks"] for r in rows})
    lines.append("")
    lines.append("median |error| " + "".join(f"{f'n={n}':>9}" for n in ranks))
    for c in (*COLLECTIVES, "all"):
        lines.append(f"{c:<15}" + "".join(f"{med.get(f'{c}@{n}', math.nan):>9.1%}"
                                          for n in ranks))
    return "\n".join(lines)


def _describe(regimes: list[Regime], bounds: Bounds) -> str:
    parts = []
    for r in regimes:
        crowd = "".join(f", {x:.3g} ranks/core: {v * 1e6:.0f} us" for x, v in r.crowded)
        upto = "inf" if math.isinf(r.upto) else f"{r.upto:.0f} B"
        pinned = bounds.at_bound(r)
        note = f" ({'; '.join(pinned)}: not determined by these sizes)" if pinned else ""
        parts.append(f"  up to {upto}: alpha {r.latency * 1e6:.3g} us, bandwidth "
                     f"{r.bandwidth / 1e9:.3g} GB/s, reduce {r.reduce_bandwidth / 1e9:.3g} "
                     f"GB/s{crowd}{note}")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    """Measure (or read ``--points``), fit, print the check table and save; 0 on success,
    2 on bad use."""
    p = parser("fuelspmd bench calibrate", __doc__)
    p.add_argument("--groups", default="2,3,4", help="group sizes to measure (default %(default)s)")
    p.add_argument("--reps", type=int, default=6, help="timings per set and point")
    p.add_argument("--max-bytes", type=int, default=2**26, help="largest size (default 64 MiB)")
    p.add_argument("--regimes", type=int, default=3, help="most size bands (default %(default)s)")
    p.add_argument("--points", help="refit the points of a saved calibration (no MPI)")
    p.add_argument("--out", help="calibration file (default: where load_calibration looks)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    cores = cpu_cores()
    if args.points:
        saved = json.loads(Path(args.points).read_text())
        records = [{k: v for k, v in r.items() if k in _RECORD} for r in saved["fit"]["points"]]
        cores, world_size, rank = int(saved.get("cores", cores)), int(saved["world"]), 0
    else:
        world = init(timeout=120.0)
        groups = sorted({int(x) for x in args.groups.split(",") if x.strip()})
        if world.size < 2 or not groups or min(groups) < 2:
            print(f"fuelspmd bench calibrate: run under mpiexec with >= 2 ranks and group "
                  f"sizes >= 2 (world {world.size}, groups {groups}): mpiexec -n 4 fuelspmd "
                  "bench calibrate", file=sys.stderr)
            return 2
        groups = [g for g in groups if g <= world.size]
        sizes = tuple(s for s in SIZES if s <= args.max_bytes)
        records = []
        for n in groups:
            member = world.rank < n
            sub = world.transport.split(0 if member else 1, world.rank)
            if member:
                # the fit is of MPI's own algorithms: the cost model prices the shm path by
                # its own formula, so a split that planned shm for some sizes must not run it
                if "route" in sub.capabilities:
                    sub.set_all_reduce_policy(algorithm="mpi")
                records += measure(sub, sizes=sizes, reps=args.reps)
            _idle_barrier(world.transport, world.timeout)
        world_size, rank = world.size, world.rank
    if rank != 0:
        return 0
    bounds = Bounds(max_bandwidth=copy_bandwidth())
    regimes = fit(records, cores=cores, max_regimes=args.regimes, bounds=bounds)
    rows = check(records, regimes, cores=cores)
    med = summary(rows)
    fit_quality = quality(rows)
    last, first = regimes[-1], regimes[0]
    data: dict[str, Any] = {
        "version": 2, "host": socket.gethostname(), "world": world_size, "cores": cores,
        "load": list(os.getloadavg()),
        # the one-line view ``detect`` reads: small-message latency, large-message rates
        "shm": {"latency": first.latency, "bandwidth": last.bandwidth,
                "reduce_bandwidth": last.reduce_bandwidth,
                **({} if not first.crowded else
                   {"oversubscribed_latency": first.crowded[0][1]})},
        "regimes": regimes_to_dict(regimes),
        "bounds": {"min_latency": bounds.min_latency, "max_bandwidth": bounds.max_bandwidth},
        "fit": {"median_abs_error_check": med["all"], "median_by": med, **fit_quality,
                "ranks_per_core": sorted({r["ranks"] / cores for r in records}),
                "points": rows}}
    if not args.no_save:
        data["path"] = str(save_calibration(data, args.out))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(_table(rows, cores))
    print(f"\nfitted on set A, judged on set B; {cores} cores, ranks per core "
          f"{', '.join(f'{x:.3g}' for x in data['fit']['ranks_per_core'])}; load "
          f"{' '.join(f'{x:.2f}' for x in data['load'])}\n"
          f"bounds: alpha >= {bounds.min_latency * 1e6:g} us, bandwidths <= "
          f"{bounds.max_bandwidth / 1e9:.3g} GB/s (one core's copy rate, measured now)\n"
          f"{_describe(regimes, bounds)}\n"
          f"quality on the check set: median |error| {fit_quality['median_abs_error']:.1%}, "
          f"worst {fit_quality['max_abs_error']:.1%}, R^2 of log(time) "
          f"{fit_quality['r2_log_time']:.3f}")
    if "path" in data:
        print(f"saved to {data['path']}")
    return 0


_RECORD = ("collective", "ranks", "nbytes", "nominal", "fit_s", "check_s")
