"""Learning-rate schedules: pure functions of the step count.

Layer 7. A schedule is a callable ``step -> lr`` (``step`` counts the optimiser steps
already taken, from 0), so every rank computes the same rate and a resumed run needs
only the step count (which the optimiser's ``state_dict`` keeps). An optimiser takes a
float (constant) or a schedule for ``lr=``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from fuelspmd.errors import ConfigError

__all__ = ["Schedule", "as_schedule", "constant", "cosine", "linear_warmup"]

Schedule = Callable[[int], float]


def _check(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not v >= 0:
            raise ConfigError(f"{owner}: {name}={v!r} must be a number >= 0")


@dataclass(frozen=True)
class constant:  # a schedule reads as a function: optim.constant(1e-3)
    """``lr`` at every step."""

    lr: float

    def __post_init__(self) -> None:
        _check("constant", lr=self.lr)

    def __call__(self, step: int) -> float:
        return float(self.lr)


@dataclass(frozen=True)
class linear_warmup:
    """``lr * (step + 1) / warmup`` for the first ``warmup`` steps, then ``lr``.

    The first step already moves (at ``lr / warmup``), as Megatron's warm-up does, and is
    torch's ``LinearLR(start_factor=1 / warmup, total_iters=warmup - 1)``.
    """

    lr: float
    warmup: int

    def __post_init__(self) -> None:
        _check("linear_warmup", lr=self.lr)
        if not isinstance(self.warmup, int) or self.warmup < 1:
            raise ConfigError(f"linear_warmup: warmup={self.warmup!r} must be an int >= 1 "
                              "(use optim.constant for none)")

    def __call__(self, step: int) -> float:
        return self.lr * min(step + 1, self.warmup) / self.warmup


@dataclass(frozen=True)
class cosine:
    """Linear warm-up over ``warmup`` steps (none when 0), then a half cosine from ``lr``
    down to ``min_lr`` over the remaining ``total - warmup`` steps, ``min_lr`` after.

    After the warm-up, at ``k = step - warmup``: ``min_lr + (lr - min_lr) (1 + cos(pi k /
    (total - warmup))) / 2``, torch's ``CosineAnnealingLR(T_max=total - warmup,
    eta_min=min_lr)`` in closed form.
    """

    lr: float
    total: int
    warmup: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        _check("cosine", lr=self.lr, min_lr=self.min_lr)
        if not isinstance(self.warmup, int) or not isinstance(self.total, int) or \
                not 0 <= self.warmup < self.total:
            raise ConfigError(f"cosine: need ints 0 <= warmup < total, got warmup="
                              f"{self.warmup!r}, total={self.total!r}; total counts the "
                              "steps of the whole run, warm-up included")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        k = min(step - self.warmup, self.total - self.warmup)
        span = self.total - self.warmup
        return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * k / span)) / 2


def as_schedule(lr: float | Schedule) -> Schedule:
    """A float as :class:`constant`; a schedule as itself."""
    if callable(lr):
        return lr
    return constant(lr)
