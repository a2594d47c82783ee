"""A fuelspmd program that fails on purpose: one rank, one way, at one moment.

    python crasher.py KIND RANK MOMENT [--timeout S] [--elements N]

KIND is how rank RANK fails:

- ``exception``: an unhandled ValueError (the crash handler prints it and aborts);
- ``exit``: ``sys.exit(1)``;
- ``abort``: ``os.abort()`` (SIGABRT: no Python code runs after it);
- ``sigkill``: the rank sends itself SIGKILL (nothing at all runs after it).

MOMENT is when, counted in the world's all-reduces the other ranks keep issuing:

- ``before``: right after ``fs.init()``, before the first all-reduce, which the others
  then wait in;
- ``during``: inside the wait of an all-reduce that every rank has started (a SIGALRM
  handler fails the rank, and re-arms itself until it lands inside a wait for the peers:
  ``Work.wait``, or the flag handshake of the shared-memory path, ``_raise_and_wait``,
  where an all-reduce of this size spends its wait and whose ``Work`` comes back done);
- ``between``: after all-reduce #2 completed on every rank and before #3, which the
  others then wait in.

After ``fs.init()`` every rank writes ``SEGMENT PATH`` for each MPI shared-memory file in
/dev/shm it maps, so a test can check that exactly this job's files are gone afterwards.
Just before it fails, the rank writes ``FAULT rank R kind K moment M at T`` (T from
``time.time()``) to stderr, so a test can measure how long the job takes to end after the
failure. Every rank that sees its program finish (it should not: the job must end first)
writes ``SURVIVED rank R``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType

import numpy as np

import fuelspmd as fs

KINDS = ("exception", "exit", "abort", "sigkill")
MOMENTS = ("before", "during", "between")
BETWEEN_AFTER = 3  # all-reduces #0..#2 complete before a "between" failure


def fail(kind: str, rank: int, moment: str) -> None:
    """Announce the failure on stderr, then fail the way ``kind`` says."""
    sys.stderr.write(f"FAULT rank {rank} kind {kind} moment {moment} at {time.time():.6f}\n")
    sys.stderr.flush()
    if kind == "exception":
        raise ValueError(f"rank {rank} fails on purpose ({moment} a collective)")
    if kind == "exit":
        sys.exit(1)
    if kind == "abort":
        os.abort()
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered before this returns
    raise AssertionError(f"unknown kind {kind!r}; one of {KINDS}")


def _inside_wait(frame: FrameType | None) -> bool:
    """Whether a method named ``*wait`` is on the stack: where a rank waits for its peers."""
    while frame is not None:
        if frame.f_code.co_name.endswith("wait") and "self" in frame.f_locals:
            return True
        frame = frame.f_back
    return False


def arm_during(kind: str, rank: int) -> None:
    """Fail from a SIGALRM handler once the main thread waits for its peers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if _inside_wait(frame):
            fail(kind, rank, "during")
        signal.setitimer(signal.ITIMER_REAL, 0.001)  # try again in 1 ms

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.2)


def main(argv: list[str] | None = None) -> int:
    """Run all-reduces until the job is ended by the failure of rank ``RANK``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("rank", type=int)
    parser.add_argument("moment", choices=MOMENTS)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="fs.init(timeout=...): seconds any wait may take (default 60)")
    parser.add_argument("--elements", type=int, default=1 << 16,
                        help="float64 elements per all-reduce (default 65536: 512 KiB)")
    parser.add_argument("--rounds", type=int, default=100_000,
                        help="all-reduces to issue at most (default 100000)")
    args = parser.parse_args(argv)

    world = fs.init(timeout=args.timeout)
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "/dev/shm/" in line
                  and not line.rstrip().endswith("(deleted)")}
    sys.stderr.write("".join(f"SEGMENT {path}\n" for path in sorted(mapped)))
    sys.stderr.flush()
    me = world.rank == args.rank
    if me and args.moment == "before":
        fail(args.kind, world.rank, "before")
    if me and args.moment == "during":
        arm_during(args.kind, world.rank)
    buf = np.ones(args.elements, dtype=np.float64)
    for i in range(args.rounds):
        if me and args.moment == "between" and i == BETWEEN_AFTER:
            fail(args.kind, world.rank, "between")
        buf[:] = 1.0
        world.transport.all_reduce(buf, fs.ReduceOp.SUM).wait()
        if buf[0] != world.size:
            raise RuntimeError(f"all-reduce #{i} gave {buf[0]}, expected {world.size}")
    sys.stderr.write(f"SURVIVED rank {world.rank}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
