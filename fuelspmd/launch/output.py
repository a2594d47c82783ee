"""What an SPMD program prints: rank 0 by default, other ranks when asked, whole lines.

Every rank runs the same ``print``, so a plain print under ``mpiexec -n 4`` says everything
four times, and the lines can run together: the launcher forwards each rank's output as it
is written, and ``print`` writes its text and its newline separately when the output is
unbuffered (a terminal, ``PYTHONUNBUFFERED``, the sbatch scripts), so two ranks can meet
between the two writes. :func:`rank_print` (``world.print``) prints on the chosen ranks
only, each call one ``write`` of whole lines (a pipe delivers a write of up to 4 KiB in
one piece), prefixed with ``[rank R]`` where several ranks print. :func:`rank_logger`
(``world.logger()``) is a :mod:`logging` logger with the same rules.

Anything with a ``rank`` (a World, a Communicator of a DeviceGroup, whose devices share
the process's output) names who is printing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any, Literal, Protocol, TextIO

__all__ = ["Ranks", "rank_logger", "rank_print"]

Ranks = int | Iterable[int] | Literal["all"]


class _HasRank(Protocol):
    @property
    def rank(self) -> int: ...


def _speaks(rank: int, ranks: Ranks) -> bool:
    if ranks == "all":
        return True
    if isinstance(ranks, int):
        return rank == ranks
    return rank in set(ranks)


def _prefixed(ranks: Ranks, prefix: bool | None) -> bool:
    """Whether lines carry ``[rank R]``: as asked, else when more than one rank may print."""
    return not isinstance(ranks, int) if prefix is None else prefix


def rank_print(who: _HasRank, *values: object, ranks: Ranks = 0, prefix: bool | None = None,
               sep: str = " ", end: str = "\n", file: TextIO | None = None) -> None:
    """``print(*values)`` on the ranks in ``ranks`` (0, a list of ranks, or ``"all"``).

    ``prefix`` puts ``[rank R] `` before every line; by default lines are prefixed when
    ``ranks`` is not a single rank. The text goes out in one write and is flushed.
    """
    if not _speaks(who.rank, ranks):
        return
    text = sep.join(map(str, values)) + end
    if _prefixed(ranks, prefix):
        head = f"[rank {who.rank}] "
        text = "".join(head + line for line in text.splitlines(keepends=True))
    out = sys.stdout if file is None else file
    out.write(text)
    out.flush()


class _RankFilter(logging.Filter):
    def __init__(self, speaks: bool) -> None:
        super().__init__()
        self.speaks = speaks

    def filter(self, record: logging.LogRecord) -> bool:
        return self.speaks


def rank_logger(who: _HasRank, name: str = "fuelspmd", *, ranks: Ranks = 0,
                level: int = logging.INFO, prefix: bool | None = None,
                stream: TextIO | None = None) -> logging.Logger:
    """A logger named ``NAME.rankR`` that writes on the ranks in ``ranks`` only.

    Lines read ``[rank R] LEVEL NAME: message`` (the prefix as :func:`rank_print` decides
    it), on stderr by default. Asking again for the same name and rank reconfigures the
    one logger instead of adding a second handler.
    """
    logger = logging.getLogger(f"{name}.rank{who.rank}")
    for handler in list(logger.handlers):
        if getattr(handler, "_fuelspmd", False):
            logger.removeHandler(handler)
    handler: Any = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler._fuelspmd = True
    head = f"[rank {who.rank}] " if _prefixed(ranks, prefix) else ""
    handler.setFormatter(logging.Formatter(f"{head}%(levelname)s {name}: %(message)s"))
    handler.addFilter(_RankFilter(_speaks(who.rank, ranks)))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger
