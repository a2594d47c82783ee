"""The plain (unsharded) layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout.

Every layer, here and in :mod:`fuelspmd.tensor_parallel`, gets its weights one of three
ways: ``full=`` (the full arrays, the same on every rank; each rank keeps its block),
``seed=`` (the full weight drawn from ``numpy.random.default_rng(seed)`` by
:func:`seeded_weight` and sliced, so a seeded layer holds the same numbers at every TP
size), or ``empty=True`` (parameters with shape and spec only, filled later by
``load_state_dict``, so no rank ever holds more than its shards). With none given the
layer is seeded with 0.

Dropout's mask is a function of ``(rng.seed, rng.step, rng.micro, layer)`` only: drawn for
the full activation and sliced like it, so the same step gives the same mask on every
rank where the activation is replicated, each rank its own block where it is sharded, and
the same numbers on any mesh (a recomputed forward redraws the same mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.functional import embedding, layer_norm, rms_norm
from fuelspmd.tensor import Tensor, host, tensor

from .module import Module
from .parameter import Parameter, Spec
from .rng import DropoutRNG

__all__ = ["Dropout", "Embedding", "LayerNorm", "Linear", "RMSNorm",
           "full_arrays", "make_parameter", "seeded_weight", "weight_source"]

Seed = int | Sequence[int]


def seeded_weight(seed: Seed, rows: int, cols: int) -> np.ndarray:
    """The full float64 ``[rows, cols]`` weight a layer seeded with ``seed`` holds a block
    of: standard normal scaled by 1/sqrt(rows), so ``x @ W`` keeps unit scale."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, cols)) / math.sqrt(rows)


def weight_source(owner: str, full: Any, seed: Seed | None, empty: bool) -> str:
    """Which of ``full=``, ``seed=``, ``empty=True`` builds the layer: "full", "seed" or
    "empty"; more than one is a ConfigError."""
    given = [n for n, v in (("full=", full is not None), ("seed=", seed is not None),
                            ("empty=True", empty)) if v]
    if len(given) > 1:
        raise ConfigError(f"{owner}: give one of full=, seed= and empty=True, not both "
                          f"{' and '.join(given)}")
    return "full" if full is not None else "empty" if empty else "seed"


def full_arrays(owner: str, full: Any, shapes: Sequence[tuple[int, ...] | None]
                ) -> list[np.ndarray | None]:
    """Check ``full`` (a sequence of arrays, None where a shape is None) against ``shapes``."""
    names = ", ".join("None" if s is None else str(s) for s in shapes)
    if not isinstance(full, (tuple, list)) or len(full) != len(shapes):
        n = len(full) if isinstance(full, (tuple, list)) else type(full).__name__
        raise ConfigError(f"{owner}: full= takes {len(shapes)} arrays of shapes ({names}), "
                          f"got {n}")
    out: list[np.ndarray | None] = []
    for i, (a, shape) in enumerate(zip(full, shapes)):
        if shape is None:
            if a is not None:
                raise ConfigError(f"{owner}: full=[{i}] must be None (bias=False); pass None")
            out.append(None)
            continue
        arr = np.asarray(a)
        if arr.shape != shape:
            raise ShapeError(f"{owner}: full=[{i}] has shape {arr.shape}, expected {shape}")
        out.append(arr)
    return out


def make_parameter(spec: Spec, value: np.ndarray | None, *, dtype: DType,
                   device: Device | str | None) -> Parameter:
    """This rank's block of the full array ``value`` as a Parameter (empty when None)."""
    if value is None:
        return Parameter(spec=spec, dtype=dtype, device=device)
    local = np.ascontiguousarray(spec.shard(value), dtype=to_numpy(dtype))
    return Parameter(tensor(local, device=device, dtype=dtype), spec=spec)


