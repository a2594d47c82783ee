"""Failure handling for a started World: one failing rank ends the whole job, quickly.

The crash handler prints the cause once (each line prefixed ``[rank R]``), dumps the flight
recorder when a ``trace_dir`` is set, removes the job's MPI shared-memory files, and aborts
the transport; a non-zero ``sys.exit`` takes the same road. A rank killed by a signal, or
that leaves with ``os._exit``, runs no Python: its supervisor names it
(:mod:`fuelspmd.launch.supervise`) and the launcher ends the job; where the launcher does
not (a plain ``srun``), :class:`PeerWatch` on the same node does.

Once, not once per rank: a ConfigError that every rank raises (invariant 4: bad input fails
the same way everywhere) would otherwise print the same traceback N times. The first rank
of a node to fail prints its traceback; the others print one line each and leave the
abort to it (``fs.init(tracebacks="all")`` makes every rank print its whole traceback). Ctrl-C
(SIGINT) ends the job with status 130 and SIGTERM with 143, the statuses a shell gives a
program those signals end, with one line naming the program's line and no traceback; a
signal that comes again within a second (a terminal's Ctrl-C reaches the rank through its
process group and through the launcher) is the same request. SIGUSR1 prints where the rank
is and the operation it is in, dumps the flight recorder, and the job goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn, Protocol

import numpy as np

from fuelspmd.comm.guarded import pin_all
from fuelspmd.comm.recorder import caller
from fuelspmd.launch.supervise import REPORTED, launcher_pid, tell
from fuelspmd.transport import Transport

__all__ = ["INTERRUPTED", "TERMINATED", "PeerWatch", "install_crash_handler",
           "remove_crash_handler", "remove_shared_memory"]


class World(Protocol):
    """What failure handling reads of :class:`fuelspmd.launch.World`."""

    rank: int
    size: int
    node: str
    nodes: list[str]
    transport: Transport
    trace_dir: str | None

    def dump_trace(self, *, reason: str = "", where: str = "", final: bool = False) -> Any: ...


_REPORT_PAUSE_S = 0.1  # a failing rank's pause between its report and the abort
_AGAIN_S = 1.0  # a signal delivered again within this is the same request (a group's)
# a rank that failed after another of its node has this long for that rank's abort to end
# it before it aborts itself (the first one may be stuck writing its flight recorder)
_FOLLOWER_WAIT_S = 2.0
INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM
# MPI's shared-memory files in /dev/shm, unlinked by MPI_Finalize, which an aborted job never
# reaches: MPICH's per-node segments and Open MPI's per-process ones
_SEGMENT_PREFIXES = ("mpich_shm_", "mpich_vci_", "sm_segment.")
_WATCH_EVERY_S = 0.5  # how often a rank looks at its same-node peers' processes
# a peer found dead is left this long to the launcher (which reports and kills the job
# within a fraction of a second where it does: docs/reliability.md) before the watch aborts
_LAUNCHER_GRACE_S = 3.0


def install_crash_handler(world: World) -> tuple[Any, ...]:
    """Make an unhandled exception, a non-zero ``sys.exit``, Ctrl-C or SIGTERM on any rank
    end the whole job, and SIGUSR1 say where the rank is.

    The cause is printed once (see the module docstring), by the failing rank, each line
    prefixed with its rank; then the transport aborts every rank (MPI_Abort), so nobody is
    left waiting in a collective. Returns what :func:`remove_crash_handler` restores.

    ``sys.exit(n)`` raises SystemExit, which never reaches ``sys.excepthook``: the
    interpreter exits, and mpi4py's exit hook calls ``MPI_Finalize``, which waits for ranks
    that are blocked in a collective with the rank that left (measured: until their own
    deadline). So ``sys.exit`` is wrapped while the world lives: it raises a
    :class:`_RankExit`, whose ``code`` the interpreter reads when, and only when, it
    turns the exception into the process's exit status, with no Python frame left on the
    stack; a non-zero status is then an abort. A SystemExit that the program catches
    (argparse's in a test, say) is read, if at all, from Python code, and changes nothing.
    SIGTERM raises the same exception with status 143 (unless the program set a handler of
    its own), so the program's ``finally`` blocks run before the job ends; the program's
    own handlers of SIGINT and SIGUSR1 are left alone too.
    ``os.abort()``, a segmentation fault or SIGKILL end the process without running any
    Python: the launcher notices the death and kills the other ranks (measured for
    MPICH's Hydra, Open MPI's mpirun and ``srun --kill-on-bad-exit=1`` in
    docs/reliability.md); faulthandler prints the dying rank's Python stack for the
    signals it can catch.
    """
    main = threading.current_thread() is threading.main_thread()
    # the signals whose handlers are taken (the program's own are left alone)
    taken = {sig: signal.getsignal(sig) for sig, default in (
        (signal.SIGTERM, signal.SIG_DFL), (signal.SIGUSR1, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler)) if main and signal.getsignal(sig) is default}
    taken_at: dict[int, float] = {}

    def again(signum: int) -> bool:
        """Whether ``signum`` is the same request delivered again: a terminal's Ctrl-C
        reaches the rank and its launcher's process group, which forward it too."""
        now = time.monotonic()
        if now - taken_at.get(signum, -_AGAIN_S) < _AGAIN_S:
            return True
        taken_at[signum] = now
        return False
    previous = (sys.excepthook, threading.excepthook, sys.exit, faulthandler.is_enabled(),
                taken)
    first = _FirstFailure(world.rank, every=world.tracebacks == "all")
    prefix = f"[rank {world.rank}] "

    def report_and_abort(kind: type[BaseException], value: BaseException,
                         tb: TracebackType | None, where: str = "") -> None:
        code = INTERRUPTED if issubclass(kind, KeyboardInterrupt) else 1
        if code == INTERRUPTED and main:  # the job is ending: a later Ctrl-C changes nothing
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        frame = _innermost(tb) if not where else _main_frame()
        pin_all(frame)
        at = caller(frame)
        full = first.claim()
        if code == INTERRUPTED:
            lines = [f"{prefix}interrupted (SIGINT){where} at {at}; ending all {world.size} "
                     f"ranks, exit status {code}"] if full else []
            if first.verbose:
                lines += _traceback_lines(prefix, kind, value, tb)
        elif full:
            lines = [f"{prefix}unhandled {kind.__name__}{where}; aborting all {world.size} "
                     "ranks", *_traceback_lines(prefix, kind, value, tb)]
        else:
            lines = [f"{prefix}unhandled {kind.__name__}{where}: {_one_line(value)} (the "
                     f"traceback is printed once, by the first rank of this node to fail; "
                     f"init(tracebacks='all') prints every rank's)"]
        if lines:
            sys.stderr.write("\n".join(lines) + "\n")
        why = ("SIGINT" if code == INTERRUPTED else f"unhandled {kind.__name__}{where}: {value}")
        _flush_then_abort(world, code, f"crash handler: {why}", follower=not full, where=at)

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        report_and_abort(kind, value, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        report_and_abort(args.exc_type, args.exc_value or args.exc_type(),
                         args.exc_traceback, where=f" in thread {name}")

    def leaving(status: int, code: object, where: str) -> None:
        full = first.claim()
        if code == "SIGTERM":
            if full:
                sys.stderr.write(f"{prefix}terminated (SIGTERM) at {where}; ending all "
                                 f"{world.size} ranks, exit status {status}\n")
            reason = "crash handler: SIGTERM"
        else:
            shown = "" if isinstance(code, int) else f" ({code})"
            sys.stderr.write(f"{prefix}sys.exit({code!r}) at {where}: exit status "
                             f"{status}{shown}; aborting all {world.size} ranks\n")
            reason = f"crash handler: sys.exit({code!r}) at {where}"
        _flush_then_abort(world, status, reason, follower=not full, where=where)

    def exit_hook(code: object = None) -> NoReturn:
        frame = sys._getframe(1)
        raise _RankExit(code, caller=f"{frame.f_code.co_filename}:{frame.f_lineno}",
                        on_exit=leaving)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if again(signum):
            return
        pin_all(frame)
        raise _RankExit(TERMINATED, caller=caller(frame), on_exit=leaving, signal="SIGTERM")

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if not again(signum):
            raise KeyboardInterrupt

    def on_sigusr1(signum: int, frame: FrameType | None) -> None:
        """Say where this rank is and dump its flight record; the job goes on."""
        at, ops = caller(frame), pin_all(frame)
        try:
            path = world.dump_trace(reason=f"SIGUSR1 at {at}", where=at, final=False)
        except (OSError, RuntimeError) as e:
            path = f"(failed: {e})"
        doing = "; in " + "; in ".join(ops) if ops else ", in no operation"
        sys.stderr.write(f"{prefix}SIGUSR1: at {at}{doing}"
                         + (f"; flight record {path}" if path else "") + "\n")
        sys.stderr.flush()

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    sys.exit = exit_hook
    for sig, handler in ((signal.SIGTERM, on_sigterm), (signal.SIGUSR1, on_sigusr1),
                         (signal.SIGINT, on_sigint)):
        if sig in taken:
            signal.signal(sig, handler)
    if not previous[3]:
        faulthandler.enable(all_threads=True)
    return previous


def _innermost(tb: TracebackType | None) -> FrameType | None:
    """The frame an exception was raised in (the last of its traceback)."""
    frame = None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return frame


def _main_frame() -> FrameType | None:
    """The main thread's current frame (read from another thread)."""
    return sys._current_frames().get(threading.main_thread().ident or 0)


def _traceback_lines(prefix: str, kind: type[BaseException], value: BaseException,
                     tb: TracebackType | None) -> list[str]:
    text = "".join(traceback.format_exception(kind, value, tb))
    return [prefix + line for line in text.rstrip("\n").split("\n")]


def _one_line(value: BaseException) -> str:
    """The exception's message, cut to its first line (the traceback has the rest)."""
    lines = str(value).strip().splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else "(no message)"


class _FirstFailure:
    """Whether this rank is the first of its node's ranks in this job to fail.

    The first creates a file named after the job in this user's private directory
    (:func:`private_dir`: mode 0700, owned by this user, so no other user can create the
    name first or read it; ``O_EXCL`` makes exactly one rank the first); the others find it
    there. The job is named by this process's parent, the launcher's process on this node
    that started every rank here (Hydra's proxy, Open MPI's prted, slurmstepd), and its
    start time. Where the directory cannot be had (another user made it, a read-only
    temporary folder) or the parent cannot be read, every rank counts as first: the cause
    is then printed too often, never lost. The files of ended jobs are removed by the next
    failure that looks.
    """

    def __init__(self, rank: int, *, every: bool = False) -> None:
        self.rank = rank
        self.verbose = every
        parent = launcher_pid()
        start = _process_start(parent)
        self._name = None if start is None else f"failure-{parent}-{start}"
        self._first: bool | None = None

    def claim(self) -> bool:
        """True when this rank prints in full: the first to fail here, or verbose."""
        if self._first is None:
            self._first = True
            where = private_dir()
            if where is not None and self._name is not None:
                _forget_ended_jobs(where)
                try:
                    fd = os.open(where / self._name, os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                                 0o600)
                    os.write(fd, f"rank {self.rank} pid {os.getpid()}\n".encode())
                    os.close(fd)
                except FileExistsError:
                    self._first = False
                except OSError:  # a full or read-only folder: print, never lose the cause
                    pass
        return self._first or self.verbose


def private_dir() -> Path | None:
    """This user's private folder for the job's failure channel, made if missing:
    ``<tmp>/fuelspmd-<uid>``, a directory (not a link) of this user's, mode 0700. None when
    what is there is not that (another user made it first): nothing in it could be
    trusted to be this job's."""
    path = Path(tempfile.gettempdir()) / f"fuelspmd-{os.geteuid()}"
    with contextlib.suppress(FileExistsError, OSError):
        os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def _forget_ended_jobs(where: Path) -> None:
    """Remove the failure files of jobs whose launcher process has ended."""
    for entry in where.glob("failure-*-*"):
        _, pid, start = entry.name.split("-", 2)
        if pid.isdigit() and str(_process_start(int(pid))) != start:
            with contextlib.suppress(OSError):
                entry.unlink()


def remove_shared_memory() -> list[str]:
    """Unlink the MPI shared-memory files in /dev/shm that this process maps; return them.

    MPI_Finalize unlinks them; an aborted job never gets there, and each left file holds
    its pages (megabytes) until the machine restarts. Only files this process has mapped
    are touched, so they are this job's; the ranks still running keep their mappings (an
    unlinked file lives on until the last one unmaps), and the job is ending anyway.
    """
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return []
    removed = []
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if not path.startswith("/dev/shm/") or path.endswith("(deleted)"):
            continue
        if os.path.basename(path).startswith(_SEGMENT_PREFIXES) and path not in removed:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:  # another rank of the node was first
                pass
    return removed


def _flush_then_abort(world: World, code: int, reason: str = "", *,
                      follower: bool = False, where: str = "") -> NoReturn:
    """Dump the flight recorder, flush the report, let the launcher forward it, then abort.

    The dump comes first: the abort ends every rank, this one included, and a failed dump
    (a full disk) is reported but must not keep the job from ending. Then the job's
    shared-memory files go (:func:`remove_shared_memory`).

    Open MPI's mpirun drops what a rank wrote just before MPI_Abort when the abort wins
    the race with its output forwarding (seen once in 12 cells under load: the report was
    lost), so the rank pauses ``_REPORT_PAUSE_S`` first; it is ending anyway. A
    ``follower`` (a rank that failed after another of its node, which aborts the job)
    waits ``_FOLLOWER_WAIT_S`` for that abort, so the launcher reports one abort, not N.
    """
    tell(REPORTED)  # the supervisor has nothing to add to this rank's end
    try:
        world.dump_trace(reason=reason or f"abort({code})", where=where, final=True)
    except (OSError, RuntimeError) as e:  # RuntimeError: the ring moved under a thread's dump
        sys.stderr.write(f"[rank {world.rank}] flight recorder dump to {world.trace_dir} "
                         f"failed: {e}\n")
    remove_shared_memory()
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(_FOLLOWER_WAIT_S if follower else _REPORT_PAUSE_S)
    world.transport.abort(code)


def remove_crash_handler(previous: tuple[Any, ...]) -> None:
    """Put back what :func:`install_crash_handler` replaced."""
    sys.excepthook, threading.excepthook, sys.exit, had_faulthandler, taken = previous
    if not had_faulthandler:
        faulthandler.disable()
    if threading.current_thread() is threading.main_thread():
        for sig, handler in taken.items():
            signal.signal(sig, handler)


class _RankExit(SystemExit):
    """The SystemExit of ``sys.exit`` after ``init``: aborts the job if it ends the process.

    CPython turns an uncaught SystemExit into the exit status by reading its ``code`` from
    C (``_Py_HandleSystemExit``) after the last Python frame has unwound; that read, with
    an empty Python stack and a non-zero status, is the moment the rank is certainly
    leaving, before ``atexit`` runs ``MPI_Finalize``. Any read from Python code (a caught
    exception inspected by the program or by pytest) has a caller frame and changes nothing.
    """

    def __init__(self, code: object, *, caller: str,
                 on_exit: Callable[[int, object, str], None], signal: str = "") -> None:
        super().__init__(code)
        self._caller = caller
        self._on_exit = on_exit
        self._signal = signal  # the signal that raised it, else "" (a sys.exit)

    @property  # type: ignore[override]
    def code(self) -> object:
        value = SystemExit.code.__get__(self)  # the base class's slot
        try:
            sys._getframe(1)
        except ValueError:  # no Python frame: the interpreter itself is exiting
            status = value if isinstance(value, int) else (0 if value is None else 1)
            if status != 0:
                self._on_exit(status, self._signal or value, self._caller)
        return value


def _process_start(pid: int) -> int | None:
    """Return when ``pid`` started (clock ticks since boot), or None if it is gone or a zombie.

    Field 22 of /proc/PID/stat; with the PID it names one process for the machine's
    lifetime, so a PID reused by another process does not pass for the peer.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] == b"Z":
        return None
    return int(fields[19])


class PeerWatch:
    """Abort the job when a rank on this node dies without the launcher ending the job.

    ``os.abort()``, a segfault or SIGKILL end a rank without running any Python, so only
    the launcher can notice; Hydra, Open MPI's mpirun and ``srun --kill-on-bad-exit=1``
    then kill the other ranks, but a plain ``srun`` (Slurm's default KillOnBadExit=0)
    leaves them blocked in their collective until its deadline (measured: the whole
    timeout). So every rank watches the processes of the ranks on its own node (their PID
    and start time, all-gathered at ``init``; a peer not visible here, in another PID
    namespace, is not watched) from a daemon thread every ``_WATCH_EVERY_S``; a peer that
    is gone, or a zombie, for ``_LAUNCHER_GRACE_S`` is reported and the job aborted.
    Ranks on other nodes are the launcher's and the transport deadline's to notice.

    A peer may not leave early in a correct program: MPI_Finalize synchronises the ranks,
    and the watch stops before this rank finalizes (``World.finalize`` or at exit, before
    mpi4py's own exit hook), so a peer that has finalized and exited is never mistaken for
    a dead one.
    """

    def __init__(self, world: World, peers: dict[int, tuple[int, int]]) -> None:
        self._world = world
        self._peers = peers  # rank -> (pid, start time)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuelspmd-peer-watch",
                                        daemon=True)

    @classmethod
    def start(cls, world: World, timeout: float) -> PeerWatch | None:
        """Gather every rank's (pid, start time) and watch this node's peers; collective."""
        me = np.array([os.getpid(), _process_start(os.getpid()) or -1], dtype=np.int64)
        every = np.empty(2 * world.size, dtype=np.int64)
        world.transport.all_gather(me, every).wait(timeout)
        peers = {r: (int(pid), int(start)) for r, (pid, start) in
                 enumerate(every.reshape(world.size, 2).tolist())
                 if r != world.rank and world.nodes[r] == world.node and start >= 0
                 and _process_start(int(pid)) == start}
        if not peers:
            return None
        watch = cls(world, peers)
        atexit.register(watch.stop)  # runs before mpi4py's MPI_Finalize (registered later)
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """Stop watching (before this rank finalizes); idempotent."""
        self._stopped.set()
        atexit.unregister(self.stop)

    def _run(self) -> None:
        dead_since: float | None = None
        while not self._stopped.wait(_WATCH_EVERY_S):
            dead = [(r, pid) for r, (pid, start) in self._peers.items()
                    if _process_start(pid) != start]
            if not dead:
                continue
            now = time.monotonic()
            if dead_since is None:
                dead_since = now
            if now - dead_since < _LAUNCHER_GRACE_S or self._stopped.is_set():
                continue
            world = self._world
            names = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
            sys.stderr.write(f"[rank {world.rank}] {names} on this node ({world.node}) died "
                             f"without finalizing and the launcher did not end the job; "
                             f"aborting all {world.size} ranks\n")
            frame = _main_frame()
            pin_all(frame)
            _flush_then_abort(world, 1, f"peer watch: {names} died", where=caller(frame))
