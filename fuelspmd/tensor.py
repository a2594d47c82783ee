"""The lazy ``Tensor`` front and its constructors (layer 3).

A :class:`Tensor` wraps one graph node. Every operation builds a node (shape and dtype
are checked then, so a mistake raises here, not when the graph runs) and nothing runs
until :meth:`Tensor.realize`, :meth:`Tensor.numpy` or :func:`realize`. Promotion follows
the Array API (:mod:`fuelspmd.graph.build`); a Python scalar takes the tensor's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd import graph
from fuelspmd.backend import Device, get_backend, on_gpu, to_gpu, to_host
from fuelspmd.backend import device as as_device
from fuelspmd.dtypes import (
    DType,
    Shape,
    bool_,
    float32,
    int64,
    normalize_axes,
    normalize_axis,
    result_type,
    to_numpy,
)
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.graph import build as B
from fuelspmd.graph.host import HostCall, call_host
from fuelspmd.graph.node import TRACE, Node, canonical

__all__ = ["Tensor", "arange", "concat", "host", "ones", "randn", "realize", "split", "tensor",
           "where", "zeros"]

Operand = Any  # Tensor | float | int | bool


def _node(x: Operand) -> Any:
    return x.node if isinstance(x, Tensor) else x


class Tensor:
    """A lazy array on one device; see the module docstring."""

    __slots__ = ("node",)
    __array_ufunc__ = None  # numpy_array + tensor: numpy steps aside, Tensor.__radd__ runs

    def __init__(self, node: Node) -> None:
        self.node = node

    # ---- what it is ---------------------------------------------------------------
    @property
    def shape(self) -> Shape:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def device(self) -> Device:
        return self.node.device

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    @property
    def size(self) -> int:
        return math.prod(self.node.shape)

    @property
    def realised(self) -> bool:
        return self.node.buffer is not None

    def __repr__(self) -> str:
        state = "realised" if self.realised else "lazy"
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device='{self.device}', {state})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ---- running it ---------------------------------------------------------------
    def realize(self) -> Tensor:
        """Run the graph under this tensor; return it (now holding its buffer)."""
        graph.realize([self.node])
        return self

    def numpy(self) -> np.ndarray:
        """Realise and return the value as a numpy array (on the host)."""
        rec = TRACE.recorder
        if rec is not None:  # inside a compiled step's trace: the value would be baked
            rec.host_read(self)
        self.realize()
        node = self.node
        node.escaped = True  # the caller holds the buffer now (to_host copies nothing)
        return to_host(node.buffer)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """``np.asarray(t)`` realises ``t`` (asking numpy for the value is asking)."""
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __iter__(self) -> Any:
        """Iterate over the first axis (each item a lazy slice)."""
        return (self[i] for i in range(len(self)))

    def item(self) -> float | int | bool:
        if self.size != 1:
            raise ShapeError(f"item() needs a tensor of one element, got shape {self.shape}")
        return self.numpy().reshape(()).item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def donate(self) -> Tensor:
        """Give this tensor's buffer to the graph; return the tensor.

        The next realise that reads it may write the result into that buffer (an in-place
        collective such as ``x = comm.all_reduce(x.donate())`` then copies nothing, as
        ``MPI_Allreduce(MPI_IN_PLACE)`` does), and after that realise the tensor has no
        value: using it raises ConfigError. The caller's array the tensor was made from
        (``fs.tensor(arr)`` does not copy) may be overwritten too. Without ``donate`` the
        graph never writes a buffer it did not allocate. An unrealised tensor's buffer is
        the graph's already; donating one changes nothing.
        """
        node = self.node
        if node.buffer is None:
            graph.node.check_live(node)
            return self
        buf = node.buffer
        flags = getattr(buf, "flags", None)  # numpy and cupy arrays; array-api-strict's none
        if flags is None or not flags.c_contiguous or not getattr(flags, "writeable", True):
            raise ConfigError(f"donate(): the tensor's buffer ({type(buf).__name__} "
                              f"{node.shape}) is not a writable C-contiguous numpy or cupy "
                              f"array, so the graph could not write it; donate a copy "
                              f"(fs.tensor(np.ascontiguousarray(arr)))")
        node.donated = True
        return self

    def to(self, device: Device | str) -> Tensor:
        """This tensor on ``device`` (a graph node; DLPack between host libraries)."""
        dst = as_device(device)
        if dst == self.device:
            return self
        return Tensor(graph.make("to", (self.node,), (canonical(dst), self.device)))

    def astype(self, dtype: DType | str) -> Tensor:
        return Tensor(B.astype(self.node, as_dtype(dtype)))

    def detach(self) -> Tensor:
        """The same value, through which no gradient flows."""
        return Tensor(graph.make("detach", (self.node,)))

    # ---- arithmetic ---------------------------------------------------------------
    def _floating(self) -> Tensor:
        """True division of integers gives float32 (as numpy gives a float)."""
        return self if self.dtype.is_floating else self.astype(float32)

    def _bin(self, name: str, other: Operand, reverse: bool = False) -> Tensor:
        if not isinstance(other, (Tensor, bool, int, float)):
            other = tensor(other, device=self.device)
        a, b = (_node(other), self.node) if reverse else (self.node, _node(other))
        return Tensor(B.binary(name, a, b))

    def __add__(self, o: Operand) -> Tensor: return self._bin("add", o)
    def __radd__(self, o: Operand) -> Tensor: return self._bin("add", o, True)
    def __sub__(self, o: Operand) -> Tensor: return self._bin("sub", o)
    def __rsub__(self, o: Operand) -> Tensor: return self._bin("sub", o, True)
    def __mul__(self, o: Operand) -> Tensor: return self._bin("mul", o)
    def __rmul__(self, o: Operand) -> Tensor: return self._bin("mul", o, True)
    def __truediv__(self, o: Operand) -> Tensor: return self._floating()._bin("div", o)
    def __rtruediv__(self, o: Operand) -> Tensor: return self._floating()._bin("div", o, True)
    def __pow__(self, o: Operand) -> Tensor: return self._bin("pow", o)
    def __rpow__(self, o: Operand) -> Tensor: return self._bin("pow", o, True)
    def __neg__(self) -> Tensor: return Tensor(B.unary("neg", self.node))
    def __abs__(self) -> Tensor: return Tensor(B.unary("abs", self.node))
    def __lt__(self, o: Operand) -> Tensor: return self._bin("lt", o)
    def __le__(self, o: Operand) -> Tensor: return self._bin("le", o)
    def __gt__(self, o: Operand) -> Tensor: return self._bin("gt", o)
    def __ge__(self, o: Operand) -> Tensor: return self._bin("ge", o)
    def __eq__(self, o: Operand) -> Tensor: return self._bin("eq", o)  # type: ignore[override]
    def __ne__(self, o: Operand) -> Tensor: return self._bin("ne", o)  # type: ignore[override]
    def __and__(self, o: Operand) -> Tensor: return self._bin("logical_and", o)
    def __or__(self, o: Operand) -> Tensor: return self._bin("logical_or", o)
    def __invert__(self) -> Tensor: return Tensor(B.unary("logical_not", self.node))
    __hash__ = object.__hash__  # identity: == builds an elementwise comparison

    def maximum(self, o: Operand) -> Tensor: return self._bin("maximum", o)
    def minimum(self, o: Operand) -> Tensor: return self._bin("minimum", o)

    def __matmul__(self, o: Operand) -> Tensor:
        return _matmul(self, o if isinstance(o, Tensor) else tensor(o, device=self.device))

    def __rmatmul__(self, o: Operand) -> Tensor:
        return _matmul(tensor(o, device=self.device), self)

    def exp(self) -> Tensor: return Tensor(B.unary("exp", self.node))
    def log(self) -> Tensor: return Tensor(B.unary("log", self.node))
    def tanh(self) -> Tensor: return Tensor(B.unary("tanh", self.node))
    def sqrt(self) -> Tensor: return Tensor(B.unary("sqrt", self.node))
    def sin(self) -> Tensor: return Tensor(B.unary("sin", self.node))
    def cos(self) -> Tensor: return Tensor(B.unary("cos", self.node))
    def abs(self) -> Tensor: return Tensor(B.unary("abs", self.node))
    def erf(self) -> Tensor: return Tensor(B.unary("erf", self.node))

    # ---- reductions ---------------------------------------------------------------
    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axes(axis, self.ndim, op="sum")
        return Tensor(graph.make("sum", (self.node,), (axes, keepdims)))

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axes(axis, self.ndim, op="mean")
        count = math.prod(self.shape[a] for a in axes)
        x = self if self.dtype.is_floating else self.astype(float32)
        return x.sum(axes, keepdims) * (1.0 / count if count else math.nan)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        axes = normalize_axes(axis, self.ndim, op="max")
        return Tensor(graph.make("max", (self.node,), (axes, keepdims)))

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return -((-self).max(axis, keepdims))

    # ---- shapes -------------------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        dims = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        dims = tuple(int(d) for d in dims)  # type: ignore[arg-type]
        if dims.count(-1) > 1:
            raise ShapeError(f"reshape: at most one -1 in {dims}")
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            if known == 0 or self.size % known:
                raise ShapeError(f"reshape: cannot reshape {self.shape} ({self.size} elements)"
                                 f" to {dims}; {self.size} is not a multiple of {known}: the other "
                                 "dims must divide the element count")
            dims = tuple(self.size // known if d == -1 else d for d in dims)
        return Tensor(B.reshape(self.node, dims))

    def transpose(self, *axes: int | Sequence[int]) -> Tensor:
        perm = tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], int) else axes
        if not perm:
            perm = tuple(reversed(range(self.ndim)))
        perm = tuple(normalize_axis(a, self.ndim, op="transpose") for a in perm)  # type: ignore[arg-type]
        return Tensor(B.transpose(self.node, perm))

    @property
    def T(self) -> Tensor:
        return self.transpose()

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        return Tensor(B.broadcast_to(self.node, shape))

    def take(self, indices: Tensor, axis: int = 0) -> Tensor:
        """Gather along ``axis`` by an integer tensor of any shape (embeddings, KV pages)."""
        if not isinstance(indices, Tensor):
            indices = tensor(np.asarray(indices), device=self.device)
        axis = normalize_axis(axis, self.ndim, op="take")
        return Tensor(graph.make("take", (self.node, indices.node), (axis,)))

    def __getitem__(self, key: Any) -> Tensor:
        if isinstance(key, Tensor):
            return self.take(key, 0)
        return _basic_index(self, key if isinstance(key, tuple) else (key,))


def _basic_index(t: Tensor, key: tuple[Any, ...]) -> Tensor:
    """Basic indexing: ints, slices, ``...`` and ``None``; a view in the graph."""
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise ShapeError("an index can have only one '...'")
    if used > t.ndim:
        raise ShapeError(f"too many indices ({used}) for a {t.ndim}-d tensor {t.shape}; give "
                         f"at most {t.ndim}")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (t.ndim - used) + key[i + 1:]
    else:
        key = key + (slice(None),) * (t.ndim - used)
    slices, out_shape, axis = [], [], 0
    for k in key:
        if k is None:
            out_shape.append(1)
            continue
        n = t.shape[axis]
        if isinstance(k, slice):
            s = k.indices(n)
            slices.append(s)
            out_shape.append(len(range(*s)))
        elif isinstance(k, (int, np.integer)):
            i = int(k)
            if not -n <= i < n:
                raise ShapeError(f"index {i} is out of bounds for axis {axis} of size {n} "
                                 f"(shape {t.shape})")
            i %= n
            slices.append((i, i + 1, 1))
        else:
            raise TypeError(f"unsupported index {k!r}: use ints, slices, ..., None or an "
                            "integer Tensor (gather)")
        axis += 1
    node = t.node
    if any(s != (0, d, 1) for s, d in zip(slices, t.shape)):
        node = graph.make("slice", (node,), (tuple(slices),))
    return Tensor(B.reshape(node, tuple(out_shape)))


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """numpy's matmul: 1-d operands gain an axis for the product and lose it after."""
    x = a.reshape(1, a.shape[0]) if a.ndim == 1 else a
    y = b.reshape(b.shape[0], 1) if b.ndim == 1 else b
    out = Tensor(B.matmul(x.node, y.node))
    if a.ndim == 1:
        out = out.reshape(out.shape[:-2] + out.shape[-1:])
    if b.ndim == 1:
        out = out.reshape(out.shape[:-1])
    return out