class Linear(Module):
    """y = x @ W + b, W ``[in_features, out_features]``; ``full=(W, b)`` (b None without
    bias) or ``seed=`` (W = seeded_weight(seed, in, out), b = 0) or ``empty=True``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 full: Any = None, seed: Seed | None = None, empty: bool = False,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        src = weight_source("Linear", full, seed, empty)
        dt = as_dtype(dtype)
        shapes = [(in_features, out_features), (out_features,) if bias else None]
        w, b = (full_arrays("Linear", full, shapes) if src == "full" else
                [None, None] if src == "empty" else
                [seeded_weight(0 if seed is None else seed, in_features, out_features),
                 np.zeros(out_features) if bias else None])
        self.weight = make_parameter(Spec(shapes[0]), w, dtype=dt, device=device)
        self.bias = None if not bias else make_parameter(Spec((out_features,)), b, dtype=dt,
                                                         device=device)

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class Embedding(Module):
    """weight[ids] for a ``(num, dim)`` table; ids outside ``[0, num)`` raise
    IndexRangeError. ``full=weight``, ``seed=`` (seeded_weight(seed, num, dim)) or
    ``empty=True``."""

    def __init__(self, num: int, dim: int, *, full: Any = None, seed: Seed | None = None,
                 empty: bool = False, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        src = weight_source("Embedding", full, seed, empty)
        w = (full_arrays("Embedding", [full], [(num, dim)])[0] if src == "full" else
             None if src == "empty" else seeded_weight(0 if seed is None else seed, num, dim))
        self.weight = make_parameter(Spec((num, dim)), w, dtype=as_dtype(dtype), device=device)

    def forward(self, ids: Tensor) -> Tensor:
        return embedding(ids, self.weight)


class _Norm(Module):
    """Shared by the norms: a ``(dim,)`` weight of ones (and bias of zeros), or ``full=``."""

    def __init__(self, owner: str, dim: int, bias: bool, full: Any, empty: bool,
                 device: Device | str | None, dtype: DType | str | Any) -> None:
        src = weight_source(owner, full, None, empty)
        dt = as_dtype(dtype)
        shapes = [(dim,), (dim,) if bias else None]
        w, b = (full_arrays(owner, full, shapes) if src == "full" else
                [None, None] if src == "empty" else [np.ones(dim), np.zeros(dim)])
        self.weight = make_parameter(Spec((dim,)), w, dtype=dt, device=device)
        self.bias = make_parameter(Spec((dim,)), b, dtype=dt, device=device) if bias else None


class LayerNorm(_Norm):
    """(x - mean) / sqrt(var + eps) · weight + bias over the last axis; ``full=(w, b)``."""

    def __init__(self, dim: int, *, eps: float = 1e-5, bias: bool = True, full: Any = None,
                 empty: bool = False, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        super().__init__("LayerNorm", dim, bias, full, empty, device, dtype)
        self.eps = float(eps)

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, eps=self.eps)


class RMSNorm(_Norm):
    """x / sqrt(mean(x²) + eps) · weight over the last axis; ``full=(w,)``."""

    def __init__(self, dim: int, *, eps: float = 1e-6, full: Any = None, empty: bool = False,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        super().__init__("RMSNorm", dim, False, None if full is None else (*full, None),
                         empty, device, dtype)
        self.eps = float(eps)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, eps=self.eps)


class Dropout(Module):
    """x · mask / (1 - p) in training mode, x in eval mode; see the module docstring.

    ``layer`` keys the mask (give each Dropout of a model its own); with ``comm`` the
    activation is sharded along ``dim`` over it (each rank its block of the full mask),
    without it the activation is replicated (one mask on every rank).
    """

    def __init__(self, p: float, *, rng: DropoutRNG | None = None, layer: int = 0,
                 comm: Any = None, dim: int = -1) -> None:
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"Dropout: p={p} must be in [0, 1)")
        self.p, self.layer, self.comm, self.dim = float(p), int(layer), comm, int(dim)
        self.rng = DropoutRNG() if rng is None else rng

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        dim = self.dim % x.ndim
        full = list(x.shape)
        lo, hi = 0, x.shape[dim]
        if self.comm is not None and self.comm.size > 1:
            n = x.shape[dim]
            full[dim] = n * self.comm.size
            lo, hi = self.comm.rank * n, (self.comm.rank + 1) * n
        mask = _Mask(self.rng, self.layer, tuple(full), dim, lo, hi, self.p, x.dtype)
        micro = tensor(np.asarray(self.rng.micro, np.int64), device=x.device)
        return x * host(mask, micro, shape=x.shape, dtype=x.dtype, device=x.device)


@dataclass(frozen=True)
class _Mask:
    """The scaled keep mask ``keep / (1 - p)`` of one Dropout call, this rank's block
    ``lo:hi`` along ``dim`` of the full mask. Made through ``fs.host``: the layer is fixed
    when the forward is built, the micro-batch is the host call's input (so the graphs of
    a step's micro-batches are one structure, one plan: as an attribute it made a plan per
    micro-batch, and a compiled pipeline of 16 of them overflowed the plan cache and never
    replayed), the step is read from ``rng`` when the mask is made, so a compiled step
    (``fs.compile``) draws each replay's own masks (the loop sets the step outside it) and
    an uncompiled one the same masks as ever."""

    rng: DropoutRNG
    layer: int
    full: tuple[int, ...]
    dim: int
    lo: int
    hi: int
    p: float
    dtype: DType

    def __call__(self, micro: np.ndarray) -> np.ndarray:
        keep = self.rng.keep(self.layer, self.full, self.p, micro=int(micro))
        index = [slice(None)] * len(self.full)
        index[self.dim] = slice(self.lo, self.hi)
        scaled = keep[tuple(index)] / (1.0 - self.p)
        return np.ascontiguousarray(scaled.astype(to_numpy(self.dtype)))
