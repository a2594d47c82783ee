"""Column- and row-parallel linear layers and the parallel MLP.

Weights are ``[in_features, out_features]`` and a layer computes ``y = x @ W + b``. A
layer is built from the full weight (``full=(weight, bias)``: every rank passes the same
arrays and keeps its shard) or from a seed: the full weight is drawn from
``numpy.random.default_rng(seed)`` (:func:`seeded_weight`) and sliced, so a seeded layer
holds exactly its shard of the same full weight at every TP size, and results do not
depend on the TP degree. Biases start at zero when seeded.

Sizes the TP degree must divide are checked when the layer is built, from its arguments
alone, so every rank raises the same :class:`~fuelspmd.errors.ConfigError` before any
communication (invariant 4).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.functional import gelu
from fuelspmd.tensor import Tensor, tensor

from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

__all__ = ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear", "check_divides",
           "seeded_weight"]

Seed = int | Sequence[int]


def check_divides(owner: str, what: str, value: int, size: int) -> int:
    """Return ``value // size``; raise ConfigError listing the TP sizes that divide it."""
    if value % size:
        ok = [d for d in range(1, value + 1) if value % d == 0]
        raise ConfigError(f"{owner}: {what}={value} is not divisible by the TP size {size}; "
                          f"TP sizes that divide {value}: {ok}. Change the TP size or make "
                          f"{what} a multiple of {size}")
    return value // size


def seeded_weight(seed: Seed, in_features: int, out_features: int) -> np.ndarray:
    """The full float64 ``[in, out]`` weight a layer seeded with ``seed`` holds a shard of:
    standard normal scaled by 1/sqrt(in_features), so activations keep unit scale."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((in_features, out_features)) / math.sqrt(in_features)


def _full_arrays(owner: str, full: Any, bias: bool, shape: tuple[int, int]
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    if not isinstance(full, (tuple, list)) or len(full) != 2:
        raise ConfigError(f"{owner}: full= takes (weight, bias) (bias None when bias=False), "
                          f"got {type(full).__name__}")
    w = np.asarray(full[0])
    if w.shape != shape:
        raise ShapeError(f"{owner}: full weight has shape {w.shape}, expected {shape} "
                         "([in_features, out_features])")
    if not bias:
        if full[1] is not None:
            raise ConfigError(f"{owner}: bias=False but full= gives a bias; pass None")
        return w, None
    b = np.asarray(full[1])
    if b.shape != (shape[1],):
        raise ShapeError(f"{owner}: full bias has shape {b.shape}, expected ({shape[1]},)")
    return w, b


class _Linear:
    """What both linear layers share: building the shard and holding the parameters."""

    owner = "Linear"

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool,
                 full: Any, seed: Seed | None, device: Device | str | None,
                 dtype: DType | str | Any, split: int) -> None:
        if full is not None and seed is not None:
            raise ConfigError(f"{self.owner}: give full=(weight, bias) or seed=, not both")
        self.comm = comm
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.dtype = as_dtype(dtype)
        self.device = comm.device if device is None else device
        n, r = comm.size, comm.rank
        what = ("out_features", "in_features")[split]
        k = check_divides(self.owner, what, (self.out_features, self.in_features)[split], n)
        if full is not None:
            w, b = _full_arrays(self.owner, full, bias,
                                (self.in_features, self.out_features))
        else:
            w = seeded_weight(0 if seed is None else seed, self.in_features,
                              self.out_features)
            b = np.zeros(self.out_features) if bias else None
        part = slice(r * k, (r + 1) * k)
        w = w[:, part] if split == 0 else w[part, :]
        self.weight = self._param(w)
        # column: the bias is split with the columns; row: added after the reduce, whole
        self.bias = (None if b is None else self._param(b[part] if split == 0 else b))

    def _param(self, a: np.ndarray) -> Tensor:
        arr = np.ascontiguousarray(a, dtype=to_numpy(self.dtype))
        return tensor(arr, device=self.device, dtype=self.dtype)

    def parameters(self) -> list[Tensor]:
        """Return the local parameter shards: ``[weight]`` or ``[weight, bias]``."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def set_parameters(self, params: Sequence[Tensor]) -> None:
        """Replace the shards, in :meth:`parameters` order (after an optimiser step)."""
        old = self.parameters()
        if len(params) != len(old):
            raise ConfigError(f"{self.owner}.set_parameters: {len(params)} tensors given, "
                              f"the layer has {len(old)}; give one per parameter")
        for p, q in zip(old, params):
            if p.shape != q.shape:
                raise ShapeError(f"{self.owner}.set_parameters: shape {q.shape} replaces "
                                 f"{p.shape}; give the local shard")
        self.weight = params[0]
        if self.bias is not None:
            self.bias = params[1]


