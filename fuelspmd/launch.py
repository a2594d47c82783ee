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
non-zero within seconds instead of leaving the other ranks blocked in a collective.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from fuelspmd.backend import Device, cuda_device_count
from fuelspmd.backend import device as as_device
from fuelspmd.errors import ConfigError, TransportUnavailableError
from fuelspmd.transport import SelfTransport, Transport, load_plugin

__all__ = ["LaunchInfo", "World", "detect_launcher", "init"]

_HOST_CHARS = 64  # host names are gathered as fixed-width int32 code points


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
    _hooks: tuple[Any, Any] | None = field(default=None, repr=False)

    @property
    def num_nodes(self) -> int:
        """Count the distinct hosts in the job."""
        return len(set(self.nodes))

    def finalize(self) -> None:
        """Release the transport and the crash handler; a later ``init()`` starts afresh."""
        global _WORLD
        if self._hooks is not None:
            sys.excepthook, threading.excepthook = self._hooks
            self._hooks = None
        close = getattr(self.transport, "finalize", None)
        if close is not None:
            close()
        if _WORLD is self:
            _WORLD = None


_WORLD: World | None = None  # init() is idempotent: the process has one world


def init(*, transport: str = "auto", device: str | Device = "auto",
         timeout: float = 600.0) -> World:
    """Start (or return) this process's World.

    ``transport``: "auto" (MPI under a launcher, the size-1 transport otherwise), or a
    plugin name such as "mpi". ``device``: "auto" (``cuda:<local_rank % gpus>`` when cupy
    sees a GPU, else ``cpu:0``) or a device string. ``timeout``: seconds every blocking
    wait may take before it raises CommTimeoutError.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    if not timeout > 0:
        raise ConfigError(f"init(timeout={timeout}): the timeout must be a positive number "
                          "of seconds, e.g. 600")
    info = detect_launcher()
    seam = _start_transport(transport, info, timeout)
    _check_world(seam, info)
    world = World(rank=seam.rank, size=seam.size, local_rank=0, local_size=1, node="",
                  nodes=[], launcher=info.launcher, device=Device("cpu", 0), transport=seam,
                  timeout=timeout)
    if seam.size > 1:
        # from here on an exception on one rank ends the job, so a check below that fails
        # on some ranks only cannot leave the others blocked
        world._hooks = _install_crash_handler(world)
    world.nodes, launcher_local = _gather_places(seam, info, timeout)
    world.node = world.nodes[seam.rank]
    world.local_size = world.nodes.count(world.node)
    world.local_rank = _local_rank(world.nodes, launcher_local, seam.rank, info.launcher)
    world.device = _pick_device(device, world.local_rank)
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


def _install_crash_handler(world: World) -> tuple[Any, Any]:
    """Make an unhandled exception on any rank end the whole job.

    The traceback is printed once, by the failing rank, each line prefixed with its rank;
    then the transport aborts every rank (MPI_Abort), so nobody is left waiting in a
    collective. Returns the previous hooks so ``finalize`` can restore them.
    """
    previous = (sys.excepthook, threading.excepthook)

    def report_and_abort(kind: type[BaseException], value: BaseException,
                         tb: TracebackType | None, where: str = "") -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        prefix = f"[rank {world.rank}] "
        lines = [f"{prefix}unhandled {kind.__name__}{where}; aborting all {world.size} ranks"]
        lines += [prefix + line for line in text.rstrip("\n").split("\n")]
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        world.transport.abort(1)

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

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    return previous

