"""Devices and the array libraries behind them.

Layer 1: imports ``errors`` and ``dtypes`` only. A :class:`Device` names where a tensor
lives (``cpu:0``, ``cuda:1``, ``strict:0``); its :class:`Backend` holds the Array API
namespace the graph's kernels are written against, and the moves between libraries.

Backends are looked up by the device kind and their library imported on first use, so
importing fuelspmd never imports cupy:

- ``cpu``    numpy (through array-api-compat), host memory.
- ``cuda``   cupy (through array-api-compat), device memory of one GPU.
- ``strict`` array-api-strict on the host: rejects anything outside the standard, so the
             tests catch a numpy-only call in a kernel before it fails on a GPU, and a
             group mixing ``cpu`` and ``strict`` exercises the cross-library path.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import array_api_compat.numpy as compat_numpy
import numpy as np

from fuelspmd.dtypes import DType, Shape, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import DeviceError, DTypeError

__all__ = ["DEVICES_FORMS", "Backend", "Device", "Spares", "StagedWork", "cuda_device_count",
           "cuda_unavailable_reason", "device", "device_limit", "get_backend", "on_gpu",
           "parse_devices", "settle", "through_host", "to_gpu", "to_host", "tracked",
           "transfer"]

_KINDS = ("cpu", "cuda", "strict")
# A host device (cpu, strict) is a thread of this process, not a piece of hardware: more of
# them than cores time-share the cores, which is fine for a test of the program and useless
# past a few per core (each step then measures the scheduler).
_HOST_DEVICES_PER_CORE = 4

DEVICES_FORMS = """\
--devices takes one of two forms:
  KIND:N            a count: the N devices KIND:0 .. KIND:N-1 ('cpu:4' is cpu:0,cpu:1,cpu:2,cpu:3)
  KIND:I,KIND:J,..  a list: exactly these devices, by index; a list has a comma, so one
                    chosen device is written with a trailing one ('cuda:1,' is GPU 1 alone)
KIND is cpu, cuda or strict."""


@dataclass(frozen=True, slots=True)
class Device:
    """A device: ``kind`` is one of cpu, cuda, strict; ``index`` counts from 0."""

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise DeviceError(f"unknown device kind {self.kind!r}; use one of {list(_KINDS)}")
        if self.index < 0:
            raise DeviceError(f"device index must be >= 0, got {self.index}")

    @property
    def library(self) -> str:
        """The array library that holds this device's arrays."""
        return {"cpu": "numpy", "cuda": "cupy", "strict": "array_api_strict"}[self.kind]

    @property
    def on_host(self) -> bool:
        """Whether arrays on this device live in host memory (cpu and strict do)."""
        return self.kind != "cuda"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"Device('{self}')"


def device(x: Device | str | None) -> Device:
    """Parse ``"cpu"``, ``"cpu:1"``, ``"cuda:0"``, ``"strict:0"`` (or pass a Device through)."""
    if x is None:
        return Device("cpu", 0)
    if isinstance(x, Device):
        return x
    if not isinstance(x, str):
        raise DeviceError(f"a device is a string like 'cpu:0' or 'cuda:1', got {x!r}")
    kind, _, index = x.strip().partition(":")
    if index and not index.isdigit():
        raise DeviceError(f"device {x!r}: the index after ':' must be a whole number >= 0, "
                          "as in 'cuda:1'")
    return Device(kind, int(index) if index else 0)


def device_limit(kind: str) -> int:
    """How many devices of ``kind`` this process can use: the GPUs cupy sees for cuda;
    ``_HOST_DEVICES_PER_CORE`` per core for the host kinds (a host device is a thread)."""
    if kind not in _KINDS:
        raise DeviceError(f"unknown device kind {kind!r}; use one of {list(_KINDS)}\n"
                          + DEVICES_FORMS)
    if kind == "cuda":
        return cuda_device_count()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return _HOST_DEVICES_PER_CORE * cores


