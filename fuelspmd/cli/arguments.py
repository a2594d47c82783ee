"""Bounded argument types for the ``fuelspmd`` subcommands' parsers.

A size the command cannot hold in memory or finish in seconds, or a number that is not
finite, is refused by argparse itself: one line naming the option and its range, exit
status 2, no traceback (``fuelspmd --help`` says what the statuses mean).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

__all__ = ["count", "number"]

N = TypeVar("N", int, float)


def _bounded(convert: Callable[[str], N], what: str, ok: Callable[[N], bool],
             wanted: str) -> Callable[[str], N]:
    """An argparse ``type``: ``convert(text)`` when ``ok`` of it, else an error naming
    ``wanted`` (what the value must be)."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {what}; give {wanted}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is outside the range; give {wanted}")
        return value

    return parse


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``lo`` to ``hi``."""
    return _bounded(int, "a whole number", lambda v: lo <= v <= hi,
                    f"a whole number from {lo} to {hi}")


def number(lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``lo`` (above it, if ``above``) to ``hi``."""
    low = f"above {lo:g}" if above else f"from {lo:g}"
    return _bounded(float, "a number", lambda v: math.isfinite(v) and lo <= v <= hi
                    and not (above and v == lo), f"a finite number {low} to {hi:g}")
