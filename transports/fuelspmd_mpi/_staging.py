"""Whether the MPI library reads GPU memory itself (CUDA-aware), asked of the library.

CUDA-aware: a GPU buffer goes to MPI as it is once its stream is synchronised (16-bit
floats are staged even then: MPI reduces them in a float32 host copy). Otherwise the
operation runs on pinned host copies: :func:`fuelspmd.backend.through_host`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["cuda_aware", "detect_cuda_aware"]


def detect_cuda_aware(*, alloc_kinds: str | None, library_version: str,
                      env: Mapping[str, str], ompi_info: Callable[[], str] | None = None
                      ) -> tuple[bool, str]:
    """Decide from what the library reports whether it is CUDA-aware; return (answer, why).

    In order: MPI 4.1's ``mpi_memory_alloc_kinds`` of COMM_WORLD (``alloc_kinds``, None when
    unset) lists ``cuda``; Open MPI's ``ompi_info --parsable --all`` (what ``ompi_info``
    returns) says it was built with CUDA; MPICH was configured ``--with-cuda`` and
    ``MPIR_CVAR_ENABLE_GPU`` is not 0.
    """
    if alloc_kinds is not None:
        kinds = [k.strip().split(":")[0] for k in alloc_kinds.split(",")]
        if "cuda" in kinds:
            return True, f"mpi_memory_alloc_kinds={alloc_kinds!r} lists cuda"
    if "Open MPI" in library_version and ompi_info is not None:
        text = ompi_info()
        if "mpi_built_with_cuda_support:value:true" in text:
            return True, "ompi_info: mpi_built_with_cuda_support:value:true"
        return False, "ompi_info: Open MPI built without CUDA support"
    if "MPICH" in library_version:
        if "--with-cuda" not in library_version:
            return False, "MPICH configured without --with-cuda"
        if env.get("MPIR_CVAR_ENABLE_GPU", "1").strip() == "0":
            return False, "MPICH built with CUDA, but MPIR_CVAR_ENABLE_GPU=0"
        return True, "MPICH configured --with-cuda (MPIR_CVAR_ENABLE_GPU not 0)"
    return False, f"no CUDA support reported (mpi_memory_alloc_kinds={alloc_kinds!r})"


def _ompi_info() -> str:
    try:  # not on the PATH: FileNotFoundError
        done = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                              text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def cuda_aware(MPI: Any) -> tuple[bool, str]:
    """Ask the initialised MPI library whether it takes device buffers; (answer, why)."""
    info = MPI.COMM_WORLD.Get_info()
    try:
        kinds = info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()
    return detect_cuda_aware(alloc_kinds=kinds, library_version=str(MPI.Get_library_version()),
                             env=os.environ, ompi_info=_ompi_info)
