"""Loading NCCL through cupy's maintained binding, ``cupy.cuda.nccl``.

Why cupy's binding and not NVIDIA's ``nccl4py`` (docs/gpu.md has the longer account):
cupy is already the GPU array library of fuelspmd, so the binding adds no package; since
cupy 14 its import preloads ``libnccl.so.2`` through NVIDIA's ``cuda-pathfinder``, which
finds the pip wheel ``nvidia-nccl-cu12`` in site-packages (checked on a machine without a
GPU or driver: ``cupy.cuda.nccl.get_version()`` answers from the wheel's library); older
cupy looked the wheel up by distribution name (``_environment._get_nccl_from_wheel``).
Its API (``NcclCommunicator``, ``groupStart``/``groupEnd``, ``send``/``recv``,
``check_async_error``, ``abort``) has been stable since cupy 8, and it exposes
``NCCL_BFLOAT16`` and ``NCCL_AVG``. ``nccl4py`` is younger (0.1 to 0.6 within months) and
would be one more wheel to keep in step with cupy's CUDA runtime.

Nothing here runs on import; each function imports cupy where it is first needed.
"""

from __future__ import annotations

from typing import Any

from fuelspmd.errors import TransportUnavailableError

__all__ = ["INSTALL_HINT", "decode_version", "load_nccl", "nccl_version", "unique_id_format"]

INSTALL_HINT = ("pip install -e '.[gpu]' (CUDA 12) or -e '.[gpu13]' (CUDA 13) from a fuelspmd "
                "checkout: cupy and the NCCL wheels")


def load_nccl() -> Any:
    """Return ``cupy.cuda.nccl`` with libnccl loaded; TransportUnavailableError if not.

    Works without a GPU or a driver: importing cupy and loading libnccl touch neither.
    """
    try:
        import cupy  # noqa: F401  (cupy's import runs the library preload)
        from cupy.cuda import nccl
    except ImportError as e:
        raise TransportUnavailableError(f"the nccl transport needs cupy: {INSTALL_HINT} "
                                        f"({e})") from e
    if not getattr(nccl, "available", False):
        raise TransportUnavailableError(
            f"cupy is installed but could not load libnccl.so.2: {INSTALL_HINT}; set "
            f"CUPY_DEBUG_LIBRARY_LOAD=1 to see where cupy looked")
    return nccl


def nccl_version(nccl: Any) -> tuple[int, int, int]:
    """Return the loaded libnccl's version as (major, minor, patch)."""
    return decode_version(int(nccl.get_version()))


def decode_version(code: int) -> tuple[int, int, int]:
    """Decode ``ncclGetVersion``'s integer: major*10000 + minor*100 + patch since NCCL 2.9,
    major*1000 + minor*100 + patch before (2.8.4 is 2804, 2.21.5 is 22105)."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def unique_id_format() -> str:
    """How this cupy passes an ``ncclUniqueId``: "bytes" (cupy >= 14) or "tuple" of 128
    signed chars (older cupy). Decided from the version: calling ``get_unique_id`` on a
    rank only to learn the format would start an NCCL bootstrap listener there."""
    import cupy

    major = int(str(cupy.__version__).split(".")[0])
    return "bytes" if major >= 14 else "tuple"
