"""``fuelspmd bench guard``: what the collective guard costs, beside the unguarded transport.

    mpiexec -n 2 fuelspmd bench guard [--bytes 1M] [--rounds 300] [--modes default,debug]
                                      [--recorder]

Each round times ``k`` back-to-back all_reduces (sum, float32, in place) of the unguarded
world transport and of a GuardedTransport over it in each mode, in turn, starting at a
barrier; the order of the candidates alternates every round (A B, B A, ...) so neither
always runs first after the barrier. A round's time is the slowest rank's. ``ratio`` is the
median over rounds of the paired ratio guarded / unguarded (pairs ran back to back, so
they saw the same machine state), ``sum ratio`` the
ratio of the total times, ``p10 ratio`` the ratio of the 10th percentiles of the round
times (on a loaded machine most rounds lose time slices to other processes; the fastest
tenth are the rounds that ran undisturbed, so this ratio is the closest to the guard's
own cost), ``+us`` the difference of the medians per call.

The guards are built as ``fs.init()`` builds the world's: without a flight recorder
(``init`` adds one only with ``trace_dir``); ``--recorder`` gives each one, as
``init(trace_dir=...)`` does. The header gives the machine's load average: on a machine
shared with other work, a figure taken at load 6 is not one taken at load 1.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.bench import Column, median, parse_bytes, parser, print_json, print_table, time_calls
from fuelspmd.comm import MODES, GuardedTransport, Recorder
from fuelspmd.errors import ConfigError
from fuelspmd.launch import init
from fuelspmd.transport import ReduceOp, Transport

__all__ = ["main", "run"]

ROUND_S = 5e-3  # target length of one timed round
MIN_CALLS = 10


def run(t: Transport, *, nbytes: int, modes: list[str], rounds: int, warmup: int = 20,
        recorder: bool = False) -> dict[str, Any]:
    """Measure unguarded against guarded all_reduce of ``nbytes``; the same on every rank."""
    buf = np.zeros(max(1, nbytes // 4), np.float32)
    calls: dict[str, Callable[[], object]] = {"unguarded": lambda: t.all_reduce(buf, "sum").wait()}
    guards = []
    for mode in modes:
        g = GuardedTransport(t, mode=mode, timeout=60.0,
                             recorder=Recorder() if recorder else None)
        guards.append(g)
        calls[mode] = (lambda g=g: g.all_reduce(buf, "sum").wait())
    est = np.array([time_calls(fn, warmup) for fn in calls.values()], np.float64)
    t.all_reduce(est, ReduceOp.MAX).wait()
    k = int(min(1000, max(MIN_CALLS, ROUND_S / max(float(est.max()), 1e-9))))
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            t.barrier().wait()
            times[name].append(time_calls(calls[name], k))
    for name in names:
        arr = np.asarray(times[name], np.float64)
        t.all_reduce(arr, ReduceOp.MAX).wait()
        times[name] = arr.tolist()
    for g in guards:
        g.close()
    base = times["unguarded"]
    rows = [{"path": "unguarded", "time_us": median(base) * 1e6}]
    for mode in modes:
        ts = times[mode]
        rows.append({"path": f"guarded ({mode})", "time_us": median(ts) * 1e6,
                     "ratio": median([b / a for a, b in zip(base, ts)]),
                     "sum_ratio": sum(ts) / sum(base),
                     "p10_ratio": float(np.quantile(ts, 0.1) / np.quantile(base, 0.1)),
                     "added_us": (median(ts) - median(base)) * 1e6})
    return {"bytes": buf.nbytes, "ranks": t.size, "rounds": rounds, "calls_per_round": k,
            "load": os.getloadavg()[0], "recorder": recorder, "rows": rows}


def main(argv: list[str]) -> int:
    """Run the benchmark on the world transport; rank 0 prints. Returns the exit code."""
    p = parser("fuelspmd bench guard", __doc__)
    p.add_argument("--bytes", default="1M", help="all_reduce size (default 1M)")
    p.add_argument("--rounds", type=int, default=300, help="interleaved rounds (default 300)")
    p.add_argument("--modes", default="default", help="guard modes to time (default, debug, off)")
    p.add_argument("--recorder", action="store_true",
                   help="give each guard a flight recorder, as init(trace_dir=...) does")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        nbytes = parse_bytes(args.bytes)
        if any(m not in MODES for m in modes) or args.rounds < 1 or nbytes < 4:
            raise ConfigError(f"bench guard: --modes among {MODES} (got {modes}), --rounds >= 1 "
                              f"(got {args.rounds}), --bytes >= 4 (got {nbytes})")
    except ConfigError as e:
        print(f"fuelspmd bench guard: {e}", file=sys.stderr, flush=True)
        return 2
    t = init(check="off").transport  # the unguarded transport: each guard wraps it
    start = time.perf_counter()
    out = run(t, nbytes=nbytes, modes=modes, rounds=args.rounds, recorder=args.recorder)
    if t.rank != 0:
        return 0
    out["seconds"] = time.perf_counter() - start
    if args.json:
        print_json({"bench": "guard", **out})
        return 0
    cols = [Column("path", "path"), Column("us/call", "time_us", "{:.1f}"),
            Column("ratio", "ratio", "{:.4f}"), Column("sum ratio", "sum_ratio", "{:.4f}"),
            Column("p10 ratio", "p10_ratio", "{:.4f}"), Column("+us", "added_us", "{:+.2f}")]
    print_table(f"all_reduce {out['bytes']} B float32, {t.size} ranks, {args.rounds} rounds of "
                f"{out['calls_per_round']} calls (ratio: median of paired guarded/unguarded), "
                f"{'with' if args.recorder else 'no'} flight recorder, load {out['load']:.2f}",
                cols, out["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