def _too_many(kind: str, spec: str, asked: str) -> DeviceError:
    """The error of a count or an index past what :func:`device_limit` allows."""
    limit = device_limit(kind)
    if kind == "cuda":
        seen = (f"cupy sees {limit} GPU(s), cuda:0 .. cuda:{limit - 1}" if limit
                else "cupy sees no GPU (no GPU, no driver, or cupy not installed: "
                     "pip install -e '.[gpu]')")
    else:
        seen = (f"at most {limit} {kind} devices here ({_HOST_DEVICES_PER_CORE} per core: a "
                f"{kind} device is a thread of this process), {kind}:0 .. {kind}:{limit - 1}")
    return DeviceError(f"--devices {spec!r} asks for {asked}, but {seen}\n" + DEVICES_FORMS)


def parse_devices(spec: str) -> list[Device]:
    """Read a ``--devices`` argument: the count form ``KIND:N`` or a comma list.

    The two forms differ by the comma, so ``cuda:1`` (one device, ``cuda:0``) and
    ``cuda:1,`` (GPU 1) cannot be taken for each other. Counts and indices are checked
    against the devices this process can use (:func:`device_limit`).
    """
    text = spec.strip()
    if "," not in text:
        kind, colon, count = text.partition(":")
        if kind not in _KINDS:
            raise DeviceError(f"--devices {spec!r}: unknown device kind {kind!r}\n"
                              + DEVICES_FORMS)
        if not colon or not count.strip().isdigit():
            raise DeviceError(f"--devices {spec!r}: a count is a whole number after "
                              f"'{kind}:', as in '{kind}:2'\n" + DEVICES_FORMS)
        n = int(count)
        if n < 1:
            raise DeviceError(f"--devices {spec!r}: the count form asks for {n} devices; "
                              f"give at least 1 ('{kind}:1'), or name the device "
                              f"{kind}:0 alone as the list '{kind}:0,'\n" + DEVICES_FORMS)
        if n > device_limit(kind):
            raise _too_many(kind, spec, f"{n} {kind} device{'s' * (n > 1)}")
        return [Device(kind, i) for i in range(n)]
    entries = [e.strip() for e in text.split(",")]
    if not any(entries) or any(not e for e in entries[:-1]):
        raise DeviceError(f"--devices {spec!r}: an empty entry in the list\n" + DEVICES_FORMS)
    devices = []
    for entry in filter(None, entries):
        kind, colon, index = entry.partition(":")
        if kind not in _KINDS or not colon or not index.isdigit():
            raise DeviceError(f"--devices {spec!r}: list entry {entry!r} is not KIND:INDEX "
                              "with an index >= 0\n" + DEVICES_FORMS)
        if int(index) >= device_limit(kind):
            raise _too_many(kind, spec, entry)
        devices.append(Device(kind, int(index)))
    if len(set(devices)) != len(devices):
        raise DeviceError(f"--devices {spec!r}: names a device twice; name each once\n"
                          + DEVICES_FORMS)
    return devices


# the device nodes an NVIDIA driver makes (Linux; /dev/dxg is WSL2's GPU paravirtualisation)
_DRIVER_NODES = ("/dev/nvidiactl", "/dev/dxg")


@cache
def _cuda_probe() -> tuple[int, str | None]:
    """(CUDA devices cupy sees, why there are none): see :func:`cuda_device_count`."""
    if sys.platform.startswith("linux") and not any(map(os.path.exists, _DRIVER_NODES)):
        return 0, f"no NVIDIA driver: none of {', '.join(_DRIVER_NODES)} exists"
    try:
        import cupy
    except ImportError as e:
        return 0, f"cupy is not installed ({e}): pip install -e '.[gpu]' (or '.[gpu13]')"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # cupy raises its own CUDARuntimeError
        text = f"{type(e).__name__}: {e}"
        if "cudaErrorNoDevice" in text:
            return 0, f"the NVIDIA driver finds no CUDA device ({text})"
        return 0, (f"the NVIDIA driver is there, but CUDA does not start with it ({text}): "
                   "a driver older than cupy's CUDA, or without its library?")
    return n, None if n else "the NVIDIA driver finds no CUDA device"


