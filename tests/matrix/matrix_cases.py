"""The configurations of the equivalence matrix: the axes, which combinations a 4-rank
machine can run, the all-pairs covering set CI runs, and the full product.

A configuration (:class:`Case`) trains a model a few steps and is compared with the
reference run (one process, uncompiled, the same dtype and dropout; see ``matrix_run``).
Every axis is a choice a user makes; the all-pairs set holds, for every two axes, every
pair of their values that some runnable configuration has (a pair no configuration of at
most ``MAX_RANKS`` ranks can have, tp 4 beside pp 2 say, is listed by :func:`impossible`).
It is generated, not hand-picked: greedily, each new configuration the runnable one that
covers the most pairs not covered yet (ties broken by a fixed order), so the set is the
same on every run and every machine.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

MAX_RANKS = 4  # the processes or devices one configuration may use on a 2-core machine

# axis -> its values, the first of each the reference's where it has one
AXES: dict[str, tuple[Any, ...]] = {
    "model": ("gpt2", "llama"),
    "dtype": ("float32", "bfloat16", "float16"),
    "compiled": (False, True),
    "tp": (1, 2, 4),
    "pipeline": ("pp1", "pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2-zb-h1"),
    "dp": ("dp1", "dp2", "dp2-zero1"),
    "recompute": (False, True),
    "dropout": (False, True),
    "ranks": ("processes", "devices"),
    "resume": ("reshaped", "shrunk"),
}


@dataclass(frozen=True)
class Case:
    """One configuration: a value of every axis of :data:`AXES`."""

    model: str
    dtype: str
    compiled: bool
    tp: int
    pipeline: str
    dp: str
    recompute: bool
    dropout: bool
    ranks: str
    resume: str

    @property
    def pp(self) -> int:
        return 1 if self.pipeline == "pp1" else 2

    @property
    def schedule(self) -> str:
        return "1f1b" if self.pipeline == "pp1" else self.pipeline.split("-", 1)[1]

    @property
    def chunks(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def data(self) -> int:
        return 1 if self.dp == "dp1" else 2

    @property
    def zero(self) -> bool:
        return self.dp.endswith("zero1")

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.data

    def layout(self) -> tuple[int, int, int]:
        """(tp, pp, dp) of the run."""
        return self.tp, self.pp, self.data

    def resumed_layout(self) -> tuple[int, int, int]:
        """(tp, pp, dp) a checkpoint is resumed on: ``reshaped``, another factorisation of
        the same number of ranks; ``shrunk``, one of half as many (at least one). Which
        one is a function of the rest of the case (a hash of its name), so the set
        resumes on every kind of layout; a one-rank run resumes on one rank."""
        n = self.size if self.resume == "reshaped" else max(1, self.size // 2)
        others = [lay for lay in layouts(n) if lay != self.layout()] or [self.layout()]
        return others[zlib.crc32(self.name.encode()) % len(others)]

    @property
    def name(self) -> str:
        return (f"{self.model}-{self.dtype}-{'compiled' if self.compiled else 'eager'}-"
                f"tp{self.tp}-{self.pipeline}-{self.dp}-"
                f"{'recompute' if self.recompute else 'keep'}-"
                f"{'dropout' if self.dropout else 'nodrop'}-{self.ranks}-{self.resume}")

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def layouts(n: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) of ``n`` ranks the matrix runs (pp and dp at most 2), tp first."""
    return [(t, p, d) for t in (4, 2, 1) for p in (2, 1) for d in (2, 1) if t * p * d == n]


def runnable(c: Case) -> bool:
    return c.size <= MAX_RANKS


def impossible(a: str, va: Any, b: str, vb: Any) -> bool:
    """Whether no runnable configuration has ``a = va`` and ``b = vb``."""
    return not any(runnable(c) for c in _all({a: (va,), b: (vb,)}))


def _all(fixed: dict[str, tuple[Any, ...]] | None = None) -> Iterator[Case]:
    axes = {**AXES, **(fixed or {})}
    for values in itertools.product(*axes.values()):
        yield Case(**dict(zip(axes, values)))


def full_product() -> list[Case]:
    """Every runnable configuration."""
    return [c for c in _all() if runnable(c)]


def all_pairs() -> list[Case]:
    """The covering set: every runnable pair of values of every two axes in some case."""
    return covering(full_product(), list(AXES))


def uncovered(cases: list[Case]) -> list[tuple[str, Any, str, Any]]:
    """The pairs some runnable case has that none of ``cases`` has."""
    return missing(cases, full_product(), list(AXES))


# ---- covering sets of any dataclass of axis values ---------------------------------------
def _pairs(c: Any, axes: list[str]) -> set[tuple[str, Any, str, Any]]:
    d = asdict(c)
    return {(a, d[a], b, d[b]) for a, b in itertools.combinations(axes, 2)}


def covering(pool: list[Any], axes: list[str]) -> list[Any]:
    """A subset of ``pool`` holding every pair of values of two of ``axes`` that some
    member of ``pool`` holds: greedily, the member covering the most pairs not covered
    yet (the first such in ``pool``'s order), until none is left."""
    want = set().union(*(_pairs(c, axes) for c in pool))
    chosen: list[Any] = []
    while want:
        best = max(pool, key=lambda c: len(_pairs(c, axes) & want))
        chosen.append(best)
        want -= _pairs(best, axes)
    return chosen


def missing(cases: list[Any], pool: list[Any], axes: list[str]
            ) -> list[tuple[str, Any, str, Any]]:
    """The pairs a member of ``pool`` has that none of ``cases`` has."""
    have = set().union(*(_pairs(c, axes) for c in cases)) if cases else set()
    return sorted(set().union(*(_pairs(c, axes) for c in pool)) - have, key=str)
