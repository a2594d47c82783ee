"""Dtypes and shapes.

Layer 0: imports only ``errors``. A :class:`DType` is a small value object with a name
that every backend understands; the numpy dtype behind it is looked up on first use
(bfloat16 comes from ml_dtypes, which numpy lacks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuelspmd.errors import DTypeError, ShapeError

__all__ = [
    "DType",
    "Shape",
    "bfloat16",
    "bool_",
    "broadcast_shapes",
    "dtype",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    "normalize_axes",
    "normalize_axis",
    "result_type",
    "to_numpy",
]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DType:
    """A dtype fuelspmd supports: ``kind`` is 'f' (float), 'i' (signed int) or 'b' (bool)."""

    name: str
    itemsize: int
    kind: str

    @property
    def is_floating(self) -> bool:
        return self.kind == "f"

    @property
    def is_integer(self) -> bool:
        return self.kind == "i"

    @property
    def is_bool(self) -> bool:
        return self.kind == "b"

    def __repr__(self) -> str:
        return f"fs.{self.name}"

    def __str__(self) -> str:
        return self.name


float16 = DType("float16", 2, "f")
bfloat16 = DType("bfloat16", 2, "f")
float32 = DType("float32", 4, "f")
float64 = DType("float64", 8, "f")
int32 = DType("int32", 4, "i")
int64 = DType("int64", 8, "i")
bool_ = DType("bool", 1, "b")

_BY_NAME: dict[str, DType] = {
    d.name: d for d in (float16, bfloat16, float32, float64, int32, int64, bool_)
}
_ALIASES = {"bool_": bool_, "half": float16, "float": float32, "double": float64}
_NUMPY: dict[DType, np.dtype] = {}


def dtype(x: Any) -> DType:
    """Return the :class:`DType` named by ``x``: a DType, a name, a numpy dtype or an array."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        found = _BY_NAME.get(x) or _ALIASES.get(x)
        if found is None:
            raise DTypeError(f"unknown dtype {x!r}; fuelspmd supports {sorted(_BY_NAME)}")
        return found
    name = getattr(getattr(x, "dtype", x), "name", None)
    if name is None:
        try:
            name = np.dtype(x).name
        except TypeError as e:
            raise DTypeError(
                f"cannot read a dtype from {x!r}; supported: {sorted(_BY_NAME)}") from e
    if name not in _BY_NAME:
        raise DTypeError(f"dtype {name} is not supported; use one of {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def to_numpy(dt: DType | str) -> np.dtype:
    """Return the numpy dtype of ``dt`` (bfloat16 through ml_dtypes)."""
    dt = dtype(dt)
    found = _NUMPY.get(dt)
    if found is None:
        if dt is bfloat16:
            import ml_dtypes

            found = np.dtype(ml_dtypes.bfloat16)
        else:
            found = np.dtype(dt.name)
        _NUMPY[dt] = found
    return found


_FLOAT_RANK = {float16: 1, bfloat16: 1, float32: 2, float64: 3}


def result_type(a: DType, b: DType) -> DType:
    """Promote two dtypes the way the Array API does, with float16 + bfloat16 -> float32.

    bool < int32 < int64 < every float; among floats the wider wins. Mixing an integer
    array with a float array gives the float (the standard leaves it to the library; numpy
    and cupy both do this).
    """
    if a is b:
        return a
    if a.is_floating and b.is_floating:
        ra, rb = _FLOAT_RANK[a], _FLOAT_RANK[b]
        if ra == rb:  # float16 with bfloat16: neither holds the other
            return float32
        return a if ra > rb else b
    if a.is_floating:
        return a
    if b.is_floating:
        return b
    if a.is_bool:
        return b
    if b.is_bool:
        return a
    return a if a.itemsize >= b.itemsize else b


def broadcast_shapes(a: Sequence[int], b: Sequence[int], *, op: str = "broadcast") -> Shape:
    """Return the numpy broadcast of two shapes, or raise ShapeError naming ``op``."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            raise ShapeError(
                f"{op}: shapes {tuple(a)} and {tuple(b)} do not broadcast "
                f"(axis -{i}: {x} vs {y}); make the sizes equal or one of them 1"
            )
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def normalize_axis(axis: int, ndim: int, *, op: str = "op") -> int:
    """Return ``axis`` in ``range(ndim)``, accepting negative axes."""
    if not -ndim <= axis < ndim:
        raise ShapeError(f"{op}: axis {axis} is out of range for a {ndim}-d tensor "
                         f"(valid: {-ndim}..{ndim - 1})")
    return axis % ndim


def normalize_axes(axes: int | Iterable[int] | None, ndim: int, *, op: str = "op") -> Shape:
    """Return sorted, de-duplicated non-negative axes; ``None`` means every axis."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = (axes,)
    out = sorted({normalize_axis(a, ndim, op=op) for a in axes})
    return tuple(out)
