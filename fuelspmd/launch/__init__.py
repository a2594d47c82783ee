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
non-zero ``sys.exit`` aborts the same way. Under a launcher the process splits before the
transport starts, and the launcher's own child supervises the rank
(:mod:`~fuelspmd.launch.supervise`): a rank killed by a signal, or that leaves without
finalising (``os._exit``), is named with its host and how it ended, and the job fails;
where the launcher does not then end the others (a plain ``srun``), the ranks on its node
notice its death and abort (:class:`~fuelspmd.launch.crash.PeerWatch`).
docs/reliability.md has the measured matrix.

``world.transport`` is checked (:class:`~fuelspmd.comm.GuardedTransport`, the mode of
``init(check=...)``): no rank hands MPI a collective its peers disagree on. Only
``check="off"`` gives the unchecked transport. With ``init(trace_dir=DIR)`` each rank's
flight recorder (the last operations of ``world.transport`` and every transport and
communicator split from it) is written to ``DIR/rank<R>.json`` on a collective timeout, a
mismatch, or an abort by the crash handler (just before the abort), and ``fuelspmd trace
DIR`` lines the ranks up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from fuelspmd.backend import Device, cuda_device_count, cuda_unavailable_reason
from fuelspmd.backend import device as as_device
from fuelspmd.comm.communicator import Communicator
from fuelspmd.comm.guard import MODES
from fuelspmd.comm.guarded import GuardedTransport, bye_all
from fuelspmd.comm.recorder import Recorder
from fuelspmd.cost.calibration import load_calibration
from fuelspmd.cost.policy import planner_for
from fuelspmd.errors import (
    CollectiveMismatchError,
    ConfigError,
    DeviceError,
    TransportUnavailableError,
)
from fuelspmd.launch.crash import PeerWatch, install_crash_handler, remove_crash_handler
from fuelspmd.launch.output import Ranks, rank_logger, rank_print
from fuelspmd.launch.places import (
    LaunchInfo,
    check_world,
    detect_launcher,
    gather_places,
    local_rank,
)
from fuelspmd.launch.supervise import FINALIZED, supervise, tell
from fuelspmd.transport import SelfTransport, Transport, find_transports, load_plugin

__all__ = ["LaunchInfo", "World", "current", "detect_launcher", "init"]

# the private names tests and older callers use
_check_world, _local_rank = check_world, local_rank


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
    transport: Transport  # checked (a GuardedTransport) unless init(check="off")
    timeout: float
    trace_dir: str | None = None  # where the flight recorder is dumped on a failure
    check: str = "default"  # the guard's mode (init(check=...))
    tracebacks: str = "first"  # which failing ranks print their traceback (init(tracebacks=...))
    calibration: str | None = None  # the cost model's calibration file (init(calibration=...))
    threads: int | None = None  # BLAS/OpenMP threads this rank was limited to; None: untouched
    _hooks: tuple[Any, ...] | None = field(default=None, repr=False)
    _watch: PeerWatch | None = field(default=None, repr=False)
    _comm: Communicator | None = field(default=None, repr=False)
    _asked: dict[str, Any] = field(default_factory=dict, repr=False)  # init()'s arguments

    @property
    def comm(self) -> Communicator:
        """The world's lazy Communicator, over the (checked) world transport."""
        if self._comm is None:
            self._comm = Communicator(self.transport, device=self.device, timeout=self.timeout)
        return self._comm

    def print(self, *values: object, ranks: Ranks = 0, prefix: bool | None = None,
              sep: str = " ", end: str = "\n", file: Any = None) -> None:
        """Print on rank 0 (or the ranks in ``ranks``, or "all"), one write of whole lines,
        ``[rank R]``-prefixed where several ranks print (:mod:`fuelspmd.launch.output`)."""
        rank_print(self, *values, ranks=ranks, prefix=prefix, sep=sep, end=end, file=file)

    def logger(self, name: str = "fuelspmd", *, ranks: Ranks = 0,
               level: int = logging.INFO) -> logging.Logger:
        """A :mod:`logging` logger that writes on rank 0 (or ``ranks``), rank-prefixed
        where several ranks write (:func:`fuelspmd.launch.output.rank_logger`)."""
        return rank_logger(self, name, ranks=ranks, level=level)

    @property
    def num_nodes(self) -> int:
        """Count the distinct hosts in the job."""
        return len(set(self.nodes))

    def dump_trace(self, *, reason: str = "", where: str = "",
                   final: bool = False) -> Path | None:
        """Write this rank's flight recorder to ``trace_dir``; None without one (or no comm).

        ``where``: the program's line the rank is at; ``final``: the rank is ending
        abnormally (the crash handler's dumps), not taking a look (SIGUSR1, on request)."""
        if not isinstance(self.transport, GuardedTransport) or self.trace_dir is None:
            return None
        return self.transport.guard.dump(reason=reason, where=where, final=final)

    def finalize(self) -> None:
        """Say bye on every guard (their peers learn that this rank finished), release the
        transport (collective) and the crash handler; a later ``init()`` starts afresh."""
        global _WORLD
        if self._hooks is not None:
            remove_crash_handler(self._hooks)
            self._hooks = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._comm = None
        bye_all()  # on every guard of the job, the splits' too: their peers learn of it now
        if "finalize" in self.transport.capabilities:
            self.transport.finalize()  # type: ignore[attr-defined]
        tell(FINALIZED)  # this rank's supervisor: it may now end in any way, silently
        if _WORLD is self:
            _WORLD = None


