"""GPU buffers on the MPI transport: passed straight to a CUDA-aware MPI, else staged.

Whether the MPI library reads device memory is asked of it (:func:`detect_cuda_aware`).
CUDA-aware: the buffer goes to MPI as it is once the current stream is synchronised (16-bit
float reductions are staged even then: they are reduced in a float32 host copy). Otherwise
the operation runs on pinned host copies (page-locked: copied at full link speed), and its
Work copies the results back when it completes (:class:`StagedWork`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fuelspmd.errors import DeviceError
from fuelspmd.transport import Work

__all__ = ["StagedWork", "cuda_aware", "detect_cuda_aware", "is_device", "stage"]


def is_device(buf: Any) -> bool:
    """Whether ``buf`` lives in GPU memory (it exposes ``__cuda_array_interface__``)."""
    return not isinstance(buf, np.ndarray) and hasattr(buf, "__cuda_array_interface__")


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


class StagedWork:
    """The Work of an operation run on host copies: ``copy_back`` runs once, when the inner
    Work is first seen complete (by ``test`` or ``wait``), on the thread that saw it."""

    __slots__ = ("_copy_back", "_inner")

    def __init__(self, inner: Work, copy_back: Callable[[], None]) -> None:
        self._inner = inner
        self._copy_back: Callable[[], None] | None = copy_back

    def test(self) -> bool:
        """Return whether the operation (and the copy back) completed; never blocks."""
        back = self._copy_back
        if back is not None and self._inner.test():
            self._copy_back = None
            back()
        return self._copy_back is None

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the operation (CommTimeoutError as its Work gives it), then copy back."""
        if self._copy_back is not None:
            self._inner.wait(timeout)
            self.test()


def _pinned_copy(buf: Any) -> np.ndarray:
    """Copy device array ``buf`` into a pinned host array (cupy's pinned memory pool)."""
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(max(1, buf.nbytes))
    host = np.frombuffer(mem, buf.dtype, buf.size).reshape(buf.shape)
    stream = cupy.cuda.get_current_stream()
    buf.get(out=host, stream=stream)
    stream.synchronize()
    return host


def stage(method: Callable[..., Work], bufs: Sequence[Any], outs: Sequence[int],
          *extra: Any, op: str, aware: Callable[[], bool]) -> Work | None:
    """Run ``method(*bufs, *extra)`` on host copies of device ``bufs`` (``outs``: the
    indices of those it writes) and return its StagedWork; or None, "proceed as it is", for
    host buffers and, when ``aware()`` (asked of device buffers only), for device buffers
    once their stream is synchronised. DeviceError for neither numpy nor device, or a mix."""
    device = [is_device(b) for b in bufs]
    if not any(device):
        for b in bufs:
            if not isinstance(b, np.ndarray):
                raise DeviceError(
                    f"{op}: the MPI transport takes numpy or GPU (cupy) buffers, got "
                    f"{type(b).__module__}.{type(b).__name__}; move it to the host first "
                    f"(fuelspmd.backend.to_host)")
        return None
    if not all(device):
        raise DeviceError(f"{op}: one operation mixes host and GPU buffers; move them to "
                          f"one device first")
    import cupy

    sixteen = any(str(b.dtype) in ("float16", "bfloat16") for b in bufs)
    if not sixteen and aware():
        cupy.cuda.get_current_stream().synchronize()
        return None
    hosts = [_pinned_copy(b) for b in bufs]
    work = method(*hosts, *extra)
    pairs = [(bufs[i], hosts[i]) for i in outs]

    def copy_back() -> None:
        for dev, host in pairs:
            dev.set(host)
        cupy.cuda.get_current_stream().synchronize()  # the pinned buffers may be reused after

    return StagedWork(work, copy_back)