def cuda_device_count() -> int:
    """Count the CUDA devices cupy can see (0 when cupy, a driver or a device is missing:
    :func:`cuda_unavailable_reason` says which).

    On Linux without an NVIDIA driver's device node the answer is 0 without importing
    cupy, which every ``fs.init`` would otherwise pay for. Cached: the set of visible
    devices is fixed once CUDA starts.
    """
    return _cuda_probe()[0]


def cuda_unavailable_reason() -> str | None:
    """Why no CUDA device is usable here, or None when one is: no NVIDIA driver, no cupy,
    a driver CUDA does not start with (older than cupy's CUDA runtime), or no device."""
    return _cuda_probe()[1]


class Backend:
    """The array library of one device kind, seen through the Array API."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "cpu":
            xp = compat_numpy
            self.lib: Any = np
        elif kind == "cuda":
            try:
                import array_api_compat.cupy as xp
                import cupy
            except ImportError as e:
                raise DeviceError(
                    "a cuda device needs cupy: pip install -e '.[gpu]' in the fuelspmd "
                    "checkout ('.[gpu13]' for CUDA 13)") from e
            self.lib = cupy
        else:
            try:
                import array_api_strict as xp
            except ImportError as e:
                raise DeviceError(
                    "a strict device needs array-api-strict: pip install array-api-strict"
                ) from e
            self.lib = xp
        self.xp: Any = xp

    def dtype(self, dt: DType | str) -> Any:
        """Return this library's dtype object for ``dt``."""
        dt = as_dtype(dt)
        if self.kind == "strict":
            if not hasattr(self.xp, dt.name):  # the standard's dtypes: no 16-bit floats
                raise DTypeError(f"a strict device holds the Array API standard's dtypes, "
                                 f"which have no {dt.name}; use float32 or float64 there")
            return getattr(self.xp, dt.name)
        return to_numpy(dt)

    def asarray(self, data: Any, dt: DType | str | None = None) -> Any:
        """Return ``data`` as an array of this library (copying only when needed)."""
        if self.kind == "strict" and isinstance(data, np.ndarray):
            dt = as_dtype(data.dtype.name if dt is None else dt)
            self.dtype(dt)  # a dtype the standard lacks: DTypeError, not the library's own
            return self.xp.asarray(data.astype(to_numpy(dt), copy=False))
        return self.xp.asarray(data, dtype=None if dt is None else self.dtype(dt))

    def empty(self, shape: Shape, dt: DType | str) -> Any:
        return self.xp.empty(shape, dtype=self.dtype(dt))

    def zeros(self, shape: Shape, dt: DType | str) -> Any:
        return self.xp.zeros(shape, dtype=self.dtype(dt))

    def to_host(self, arr: Any) -> np.ndarray:
        """Return ``arr`` as a numpy array (no copy on the host libraries)."""
        if self.kind == "cpu":
            return np.asarray(arr)
        return to_host(arr)

    def to_transport(self, arr: Any) -> Any:
        """``arr`` as a transport takes it: numpy and cupy arrays as they are, an
        array-api-strict array as host numpy over the same memory (staged through the
        host: the one place that is written)."""
        return np.from_dlpack(arr) if self.kind == "strict" else arr

    def from_transport(self, arr: Any) -> Any:
        """An array a transport filled (numpy, or cupy on a GPU) as this backend's array."""
        return self.asarray(arr) if self.kind == "strict" else arr

    def transport_empty(self, shape: Shape, dt: DType | str) -> Any:
        """An uninitialised buffer of this device's that a transport may fill."""
        if self.kind == "cuda":
            return self.lib.empty(shape, dtype=self.dtype(dt))
        return np.empty(shape, to_numpy(as_dtype(dt)))

    def from_host(self, arr: np.ndarray, dev: Device) -> Any:
        """Return the host array ``arr`` on ``dev`` of this library."""
        if self.kind == "cuda":
            with self.lib.cuda.Device(dev.index):
                return self.lib.asarray(arr)
        return self.asarray(arr)


