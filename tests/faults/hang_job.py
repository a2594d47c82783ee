"""A job that hangs: one rank stuck in Python while the others wait in a collective.

    mpiexec -n 4 python hang_job.py TRACE_DIR [--timeout S] [--in-recv]

Every rank runs 20 all_reduces of the world (collectives #0..#19), prints ``READY rank R
pid P`` and goes on to the 21st; rank 2 instead sleeps for ten minutes, stuck in Python
(``time.sleep``, the line marked ``<- STUCK``), so the others wait in collective #20
(marked ``<- WAIT``). With ``--in-recv`` rank 3 is the one stuck, and rank 2 waits in a
recv of a message rank 3 would send after its sleep (marked ``<- IN RECV``). Nothing ends the
job but a signal, or the ranks' deadline (``fs.init(timeout=S)``, default 600 s): the
test sends SIGTERM, SIGINT or SIGUSR1, and reads the flight records in TRACE_DIR with
``fuelspmd trace``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import fuelspmd as fs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("trace_dir")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--in-recv", action="store_true")
    args = p.parse_args()
    stuck = 3 if args.in_recv else 2
    world = fs.init(timeout=args.timeout, trace_dir=args.trace_dir)
    x = fs.tensor(np.ones(8, np.float32))
    for _ in range(20):
        world.comm.all_reduce(x).numpy()
    sys.stdout.write(f"READY rank {world.rank} pid {os.getpid()}\n")
    sys.stdout.flush()
    if world.rank == stuck:
        time.sleep(600)  # <- STUCK
        world.comm.send(x, 2).numpy()
    if world.rank == 2 and args.in_recv:
        world.comm.recv((8,), "float32", 3).numpy()  # <- IN RECV
    world.comm.all_reduce(x).numpy()  # <- WAIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
