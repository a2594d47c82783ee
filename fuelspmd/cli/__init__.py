"""The ``fuelspmd`` command (layer 8): info, bench <what>, schedule, plan, trace.

Each subcommand lives in a module with ``main(argv) -> int``; this one only dispatches,
so ``fuelspmd --help`` stays fast and a subcommand imports only what it needs.
``fuelspmd bench X`` runs ``fuelspmd.bench.X``.

Exit statuses: 0 success, 1 a failure the command found (``trace``: the ranks differ), 2
bad input (a message on stderr, no traceback), 130 interrupted (Ctrl-C), 141 the reader
of the output went away (``fuelspmd plan ... | head -1``: the rest is dropped quietly, as
``cat`` does when SIGPIPE ends it).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import sys
from importlib import import_module

import fuelspmd

__all__ = ["main"]

_COMMANDS = {
    "info": ("fuelspmd.cli.info", "print the version, launcher, world, transports and devices"),
    "bench": ("", "run a benchmark: fuelspmd bench <what> [--json] (see fuelspmd bench --help)"),
    "schedule": ("fuelspmd.cli.schedule", "draw a pipeline schedule (grid, bubble, --png)"),
    "plan": ("fuelspmd.cli.plan", "rank tp x pp x dp layouts of a transformer on a cluster"),
    "trace": ("fuelspmd.cli.trace", "line up flight-recorder dumps and name the first difference"),
}


def _benches() -> list[str]:
    """The benchmark modules, found without importing the package (rich and numpy load
    only for the benchmark that runs)."""
    spec = importlib.util.find_spec("fuelspmd.bench")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(m.name for m in pkgutil.iter_modules(where) if not m.ispkg)


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C ended
BROKEN_PIPE = 141  # 128 + SIGPIPE


def _usage() -> str:
    lines = ["usage: fuelspmd [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in _COMMANDS.items()]
    lines += ["", "fuelspmd <command> --help describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the fuelspmd command line with ``argv`` (default: sys.argv[1:]).

    A closed output pipe and Ctrl-C end the command with a status and no traceback.
    """
    try:
        code = _dispatch(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # here, so a closed pipe is seen inside the try
        return code
    except BrokenPipeError:
        # nothing more can be written: point stdout at /dev/null so that the interpreter's
        # own flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt:
        sys.stderr.write("fuelspmd: interrupted\n")
        return INTERRUPTED


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    if args[0] in {"-V", "--version"}:
        print(f"fuelspmd {fuelspmd.__version__}")
        return 0
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
