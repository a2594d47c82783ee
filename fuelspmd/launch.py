"""``fs.init()``: find the launcher, start the transport, pick the device, guard the job.

Layer 5. The same program runs under ``mpiexec`` (MPICH's Hydra or Open MPI), under
Slurm's ``srun`` (or ``mpiexec`` inside an sbatch allocation), and as a plain script. The
launcher is read from the environment *before* any MPI library is loaded, so a plain run
never imports mpi4py, and so a launch that MPI would get wrong is caught with a message
that says how to fix it:

=============  =================================================  ==========================
launcher       environment it sets                                 rank, size, local rank
=============  =================================================  ==========================
mpiexec/Hydra  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID                 PMI_RANK, PMI_SIZE, ...
Open MPI       OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK                 the same
srun           SLURM_STEP_ID, SLURM_PROCID, SLURM_STEP_NUM_TASKS,   SLURM_PROCID, ...
               SLURM_LOCALID
none           nothing of the above                                 0, 1, 0 (no MPI)
=============  =================================================  ==========================

After the transport is up, every rank's host name is gathered, so ``local_rank``,
``local_size`` and the node list come from the job itself and are checked against what the
launcher said.

One failure ends the job: ``init`` installs an exception hook that prints the traceback
once, each line prefixed with ``[rank R]``, and aborts the transport, so ``mpiexec`` returns
non-zero within seconds instead of leaving the other ranks blocked in a collective. A
non-zero ``sys.exit`` aborts the same way; a rank killed by a signal is the launcher's to
notice, and where the launcher does not (a plain ``srun``), the ranks on its node notice
its death and abort (:class:`_PeerWatch`). docs/reliability.md has the measured matrix.

With ``init(trace_dir=DIR)`` each rank's flight recorder (the last operations of
``world.comm`` and every communicator split from it) is written to ``DIR/rank<R>.json`` on a
collective timeout, a mismatch, or an abort by the crash handler (just before the abort),
and ``fuelspmd trace DIR`` lines the ranks up.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import numpy as np

from fuelspmd.backend import Device, cuda_device_count
from fuelspmd.backend import device as as_device
from fuelspmd.comm.communicator import Communicator
from fuelspmd.comm.guarded import GuardedTransport
from fuelspmd.comm.recorder import Recorder
from fuelspmd.errors import ConfigError, TransportUnavailableError
from fuelspmd.transport import SelfTransport, Transport, load_plugin

__all__ = ["LaunchInfo", "World", "detect_launcher", "init"]

_HOST_CHARS = 64  # host names are gathered as fixed-width int32 code points
_REPORT_PAUSE_S = 0.1  # a failing rank's pause between its report and the abort
_WATCH_EVERY_S = 0.5  # how often a rank looks at its same-node peers' processes
# a peer found dead is left this long to the launcher (which reports and kills the job in
# 0.1-0.4 s where it does: measured in docs/reliability.md) before the watch aborts
_LAUNCHER_GRACE_S = 3.0


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """What the environment says about this process, before any MPI library is loaded."""

    launcher: str  # "mpiexec", "openmpi", "srun", "none"
    rank: int = 0
    size: int = 1
    local_rank: int | None = None
    local_size: int | None = None
    slurm_mpi: str | None = None  # srun's --mpi plugin, when srun started us


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher and this process's place in the job from ``env``.

    Order matters: ``mpiexec`` inside a Slurm allocation starts its processes through
    srun, so they see Slurm's variables too; the MPI launcher's own variables win. A plain
    ``python`` inside an sbatch script sees SLURM_NTASKS but no SLURM_STEP_ID of a task
    step, so it is a plain run.
    """
    env = os.environ if env is None else env
    slurm_mpi = env.get("SLURM_MPI_TYPE")
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo("openmpi", _int(env, "OMPI_COMM_WORLD_RANK") or 0,
                          _int(env, "OMPI_COMM_WORLD_SIZE") or 1,
                          _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), slurm_mpi)
    if "MPI_LOCALRANKID" in env or ("PMI_RANK" in env and "SLURM_STEP_ID" not in env):
        return LaunchInfo("mpiexec", _int(env, "PMI_RANK") or 0, _int(env, "PMI_SIZE") or 1,
                          _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"), slurm_mpi)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return LaunchInfo("srun", _int(env, "SLURM_PROCID") or 0,
                          _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1,
                          _int(env, "SLURM_LOCALID"), None, slurm_mpi)
    return LaunchInfo("none")


