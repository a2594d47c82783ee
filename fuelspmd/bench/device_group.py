"""``fuelspmd bench device_group``: a DeviceGroup all_reduce against memory bandwidth.

    fuelspmd bench device_group [--devices 4] [--bytes 64M] [--iters 10] [--json]

One process, ``DeviceGroup.cpu(devices)``: each device all_reduces its own ``bytes`` of
float32 (a leaf), realised inside ``group.run``. The group reduces once, for all devices,
into one shared result, so the work is reading ``devices`` inputs and writing one output.

The bound is measured in the same run, interleaved round by round: ``copy`` is numpy
copying ``bytes`` (one read and one write of the buffer), which gives the machine's copy
bandwidth ``2 * bytes / t_copy``. At that bandwidth the reduction's traffic,
``(devices + 1) * bytes``, takes ``t_bound = t_copy * (devices + 1) / 2``.

- ``vs_bound`` = t_bound / t_all_reduce (target: at least 0.5);
- ``vs_copy`` = t_copy / t_all_reduce (the all_reduce against one plain copy of its bytes).

Both are medians of paired per-round ratios; the all_reduce's time includes starting the
device threads and building and realising the lazy graph.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from fuelspmd.bench import Column, interleave, median, parse_bytes, parser, print_json, print_table
from fuelspmd.comm.communicator import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError
from fuelspmd.tensor import tensor

__all__ = ["main", "run"]


def run(*, devices: int, nbytes: int, rounds: int) -> dict[str, Any]:
    """Time the group all_reduce and the copy, interleaved; return medians and ratios."""
    n = max(1, nbytes // 4)
    group = DeviceGroup.cpu(devices, timeout=600.0)
    inputs = [np.full(n, float(i + 1), np.float32) for i in range(devices)]
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)

    def step(comm: Communicator, x: np.ndarray) -> Any:
        return comm.all_reduce(tensor(x, device=comm.device)).realize().node.buffer

    out = group.run(step, inputs)
    want = float(devices * (devices + 1) / 2)
    if devices > 1 and not (out[0] is out[-1] and out[0][0] == want and out[0][-1] == want):
        raise RuntimeError("DeviceGroup all_reduce gave a wrong or unshared result")

    def timed_group() -> float:
        start = time.perf_counter()
        group.run(step, inputs)
        return time.perf_counter() - start

    def timed_copy() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    times = interleave({"all_reduce": timed_group, "copy": timed_copy}, count=rounds)
    ar, cp = times["all_reduce"], times["copy"]
    return {"devices": devices, "bytes": n * 4, "rounds": rounds,
            "all_reduce_ms": median(ar) * 1e3, "copy_ms": median(cp) * 1e3,
            "copy_gbps": 2 * n * 4 / median(cp) / 1e9,
            "vs_bound": median([c * (devices + 1) / 2 / a for a, c in zip(ar, cp)]),
            "vs_copy": median([c / a for a, c in zip(ar, cp)])}


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table (or JSON). Returns the exit code."""
    p = parser("fuelspmd bench device_group", __doc__)
    p.add_argument("--devices", type=int, default=4, help="cpu devices in the group (4)")
    p.add_argument("--bytes", default="64M", help="bytes each device reduces (64M)")
    p.add_argument("--iters", type=int, default=10, help="timed rounds per candidate (10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        if args.devices < 1 or args.iters < 1:
            raise ConfigError(f"bench device_group: --devices and --iters must be >= 1 (got "
                              f"{args.devices}, {args.iters})")
        res = run(devices=args.devices, nbytes=parse_bytes(args.bytes), rounds=args.iters)
    except ConfigError as e:
        print(f"fuelspmd bench device_group: {e}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print_json({"bench": "device_group", **res})
        return 0
    print_table(f"DeviceGroup.cpu({res['devices']}) all_reduce of {res['bytes']} B float32 "
                f"(median of {res['rounds']} interleaved rounds)",
                [Column("all_reduce ms", "all_reduce_ms", "{:.2f}"),
                 Column("copy ms", "copy_ms", "{:.2f}"),
                 Column("copy GB/s", "copy_gbps", "{:.2f}"),
                 Column("vs bound", "vs_bound", "{:.3f}"),
                 Column("vs copy", "vs_copy", "{:.3f}")], [res])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
