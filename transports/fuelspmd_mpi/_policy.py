"""The all-reduce route of one MPI transport: size bands -> algorithm, with the reason.

The transport never decides by itself which all-reduce to run: the layer above either
names one (``set_all_reduce_policy(algorithm="shm", min_bytes=..., max_bytes=...)``) or
hands a *planner* (``algorithm="auto"``), a callable that maps the group's world ranks to

    {"bands": [(upto_bytes, algorithm, reason), ...], "nodes": [node of each group rank]}

(:func:`fuelspmd.cost.policy.all_reduce_planner` builds one from the calibrated cost
model). The plugin cannot import the cost model (it sits below it), so the plan arrives as
plain data.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from fuelspmd.errors import ConfigError

__all__ = ["ALGORITHMS", "RUNS", "Route", "manual_bands", "parse_bands"]

RUNS = ("mpi", "shm", "hierarchical")  # what a band may run
ALGORITHMS = (*RUNS, "auto")  # what set_all_reduce_policy takes


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def manual_bands(algorithm: str, lo: int, hi: int, source: str) -> list[tuple[float, str, str]]:
    """Bands for one named algorithm on ``lo..hi`` bytes and MPI's own elsewhere."""
    if algorithm == "mpi":
        return [(math.inf, "mpi", f"MPI's own all-reduce ({source})")]
    why = f"{algorithm} for {_fmt(lo)}..{_fmt(hi)} ({source})"
    bands: list[tuple[float, str, str]] = []
    if lo > 0:
        bands.append((lo - 0.5, "mpi", f"MPI's own: below the range of {why}"))
    bands.append((hi, algorithm, why))
    if hi < 2**62:
        bands.append((math.inf, "mpi", f"MPI's own: above the range of {why}"))
    return bands


def parse_bands(data: Any) -> list[tuple[float, str, str]]:
    """Check a planner's bands: ascending upper sizes ending unbounded, known algorithms."""
    try:
        bands = [(float(u), str(a), str(why)) for u, a, why in data]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"an all-reduce plan is a list of (upto_bytes, algorithm, reason), "
                          f"got {data!r} ({e})") from None
    edges = [u for u, _, _ in bands]
    if not bands or edges != sorted(set(edges)) or not math.isinf(edges[-1]):
        raise ConfigError(f"an all-reduce plan needs ascending upper sizes ending with inf, "
                          f"got {edges}")
    bad = sorted({a for _, a, _ in bands} - set(RUNS))
    if bad:
        raise ConfigError(f"an all-reduce plan names {bad}; a band runs one of {list(RUNS)}")
    return bands


class Route:
    """Which algorithm an all-reduce of ``nbytes`` runs, and why."""

    __slots__ = ("algos", "edges", "reasons", "routed", "smallest")

    def __init__(self, bands: Sequence[tuple[float, str, str]]) -> None:
        self.edges = [u for u, _, _ in bands]
        self.algos = [a for _, a, _ in bands]
        self.reasons = [why for _, _, why in bands]
        self.routed = any(a != "mpi" for a in self.algos)  # else: the plain MPI fast path
        # the fewest bytes any non-MPI band takes: smaller all-reduces skip the band lookup
        lows = [0.0, *self.edges[:-1]]
        self.smallest = min((lo for lo, a in zip(lows, self.algos, strict=True) if a != "mpi"),
                            default=math.inf)

    def algorithm(self, nbytes: int) -> str:
        """The algorithm of the band holding ``nbytes``."""
        return self.algos[min(bisect_left(self.edges, nbytes), len(self.algos) - 1)]

    def explain(self, nbytes: int) -> str:
        """The algorithm of ``nbytes``' band and the reason, in words."""
        i = min(bisect_left(self.edges, nbytes), len(self.algos) - 1)
        return f"all_reduce of {_fmt(nbytes)}: {self.algos[i]} ({self.reasons[i]})"

    def replace(self, algorithm: str, why: str) -> Route:
        """This route with ``algorithm``'s bands run by MPI instead, saying ``why``."""
        return Route([(u, "mpi", f"MPI's own: {algorithm} {why}; the plan said: {r}")
                      if a == algorithm else (u, a, r)
                      for u, a, r in zip(self.edges, self.algos, self.reasons, strict=True)])