@dataclass(eq=False)
class World:
    """The job as this rank sees it: its place, its device and the world transport."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: str
    nodes: list[str]  # host name of every rank, indexed by rank
    launcher: str
    device: Device
    transport: Transport
    timeout: float
    trace_dir: str | None = None  # where the flight recorder is dumped on a failure
    _hooks: tuple[Any, ...] | None = field(default=None, repr=False)
    _watch: _PeerWatch | None = field(default=None, repr=False)
    _comm: Communicator | None = field(default=None, repr=False)

    @property
    def comm(self) -> Communicator:
        """The world's lazy Communicator, over the guarded world transport.

        Made on first use, and that first use is collective (the guard splits a control
        channel off the transport): every rank must touch ``world.comm`` at the same point.
        A size-1 world needs no guard. With a ``trace_dir`` the guard keeps a flight recorder
        (one ring shared with the communicators split from this one), dumped there on a
        failure; without one it records nothing (a deque append and a timestamp per op).
        """
        if self._comm is None:
            seam: Transport = self.transport
            if self.size > 1:
                recorder = Recorder() if self.trace_dir is not None else None
                seam = GuardedTransport(seam, timeout=self.timeout, recorder=recorder,
                                        trace_dir=self.trace_dir)
            self._comm = Communicator(seam, device=self.device, timeout=self.timeout)
        return self._comm

    @property
    def num_nodes(self) -> int:
        """Count the distinct hosts in the job."""
        return len(set(self.nodes))

    def dump_trace(self, *, reason: str = "") -> Path | None:
        """Write this rank's flight recorder to ``trace_dir``; None without one (or no comm)."""
        guard = getattr(self._comm.transport, "guard", None) if self._comm is not None else None
        if guard is None or self.trace_dir is None:
            return None
        return guard.dump(reason=reason)

    def finalize(self) -> None:
        """Release the transport and the crash handler; a later ``init()`` starts afresh."""
        global _WORLD
        if self._hooks is not None:
            _remove_crash_handler(self._hooks)
            self._hooks = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._comm is not None:
            close_guard = getattr(self._comm.transport, "close", None)
            if close_guard is not None:
                close_guard()
            self._comm = None
        close = getattr(self.transport, "finalize", None)
        if close is not None:
            close()
        if _WORLD is self:
            _WORLD = None


_WORLD: World | None = None  # init() is idempotent: the process has one world