_WORLD: World | None = None  # init() is idempotent: the process has one world


def current() -> World | None:
    """The world ``init()`` made in this process, or None before (or after finalize): the
    default group of a collective that the caller gave none (``checkpoint.save``)."""
    return _WORLD


ALL_REDUCE = ("auto", "mpi", "shm", "hierarchical")
# init(timeout=...): seconds. Below a second the start-up alone (MPI_Init, the first
# exchanges) may not fit; past a week a wait that has not ended is a hang, and the
# deadline's clocks (faulthandler's start-up watchdog among them) must still hold it.
TIMEOUT_RANGE = (1.0, 7 * 24 * 3600.0)


def _check_arguments(asked: dict[str, Any]) -> None:
    """Raise ConfigError (DeviceError for a device string) for an argument of ``init``
    outside its range, before anything starts: every rank passes the same arguments, so
    every rank raises the same error."""
    timeout, (lo, hi) = asked["timeout"], TIMEOUT_RANGE
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            lo <= timeout <= hi):
        raise ConfigError(f"init(timeout={timeout!r}): the timeout must be a positive number "
                          f"of seconds from {lo:g} to {hi:g} (a week), e.g. 600 (the default)")
    for name, allowed in (("check", MODES), ("tracebacks", ("first", "all")),
                          ("all_reduce", ALL_REDUCE)):
        if asked[name] not in allowed:
            raise ConfigError(f"init({name}={asked[name]!r}): use one of {list(allowed)}")
    if asked["device"] != "auto":
        try:
            as_device(asked["device"])
        except DeviceError as e:
            raise DeviceError(f"init(device={asked['device']!r}): {e}; use 'auto' or a device "
                              "such as 'cpu:0' or 'cuda:1'") from None


def _device_exists(dev: Device) -> None:
    """Raise DeviceError when ``dev`` names a GPU this process cannot see, at ``init``
    rather than at the first operation that touches it."""
    if dev.kind != "cuda":
        return
    gpus = cuda_device_count()
    if dev.index >= gpus:
        seen = (f"cupy sees {gpus} GPU(s), cuda:0 .. cuda:{gpus - 1}" if gpus else
                f"no GPU is usable here ({cuda_unavailable_reason()})")
        raise DeviceError(f"init(device={str(dev)!r}): {seen}; use device='auto' (a GPU "
                          f"when there is one, else the CPU) or 'cpu:0'")


def _same_arguments(first: dict[str, Any], asked: dict[str, Any]) -> None:
    """A second ``init`` returns the world only for the same arguments (or none at all:
    ``init()`` asks for the world as it is); other arguments raise ConfigError."""
    defaults = {name: p.default for name, p in inspect.signature(init).parameters.items()}
    if all(asked[k] == defaults[k] for k in asked):
        return
    differ = [k for k in asked if asked[k] != first.get(k)]
    if differ:
        raise ConfigError(
            "init() was called before with " + ", ".join(f"{k}={first.get(k)!r}" for k in differ)
            + "; this call passes " + ", ".join(f"{k}={asked[k]!r}" for k in differ)
            + ", which the running world cannot change: pass the same arguments (or none, "
            "init() returns the world), or call world.finalize() first")


