"""The MPI transport: fuelspmd's Transport seam over mpi4py's buffer API.

Registered as the entry point ``mpi = "fuelspmd_mpi:plugin"`` in the group
``fuelspmd.transports``; fuelspmd finds it there and never imports this package by name.
Importing it imports neither mpi4py nor MPI: :data:`plugin`'s calls do, and initialise MPI
themselves (:mod:`fuelspmd_mpi._env`). How dtypes and reduce ops map onto MPI is in
:mod:`fuelspmd_mpi._work`, the all-reduce paths in :mod:`fuelspmd_mpi._transport`.
"""

from __future__ import annotations

from typing import Any

from fuelspmd.errors import TransportUnavailableError
from fuelspmd_mpi._env import initialize, library_version, load_mpi, pmix_trap
from fuelspmd_mpi._transport import MPITransport

__all__ = ["MPIPlugin", "MPITransport", "library_version", "plugin", "pmix_trap"]


class MPIPlugin:
    """The ``mpi`` transport plugin: availability check and the world transport."""

    name = "mpi"

    def unavailable_reason(self) -> str | None:
        """Return why MPI cannot run here (no mpi4py, no MPI library), or None.

        A launch MPI would abort in (srun --mpi=pmix with an MPICH lacking PMIx) is not
        "unavailable": MPI is there, the launch is wrong, and ``world()`` says how to fix
        it with a ConfigError.
        """
        try:
            MPI = load_mpi()
        except TransportUnavailableError as e:
            return str(e)
        return "MPI was already finalized in this process" if MPI.Is_finalized() else None

    def world(self, *, timeout: float, device: Any = None) -> MPITransport:
        """Initialise MPI if needed and return the transport over COMM_WORLD.

        ``timeout`` (seconds) is what every wait allows when given none. ``device`` changes
        nothing: MPI takes host buffers, and GPU buffers through CUDA-aware MPI or staging.
        Raises ConfigError for a launch known to abort in MPI_Init (:func:`pmix_trap`),
        TransportUnavailableError when mpi4py or MPI is missing.
        """
        MPI = initialize()
        return MPITransport(MPI.COMM_WORLD, MPI=MPI, timeout=timeout, label="world")

    def library_version(self, *, full: bool = False) -> str:
        """Return the MPI library's version line (all of it with ``full``), for ``info``."""
        return library_version(full=full)

    def __repr__(self) -> str:
        return "<fuelspmd transport plugin 'mpi' (mpi4py)>"


plugin = MPIPlugin()
