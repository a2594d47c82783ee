"""The job of test_guard_heap.py: the documented mismatch example, or the whole matrix.

    mpiexec -n 4 python mismatch_job.py example   # docs/reliability.md's example, verbatim
    mpiexec -n 4 python mismatch_job.py matrix OUT ROUNDS  # all faults, all paths

``matrix`` runs each fault ROUNDS times, each on a fresh split of the world (after a few
good operations), catches the error and writes ``<case> <error type> <seconds>`` per case
to ``OUT/rank<R>.txt``; the test reads those files. The test runs it under MALLOC_CHECK_=3
and MALLOC_PERTURB_, so a write into freed memory aborts the rank with SIGABRT instead of
passing unseen.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.comm import GuardedTransport, Recorder
from fuelspmd.errors import CommError

FIELDS = ("op", "shape", "dtype", "reduce_op", "root", "group", "seq")
PAIRS = ("tag", "shape", "both_send", "skip_send", "skip_recv")


def example() -> None:
    from fuelspmd_mpi import plugin

    world = plugin.world(timeout=60)
    g = GuardedTransport(world, timeout=60, recorder=Recorder(), trace_dir="trace")
    buf = np.ones(1024, np.float32)
    g.all_reduce(buf, "sum").wait()
    if g.rank == 2:
        buf = buf.astype(np.float64)
    g.all_reduce(buf, "sum").wait()


def _collective(g: GuardedTransport, bad: bool, field: str, n: int) -> None:
    if field == "op" and bad:
        g.all_gather(np.zeros(n, np.float32), np.empty(n * g.size, np.float32)).wait()
    elif field == "root":
        g.broadcast(np.zeros(n, np.float32), 1 if bad else 0).wait()
    else:
        if bad and field == "seq":
            g.seq += 1
            g.cseq += 1
        if bad and field == "group":
            g.group += 1
            g._calls.clear()  # and the memo of the last kind, built for the old group
            g._memo = ((), None, None, None)
        shape = (n + 8,) if bad and field == "shape" else (n,)
        dt = np.float64 if bad and field == "dtype" else np.float32
        g.all_reduce(np.ones(shape, dt), "max" if bad and field == "reduce_op" else "sum").wait()


def _pair(g: GuardedTransport, case: str, n: int) -> None:
    x = np.arange(4.0)
    if g.rank == 0 and case != "skip_send":
        g.send(x, 1, 5).wait()
    elif g.rank == 1 and case != "skip_recv":
        if case == "both_send":
            g.send(x, 0, 5).wait()
        else:
            g.recv(np.empty((5,) if case == "shape" else (4,)), 0, 6 if case == "tag" else 5
                   ).wait()
    g.barrier().wait()
    g.all_reduce(np.ones(n, np.float32), "sum").wait()


def matrix(out: str, rounds: int) -> None:
    from fuelspmd_mpi import plugin

    world = plugin.world(timeout=30)
    log = open(f"{out}/rank{world.rank}.txt", "w")
    bad = world.size - 1
    cases: list[tuple[str, Any]] = []
    for mode in ("default", "debug"):
        for algo in ("mpi", "shm"):
            for n in (8, 1 << 16):
                cases += [(f"{mode}/{algo}/{n}/{f}", (mode, algo, n, _collective, f))
                          for f in FIELDS]
                cases += [(f"{mode}/{algo}/{n}/p2p-{c}", (mode, algo, n, _pair, c))
                          for c in PAIRS]
    for name, (mode, algo, n, fault, arg) in cases * rounds:
        t = world.split(0, world.rank)
        t.set_all_reduce_policy(algorithm=algo)
        g = GuardedTransport(t, mode=mode, timeout=8.0, recorder=Recorder())
        for i in range(2):
            b = np.full(n, float(i), np.float32)
            g.all_reduce(b, "sum").wait()
            g.barrier().wait()
        world.comm.Barrier()
        t0 = time.monotonic()
        try:
            if fault is _collective:
                _collective(g, g.rank == bad, arg, n)
            else:
                _pair(g, arg, n)
            got = "none"
        except CommError as e:
            got = type(e).__name__
        log.write(f"{name} {got} {time.monotonic() - t0:.2f}\n")
        log.flush()
        # what the fault left unreceived goes before the splits are freed (MPI reuses
        # their contexts): the guard's close drains its control channel, this the data's
        g.close()
        world.comm.Barrier()
        from mpi4py import MPI

        st = MPI.Status()
        while t.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, st):
            t.comm.Recv(np.empty(st.Get_count(MPI.BYTE), np.uint8), st.Get_source(),
                        st.Get_tag())
        world.comm.Barrier()
        t.finalize()


def _example_then_meet() -> None:
    """Run the example; on its error print the traceback, then wait (10 s at most) until
    every rank has printed before exiting 1: mpiexec kills the other ranks as soon as one
    exits non-zero, which could cut a slower rank's traceback short."""
    try:
        example()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        Path(f"printed.{world.Get_rank()}").touch()
        deadline = time.monotonic() + 10
        while (len(list(Path().glob("printed.*"))) < world.Get_size()
               and time.monotonic() < deadline):
            time.sleep(0.01)
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "example":
        _example_then_meet()
    else:
        matrix(sys.argv[2], int(sys.argv[3]))
