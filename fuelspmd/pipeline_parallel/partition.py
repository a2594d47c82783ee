"""``partition(costs, stages)``: contiguous pipeline stages minimising the slowest one.

Pure policy: imports only ``fuelspmd.errors``, the standard library and numpy.

The answer is exact. The cost of a stage holding layers ``i .. j-1`` is
``seg(i, j) = P[j] - P[i]`` (+ ``first_extra`` when ``i = 0``, + ``last_extra`` when
``j = n``), with ``P`` the running sum of the costs. The optimal bottleneck is one of these
``O(n^2)`` segment values, so we binary-search the sorted candidates with a feasibility
check: a greedy left-to-right fill that gives each stage as many layers as stay within
the threshold while leaving one layer per remaining stage. Because every cost is positive,
``seg`` grows when a segment grows (float rounding is monotone too), which makes the
furthest-reaching greedy optimal for a fixed threshold and the check monotone in it. Both
the candidates and the check use the same ``seg``, so the float answer is exactly the
smallest feasible candidate.

Ties: among the optimal partitions, the one returned is the greedy fill at the optimal
threshold, i.e. each stage from the first takes as many layers as fit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from fuelspmd.errors import ConfigError

__all__ = ["Partition", "partition"]


@dataclass(frozen=True)
class Partition:
    """Contiguous stages: ``ranges[s]`` are the layer indices of stage ``s`` and
    ``costs[s]`` its cost, extras included. Iterating yields the ranges."""

    ranges: tuple[range, ...]
    costs: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """The cost of the slowest stage, which sets the pipeline's step rate."""
        return max(self.costs)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The first layer of each stage, then the layer count: ``(0, b1, ..., n)``."""
        return (*(r.start for r in self.ranges), self.ranges[-1].stop)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, stage: int) -> range:
        return self.ranges[stage]


def partition(
    costs: Sequence[float],
    stages: int,
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> Partition:
    """Split per-layer ``costs`` into ``stages`` contiguous stages minimising the slowest.

    ``first_extra`` and ``last_extra`` are added to the first and last stage (an embedding,
    a loss head). Raises :class:`~fuelspmd.errors.ConfigError` for ``stages < 1``, more
    stages than layers, or a cost that is not a finite positive number.
    """
    cost = _check(costs, stages, first_extra, last_extra)
    n = len(cost)
    prefix = [0.0, *accumulate(cost)]

    def seg(i: int, j: int) -> float:
        value = prefix[j] - prefix[i]
        if i == 0:
            value += first_extra
        if j == n:
            value += last_extra
        return value

    def fill(limit: float) -> list[int] | None:
        """Greedy stage ends for threshold ``limit``, or None if it needs more stages."""
        ends, i = [], 0
        for s in range(stages - 1):
            j = i + 1
            if seg(i, j) > limit:
                return None
            last_allowed = n - (stages - 1 - s)  # leave one layer per later stage
            while j < last_allowed and seg(i, j + 1) <= limit:
                j += 1
            ends.append(j)
            i = j
        if seg(i, n) > limit:
            return None
        return [*ends, n]

    candidates = _candidates(prefix, n, first_extra, last_extra)
    lo, hi = 0, len(candidates) - 1  # candidates[hi] = everything in one stage: feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(float(candidates[mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    ends = fill(float(candidates[lo]))
    if ends is None:
        raise RuntimeError(f"partition: the largest candidate {candidates[lo]} is infeasible")
    starts = [0, *ends[:-1]]
    return Partition(
        ranges=tuple(range(a, b) for a, b in zip(starts, ends)),
        costs=tuple(seg(a, b) for a, b in zip(starts, ends)),
    )


def _candidates(prefix: list[float], n: int, first_extra: float, last_extra: float) -> np.ndarray:
    """Every ``seg(i, j)`` value, sorted and unique (same float operations as ``seg``)."""
    p = np.asarray(prefix, dtype=np.float64)
    i, j = np.triu_indices(n + 1, k=1)
    values = p[j] - p[i]
    values = np.where(i == 0, values + first_extra, values)
    values = np.where(j == n, values + last_extra, values)
    return np.unique(values)


def _check(
    costs: Sequence[float], stages: int, first_extra: float, last_extra: float
) -> list[float]:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"stages must be an int >= 1, got {stages!r}")
    cost = list(costs)
    if stages > len(cost):
        raise ConfigError(
            f"cannot split {len(cost)} layers into {stages} stages: every stage needs a "
            f"layer; use stages <= {len(cost)} or split the model into more layers"
        )
    for k, c in enumerate(cost):
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c <= 0:
            raise ConfigError(
                f"layer {k} has cost {c!r}; every cost must be a finite number > 0 "
                f"(give a small positive cost to a free layer)"
            )
    for name, x in (("first_extra", first_extra), ("last_extra", last_extra)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
            raise ConfigError(f"{name} must be a finite number >= 0, got {x!r}")
    return [float(c) for c in cost]
