"""Which all-reduce the MPI transport runs for a group, per size, from the cost model.

Pure policy (layer 5): :func:`plan_all_reduce` turns a :class:`~fuelspmd.cost.CostModel`
and a group into bands of sizes, each with the transport algorithm that the model predicts
fastest and the reason in words. The transport (a plugin, which may not import the cost
model) receives the bands as plain data through a *planner*, a callable of the group's
world ranks; a ``split`` asks the same planner for its own group, so every group gets
its own plan. Every rank computes the same plan from the same calibration; the
transport checks that they agree.

Transport algorithms and how the model prices them:

- ``mpi``: the MPI library's own all-reduce, priced as the fastest of the model's default
  algorithms (ring, halving_doubling, doubling) on the group: what MPICH picks by size.
- ``shm``: the shared-memory path of ``fuelspmd_mpi`` (a group on one CPU node), priced by
  :meth:`CostModel.estimate` with ``algorithm="shm"`` (:meth:`CostModel.shm_min_bytes`:
  where it first beats MPI's own).
- ``hierarchical``: intra-node reduce-scatter, inter-node all-reduce per rail, intra-node
  all-gather over split communicators (a group on >= 2 nodes with the same number of its
  ranks on each).

Sizes are evaluated at powers of two from 8 B to ``largest``; a band runs from halfway
(geometrically) after the previous band's last size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fuelspmd.cost.calibration import calibrated_model, load_calibration
from fuelspmd.cost.collectives import CostModel, format_bytes, format_seconds
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Topology, WorldLike, detect

__all__ = ["TRANSPORT_ALGORITHMS", "AllReducePlan", "Band", "all_reduce_planner",
           "plan_all_reduce", "planner_for"]

TRANSPORT_ALGORITHMS = ("mpi", "shm", "hierarchical")
_MPI_OWN = ("ring", "halving_doubling", "doubling")


@dataclass(frozen=True, slots=True)
class Band:
    """All-reduces of at most ``upto`` bytes (inf: no bound) run ``algorithm``."""

    upto: float
    algorithm: str
    reason: str


@dataclass(frozen=True)
class AllReducePlan:
    """A group's all-reduce algorithm per size band, and the node of each group rank."""

    bands: tuple[Band, ...]
    nodes: tuple[int, ...]

    def choose(self, nbytes: float) -> Band:
        """The band that holds ``nbytes``."""
        for band in self.bands:
            if nbytes <= band.upto:
                return band
        return self.bands[-1]

    def as_data(self) -> dict[str, Any]:
        """The plain form a transport takes: ``{"bands": [(upto, algorithm, reason)],
        "nodes": [node index per group rank]}``."""
        return {"bands": [(b.upto, b.algorithm, b.reason) for b in self.bands],
                "nodes": list(self.nodes)}


def _candidates(model: CostModel, nbytes: float, group: list[int],
                shm: bool) -> dict[str, tuple[float, str]]:
    """Predicted seconds and a short note per transport algorithm that applies."""
    out: dict[str, tuple[float, str]] = {}
    own = [a for a in model.algorithms("all_reduce", group) if a in _MPI_OWN]
    best = min((model.estimate("all_reduce", nbytes, group, algorithm=a) for a in own),
               key=lambda e: e.seconds)
    out["mpi"] = (best.seconds, f"MPI's own ({best.algorithm})")
    if "hierarchical" in model.algorithms("all_reduce", group):
        e = model.estimate("all_reduce", nbytes, group, algorithm="hierarchical")
        out["hierarchical"] = (e.seconds, f"hierarchical ({e.bound})")
    if shm and "shm" in model.algorithms("all_reduce", group, opt_in=True):
        e = model.estimate("all_reduce", nbytes, group, algorithm="shm")
        out["shm"] = (e.seconds, "shared memory")
    return out


def plan_all_reduce(model: CostModel, group: Sequence[int], *, shm: bool = True,
                    largest: int = 1 << 34) -> AllReducePlan:
    """The all-reduce plan of ``group`` (device indices of ``model``'s topology).

    ``shm=False`` leaves the shm path out (the transport's shared windows cost memory).
    """
    members = sorted(group)
    if len(set(members)) != len(members) or not members:
        raise ConfigError(f"plan_all_reduce: a group is a non-empty list of distinct "
                          f"devices, got {list(group)}; pass each member rank once, e.g. "
                          f"{sorted(set(group)) or [0]}")
    topo = model.topology
    node_ids = [topo.node_index(d) for d in group]  # in the group's rank order
    nodes = tuple(sorted(set(node_ids)).index(k) for k in node_ids)
    if len(members) == 1:
        return AllReducePlan((Band(math.inf, "mpi", "one rank: nothing to reduce"),), nodes)
    where = (f"{len(members)} ranks on {len(set(nodes))} node(s)")
    picks: list[tuple[int, str, str]] = []
    size = 8
    while size <= largest:
        cands = _candidates(model, size, members, shm)
        usable = {k: v for k, v in cands.items() if k in TRANSPORT_ALGORITHMS}
        algo = min(usable, key=lambda k: usable[k][0])
        t = usable[algo][0]
        others = "; ".join(f"{note} {format_seconds(s)} (x{s / t:.2f})"
                           for k, (s, note) in sorted(cands.items(), key=lambda kv: kv[1][0])
                           if k != algo)
        picks.append((size, algo, f"{usable[algo][1]} predicted {format_seconds(t)}"
                      + (f"; {others}" if others else "")))
        size *= 2
    bands: list[Band] = []
    i = 0
    while i < len(picks):
        j = i
        while j + 1 < len(picks) and picks[j + 1][1] == picks[i][1]:
            j += 1
        lo = 0 if i == 0 else math.sqrt(picks[i - 1][0] * picks[i][0])
        upto = math.inf if j == len(picks) - 1 else math.sqrt(picks[j][0] * picks[j + 1][0])
        span = (f"up to {format_bytes(upto)}" if i == 0 else
                f"from {format_bytes(lo)}" if math.isinf(upto) else
                f"{format_bytes(lo)} to {format_bytes(upto)}")
        bands.append(Band(upto, picks[i][1], f"all_reduce {span} over {where}: "
                          f"{picks[i][1]}; at {format_bytes(picks[i][0])}: {picks[i][2]}"))
        i = j + 1
    return AllReducePlan(tuple(bands), nodes)


def all_reduce_planner(model: CostModel, *, shm: bool = True
                       ) -> Callable[[Sequence[int]], dict[str, Any]]:
    """A planner for ``MPITransport.set_all_reduce_policy(algorithm="auto", planner=...)``:
    world ranks of a group -> :meth:`AllReducePlan.as_data` (device ``r`` of the model's
    topology is world rank ``r``, as :func:`fuelspmd.topology.detect` numbers them)."""
    def planner(world_ranks: Sequence[int]) -> dict[str, Any]:
        return plan_all_reduce(model, world_ranks, shm=shm).as_data()
    return planner


def planner_for(world: WorldLike, *, calibration: Any = None,
                topology: Topology | None = None) -> Callable[[Sequence[int]], dict[str, Any]]:
    """The planner of a running job: its detected (or the given) topology, this machine's
    calibration (``load_calibration()`` unless given). Hand it to
    ``world.transport.set_all_reduce_policy(algorithm="auto", planner=...)``."""
    cal = load_calibration() if calibration is None else calibration
    topo = topology if topology is not None else detect(world, calibration=cal)
    return all_reduce_planner(calibrated_model(topo, cal))