def init(*, transport: str = "auto", device: str | Device = "auto", timeout: float = 600.0,
         check: str = "default", all_reduce: str = "auto",
         calibration: str | os.PathLike[str] | None = None,
         trace_dir: str | os.PathLike[str] | None = None, tracebacks: str = "first") -> World:
    """Start (or return) this process's World.

    ``transport``: "auto" (under a launcher NCCL when the rank's device is a CUDA GPU and
    the nccl plugin can run, else MPI; the size-1 transport otherwise), or a plugin name
    such as "mpi" or "nccl". ``device``: "auto" (``cuda:<local_rank % gpus>`` when cupy
    sees a GPU, else ``cpu:0``) or a device string. ``timeout``: seconds every blocking
    wait may take before it raises CommTimeoutError. ``check``: the guard's mode,
    "default" (every collective compared before its data moves), "debug" (also a CRC of
    every result that must be alike) or "off" (the unchecked transport). ``all_reduce``:
    how the MPI transport reduces, "auto" (the calibrated cost model chooses per size),
    "mpi" (MPI's own), "shm" (shared memory where the ranks share it) or "hierarchical".
    ``calibration``: the cost model's calibration file (default: where ``fuelspmd bench
    calibrate`` writes it). ``tracebacks``: when several ranks fail, "first" (the first
    failing rank of a node prints its traceback, the others one line each) or "all".
    ``trace_dir``: a directory (created
    when first written) for the flight-recorder dumps, one ``rank<R>.json`` per rank, written
    on a collective timeout or mismatch and by the crash handler before it aborts; read
    them with ``fuelspmd trace DIR``. None (the default) writes nothing.
    """
    global _WORLD
    asked = {"transport": transport, "device": device, "timeout": timeout, "check": check,
             "all_reduce": all_reduce, "calibration": calibration, "trace_dir": trace_dir,
             "tracebacks": tracebacks}
    if _WORLD is not None:
        _same_arguments(_WORLD._asked, asked)
        return _WORLD
    _check_arguments(asked)
    info = detect_launcher()
    if info.launcher != "none" and info.size > 1:
        supervise(info.rank)  # the process splits: the launcher's child supervises this rank
    if device != "auto":
        _device_exists(as_device(device))
    with _startup_deadline(info, timeout):
        seam = _start_transport(transport, info, timeout, device)
    check_world(seam, info)
    world = World(rank=seam.rank, size=seam.size, local_rank=0, local_size=1, node="",
                  nodes=[], launcher=info.launcher, device=Device("cpu", 0), transport=seam,
                  timeout=timeout, trace_dir=None if trace_dir is None else os.fspath(trace_dir),
                  check=check, tracebacks=tracebacks,
                  calibration=None if calibration is None else os.fspath(calibration),
                  _asked=asked)
    if seam.size > 1:
        # from here on an exception on one rank ends the job, so a check below that fails
        # on some ranks only cannot leave the others blocked
        world._hooks = install_crash_handler(world)
    world.nodes, launcher_local = gather_places(seam, info, timeout)
    world.node = world.nodes[seam.rank]
    world.local_size = world.nodes.count(world.node)
    world.local_rank = local_rank(world.nodes, launcher_local, seam.rank, info.launcher)
    world.device = _pick_device(device, world.local_rank, seam)
    world.threads = _share_cores(world.local_size)
    if seam.size > 1 and "route" in seam.capabilities:
        _plan_all_reduce(world, seam, all_reduce)
    if seam.size > 1:
        world._watch = PeerWatch.start(world, timeout)
    if seam.size > 1 and check != "off":  # from here on every collective of the job counts
        world.transport = GuardedTransport(
            seam, mode=check, timeout=timeout, world_rank=seam.rank,
            recorder=Recorder() if world.trace_dir is not None else None,
            trace_dir=world.trace_dir)
    _WORLD = world
    return world


