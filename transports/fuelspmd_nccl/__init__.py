"""The NCCL transport: fuelspmd's Transport seam over NCCL, for ranks that each drive a GPU.

Registered as the entry point ``nccl = "fuelspmd_nccl:plugin"`` in the group
``fuelspmd.transports``; fuelspmd finds it there and never imports this package by name.
NCCL comes from the pip wheel ``nvidia-nccl-cu12`` through cupy's binding
(:mod:`fuelspmd_nccl._binding` says why that binding). The ``ncclUniqueId`` travels over
MPI, so this plugin stands on the ``mpi`` plugin (:mod:`fuelspmd_mpi`), which also carries
the group's host-buffer operations (:mod:`fuelspmd_nccl._transport`). Importing this
package imports neither cupy nor mpi4py; dtype and reduce-op mapping is in
:mod:`fuelspmd_nccl._tables`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fuelspmd.backend import Device, cuda_device_count
from fuelspmd.backend import device as as_device
from fuelspmd.errors import ConfigError, TransportUnavailableError
from fuelspmd_nccl._binding import INSTALL_HINT, load_nccl, nccl_version

if TYPE_CHECKING:
    from fuelspmd_nccl._transport import NCCLTransport

__all__ = ["NCCLPlugin", "NCCLTransport", "plugin"]


class NCCLPlugin:
    """The ``nccl`` transport plugin: availability check and the world transport."""

    name = "nccl"

    def unavailable_reason(self) -> str | None:
        """Return why NCCL cannot run here (no cupy, no libnccl, no MPI), or None.

        A machine with the libraries but no GPU is not "unavailable" but a configuration
        mistake: ``world()`` says so with a ConfigError and the fix.
        """
        try:
            load_nccl()
        except TransportUnavailableError as e:
            return str(e)
        from fuelspmd_mpi import plugin as mpi_plugin

        reason = mpi_plugin.unavailable_reason()
        if reason is not None:
            return f"the nccl transport bootstraps over MPI, which cannot run here: {reason}"
        return None

    def world(self, *, timeout: float, device: Device | str | None = None) -> NCCLTransport:
        """Start MPI, pick this rank's GPU and connect the world's NCCL communicator.

        The GPU is ``device`` when given (a ``cuda:N``), else ``cuda:<node-local rank % GPUs>``
        (the node-local rank from ``MPI_Comm_split_type(SHARED)``). ConfigError without a
        GPU, or for a device that is not a visible GPU; the NCCL communicator is made
        here, so a broken NCCL setup fails in ``fs.init``, not at the first collective.
        """
        nccl = load_nccl()
        gpus = cuda_device_count()
        if gpus == 0:
            raise ConfigError(
                "transport='nccl' needs a CUDA GPU, but cupy sees none on this machine (no "
                "GPU, or no NVIDIA driver: check `nvidia-smi`). Run on a GPU node, or use "
                "transport='mpi' (or 'auto', which picks MPI without a GPU) and CPU devices")
        wanted = None if device is None or device == "auto" else as_device(device)
        if wanted is not None and (wanted.kind != "cuda" or wanted.index >= gpus):
            raise ConfigError(
                f"transport='nccl' drives a GPU, but device={str(wanted)!r} is not one of "
                f"the {gpus} visible: pass device='cuda:N' with N in 0..{gpus - 1}, or "
                f"device='auto'")
        from fuelspmd_mpi import load_mpi
        from fuelspmd_mpi import plugin as mpi_plugin
        from fuelspmd_nccl._transport import NCCLTransport

        mpi = mpi_plugin.world(timeout=timeout)
        MPI = load_mpi()
        node = mpi.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            local_rank = node.Get_rank()
        finally:
            node.Free()
        index = wanted.index if wanted is not None else local_rank % gpus
        import cupy

        cupy.cuda.Device(index).use()
        transport = NCCLTransport(mpi, nccl=nccl, device_index=index, timeout=timeout)
        transport.connect()
        return transport

    def library_version(self) -> str:
        """Return the loaded libnccl's version, e.g. "NCCL 2.21.5", for ``info``."""
        return "NCCL " + ".".join(map(str, nccl_version(load_nccl())))

    def __repr__(self) -> str:
        return "<fuelspmd transport plugin 'nccl' (cupy.cuda.nccl)>"


plugin = NCCLPlugin()


def __getattr__(name: str) -> Any:
    if name == "NCCLTransport":  # imported on first use: no cupy, no MPI on import
        from fuelspmd_nccl._transport import NCCLTransport

        return NCCLTransport
    if name == "INSTALL_HINT":
        return INSTALL_HINT
    raise AttributeError(f"module 'fuelspmd_nccl' has no attribute {name!r}")
