"""A 2-rank job whose failure channel another user tries to take first (issue 41).

    mpiexec -n 2 python squatter_job.py MODE

Before rank 1 fails (an unhandled ValueError), a child of it drops to another uid
(``nobody``, 65534) and tries to take this job's failure channel, then says what it got on
stdout as ``SQUAT <what> <result>``:

- ``abstract``: binds the abstract unix socket ``\\0fuelspmd-failure-<ppid>-<start>``, the
  channel of before (any local user could bind it first, and then no rank printed the
  traceback);
- ``file``: creates the job's file in this user's private folder (refused: mode 0700);
- ``folder``: makes this user's private folder first, in its own name (run with a TMPDIR
  of its own, mode 1777: the crash handler then trusts no folder, and every failing rank
  prints its traceback).

The squatter holds what it took until the job ends. The rank then raises; the crash
handler must print its traceback.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import fuelspmd as fs
from fuelspmd.launch.crash import _process_start

NOBODY = 65534


def squat(mode: str) -> None:
    """Fork a child that takes ``mode``'s channel as uid ``NOBODY`` and holds it."""
    parent = os.getppid()
    name = f"fuelspmd-failure-{parent}-{_process_start(parent)}"
    folder = os.path.join(tempfile.gettempdir(), f"fuelspmd-{os.geteuid()}")
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        os.close(ready_r)
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        try:
            if mode == "abstract":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind("\0" + name)
                got = "bound"
            elif mode == "file":
                os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                got = "created"
            else:
                os.mkdir(folder, 0o700)
                got = "made"
        except OSError as e:
            got = type(e).__name__
        os.write(1, f"SQUAT {mode} {got} uid {os.getuid()}\n".encode())
        os.write(ready_w, b"x")
        time.sleep(30)  # held while the job runs; the launcher ends us with it
        os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)


def main() -> int:
    mode = sys.argv[1]
    world = fs.init(timeout=30)
    if world.rank == 1:
        if mode == "file":  # the folder is made (0700) when it is first needed; make it now
            from fuelspmd.launch.crash import private_dir

            assert private_dir() is not None
        squat(mode)
        raise ValueError("rank 1 fails after another user squatted its failure channel")
    time.sleep(30)  # the abort ends us
    return 0


if __name__ == "__main__":
    sys.exit(main())
