"""Column- and row-parallel linear layers and the parallel MLP, as :class:`~fuelspmd.nn.Module`s.

Weights are ``[in_features, out_features]`` and a layer computes ``y = x @ W + b``. Its
parameters are :class:`~fuelspmd.nn.Parameter`s with their :class:`~fuelspmd.nn.Spec`
(split along a dim over the ``"tp"`` communicator, or replicated); they come from
``full=`` (every rank passes the same full arrays and keeps its block), ``seed=`` (the
full weight is ``seeded_weight(seed, in, out)``, so a seeded layer holds the same numbers
at every TP size; biases start at zero) or ``empty=True`` (filled by ``load_state_dict``).

Sizes the TP degree must divide are checked when the layer is built, from its arguments
alone, so every rank raises the same :class:`~fuelspmd.errors.ConfigError` before any
communication (invariant 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError
from fuelspmd.functional import gelu
from fuelspmd.nn import Module, Spec, full_arrays, make_parameter, seeded_weight, weight_source
from fuelspmd.tensor import Tensor

from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

__all__ = ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear", "check_divides"]

Seed = int | Sequence[int]
AXIS = "tp"


def check_divides(owner: str, what: str, value: int, size: int) -> int:
    """Return ``value // size``; raise ConfigError listing the TP sizes that divide it."""
    if value % size:
        ok = [d for d in range(1, value + 1) if value % d == 0]
        raise ConfigError(f"{owner}: {what}={value} is not divisible by the TP size {size}; "
                          f"TP sizes that divide {value}: {ok}. Change the TP size or make "
                          f"{what} a multiple of {size}")
    return value // size


class _Linear(Module):
    """What both linear layers share: the checks and the parameters with their specs.
    ``split`` 0 shards the output features (column), 1 the input features (row)."""

    owner = "Linear"

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool,
                 full: Any, seed: Seed | None, empty: bool, device: Device | str | None,
                 dtype: DType | str | Any, split: int) -> None:
        src = weight_source(self.owner, full, seed, empty)
        self.comm = comm
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.dtype = as_dtype(dtype)
        self.device = comm.device if device is None else device
        what = ("out_features", "in_features")[split]
        check_divides(self.owner, what, (self.out_features, self.in_features)[split],
                      comm.size)
        shapes = [(self.in_features, self.out_features), (self.out_features,) if bias else None]
        w, b = (full_arrays(self.owner, full, shapes) if src == "full" else
                [None, None] if src == "empty" else
                [seeded_weight(0 if seed is None else seed, *shapes[0]),
                 np.zeros(self.out_features) if bias else None])
        kw: dict[str, Any] = dict(dtype=self.dtype, device=self.device)
        self.weight = make_parameter(Spec(shapes[0], 1 - split, AXIS, comm), w, **kw)
        # column: the bias is split with the columns; row: added after the reduce, whole
        bspec = Spec((self.out_features,), 0, AXIS, comm) if split == 0 else \
            Spec((self.out_features,))
        self.bias = None if not bias else make_parameter(bspec, b, **kw)


class ColumnParallelLinear(_Linear):
    """Y = X A + b with A split along its columns: rank r holds A[:, r] and b[r].

    Forward: ``copy_to_tp`` (no communication), then the local ``X A_r + b_r``: each rank
    has the output features of its block. With ``gather_output`` the blocks are
    all_gathered into the full Y. Backward: dX = sum_r dY_r A_r^T, one all_reduce.
    """

    owner = "ColumnParallelLinear"

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 full: Any = None, seed: Seed | None = None, empty: bool = False,
                 gather_output: bool = False, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        super().__init__(in_features, out_features, comm=comm, bias=bias, full=full,
                         seed=seed, empty=empty, device=device, dtype=dtype, split=0)
        self.gather_output = bool(gather_output)

    def local(self, x: Tensor) -> Tensor:
        """``x @ A_r + b_r`` for an ``x`` already in the TP region (no mapping)."""
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def forward(self, x: Tensor) -> Tensor:
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
                 full: Any = None, seed: Seed | None = None, empty: bool = False,
                 input_is_parallel: bool = False, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        super().__init__(in_features, out_features, comm=comm, bias=bias, full=full,
                         seed=seed, empty=empty, device=device, dtype=dtype, split=1)
        self.input_is_parallel = bool(input_is_parallel)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, comm=self.comm)
        y = reduce_from_tp(x @ self.weight, comm=self.comm)
        return y if self.bias is None else y + self.bias


class ParallelMLP(Module):
    """Y = act(X A + a) B + b: A column-parallel, B row-parallel (Megatron's MLP); with
    ``gated``, Y = (act(X G + g) · (X A + a)) B + b (SwiGLU with ``activation=silu``).

    The activation acts on each rank's block of hidden features, so the block needs one
    all_reduce forward (B's) and one backward (the input gradient of A and G together).
    ``full=(A, a, B, b)`` (``+ (G, g)`` when gated) or ``seed=`` (A from ``[seed, 0]``,
    B from ``[seed, 1]``, G from ``[seed, 2]``) or ``empty=True``.
    """

    def __init__(self, hidden: int, ffn: int, *, comm: Any, bias: bool = True,
                 full: Sequence[Any] | None = None, seed: int | None = None,
                 empty: bool = False, activation: Callable[[Tensor], Tensor] = gelu,
                 gated: bool = False, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        weight_source("ParallelMLP", full, seed, empty)
        n = 6 if gated else 4
        if full is not None and len(full) != n:
            raise ConfigError(f"ParallelMLP: full= takes (A, a, B, b{', G, g' if gated else ''})"
                              f", got {len(full)} items")
        s = 0 if seed is None else seed
        self.comm = comm
        kw: dict[str, Any] = dict(comm=comm, bias=bias, device=device, dtype=dtype,
                                  empty=empty)

        def part(i: int) -> dict[str, Any]:
            if full is not None:
                return {"full": (full[2 * i], full[2 * i + 1])}
            return {} if empty else {"seed": [s, i]}

        self.fc1 = ColumnParallelLinear(hidden, ffn, **kw, **part(0))
        self.fc2 = RowParallelLinear(ffn, hidden, input_is_parallel=True, **kw, **part(1))
        self.gate = ColumnParallelLinear(hidden, ffn, **kw, **part(2)) if gated else None
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        xc = copy_to_tp(x, comm=self.comm)  # one all_reduce backward for fc1 and gate
        h = self.fc1.local(xc)
        h = self.activation(h) if self.gate is None else \
            self.activation(self.gate.local(xc)) * h
        return self.fc2(h)