def init(*, transport: str = "auto", device: str | Device = "auto",
         timeout: float = 600.0, trace_dir: str | os.PathLike[str] | None = None) -> World:
    """Start (or return) this process's World.

    ``transport``: "auto" (MPI under a launcher, the size-1 transport otherwise), or a
    plugin name such as "mpi". ``device``: "auto" (``cuda:<local_rank % gpus>`` when cupy
    sees a GPU, else ``cpu:0``) or a device string. ``timeout``: seconds every blocking
    wait may take before it raises CommTimeoutError. ``trace_dir``: a directory (created
    when first written) for the flight-recorder dumps, one ``rank<R>.json`` per rank, written
    on a collective timeout or mismatch and by the crash handler before it aborts; read
    them with ``fuelspmd trace DIR``. None (the default) writes nothing.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    if not timeout > 0:
        raise ConfigError(f"init(timeout={timeout}): the timeout must be a positive number "
                          "of seconds, e.g. 600")
    info = detect_launcher()
    with _startup_deadline(info, timeout):
        seam = _start_transport(transport, info, timeout)
    _check_world(seam, info)
    world = World(rank=seam.rank, size=seam.size, local_rank=0, local_size=1, node="",
                  nodes=[], launcher=info.launcher, device=Device("cpu", 0), transport=seam,
                  timeout=timeout, trace_dir=None if trace_dir is None else os.fspath(trace_dir))
    if seam.size > 1:
        # from here on an exception on one rank ends the job, so a check below that fails
        # on some ranks only cannot leave the others blocked
        world._hooks = _install_crash_handler(world)
    world.nodes, launcher_local = _gather_places(seam, info, timeout)
    world.node = world.nodes[seam.rank]
    world.local_size = world.nodes.count(world.node)
    world.local_rank = _local_rank(world.nodes, launcher_local, seam.rank, info.launcher)
    world.device = _pick_device(device, world.local_rank)
    if seam.size > 1:
        world._watch = _PeerWatch.start(world, timeout)
    _WORLD = world
    return world


def _start_transport(name: str, info: LaunchInfo, timeout: float) -> Transport:
    if name == "auto":
        if info.launcher == "none":
            return SelfTransport()
        name = "mpi"
    if name == "self":
        if info.size > 1:
            raise ConfigError(f"transport='self' runs one rank, but the {info.launcher} "
                              f"launcher started {info.size}; use transport='auto'")
        return SelfTransport()
    plugin = load_plugin(name)
    reason = plugin.unavailable_reason()
    if reason is not None:
        raise TransportUnavailableError(f"transport {name!r} cannot run here: {reason}")
    return plugin.world(timeout=timeout)


@contextlib.contextmanager
def _startup_deadline(info: LaunchInfo, timeout: float) -> Iterator[None]:
    """End this process if the transport is not up within ``timeout`` seconds.

    ``MPI_Init`` waits for every rank of the job and has no deadline of its own: a rank
    that fails before it calls ``fs.init()`` (an import error, a bad argument on one rank)
    leaves the others in it for ever. Hydra does not end them (measured: a rank exiting
    with status 1 before MPI_Init left the other blocked until killed 90 s later; Open
    MPI's mpirun ended the job in 0.4 s). ``MPI_Init`` holds the GIL, so no Python thread
    or signal handler can run meanwhile: faulthandler's C watchdog thread does the work.
    When the deadline passes it prints every thread's stack (the main thread's ends in
    ``_start_transport``, naming where it waited) and exits the process with status 1; the
    launcher, seeing every rank gone, ends the job.
    """
    if info.launcher == "none" or info.size <= 1:
        yield
        return
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _check_world(seam: Transport, info: LaunchInfo) -> None:
    """Raise ConfigError when the launcher and the transport disagree on the job."""
    if info.launcher == "none" or (seam.size == info.size and seam.rank == info.rank):
        return
    if seam.size == 1 and info.size > 1:
        if info.launcher == "srun":
            fix = ("srun started the tasks without a PMI the MPI library understands "
                   f"(--mpi={info.slurm_mpi or 'none'}), so each task is its own world; "
                   "run `srun --mpi=pmi2 ...` (or set MpiDefault=pmi2 in slurm.conf)")
        else:
            fix = (f"{info.launcher} is not the launcher of the MPI library mpi4py uses; run "
                   "the mpiexec of that library (`python -m fuelspmd info` names it)")
        raise ConfigError(f"the environment says {info.size} tasks (this is task {info.rank}) "
                          f"but MPI reports a world of 1: {fix}")
    raise ConfigError(f"the {info.launcher} launcher says rank {info.rank} of {info.size}, but "
                      f"the transport says rank {seam.rank} of {seam.size}; start every rank "
                      "with the same launcher")


def _hostname() -> str:
    return socket.gethostname().split(".")[0][:_HOST_CHARS]


def _gather_places(seam: Transport, info: LaunchInfo,
                   timeout: float) -> tuple[list[str], list[int]]:
    """All-gather every rank's host name and the local rank its launcher gave it (-1: none).

    Fixed-width int32 code points, no pickling; one collective, so every rank ends up with
    the same table and reaches the same verdict in :func:`_local_rank`.
    """
    name = _hostname()
    if seam.size == 1:
        return [name], [-1 if info.local_rank is None else info.local_rank]
    mine = np.zeros(_HOST_CHARS + 1, dtype=np.int32)
    mine[: len(name)] = [ord(c) for c in name]
    mine[-1] = -1 if info.local_rank is None else info.local_rank
    every = np.empty((_HOST_CHARS + 1) * seam.size, dtype=np.int32)
    seam.all_gather(mine, every).wait(timeout)
    rows = every.reshape(seam.size, _HOST_CHARS + 1)
    return ["".join(chr(c) for c in row[:-1] if c) for row in rows], rows[:, -1].tolist()


def _local_rank(nodes: list[str], launcher_local: list[int], rank: int, launcher: str) -> int:
    """This rank's index among the ranks on its host.

    The launcher's numbering is kept when it gives one (Open MPI's default ``--map-by
    core`` numbers local ranks out of rank order, and GPU binding follows it); it must be a
    permutation of ``0..local_size-1`` on every host, or the launcher and MPI disagree about
    the job. Checked on the gathered table, so every rank raises the same error.
    """
    by_host: dict[str, list[int]] = {}
    for r, host in enumerate(nodes):
        by_host.setdefault(host, []).append(r)
    if all(x < 0 for x in launcher_local):
        return by_host[nodes[rank]].index(rank)
    for host, ranks in by_host.items():
        given = sorted(launcher_local[r] for r in ranks)
        if given != list(range(len(ranks))):
            raise ConfigError(
                f"host {host!r} runs ranks {ranks}, but the launcher ({launcher}) gave them "
                f"local ranks {[launcher_local[r] for r in ranks]}, not a numbering "
                f"0..{len(ranks) - 1}: the launcher and MPI disagree about the job (is "
                "mpi4py built against the launcher's MPI?)")
    return launcher_local[rank]


def _pick_device(device: str | Device, local_rank: int) -> Device:
    if device != "auto":
        return as_device(device)
    gpus = cuda_device_count()
    return Device("cuda", local_rank % gpus) if gpus else Device("cpu", 0)


def _install_crash_handler(world: World) -> tuple[Any, ...]:
    """Make an unhandled exception, or a non-zero ``sys.exit``, on any rank end the whole job.

    The cause is printed once, by the failing rank, each line prefixed with its rank; then
    the transport aborts every rank (MPI_Abort), so nobody is left waiting in a
    collective. Returns what :func:`_remove_crash_handler` restores.

    ``sys.exit(n)`` raises SystemExit, which never reaches ``sys.excepthook``: the
    interpreter exits, and mpi4py's exit hook calls ``MPI_Finalize``, which waits for ranks
    that are blocked in a collective with the rank that left (measured: until their own
    deadline). So ``sys.exit`` is wrapped while the world lives: it raises a
    :class:`_RankExit`, whose ``code`` the interpreter reads when, and only when, it
    turns the exception into the process's exit status, with no Python frame left on the
    stack; a non-zero status is then an abort. A SystemExit that the program catches
    (argparse's in a test, say) is read, if at all, from Python code, and changes nothing.
    ``os.abort()``, a segmentation fault or SIGKILL end the process without running any
    Python: the launcher notices the death and kills the other ranks (measured for
    MPICH's Hydra, Open MPI's mpirun and ``srun --kill-on-bad-exit=1`` in
    docs/reliability.md); faulthandler prints the dying rank's Python stack for the
    signals it can catch.
    """
    previous = (sys.excepthook, threading.excepthook, sys.exit, faulthandler.is_enabled())

    def report_and_abort(kind: type[BaseException], value: BaseException,
                         tb: TracebackType | None, where: str = "") -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        prefix = f"[rank {world.rank}] "
        lines = [f"{prefix}unhandled {kind.__name__}{where}; aborting all {world.size} ranks"]
        lines += [prefix + line for line in text.rstrip("\n").split("\n")]
        sys.stderr.write("\n".join(lines) + "\n")
        _flush_then_abort(world, 1, f"crash handler: unhandled {kind.__name__}{where}: {value}")

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous[0](kind, value, tb)
        report_and_abort(kind, value, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        report_and_abort(args.exc_type, args.exc_value or args.exc_type(),
                         args.exc_traceback, where=f" in thread {name}")

    def leaving(status: int, code: object, caller: str) -> None:
        prefix = f"[rank {world.rank}] "
        shown = "" if isinstance(code, int) else f" ({code})"
        sys.stderr.write(f"{prefix}sys.exit({code!r}) at {caller}: exit status "
                         f"{status}{shown}; aborting all {world.size} ranks\n")
        _flush_then_abort(world, status, f"crash handler: sys.exit({code!r}) at {caller}")

    def exit_hook(code: object = None) -> NoReturn:
        frame = sys._getframe(1)
        caller = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        raise _RankExit(code, caller=caller, on_exit=leaving)

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    sys.exit = exit_hook
    if not previous[3]:
        faulthandler.enable(all_threads=True)
    return previous


def _flush_then_abort(world: World, code: int, reason: str = "") -> NoReturn:
    """Dump the flight recorder, flush the report, let the launcher forward it, then abort.

    The dump comes first: the abort ends every rank, this one included, and a failed dump
    (a full disk) is reported but must not keep the job from ending.

    Open MPI's mpirun drops what a rank wrote just before MPI_Abort when the abort wins
    the race with its output forwarding (seen once in 12 cells under load: the report was
    lost), so the rank pauses ``_REPORT_PAUSE_S`` first; it is ending anyway.
    """
    try:
        world.dump_trace(reason=reason or f"abort({code})")
    except (OSError, RuntimeError) as e:  # RuntimeError: the ring moved under a thread's dump
        sys.stderr.write(f"[rank {world.rank}] flight recorder dump to {world.trace_dir} "
                         f"failed: {e}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(_REPORT_PAUSE_S)
    world.transport.abort(code)


def _remove_crash_handler(previous: tuple[Any, ...]) -> None:
    """Put back what :func:`_install_crash_handler` replaced."""
    sys.excepthook, threading.excepthook, sys.exit, had_faulthandler = previous
    if not had_faulthandler:
        faulthandler.disable()


class _RankExit(SystemExit):
    """The SystemExit of ``sys.exit`` after ``init``: aborts the job if it ends the process.

    CPython turns an uncaught SystemExit into the exit status by reading its ``code`` from
    C (``_Py_HandleSystemExit``) after the last Python frame has unwound; that read, with
    an empty Python stack and a non-zero status, is the moment the rank is certainly
    leaving, before ``atexit`` runs ``MPI_Finalize``. Any read from Python code (a caught
    exception inspected by the program or by pytest) has a caller frame and changes nothing.
    """

    def __init__(self, code: object, *, caller: str,
                 on_exit: Callable[[int, object, str], None]) -> None:
        super().__init__(code)
        self._caller = caller
        self._on_exit = on_exit

    @property  # type: ignore[override]
    def code(self) -> object:
        value = SystemExit.code.__get__(self)  # the base class's slot
        try:
            sys._getframe(1)
        except ValueError:  # no Python frame: the interpreter itself is exiting
            status = value if isinstance(value, int) else (0 if value is None else 1)
            if status != 0:
                self._on_exit(status, value, self._caller)
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


class _PeerWatch:
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
    def start(cls, world: World, timeout: float) -> _PeerWatch | None:
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
            sys.stderr.write(f"[rank {world.rank}] {names} on this node died without "
                             f"finalizing and the launcher did not end the job; aborting "
                             f"all {world.size} ranks\n")
            _flush_then_abort(world, 1, f"peer watch: {names} died")