class ColumnParallelLinear(_Linear):
    """Y = X A + b with A split along its columns: rank r holds A[:, r] and b[r].

    Forward: ``copy_to_tp`` (no communication), then the local ``X A_r + b_r``: each rank
    has the output features of its block. With ``gather_output`` the blocks are
    all_gathered into the full Y. Backward: dX = sum_r dY_r A_r^T, one all_reduce.
    """

    owner = "ColumnParallelLinear"

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 full: Any = None, seed: Seed | None = None, gather_output: bool = False,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        super().__init__(in_features, out_features, comm=comm, bias=bias, full=full,
                         seed=seed, device=device, dtype=dtype, split=0)
        self.gather_output = bool(gather_output)

    def local(self, x: Tensor) -> Tensor:
        """``x @ A_r + b_r`` for an ``x`` already in the TP region (no mapping)."""
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def __call__(self, x: Tensor) -> Tensor:
        y = self.local(copy_to_tp(x, comm=self.comm))
        return gather_from_tp(y, comm=self.comm) if self.gather_output else y


class RowParallelLinear(_Linear):
    """Y = X A + b with A split along its rows: rank r holds A[r] and the whole b.

    X is split along its last axis to match (``input_is_parallel`` says it already is,
    e.g. a ColumnParallelLinear's output; otherwise ``scatter_to_tp`` takes block r).
    Forward: Y = all_reduce(X_r A_r) + b, one all_reduce; backward: none (dX_r = dY A_r^T).
    """

    owner = "RowParallelLinear"

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 full: Any = None, seed: Seed | None = None, input_is_parallel: bool = False,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        super().__init__(in_features, out_features, comm=comm, bias=bias, full=full,
                         seed=seed, device=device, dtype=dtype, split=1)
        self.input_is_parallel = bool(input_is_parallel)

    def __call__(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, comm=self.comm)
        y = reduce_from_tp(x @ self.weight, comm=self.comm)
        return y if self.bias is None else y + self.bias


class ParallelMLP:
    """Y = act(X A + a) B + b: A column-parallel, B row-parallel (Megatron's MLP).

    The activation acts on each rank's block of hidden features, so the whole block needs
    one all_reduce forward (B's) and one backward (A's input gradient).
    ``full=(A, a, B, b)`` or ``seed=`` (A drawn from ``[seed, 0]``, B from ``[seed, 1]``).
    """

    def __init__(self, hidden: int, ffn: int, *, comm: Any, bias: bool = True,
                 full: Sequence[Any] | None = None, seed: int | None = None,
                 activation: Callable[[Tensor], Tensor] = gelu,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        if full is not None and seed is not None:
            raise ConfigError("ParallelMLP: give full=(A, a, B, b) or seed=, not both")
        if full is not None and len(full) != 4:
            raise ConfigError(f"ParallelMLP: full= takes (A, a, B, b), got {len(full)} items")
        s = 0 if seed is None else seed
        self.fc1 = ColumnParallelLinear(
            hidden, ffn, comm=comm, bias=bias, device=device, dtype=dtype,
            full=None if full is None else (full[0], full[1]),
            seed=None if full is not None else [s, 0])
        self.fc2 = RowParallelLinear(
            ffn, hidden, comm=comm, bias=bias, device=device, dtype=dtype,
            input_is_parallel=True, full=None if full is None else (full[2], full[3]),
            seed=None if full is not None else [s, 1])
        self.activation = activation

    def __call__(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation(self.fc1(x)))

    def parameters(self) -> list[Tensor]:
        """Return the local shards: fc1's then fc2's."""
        return self.fc1.parameters() + self.fc2.parameters()

    def set_parameters(self, params: Sequence[Tensor]) -> None:
        """Replace the shards, in :meth:`parameters` order."""
        k = len(self.fc1.parameters())
        self.fc1.set_parameters(params[:k])
        self.fc2.set_parameters(params[k:])