@cache
def get_backend(kind: str) -> Backend:
    """Return the backend of a device kind, importing its library on first use."""
    if kind not in _KINDS:
        raise DeviceError(f"unknown device kind {kind!r}; use one of {list(_KINDS)}")
    return Backend(kind)


def on_gpu(arr: Any) -> bool:
    """Whether ``arr`` lies in GPU memory: it exposes ``__cuda_array_interface__`` (cupy's
    arrays; the moves here use cupy's ``device``, ``get`` and ``set``)."""
    return type(arr) is not np.ndarray and hasattr(arr, "__cuda_array_interface__")


def to_host(arr: Any, *, pinned: bool = False) -> np.ndarray:
    """Return any supported array as a numpy array: a host array through DLPack (no copy),
    a GPU array copied under its own device (the calling thread may drive another one),
    into page-locked memory with ``pinned`` (copied at full link speed: what a transport
    stages through), complete on return."""
    if isinstance(arr, np.ndarray):
        return arr
    if not on_gpu(arr):
        return np.from_dlpack(arr)
    import cupy

    with cupy.cuda.Device(arr.device.id):
        if not pinned:
            return cupy.asnumpy(arr)  # type: ignore[no-any-return]
        mem = cupy.cuda.alloc_pinned_memory(max(1, arr.nbytes))
        host = np.frombuffer(mem, arr.dtype, arr.size).reshape(arr.shape)
        stream = cupy.cuda.get_current_stream()
        arr.get(out=host, stream=stream)
        stream.synchronize()
        return host


def settle(arr: Any) -> Any:
    """Return ``arr``; a GPU array once its device's current stream has finished writing
    it (a reader on another stream, thread or library could otherwise read it early)."""
    if on_gpu(arr):
        import cupy

        with cupy.cuda.Device(arr.device.id):
            cupy.cuda.get_current_stream().synchronize()
    return arr


class StagedWork:
    """The Work of an operation run on host copies: ``copy_back`` runs once, when the inner
    Work is first seen complete (by ``test`` or ``wait``), on the thread that saw it."""

    __slots__ = ("_copy_back", "_inner")

    def __init__(self, inner: Any, copy_back: Callable[[], None]) -> None:
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


def through_host(run: Callable[..., Any], bufs: Sequence[Any], outs: Sequence[int], *,
                 op: str, direct: Callable[[], bool]) -> StagedWork | None:
    """Host staging for a transport that moves host memory: ``run(*copies)`` on pinned host
    copies of GPU ``bufs``, its Work a StagedWork that copies back those of ``outs`` (the
    indices of the bufs it writes). None, "proceed as they are": host arrays, and GPU
    arrays once settled when ``direct()`` (asked of GPU arrays only: the transport reads
    device memory itself). DeviceError for a mix, or for an array neither numpy nor GPU."""
    gpu = [on_gpu(b) for b in bufs]
    if not any(gpu):
        for b in bufs:
            if not isinstance(b, np.ndarray):
                raise DeviceError(
                    f"{op}: this transport takes numpy or GPU (cupy) buffers, got "
                    f"{type(b).__module__}.{type(b).__name__}; move it to the host first "
                    f"(fuelspmd.backend.to_host)")
        return None
    if not all(gpu):
        raise DeviceError(f"{op}: one operation mixes host and GPU buffers; move them to "
                          f"one device first")
    if direct():
        for b in bufs:
            settle(b)
        return None
    hosts = [to_host(b, pinned=True) for b in bufs]
    work = run(*hosts)
    pairs = [(bufs[i], hosts[i]) for i in outs]

    def copy_back() -> None:
        import cupy

        for dev, host in pairs:
            with cupy.cuda.Device(dev.device.id):
                dev.set(host)
                cupy.cuda.get_current_stream().synchronize()  # the pinned copy may be reused

    return StagedWork(work, copy_back)