def _start_transport(name: str, info: LaunchInfo, timeout: float,
                     device: str | Device = "auto") -> Transport:
    if name == "auto":
        if info.launcher == "none":
            return SelfTransport()
        name = "nccl" if _nccl_for(device) else "mpi"
    if name == "self":
        if info.size > 1:
            raise ConfigError(f"transport='self' runs one rank, but the {info.launcher} "
                              f"launcher started {info.size}; use transport='auto'")
        return SelfTransport()
    plugin = load_plugin(name)
    reason = plugin.unavailable_reason()
    if reason is not None:
        raise TransportUnavailableError(f"transport {name!r} cannot run here: {reason}")
    return plugin.world(timeout=timeout, device=None if device == "auto" else as_device(device))


def _nccl_for(device: str | Device) -> bool:
    """Whether transport="auto" under a launcher picks NCCL: the rank's device is a CUDA
    GPU (named, or "auto" with a GPU visible) and the nccl plugin can run here."""
    wants_gpu = (cuda_device_count() > 0 if device == "auto"
                 else as_device(device).kind == "cuda")
    if not wants_gpu or "nccl" not in find_transports():
        return False
    return load_plugin("nccl").unavailable_reason() is None


@contextlib.contextmanager
def _startup_deadline(info: LaunchInfo, timeout: float) -> Iterator[None]:
    """End this process if the transport is not up within ``timeout`` seconds.

    ``MPI_Init`` waits for every rank of the job and has no deadline of its own: a rank
    that fails before it calls ``fs.init()`` (an import error, a bad argument on one rank)
    leaves the others in it for ever: MPICH's Hydra does not end them (Open MPI's mpirun
    does). ``MPI_Init`` holds the GIL, so no Python thread
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


def _plan_all_reduce(world: World, seam: Transport, algorithm: str) -> None:
    """Set the transport's all-reduce route: ``algorithm``, or with "auto" the calibrated
    cost model's choice per size.

    Collective. The plan comes from the calibration file (``init(calibration=...)``, else
    this machine's, else defaults) and the detected topology; the transport checks that
    every rank planned the same bands. Ranks that read different calibration files do not,
    and since they all judge the same gathered table they all fall back to MPI's own
    all-reduce together, with a warning naming the fix.
    """
    if algorithm != "auto":
        seam.set_all_reduce_policy(algorithm=algorithm)  # type: ignore[attr-defined]
        return
    try:
        seam.set_all_reduce_policy(  # type: ignore[attr-defined]
            algorithm="auto", planner=planner_for(
                world, calibration=load_calibration(world.calibration)))
    except CollectiveMismatchError as e:
        warnings.warn(f"fs.init: the ranks planned different all-reduce algorithms ({e}); "
                      "using MPI's own all-reduce. Give every rank the same calibration "
                      "file (init(calibration=...))", RuntimeWarning, stacklevel=3)
        seam.set_all_reduce_policy(algorithm="mpi")  # type: ignore[attr-defined]


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _share_cores(local_size: int) -> int | None:
    """Limit this rank's BLAS/OpenMP pools to its share of the node's cores.

    Every BLAS starts one thread per core in every process, so ``local_size`` ranks on a
    node run ``local_size`` x cores threads that preempt each other inside every matmul
    (a step's every matmul waits for the slowest of threads that share cores). torchrun
    sets OMP_NUM_THREADS=1 for the same reason; here a rank
    gets ``cores // local_size`` threads (at least 1). A thread count the user set in the
    environment wins, and a single rank per node is left alone. Returns the limit, or None.
    """
    if local_size <= 1 or any(os.environ.get(v) for v in _THREAD_VARS):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = max(1, cores // local_size)
    threadpool_limits(limits=limit)
    return limit


def _pick_device(device: str | Device, local_rank: int,
                 seam: Transport | None = None) -> Device:
    if device != "auto":
        return as_device(device)
    if seam is not None and "device" in seam.capabilities:  # nccl chose its GPU already
        return seam.device  # type: ignore[attr-defined,no-any-return]
    gpus = cuda_device_count()
    return Device("cuda", local_rank % gpus) if gpus else Device("cpu", 0)
