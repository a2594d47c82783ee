"""The ``fuelspmd`` command (layer 8): info, bench <what>, schedule, plan, trace.

Each subcommand lives in a module with ``main(argv) -> int``; this one only dispatches,
so ``fuelspmd --help`` stays fast and a subcommand imports only what it needs.
``fuelspmd bench X`` runs ``fuelspmd.bench.X``.
"""

from __future__ import annotations

import pkgutil
import sys
from importlib import import_module

from fuelspmd import bench

__all__ = ["main"]

_COMMANDS = {
    "info": ("fuelspmd.cli.info", "print the version, launcher, world, transports and devices"),
    "bench": ("", "run a benchmark: fuelspmd bench <what> [--json] (see fuelspmd bench --help)"),
    "schedule": ("fuelspmd.cli.schedule", "draw a pipeline schedule (grid, bubble, --png)"),
    "plan": ("fuelspmd.cli.plan", "rank tp x pp x dp layouts of a transformer on a cluster"),
    "trace": ("fuelspmd.cli.trace", "line up flight-recorder dumps and name the first difference"),
}


def _benches() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.ispkg)


def _usage() -> str:
    lines = ["usage: fuelspmd <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the fuelspmd command line with ``argv`` (default: sys.argv[1:])."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "bench":
        names = _benches()
        if not rest or rest[0] in {"-h", "--help"} or rest[0] not in names:
            if rest and rest[0] not in {"-h", "--help"}:
                print(f"fuelspmd bench: unknown benchmark {rest[0]!r}", file=sys.stderr)
            print("usage: fuelspmd bench <what> [options]\nbenchmarks: " + ", ".join(names))
            return 0 if rest and rest[0] in {"-h", "--help"} else 2
        return int(import_module(f"fuelspmd.bench.{rest[0]}").main(rest[1:]) or 0)
    if command not in _COMMANDS:
        print(f"fuelspmd: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(import_module(_COMMANDS[command][0]).main(rest) or 0)
