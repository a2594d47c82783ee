"""Causal self-attention with its heads split across the TP ranks.

For input X of shape ``(batch, seq, hidden)`` with ``heads`` heads of ``d = hidden/heads``
features: Q = X Wq + bq, K = X Wk + bk, V = X Wv + bv (column-parallel: rank r holds the
columns of heads ``r*h/N .. (r+1)*h/N - 1``, since head j owns columns ``j*d .. j*d+d-1``),
per head ``softmax(Q K^T / sqrt(d) + M) V`` with M = -1e9 above the diagonal (causal), and
the heads' outputs concatenated times Wo + bo (row-parallel over the same head blocks).
Heads never interact, so the only communication is ``copy_to_tp`` (all_reduce of dX
backward) and the output layer's all_reduce forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.functional import softmax
from fuelspmd.tensor import Tensor, tensor

from .layers import ColumnParallelLinear, RowParallelLinear, check_divides
from .mappings import copy_to_tp

__all__ = ["ParallelAttention", "causal_mask"]

MASKED = -1e9  # exp underflows to exactly 0 in float32 and float64


def causal_mask(seq: int) -> np.ndarray:
    """The additive (seq, seq) mask: 0 on and below the diagonal, ``MASKED`` above."""
    return np.triu(np.full((seq, seq), MASKED), k=1)


class ParallelAttention:
    """Causal multi-head self-attention, heads split over ``comm``; see the module docs.

    ``full=(Wq, bq, Wk, bk, Wv, bv, Wo, bo)`` (each W ``[hidden, hidden]``) or ``seed=``
    (Wq, Wk, Wv, Wo drawn from ``[seed, 0..3]``).
    """

    def __init__(self, hidden: int, heads: int, *, comm: Any, bias: bool = True,
                 full: Sequence[Any] | None = None, seed: int | None = None,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        if hidden % heads:
            raise ConfigError(f"ParallelAttention: hidden={hidden} is not divisible by "
                              f"heads={heads}; each head needs hidden/heads features")
        if full is not None and seed is not None:
            raise ConfigError("ParallelAttention: give full= or seed=, not both")
        if full is not None and len(full) != 8:
            raise ConfigError(f"ParallelAttention: full= takes (Wq, bq, Wk, bk, Wv, bv, Wo, "
                              f"bo), got {len(full)} items")
        self.local_heads = check_divides("ParallelAttention", "heads", heads, comm.size)
        self.comm, self.heads, self.head_dim = comm, heads, hidden // heads
        self.dtype = as_dtype(dtype)
        s = 0 if seed is None else seed
        kw: dict[str, Any] = dict(comm=comm, bias=bias, device=device, dtype=dtype)

        def part(i: int) -> dict[str, Any]:
            if full is None:
                return {"seed": [s, i]}
            return {"full": (full[2 * i], full[2 * i + 1])}

        self.q, self.k, self.v = (ColumnParallelLinear(hidden, hidden, **kw, **part(i))
                                  for i in range(3))
        self.out = RowParallelLinear(hidden, hidden, input_is_parallel=True, **kw, **part(3))
        self._masks: dict[int, Tensor] = {}

    def _mask(self, seq: int, device: Any) -> Tensor:
        m = self._masks.get(seq)
        if m is None:
            arr = causal_mask(seq).astype(to_numpy(self.dtype))
            m = self._masks[seq] = tensor(arr, device=device, dtype=self.dtype)
        return m

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim != 3 or x.shape[2] != self.heads * self.head_dim:
            raise ShapeError(f"ParallelAttention: input must be (batch, seq, "
                             f"{self.heads * self.head_dim}), got {x.shape}")
        b, t, _ = x.shape
        h, d = self.local_heads, self.head_dim
        xc = copy_to_tp(x, comm=self.comm)  # one all_reduce backward for q, k and v

        def split_heads(y: Tensor) -> Tensor:  # (b, t, h*d) -> (b, h, t, d)
            return y.reshape(b, t, h, d).transpose(0, 2, 1, 3)

        q, k, v = (split_heads(layer.local(xc)) for layer in (self.q, self.k, self.v))
        scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d))
        p = softmax(scores + self._mask(t, x.device), -1)
        ctx = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, h * d)
        return self.out(ctx)

    def parameters(self) -> list[Tensor]:
        """Return the local shards: q's, k's, v's, then the output layer's."""
        return [p for m in (self.q, self.k, self.v, self.out) for p in m.parameters()]

    def set_parameters(self, params: Sequence[Tensor]) -> None:
        """Replace the shards, in :meth:`parameters` order."""
        i = 0
        for m in (self.q, self.k, self.v, self.out):
            n = len(m.parameters())
            m.set_parameters(params[i:i + n])
            i += n