# ---- constructors ------------------------------------------------------------------

def tensor(data: Any, *, device: Device | str | None = None,
           dtype: DType | str | None = None) -> Tensor:
    """A leaf holding ``data`` (a numpy/cupy/array-api array, or nested lists).

    Arrays keep their dtype (numpy's float64 stays float64); nested lists of floats give
    float32, of ints int64. The buffer is not copied when it already lives on ``device``.
    """
    if isinstance(data, Tensor):
        out = data.to(device) if device is not None else data
        return out.astype(dtype) if dtype is not None else out
    dev = as_device(device)
    be = get_backend(dev.kind)
    if isinstance(data, (list, tuple, int, float, bool)):
        arr = np.asarray(data)
        dt = as_dtype(dtype) if dtype is not None else (
            float32 if arr.dtype.kind == "f" else int64 if arr.dtype.kind in "iu" else
            bool_ if arr.dtype.kind == "b" else as_dtype(arr.dtype))
    else:
        arr = data
        dt = as_dtype(dtype) if dtype is not None else graph.array_dtype(arr)
    lib = type(arr).__module__.split(".")[0]
    if dev.kind == "cuda":
        buf = to_gpu(arr, dev.index) if on_gpu(arr) else be.from_host(to_host(arr), dev)
        if graph.array_dtype(buf) is not dt:
            buf = be.xp.astype(buf, be.dtype(dt))
    elif lib == "numpy" and dev.kind == "cpu" and type(arr) is np.ndarray:
        buf = arr if arr.dtype == to_numpy(dt) else arr.astype(to_numpy(dt))
    elif lib == dev.library:
        buf = be.asarray(arr, dt)
    else:
        buf = be.asarray(to_host(arr), dt)
    return Tensor(graph.leaf(buf, dev))


