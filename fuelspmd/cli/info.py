"""``fuelspmd info``: what this installation and this job look like."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings
from typing import Any

import numpy as np

import fuelspmd
from fuelspmd.backend import cuda_device_count
from fuelspmd.cost import load_calibration
from fuelspmd.cost.collectives import format_bytes
from fuelspmd.launch import init
from fuelspmd.topology import detect
from fuelspmd.transport import find_transports

__all__ = ["collect", "main"]


def _transports() -> list[dict[str, Any]]:
    """A row per transport plugin: whether it can run here and why not. What a plugin's
    libraries warn while it is probed (cupy, when NCCL is missing) is its row's business,
    not the terminal's: an unavailable plugin's reason says it, and an available one's
    warnings are kept in its row."""
    rows = []
    for name, entry in sorted(find_transports().items()):
        row: dict[str, Any] = {"name": name, "entry_point": entry.value}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                plugin = entry.load()
                row["unavailable"] = plugin.unavailable_reason()
                version = getattr(plugin, "library_version", None)
                row["library"] = (version() if callable(version) and not row["unavailable"]
                                  else None)
            except Exception as e:  # a broken third-party plugin must not break `info`
                row["unavailable"] = f"failed to load: {type(e).__name__}: {e}"
                row["library"] = None
        row["warnings"] = ([] if row["unavailable"] else
                           [" ".join(str(w.message).split()) for w in said])
        rows.append(row)
    return rows


# all-reduce sizes whose algorithm ``info`` shows: the transport's plan at a glance
PLAN_SIZES = (8, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def _all_reduce_plan(transport: Any) -> dict[str, str] | None:
    """The algorithm the world transport runs for a float32 all-reduce of each of
    ``PLAN_SIZES`` bytes (None when the transport has no choice to report)."""
    if "route" not in transport.capabilities:
        return None
    return {format_bytes(n): transport.all_reduce_algorithm(n, np.float32) for n in PLAN_SIZES}


def collect() -> dict[str, Any]:
    """Gather the facts ``info`` prints (starts the world, as every rank must)."""
    world = init()
    gpus = cuda_device_count()
    return {
        "version": fuelspmd.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "launcher": world.launcher,
        "rank": world.rank,
        "size": world.size,
        "nodes": {n: world.nodes.count(n) for n in dict.fromkeys(world.nodes)},
        "transport": world.transport.name,
        "device": str(world.device),
        "cuda_devices": gpus,
        "all_reduce": _all_reduce_plan(world.transport),
        "transports": _transports(),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fuelspmd info", description="Print what this installation and this job look "
        "like: the version, the launcher, the world, the transports found and whether each "
        "can run here, and the devices.")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--topology", action="store_true",
                        help="print the detected devices, nodes and links as a table")
    args = parser.parse_args(argv)
    facts = collect()
    if args.topology:
        table = detect(init(), calibration=load_calibration()).table()
        if facts["rank"] == 0:
            print(table)
        return 0
    if facts["rank"] != 0:
        return 0
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    nodes = ", ".join(f"{n} ({c} rank{'s' * (c > 1)})" for n, c in facts["nodes"].items())
    out = [
        f"fuelspmd {facts['version']}  (python {facts['python']}, numpy {facts['numpy']})",
        f"launcher   {facts['launcher']}: {facts['size']} rank(s) on {nodes}",
        f"world      transport {facts['transport']}, device of rank 0: {facts['device']}",
        f"devices    cpu, cuda x {facts['cuda_devices']}",
    ]
    if facts["all_reduce"]:
        plan = ", ".join(f"{size} {algo}" for size, algo in facts["all_reduce"].items())
        out.append(f"all_reduce {plan}  (why: transport.explain_all_reduce(nbytes))")
    out.append("transports")
    for t in facts["transports"]:
        state = "ok" if not t["unavailable"] else f"unavailable: {t['unavailable']}"
        out.append(f"  {t['name']:<8} {state}")
        if t["library"]:
            out.append(f"           {t['library']}")
        out += [f"           warning: {w}" for w in t["warnings"]]
    print("\n".join(out))
    sys.stdout.flush()
    return 0
