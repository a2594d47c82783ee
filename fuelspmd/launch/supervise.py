"""A rank's supervisor: no rank of a job ends without saying so.

A rank that leaves without finalising (``os._exit``, a signal, the interpreter killed)
runs no Python on its way out, and its peers are ended by the launcher at once (Hydra
kills them with SIGKILL): nobody is left to say which rank it was, on which host, or how
it ended. Hydra even reports success when the rank exited 0, and names another rank's PID
when it was killed (docs/reliability.md, the fault table). Only the process that started
the rank learns how it ended (``waitpid``), and that is the launcher's.

So ``fs.init`` under a launcher forks before the transport starts: the launcher's own
child becomes this rank's supervisor, and the program goes on in the child, the rank. The
supervisor runs no program code: it forwards the signals a launcher or a user sends
(SIGTERM, SIGINT, SIGUSR1, ...), waits for the rank, and ends as it did, so that the
launcher sees the same status or signal as before. The rank tells it, through a pipe, that
it finalized (``World.finalize``, or the interpreter's normal exit) or that the crash
handler reported its failure; when it did neither, the supervisor writes one line before
it ends, naming the rank, its host and how it ended, and turns an exit status of 0 into 1:
a rank that ran off the end while the others wait must never look like success. The rank
dies with its supervisor (``PR_SET_PDEATHSIG``), so a launcher that kills the supervisor
kills it too.

A fork is only safe before anything it would split is started: the supervisor is not set
up (and the rank runs as before) when the MPI library is already loaded, when another
Python thread runs, when CUDA's driver is loaded, or off Linux.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import os
import resource
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

__all__ = ["FINALIZED", "REPORTED", "Rank", "launcher_pid", "supervise"]

FINALIZED, REPORTED = b"F", b"R"  # what a rank tells its supervisor
# what the supervisor passes on to the rank: a launcher's or a user's signals
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGXCPU)
# those of them that ask a process to end: after one, how the rank ended is no news
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGXCPU)
_PR_SET_PDEATHSIG = 1


@dataclass
class Rank:
    """The rank's side: the pipe to its supervisor, and the launcher's process."""

    fd: int
    launcher: int  # the supervisor's parent: Hydra's proxy, prted, slurmstepd
    told: bool = False

    def tell(self, what: bytes) -> None:
        """Tell the supervisor how this rank ends (:data:`FINALIZED` or :data:`REPORTED`)."""
        if not self.told:
            self.told = True
            with contextlib.suppress(OSError):
                os.write(self.fd, what)


_RANK: Rank | None = None  # set in the rank once it is supervised


def launcher_pid() -> int:
    """The process that started this rank: the launcher's (its supervisor's parent when it
    has one)."""
    return _RANK.launcher if _RANK is not None else os.getppid()


def tell(what: bytes) -> None:
    """Tell this rank's supervisor, if it has one, how the rank ends."""
    if _RANK is not None:
        _RANK.tell(what)


def _can_fork() -> str | None:
    """Why the process cannot be split now, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if "mpi4py.MPI" in sys.modules:
        return "the MPI library is loaded already"
    if threading.active_count() > 1:
        return "other threads run"
    try:
        with open("/proc/self/maps") as f:
            if "libcuda.so" in f.read():
                return "CUDA's driver is loaded"
    except OSError:
        return "/proc/self/maps cannot be read"
    return None


def supervise(rank: int) -> bool:
    """Split this process into a supervisor and the rank (see the module docstring).

    Returns, in the rank, whether it is supervised; the supervisor never returns.
    """
    global _RANK
    if _RANK is not None:
        return True
    if _can_fork() is not None:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    launcher, parent = os.getppid(), os.getpid()
    child = os.fork()
    if child == 0:
        os.close(read)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before the prctl
            os._exit(1)
        _RANK = Rank(write, launcher)
        atexit.register(tell, FINALIZED)
        return True
    os.close(write)
    _wait(child, read, rank)  # never returns


def _wait(child: int, read: int, rank: int) -> NoReturn:
    """The supervisor: forward signals to ``child``, wait for it, end as it did."""
    forwarded: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    if faulthandler.is_enabled():
        faulthandler.disable()
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:  # reaped elsewhere: nothing to report
            os._exit(1)
    os.set_blocking(read, False)
    try:
        told = os.read(read, 16)
    except OSError:
        told = b""
    line = _verdict(status, told, forwarded, rank)
    if line:
        os.write(2, line.encode())
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    code = os.WEXITSTATUS(status)
    os._exit(code if code or not line else 1)


def _verdict(status: int, told: bytes, forwarded: list[int], rank: int) -> str:
    """The supervisor's line on how the rank ended, or "" when there is nothing to say: it
    finalized, its crash handler reported, or the signal that ended it was forwarded."""
    host = socket.gethostname().split(".")[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in forwarded:
            return ""
        how = f"killed by signal {sig} ({_name(sig)})"
        after = " after it finalized" if FINALIZED in told else " without finalizing"
        return f"[rank {rank}] on host {host}: {how}{after}; the job fails\n"
    code = os.WEXITSTATUS(status)
    if told or set(forwarded) & set(ENDING):
        return ""
    fix = (" (os._exit, or an exit outside the interpreter's own; call world.finalize() "
           "first to leave early)" if code == 0 else "")
    return (f"[rank {rank}] on host {host}: exited with status {code} without finalizing"
            f"{fix}; the job fails{', exit status 1' if code == 0 else ''}\n")


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _die_by(sig: int) -> NoReturn:
    """End this process by ``sig``, as the rank ended, so the launcher sees the same."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank's core, not ours
    with contextlib.suppress(ValueError, OSError):  # SIGKILL and SIGSTOP have no handler
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal that does not end a process