def _shape(shape: int | Sequence[int]) -> Shape:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)


def zeros(shape: int | Sequence[int], *, device: Device | str | None = None,
          dtype: DType | str = float32) -> Tensor:
    """A tensor of zeros: a constant node (structure only, no buffer until it is used)."""
    return Tensor(graph.const(0, _shape(shape), as_dtype(dtype), as_device(device)))


def ones(shape: int | Sequence[int], *, device: Device | str | None = None,
         dtype: DType | str = float32) -> Tensor:
    """A tensor of ones (a constant node)."""
    return Tensor(graph.const(1, _shape(shape), as_dtype(dtype), as_device(device)))


def arange(start: int | float, stop: int | float | None = None, step: int | float = 1, *,
           device: Device | str | None = None, dtype: DType | str | None = None) -> Tensor:
    """``numpy.arange``: int64 for integer arguments, float32 otherwise."""
    if stop is None:
        start, stop = 0, start
    ints = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
    dt = as_dtype(dtype) if dtype is not None else (int64 if ints else float32)
    return tensor(np.arange(start, stop, step).astype(to_numpy(dt)), device=device, dtype=dt)


def randn(shape: int | Sequence[int], *, seed: int | None = None,
          device: Device | str | None = None, dtype: DType | str = float32) -> Tensor:
    """Standard normal samples from numpy's PCG64 stream of ``seed`` (same on every device)."""
    dt = as_dtype(dtype)
    data = np.random.default_rng(seed).standard_normal(_shape(shape))
    return tensor(data.astype(to_numpy(dt)), device=device, dtype=dt)


