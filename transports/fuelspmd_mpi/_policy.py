"""The all-reduce route of one MPI transport: size bands -> algorithm, with the reason.

The transport never decides by itself which all-reduce to run: the layer above either
names one (``set_all_reduce_policy(algorithm="shm", min_bytes=..., max_bytes=...)``) or
hands a *planner* (``algorithm="auto"``), a callable that maps the group's world ranks to

    {"bands": [(upto_bytes, algorithm, reason), ...], "nodes": [node of each group rank]}

(:func:`fuelspmd.cost.policy.all_reduce_planner` builds one from the calibrated cost
model). The plugin cannot import the cost model (it sits below it), so the plan arrives as
plain data, and stays plain data here: a :class:`Route` is its bands.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any, NamedTuple

from fuelspmd.errors import ConfigError

__all__ = ["ALGORITHMS", "RUNS", "Band", "Route", "manual_bands", "parse_bands"]

RUNS = ("mpi", "shm", "hierarchical")  # what a band may run
ALGORITHMS = (*RUNS, "auto")  # what set_all_reduce_policy takes


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


class Band(NamedTuple):
    """All-reduces above the previous band's ``upto`` and up to this one run ``algorithm``."""

    upto: float
    algorithm: str
    reason: str


def manual_bands(algorithm: str, lo: int, hi: int, source: str) -> list[Band]:
    """Bands for one named algorithm on ``lo..hi`` bytes and MPI's own elsewhere."""
    if algorithm == "mpi":
        return [Band(math.inf, "mpi", f"MPI's own all-reduce ({source})")]
    why = f"{algorithm} for {_fmt(lo)}..{_fmt(hi)} ({source})"
    below = [Band(lo - 0.5, "mpi", f"MPI's own: below the range of {why}")] if lo > 0 else []
    above = [Band(math.inf, "mpi", f"MPI's own: above the range of {why}")] if hi < 2**62 else []
    return [*below, Band(hi, algorithm, why), *above]


def parse_bands(data: Any) -> list[Band]:
    """Check a planner's bands: ascending upper sizes ending unbounded, known algorithms."""
    try:
        bands = [Band(float(u), str(a), str(why)) for u, a, why in data]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"an all-reduce plan is a list of (upto_bytes, algorithm, reason), "
                          f"got {data!r} ({e})") from None
    edges = [b.upto for b in bands]
    if not bands or edges != sorted(set(edges)) or not math.isinf(edges[-1]):
        raise ConfigError(f"an all-reduce plan needs ascending upper sizes ending with inf, "
                          f"got {edges}")
    bad = sorted({b.algorithm for b in bands} - set(RUNS))
    if bad:
        raise ConfigError(f"an all-reduce plan names {bad}; a band runs one of {list(RUNS)}")
    return bands


class Route(NamedTuple):
    """Ascending bands, the last unbounded; ``smallest`` is the fewest bytes a band other
    than MPI's own takes (smaller all-reduces skip the lookup; inf: MPI's own for all)."""

    bands: tuple[Band, ...]
    edges: tuple[float, ...]
    smallest: float

    @classmethod
    def of(cls, bands: Iterable[Band]) -> Route:
        """The route of ``bands`` (as :func:`parse_bands` or :func:`manual_bands` gives)."""
        bs = tuple(bands)
        lows = [0.0, *(b.upto for b in bs[:-1])]
        return cls(bs, tuple(b.upto for b in bs),
                   min((lo for lo, b in zip(lows, bs) if b.algorithm != "mpi"),
                       default=math.inf))

    @property
    def algorithms(self) -> frozenset[str]:
        """Every algorithm some band runs."""
        return frozenset(b.algorithm for b in self.bands)

    def band(self, nbytes: int) -> Band:
        """The band holding ``nbytes``."""
        return self.bands[min(bisect_left(self.edges, nbytes), len(self.bands) - 1)]

    def explain(self, nbytes: int) -> str:
        """The algorithm of ``nbytes``' band and the reason, in words."""
        b = self.band(nbytes)
        return f"all_reduce of {_fmt(nbytes)}: {b.algorithm} ({b.reason})"

    def without(self, algorithm: str, why: str) -> Route:
        """This route with ``algorithm``'s bands run by MPI instead, saying ``why``."""
        return Route.of(Band(b.upto, "mpi", f"MPI's own: {algorithm} {why}; the plan said: "
                                            f"{b.reason}") if b.algorithm == algorithm else b
                        for b in self.bands)
