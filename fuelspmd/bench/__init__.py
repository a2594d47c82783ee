"""Benchmarks run by ``fuelspmd bench <what>``, and the helpers they share.

Layer 8. Each benchmark is a module with ``main(argv) -> int`` that puts its baseline in
the same run as the candidate. A machine shared with other work, or one that changes its
clock, can switch between a fast and a slow state for minutes at a time, so a comparison
is only meaningful when the two are interleaved: :func:`interleave` runs one round of each
candidate in turn (A, B, A, B, ...) and the report is the median per candidate and their
ratio, never two absolute numbers taken minutes apart. The CLI lists the benchmarks
without importing this package.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from fuelspmd.comm.guarded import GuardedTransport

__all__ = ["Column", "help_text", "interleave", "median", "mpi_comm", "parse_bytes", "parser",
           "print_json", "print_table", "time_calls"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def mpi_comm(t: Any) -> Any | None:
    """The mpi4py communicator under ``t`` (the MPI transport, guarded or not), for a raw
    baseline; None for any other transport."""
    inner = t.inner if isinstance(t, GuardedTransport) else t
    return inner.comm if inner.name == "mpi" else None


_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc):`~?([^`]+)`")


def help_text(doc: str) -> str:
    """A module docstring as ``--help`` shows it: reST roles and literals as plain text."""
    text = _ROLE.sub(r"\1", doc.strip())
    text = text.replace("``", "").replace("::\n", ":\n")
    return text


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser whose description is ``doc`` in plain text, line breaks kept."""
    return argparse.ArgumentParser(prog=prog, description=help_text(doc),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_bytes(text: str) -> int:
    """Parse ``"8"``, ``"64K"``, ``"1MiB"``, ``"64M"`` into bytes (binary units)."""
    s = text.strip().upper()
    digits = s.rstrip("BKMGI")
    unit = s[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"cannot read a byte count from {text!r}; write e.g. 8, 64K, 1M, 64MiB")
    return int(digits) * _UNITS[unit]


def time_calls(fn: Callable[[], object], calls: int) -> float:
    """Return the seconds per call of ``calls`` back-to-back calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleave(rounds: Mapping[str, Callable[[], float]], *, count: int) -> dict[str, list[float]]:
    """Run ``count`` rounds of every candidate in turn (A, B, A, B, ...); collect the times.

    Each callable runs one timed round and returns its time (seconds per operation). The
    candidates alternate inside every round, so a change of machine state hits them alike.
    """
    out: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(count):
        for name, run in rounds.items():
            out[name].append(run())
    return out


def median(values: Sequence[float]) -> float:
    """The median (the report's statistic: robust to the odd preempted round)."""
    return float(statistics.median(values))


class Column:
    """A table column: its header, the row key it shows and a format for the value."""

    __slots__ = ("fmt", "header", "key")

    def __init__(self, header: str, key: str, fmt: str = "{}") -> None:
        self.header, self.key, self.fmt = header, key, fmt

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        return "-" if value is None else self.fmt.format(value)


def print_table(title: str | None, columns: Sequence[Column],
                rows: Sequence[Mapping[str, Any]], *, out: TextIO | None = None) -> None:
    """Print ``rows`` as a right-aligned table (rich's, without borders: it reads the same in
    a log as on a terminal, where the header is bold) under a ``# title`` line."""
    out = out or sys.stdout
    table = Table(box=None, pad_edge=False, header_style="bold")
    for c in columns:
        table.add_column(c.header, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(c.cell(r) for c in columns))
    # laid out into a string and written here: rich's own writer turns a closed pipe into
    # SystemExit(1), where the CLI gives a closed pipe its own status. Wide enough never to
    # wrap: a log line may be long, a cut number is wrong.
    text = io.StringIO()
    Console(file=text, width=100_000, highlight=False, soft_wrap=True,
            force_terminal=out.isatty()).print(table)
    if title is not None:
        print(f"# {title}", file=out)
    print(text.getvalue(), file=out, flush=True)


def print_json(payload: Mapping[str, Any], *, out: TextIO | None = None) -> None:
    """Print ``payload`` as one JSON document (the ``--json`` output of every bench)."""
    print(json.dumps(payload, indent=1), file=out or sys.stdout, flush=True)
