"""Bounded argument types for the ``fuelspmd`` subcommands' parsers.

A size the command cannot hold in memory or finish in seconds, or a number that is not
finite, is refused by argparse itself: one line naming the option and its range, exit
status 2, no traceback (``fuelspmd --help`` says what the statuses mean).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["count", "number"]


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``lo`` to ``hi``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number; give one from {lo} to {hi}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}; give a whole "
                                             f"number from {lo} to {hi}")
        return value

    return parse


def number(lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``lo`` (above it, if ``above``) to ``hi``."""
    low = f"above {lo:g}" if above else f"from {lo:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number; give one {low} to {hi:g}") from None
        if not (math.isfinite(value) and (value > lo if above else value >= lo)
                and value <= hi):
            raise argparse.ArgumentTypeError(f"{text} is outside the range; give a finite "
                                             f"number {low} to {hi:g}")
        return value

    return parse