def _promote(tensors: Sequence[Tensor]) -> list[Tensor]:
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = result_type(dt, t.dtype)
    return [t.astype(dt) for t in tensors]


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along ``axis`` (dtypes promoted)."""
    if not tensors:
        raise ShapeError("concat needs at least one tensor")
    axis = normalize_axis(axis, tensors[0].ndim, op="concat")
    ts = _promote(tensors)
    return Tensor(graph.make("concat", tuple(t.node for t in ts), (axis,)))


def split(t: Tensor, n: int | Sequence[int], axis: int = 0) -> list[Tensor]:
    """Split ``t`` along ``axis`` into ``n`` equal parts, or into parts of the given sizes."""
    axis = normalize_axis(axis, t.ndim, op="split")
    size = t.shape[axis]
    if isinstance(n, int):
        if n <= 0 or size % n:
            ok = [d for d in range(1, size + 1) if size % d == 0]
            raise ShapeError(f"split: axis {axis} of size {size} does not divide into {n} "
                             f"equal parts; use one of {ok} or pass a list of sizes")
        sizes = [size // n] * n
    else:
        sizes = [int(s) for s in n]
        if sum(sizes) != size or any(s < 0 for s in sizes):
            raise ShapeError(f"split: sizes {sizes} sum to {sum(sizes)}, axis {axis} has {size}")
    out, start = [], 0
    for s in sizes:
        idx = tuple(slice(start, start + s) if i == axis else slice(None) for i in range(t.ndim))
        out.append(t[idx])
        start += s
    return out


def where(cond: Tensor, a: Operand, b: Operand) -> Tensor:
    """``a`` where ``cond`` holds, else ``b``, broadcast together."""
    return Tensor(B.where(cond.node, _node(a), _node(b)))


def host(fn: Any, *inputs: Tensor, shape: int | Sequence[int], dtype: DType | str,
         device: Device | str | None = None) -> Tensor:
    """``fn(*host arrays of inputs)`` as a tensor of ``shape`` and ``dtype`` on ``device``
    (the first input's, or the default device).

    Python that must run on every step, compiled or not: computed at once when every
    input is realised and no compiled step is being traced (an error ``fn`` raises comes
    from here), else a ``host`` node computed when the graph runs, so a step compiled by
    ``fs.compile`` calls ``fn`` again on every replay. ``fn`` must compare equal from call
    to call (a bound method, a frozen dataclass), or each step's graph is a new one.
    """
    dev = canonical(as_device(device if device is not None else
                              inputs[0].device if inputs else None))
    attrs = HostCall(fn, _shape(shape), as_dtype(dtype), dev)
    nodes = tuple(t.node for t in inputs)
    if TRACE.recorder is None and all(n.buffer is not None for n in nodes):
        out = call_host(attrs, [to_host(n.buffer) for n in nodes])
        return Tensor(graph.leaf(get_backend(dev.kind).from_host(out, dev), dev))
    return Tensor(graph.make("host", nodes, attrs))


def realize(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Realise several tensors as one graph (shared work runs once); return them."""
    graph.realize([t.node for t in tensors])
    return tensors
