"""Size regimes of a CPU node's shared memory: one alpha, beta, gamma per band of sizes.

Why one line does not fit: MPICH between the processes of a node is not one alpha-beta
line from 8 B to 64 MiB. Small messages travel eagerly through preallocated cells (a copy
in, a copy out, a few microseconds each), large ones by a rendezvous and a pipelined copy
through a bounded buffer; and its collectives switch algorithm with size (recursive
doubling for short all-reduces, Rabenseifner or a ring above, a node-local release/gather
tree for the smallest). A single (alpha, beta) fitted over the whole range fits neither
end: the measured 8 B to 32 KiB times are flat at a few microseconds while 2 MiB and up
follow the copy bandwidth, and in between the caches decide.

So the calibrated model holds a few :class:`Regime` s, each the shared-memory link's
alpha (latency), bandwidth, reduce bandwidth and crowded latencies for collectives
whose buffer (``nbytes`` as :meth:`~fuelspmd.cost.CostModel.estimate` counts it) is at
most ``upto`` bytes. The band edges are fitted too (``fuelspmd bench calibrate``), at most
three bands each spanning at least two measured sizes: 12 numbers for 81 measured points,
a model and not a table of the points.

Ranks beyond the cores: when more ranks are busy than a node has cores, a message waits
for its receiver to be scheduled, and how long depends on how crowded the node is, in no
simple law (on 2 cores, 3 ranks can wait longer per message than 4: the scheduler pairs
4 ranks more evenly than 3). So ``crowded`` holds the per-message latency the calibration
found at each ranks-per-core ratio it ran; between
them it is interpolated, beyond the last scaled by the ranks beyond the cores, below the
first likewise. The copy and reduce rates shrink by ``cores / busy``
(:meth:`fuelspmd.topology.Node.crowding`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology

__all__ = ["Regime", "apply_regime", "pick", "regimes_from_dict", "regimes_to_dict"]


@dataclass(frozen=True, slots=True)
class Regime:
    """Shared-memory link parameters for collectives of at most ``upto`` bytes."""

    upto: float
    latency: float
    bandwidth: float
    reduce_bandwidth: float
    crowded: tuple[tuple[float, float], ...] = ()  # (ranks per core > 1, seconds), ascending

    def crowded_latency(self, ratio: float) -> float | None:
        """Per-message latency with ``ratio`` ranks per core (> 1); None if never measured."""
        pts = self.crowded
        if not pts or ratio <= 1:
            return None
        if ratio <= pts[0][0]:
            return pts[0][1] * (ratio - 1) / (pts[0][0] - 1)
        for (r0, l0), (r1, l1) in pairwise(pts):
            if ratio <= r1:
                return l0 + (l1 - l0) * (ratio - r0) / (r1 - r0)
        return pts[-1][1] * (ratio - 1) / (pts[-1][0] - 1)

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth", "reduce_bandwidth"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) or (
                    name != "latency" and v == 0):
                raise ConfigError(f"regime up to {self.upto} B: {name} = {v!r} is not usable "
                                  "(latency >= 0 s, bandwidths > 0 B/s); rerun the calibration")
        if not self.upto > 0:
            raise ConfigError(f"a regime's upper size must be > 0 bytes, got {self.upto}")
        ratios = [r for r, _ in self.crowded]
        if any(r <= 1 for r in ratios) or ratios != sorted(set(ratios)) or any(
                not (math.isfinite(v) and v >= 0) for _, v in self.crowded):
            raise ConfigError(f"regime up to {self.upto} B: crowded = {self.crowded!r} needs "
                              "ascending ranks-per-core ratios > 1 and latencies >= 0 s")


def regimes_to_dict(regimes: Sequence[Regime]) -> list[dict[str, Any]]:
    """The JSON form (``upto`` of the last band written as null: no upper bound)."""
    return [{"upto": None if math.isinf(r.upto) else r.upto, "latency": r.latency,
             "bandwidth": r.bandwidth, "reduce_bandwidth": r.reduce_bandwidth,
             "crowded": [list(p) for p in r.crowded]} for r in regimes]


def regimes_from_dict(data: Sequence[Mapping[str, Any]] | None) -> tuple[Regime, ...]:
    """Read :func:`regimes_to_dict`'s form back; checks the bands ascend and end unbounded."""
    if not data:
        return ()
    out = tuple(Regime(math.inf if d.get("upto") is None else float(d["upto"]),
                       float(d["latency"]), float(d["bandwidth"]),
                       float(d["reduce_bandwidth"]),
                       tuple((float(a), float(b)) for a, b in d.get("crowded") or ()))
                for d in data)
    edges = [r.upto for r in out]
    if edges != sorted(set(edges)) or not math.isinf(edges[-1]):
        raise ConfigError(f"regimes must have ascending upper sizes ending with null "
                          f"(unbounded), got {[d.get('upto') for d in data]}; rerun the "
                          "calibration")
    return out


def pick(regimes: Sequence[Regime], nbytes: float) -> int:
    """Index of the regime that prices a collective of ``nbytes``."""
    for i, r in enumerate(regimes):
        if nbytes <= r.upto:
            return i
    return len(regimes) - 1


def apply_regime(topology: Topology, regime: Regime, *, busy: int) -> Topology:
    """``topology`` with every shared-memory node's link set to ``regime``'s numbers.

    ``busy`` ranks on a node (the group times the groups running at once) pick the
    node's per-message latency when they outnumber its cores.
    """
    nodes: list[Node] = []
    for node in topology.nodes:
        if node.fabric.kind != "shm":
            nodes.append(node)
            continue
        crowded = None
        if node.cores is not None:
            crowded = regime.crowded_latency(busy / node.cores)
        nodes.append(replace(node, fabric=Link("shm", regime.bandwidth, regime.latency),
                             reduce_bandwidth=regime.reduce_bandwidth,
                             oversubscribed_latency=crowded))
    return Topology(nodes, network=topology.network, name=topology.name)
