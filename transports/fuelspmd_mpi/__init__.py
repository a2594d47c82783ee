"""The MPI transport: fuelspmd's Transport seam over mpi4py's buffer API.

Registered as the entry point ``mpi = "fuelspmd_mpi:plugin"`` in the group
``fuelspmd.transports``; fuelspmd finds it there and never imports this package by name.
Importing it imports neither mpi4py nor MPI: :data:`plugin`'s calls do, with
``mpi4py.rc.initialize = False`` so that importing ``mpi4py.MPI`` does not initialise MPI:
the library version can then be read (``MPI_Get_library_version`` is callable before
``MPI_Init``) and a launch known to abort inside ``MPI_Init`` is turned into a
:class:`ConfigError` with the fix (:func:`pmix_trap`). How dtypes and reduce ops map onto
MPI is in :mod:`fuelspmd_mpi._work`, the all-reduce paths in :mod:`fuelspmd_mpi._transport`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fuelspmd.errors import ConfigError, TransportUnavailableError
from fuelspmd_mpi._transport import MPITransport

__all__ = ["MPIPlugin", "MPITransport", "initialize", "library_version", "load_mpi", "plugin",
           "pmix_trap"]

_INSTALL_HINT = "pip install mpi4py mpich (or build mpi4py against the system MPI)"


def load_mpi() -> Any:
    """Return the ``mpi4py.MPI`` module without initialising MPI (when someone else imported
    it first, its settings stand); TransportUnavailableError without mpi4py or libmpi."""
    try:
        import mpi4py
    except ImportError as e:
        raise TransportUnavailableError(f"mpi4py is not installed: {_INSTALL_HINT}") from e
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True  # mpi4py calls MPI_Finalize at exit once MPI is initialised
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:  # no libmpi.so, or an ABI mismatch
        raise TransportUnavailableError(
            f"mpi4py is installed but cannot load an MPI library ({e}); {_INSTALL_HINT}") from e
    return MPI


def library_version(*, full: bool = False) -> str:
    """Return the MPI library's version line (all of it with ``full``), for ``fuelspmd info``;
    callable before MPI is initialised."""
    text = str(load_mpi().Get_library_version()).strip()
    return text if full else text.splitlines()[0].strip()


def pmix_trap(version: str, env: Mapping[str, str]) -> str | None:
    """Return why ``MPI_Init`` would abort under this launcher, or None.

    Slurm's ``srun --mpi=pmix`` (``SLURM_MPI_TYPE=pmix``, or ``PMIX_RANK`` set) speaks only
    PMIx, and an MPICH built without PMIx (the PyPI ``mpich`` wheel is one) aborts in
    ``MPI_Init`` with "unsupported PMI version PMIx". Open MPI speaks PMIx natively.
    """
    via_srun = env.get("SLURM_MPI_TYPE", "").lower().startswith("pmix")
    uses_pmix = via_srun or "PMIX_RANK" in env
    if not uses_pmix or "MPICH" not in version or "pmix" in version.lower():
        return None
    first = version.strip().splitlines()[0].strip() if version.strip() else "MPICH"
    if via_srun:
        return (f"this job was launched with PMIx (srun --mpi=pmix) but the MPI library "
                f"({first}) is MPICH built without PMIx, which aborts in MPI_Init with "
                f"'unsupported PMI version PMIx'. Launch with `srun --mpi=pmi2` (or set "
                f"MpiDefault=pmi2 in slurm.conf), or run under `mpiexec`")
    return (f"this process was started by a PMIx launcher (PMIX_RANK is set: Open MPI's "
            f"mpirun/mpiexec, or prterun) but mpi4py loads {first}, which has no PMIx and "
            f"would abort in MPI_Init. Start it with the mpiexec of that MPICH (the one "
            f"beside this Python: `python -m fuelspmd info` names the library), or point "
            f"mpi4py at Open MPI")


def initialize() -> Any:
    """Initialise MPI (thread level MULTIPLE, mpi4py's own default: a crash handler or a
    progress thread may call MPI) unless it already is; return ``mpi4py.MPI``."""
    MPI = load_mpi()
    if MPI.Is_finalized():
        raise ConfigError("MPI was already finalized in this process and cannot be "
                          "initialised again; call fs.init() once per process")
    if not MPI.Is_initialized():
        trap = pmix_trap(str(MPI.Get_library_version()), os.environ)
        if trap is not None:
            raise ConfigError(trap)
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


class MPIPlugin:
    """The ``mpi`` transport plugin: availability check and the world transport."""

    name = "mpi"

    def unavailable_reason(self) -> str | None:
        """Return why MPI cannot run here (no mpi4py, no MPI library), or None. A launch MPI
        would abort in (:func:`pmix_trap`) is not "unavailable": MPI is there, the launch is
        wrong, and ``world()`` says how to fix it with a ConfigError."""
        try:
            MPI = load_mpi()
        except TransportUnavailableError as e:
            return str(e)
        return "MPI was already finalized in this process" if MPI.Is_finalized() else None

    def world(self, *, timeout: float, device: Any = None) -> MPITransport:
        """Initialise MPI if needed (:func:`initialize`) and return the transport over
        COMM_WORLD. ``timeout`` (seconds) is what every wait allows when given none.
        ``device`` changes nothing: MPI takes host buffers, and GPU buffers through
        CUDA-aware MPI or staging."""
        MPI = initialize()
        return MPITransport(MPI.COMM_WORLD, MPI=MPI, timeout=timeout, label="world")

    library_version = staticmethod(library_version)

    def __repr__(self) -> str:
        return "<fuelspmd transport plugin 'mpi' (mpi4py)>"


plugin = MPIPlugin()
