"""``partition(costs, stages)``: contiguous pipeline stages minimising the slowest one.

Pure policy: imports only ``fuelspmd.errors``, ``fuelspmd.topology`` (for :class:`Link`),
the standard library and numpy.

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

**Unequal stage links** (``links=``). When stage ``s`` and ``s + 1`` sit on ranks joined by
different links (NVLink inside a node, the network between nodes), moving the activation
across boundary ``s`` costs ``x_s(k)`` seconds, where ``k`` is the first layer of stage
``s + 1``: a fixed time, or ``latency + activation_bytes[k - 1] / bandwidth`` of a
:class:`~fuelspmd.topology.Link`. A stage's time is then its compute plus the transfers at
both of its boundaries,

    t_s(i, j) = seg(i, j) + x_{s-1}(i) [s > 0] + x_s(j) [s < S - 1],

because with blocking point-to-point transfers (what the executor runs) a transfer keeps
both its sender and its receiver busy. A transfer that depends on where the cut falls
makes ``t_s`` non-monotone in ``j``, so the greedy check no longer applies; the answer is
still exact, by dynamic programming over (stage, last layer): ``best_s(j) = min_i max(
best_{s-1}(i), t_s(i, j))``, ``O(S n^2)`` numpy operations. Ties follow the same rule as
above: each stage from the first takes as many layers as the optimum allows.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

import numpy as np

from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Topology

__all__ = ["Partition", "partition", "stage_links"]


@dataclass(frozen=True)
class Partition:
    """Contiguous stages: ``ranges[s]`` are the layer indices of stage ``s`` and
    ``costs[s]`` its cost, extras included. Iterating yields the ranges."""

    ranges: tuple[range, ...]
    costs: tuple[float, ...]
    transfers: tuple[float, ...] = ()
    """Per stage, the seconds of its incoming plus outgoing transfers (with ``links=``)."""
    explanation: str = ""

    @property
    def bottleneck(self) -> float:
        """The cost of the slowest stage, which sets the pipeline's step rate."""
        return max(self.costs)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The first layer of each stage, then the layer count: ``(0, b1, ..., n)``."""
        return (*(r.start for r in self.ranges), self.ranges[-1].stop)

    def explain(self) -> str:
        """Say, in words, what each stage holds and costs, and what set the boundaries."""
        if self.explanation:
            return self.explanation
        lines = [f"stage {s}: layers {r.start}-{r.stop - 1} ({len(r)}), cost {c:.6g}"
                 for s, (r, c) in enumerate(zip(self.ranges, self.costs))]
        worst = self.costs.index(self.bottleneck)
        return "\n".join([*lines, f"bottleneck: stage {worst}, {self.bottleneck:.6g} (the "
                                  "smallest possible slowest stage)"])

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
    links: Sequence[float | Link] | None = None,
    activation_bytes: float | Sequence[float] | None = None,
) -> Partition:
    """Split per-layer ``costs`` into ``stages`` contiguous stages minimising the slowest.

    ``first_extra`` and ``last_extra`` are added to the first and last stage (an embedding,
    a loss head). ``links`` (one per boundary, ``stages - 1``) prices moving the activation
    from stage ``s`` to ``s + 1``: seconds, or a :class:`~fuelspmd.topology.Link` (see
    :func:`stage_links`) that moves ``activation_bytes`` (one number, or one per layer: what
    layer ``k`` outputs); both ends of a boundary pay it (module docstring). Use the same
    unit as ``costs``: if they are a micro-batch's forward and backward, a boundary carries
    the activation forward and its gradient back, so give twice the activation's bytes.

    Raises :class:`~fuelspmd.errors.ConfigError` for ``stages < 1``, more stages than layers,
    a cost that is not a finite positive number, or links that do not fit.
    """
    cost = _check(costs, stages, first_extra, last_extra)
    if links is not None:
        items = list(links)
        kinds = [f" over {x.kind}" if isinstance(x, Link) else "" for x in items]
        return _linked(cost, stages, first_extra, last_extra,
                       _boundary_times(items, activation_bytes, stages, len(cost)), kinds)
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


def stage_links(topology: Topology, ranks: Sequence[int]) -> list[Link]:
    """The link from each stage's rank to the next one's (``ranks[s]`` holds stage ``s``;
    a mesh gives them as ``mesh.group("pp")``), for ``partition(links=...)``.

    One device per stage is enough: the ranks of a tensor-parallel stage send their shards
    side by side over links of the same class."""
    if len(ranks) < 2:
        return []
    return [topology.link(a, b) for a, b in pairwise(ranks)]


def _boundary_times(links: Sequence[float | Link], activation_bytes: float | Sequence[float]
                    | None, stages: int, n: int) -> np.ndarray:
    """``x[s, k]``: seconds to cross boundary ``s`` when stage ``s + 1`` starts at layer
    ``k`` (``k`` in 1..n-1; column 0 and n unused)."""
    items = list(links)
    if len(items) != stages - 1:
        raise ConfigError(f"links: {stages} stages have {stages - 1} boundaries, got "
                          f"{len(items)} links; give one per boundary (stage s to s+1)")
    acts: np.ndarray | None = None
    if any(isinstance(x, Link) for x in items):
        if activation_bytes is None:
            raise ConfigError("links given as Link need activation_bytes= (what a layer "
                              "sends to the next stage: one number, or one per layer)")
        raw = [activation_bytes] * n if isinstance(activation_bytes, numbers.Real) \
            else list(activation_bytes)
        if len(raw) != n:
            raise ConfigError(f"activation_bytes has {len(raw)} entries for {n} layers; give "
                              "one number, or one per layer")
        for k, b in enumerate(raw):
            if isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) \
                    or b < 0:
                raise ConfigError(f"activation_bytes[{k}] = {b!r}; give a finite number >= 0")
        acts = np.asarray(raw, dtype=np.float64)
    x = np.zeros((max(stages - 1, 0), n + 1))
    for s, link in enumerate(items):
        if isinstance(link, Link):
            assert acts is not None
            x[s, 1:n] = link.latency + acts[: n - 1] / link.bandwidth
        elif isinstance(link, bool) or not isinstance(link, numbers.Real) \
                or not math.isfinite(link) or link < 0:
            raise ConfigError(f"links[{s}] = {link!r}; give seconds (a finite number >= 0) "
                              "or a fuelspmd.topology.Link")
        else:
            x[s, :] = float(link)
    return x


def _linked(cost: list[float], stages: int, first: float, last: float,
            x: np.ndarray, kinds: list[str]) -> Partition:
    """Exact min-max partition with boundary transfers, by dynamic programming."""
    n = len(cost)
    p = np.asarray([0.0, *accumulate(cost)])
    idx = np.arange(n + 1)
    inf = np.inf

    def times(s: int) -> np.ndarray:
        """t[i, j] of stage ``s`` holding layers i..j-1 (inf where i >= j)."""
        t = p[None, :] - p[:, None]
        if s == 0:
            t[0, :] += first
        if s == stages - 1:
            t[:, n] += last
        if s > 0:
            t = t + x[s - 1][:, None]
        if s < stages - 1:
            t = t + x[s][None, :]
        return np.where(idx[:, None] < idx[None, :], t, inf)

    # The tables are recomputed in each pass rather than kept: O(n^2) memory, not O(S n^2).
    best = np.full(n + 1, inf)
    best[0] = 0.0  # zero stages cover zero layers
    for s in range(stages):
        best = np.maximum(best[:, None], times(s)).min(axis=0)
    optimum = best[n]
    # ok[s][i]: stages s.. can cover layers i.. with every stage <= optimum
    ok = [np.zeros(n + 1, dtype=bool) for _ in range(stages + 1)]
    ok[stages][n] = True
    for s in range(stages - 1, -1, -1):
        ok[s] = ((times(s) <= optimum) & ok[s + 1][None, :]).any(axis=1)
    starts, ends, stage_costs, i = [], [], [], 0
    for s in range(stages):
        row = times(s)[i]
        fits = np.nonzero((row <= optimum) & ok[s + 1])[0]
        if fits.size == 0:
            raise RuntimeError(f"partition: no stage {s} from layer {i} within the optimum "
                               f"{optimum}")
        j = int(fits.max())
        starts.append(i)
        ends.append(j)
        stage_costs.append(float(row[j]))
        i = j
    transfers = tuple(
        (float(x[s - 1, a]) if s > 0 else 0.0) + (float(x[s, b]) if s < stages - 1 else 0.0)
        for s, (a, b) in enumerate(zip(starts, ends)))
    result = Partition(tuple(range(a, b) for a, b in zip(starts, ends)), tuple(stage_costs),
                       transfers)
    plain = partition(cost, stages, first_extra=first, last_extra=last)
    plain_t = max(float(times(s)[r.start, r.stop]) for s, r in enumerate(plain.ranges))
    return Partition(result.ranges, result.costs, transfers,
                     _explain(result, plain, plain_t, x, kinds))


def _explain(result: Partition, plain: Partition, plain_t: float, x: np.ndarray,
             kinds: list[str]) -> str:
    lines = []
    for s, (r, c, t) in enumerate(zip(result.ranges, result.costs, result.transfers)):
        parts = [f"compute {c - t:.6g}"]
        if s > 0:
            parts.append(f"in {x[s - 1, r.start]:.6g}")
        if s < len(result) - 1:
            parts.append(f"out {x[s, r.stop]:.6g}")
        lines.append(f"stage {s}: layers {r.start}-{r.stop - 1} ({len(r)}), "
                     f"{' + '.join(parts)} = {c:.6g}")
    worst = result.costs.index(result.bottleneck)
    lines.append(f"bottleneck: stage {worst}, {result.bottleneck:.6g}")
    if len(result) > 1:
        cross = [float(x[s, b]) for s, b in enumerate(result.boundaries[1:-1])]
        s = cross.index(max(cross))
        lines.append(f"costliest link: {s}->{s + 1}{kinds[s]}, {cross[s]:.6g} per crossing, "
                     f"paid by stages {s} and {s + 1} ({len(result[s])} and "
                     f"{len(result[s + 1])} layers)")
    if plain.boundaries == result.boundaries:
        lines.append(f"the links do not move a boundary: the split by compute alone, "
                     f"{plain.boundaries}, is also optimal with them")
    else:
        moved = [f"boundary {s} (link {s}->{s + 1}, {x[s, b]:.6g}) from layer {a} to {b}"
                 for s, (a, b) in enumerate(zip(plain.boundaries[1:-1],
                                                result.boundaries[1:-1])) if a != b]
        lines.append(f"the links move {'; '.join(moved)}: split by compute alone "
                     f"{plain.boundaries} the slowest stage would take {plain_t:.6g} with the "
                     f"links, against {result.bottleneck:.6g}")
    return "\n".join(lines)


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