def to_gpu(arr: Any, index: int) -> Any:
    """GPU array ``arr`` on GPU ``index``: itself when it is there already, else a copy there.

    One copy of the bytes between the two allocations: with unified addressing the driver
    makes it a peer copy when the GPUs reach each other (NVLink, PCIe P2P) and stages it
    through the host when they do not. A strided ``arr`` is made contiguous on its own GPU
    first. Both GPUs' current streams are synchronised around the copy (the source's work
    that writes ``arr`` runs on another device's stream, which orders nothing here), so
    the result is complete on return.
    """
    if arr.device.id == index:
        return arr
    import cupy

    with arr.device:
        arr = cupy.ascontiguousarray(arr)
        cupy.cuda.get_current_stream().synchronize()
    with cupy.cuda.Device(index):
        out = cupy.empty(arr.shape, arr.dtype)
        out.data.copy_from_device(arr.data, arr.nbytes)
        cupy.cuda.get_current_stream().synchronize()
    return out


def transfer(arr: Any, src: Device, dst: Device) -> Any:
    """Move ``arr`` from ``src`` to ``dst``.

    Same library and memory: no copy. Host libraries exchange by DLPack (zero copy).
    Anything else crosses through host memory: that is what "staged through the host"
    means for a hop between libraries or vendors.
    """
    if src == dst or (src.kind == dst.kind and src.on_host):
        return arr
    dst_backend = get_backend(dst.kind)
    if src.on_host and dst.on_host:
        return dst_backend.asarray(np.from_dlpack(arr))
    if src.kind == "cuda" and dst.kind == "cuda":
        return to_gpu(arr, dst.index)
    return dst_backend.from_host(get_backend(src.kind).to_host(arr), dst)


def tracked(memory: np.ndarray) -> np.ndarray:
    """An array of its own (uint8) over ``memory``, from which every view of it derives.

    numpy collapses a view's base to the first array that owns its data or whose base is
    not an array; this one's base is a memoryview, so every view made from it (sliced,
    reshaped, viewed as another dtype) has it as its base, and a weak reference to it is
    alive exactly while some view of the memory is. That is how a pool knows, without
    reference counts, that nothing refers to a buffer it lent.
    """
    # viewed as bytes first: the buffer protocol cannot export ml_dtypes' bfloat16
    return np.frombuffer(memoryview(memory.reshape(-1).view(np.uint8)), np.uint8)


class Spares:
    """Host buffers handed out again once nothing refers to them.

    Fresh memory costs a page fault per 4 KiB, as much as the copy or reduction that
    fills it, and a training loop asks for the same sizes step after step. Each buffer is
    handed out as a view of a :func:`tracked` area, so the weak reference kept here tells
    exactly when every view of it is gone. A step may hold several at once (the buckets of
    its gradients, each result a view of its bucket until the optimiser has read it), so
    each (shape, dtype) keeps up to ``per_key`` of them, for the ``keys`` latest keys;
    buffers under ``min_bytes`` are not kept (malloc hands back warm memory anyway).
    """

    def __init__(self, *, min_bytes: int = 1 << 18, keys: int = 4, per_key: int = 16) -> None:
        self.min_bytes, self.keys, self.per_key = min_bytes, keys, per_key
        self._pools: dict[tuple[Any, ...], list[list[Any]]] = {}  # [memory, ref or None]

    def take(self, shape: Shape, dt: Any) -> np.ndarray:
        """A buffer of ``shape`` and ``dt`` that nothing else refers to."""
        shape, dt = tuple(shape), np.dtype(dt)
        key = (shape, dt)
        pool = self._pools.get(key)
        for entry in pool or ():
            if entry[1] is None or entry[1]() is None:
                return self._lend(entry, shape, dt)
        mem = np.empty(shape, dt)
        if mem.nbytes < self.min_bytes:
            return mem
        if pool is None:
            pool = self._pools[key] = []
            while len(self._pools) > self.keys:
                del self._pools[next(iter(self._pools))]
        if len(pool) >= self.per_key:
            return mem
        entry = [mem, None]
        pool.append(entry)
        return self._lend(entry, shape, dt)

    @staticmethod
    def _lend(entry: list[Any], shape: Shape, dt: np.dtype) -> np.ndarray:
        area = tracked(entry[0])
        entry[1] = weakref.ref(area)
        return area.view(dt).reshape(shape)

