"""Vocabulary-parallel embedding and cross-entropy: rank r owns vocabulary rows
``r*V/N .. (r+1)*V/N - 1`` and the full ``(…, V)`` logits are never gathered.

Embedding: each rank looks up the ids in its range (others read row 0 and are zeroed),
and ``reduce_from_tp`` sums the partial lookups: exactly one rank contributes each row.

Cross-entropy of logits Z (N, V) split by columns, targets t: with m = max over ranks of
the local row maxima (all_reduce max, no gradient: the shift cancels), the loss of row i is
``log sum_r sum_j exp(Z_r[i, j] - m_i) - (Z[i, t_i] - m_i)``. The sum of exponentials and the
picked logit are each a (N,) all_reduce (sum) of local parts, so the communication is three
(N,) all_reduces instead of an (N, V) gather. The gradient on rank r is
``(softmax(Z)_r - onehot(t)_r) / N``: local, no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, int64, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, DTypeError, ShapeError
from fuelspmd.tensor import Tensor, arange, tensor, where

from .layers import check_divides, seeded_weight
from .mappings import reduce_from_tp

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def _in_range(ids: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """(ids - lo where lo <= ids < hi else 0, the mask as a bool tensor)."""
    mask = (ids >= lo) & (ids < hi)
    return where(mask, ids - lo, 0), mask


class VocabParallelEmbedding:
    """E[ids] for a (V, D) table split by rows over ``comm``; ``full=weight`` or ``seed=``
    (a seeded table is ``seeded_weight(seed, V, D)``: N(0, 1/V) entries, same at every TP
    size)."""

    def __init__(self, vocab: int, dim: int, *, comm: Any, full: Any = None,
                 seed: int | Sequence[int] | None = None, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        if full is not None and seed is not None:
            raise ConfigError("VocabParallelEmbedding: give full= or seed=, not both")
        k = check_divides("VocabParallelEmbedding", "vocab", vocab, comm.size)
        self.comm, self.vocab, self.dim = comm, int(vocab), int(dim)
        self.lo, self.hi = comm.rank * k, (comm.rank + 1) * k
        w = seeded_weight(0 if seed is None else seed, vocab, dim) if full is None \
            else np.asarray(full)
        if w.shape != (vocab, dim):
            raise ShapeError(f"VocabParallelEmbedding: full weight has shape {w.shape}, "
                             f"expected ({vocab}, {dim})")
        self.dtype = as_dtype(dtype)
        arr = np.ascontiguousarray(w[self.lo:self.hi], dtype=to_numpy(self.dtype))
        self.weight = tensor(arr, device=comm.device if device is None else device,
                             dtype=self.dtype)

    def __call__(self, ids: Tensor) -> Tensor:
        if not ids.dtype.is_integer:
            raise DTypeError(f"VocabParallelEmbedding: ids must be integers, got {ids.dtype}")
        if self.comm.size == 1:
            return self.weight.take(ids, 0)
        local, mask = _in_range(ids.astype(int64), self.lo, self.hi)
        rows = self.weight.take(local, 0) * mask.astype(self.dtype).reshape(*ids.shape, 1)
        return reduce_from_tp(rows, comm=self.comm)

    def parameters(self) -> list[Tensor]:
        """Return ``[weight]``, this rank's rows of the table."""
        return [self.weight]

    def set_parameters(self, params: Sequence[Tensor]) -> None:
        """Replace the local rows."""
        if len(params) != 1 or params[0].shape != self.weight.shape:
            raise ShapeError(f"VocabParallelEmbedding.set_parameters: give one tensor of "
                             f"shape {self.weight.shape}")
        self.weight = params[0]


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, *, comm: Any) -> Tensor:
    """Mean over rows of the cross-entropy of vocabulary-split logits; see the module docs.

    logits: this rank's (N, V/size) columns; targets: (N,) class indices in [0, V), the
    same on every rank. Returns the (replicated) scalar loss.
    """
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ShapeError(f"vocab_parallel_cross_entropy: logits must be (N, V/size) and "
                         f"targets (N,), got {logits.shape} and {targets.shape}")
    if not targets.dtype.is_integer:
        raise DTypeError(f"vocab_parallel_cross_entropy: targets must be integer class "
                         f"indices, got {targets.dtype}")
    n, k = logits.shape
    local_max = logits.max(-1, keepdims=True).detach()
    shifted = logits - comm.all_reduce(local_max, "max").detach()
    sumexp = reduce_from_tp(shifted.exp().sum(-1), comm=comm)
    lo = comm.rank * k
    local_t, mask = _in_range(targets.astype(int64), lo, lo + k)
    rows = arange(n, device=logits.device, dtype=int64) * k
    picked = shifted.reshape(n * k).take(rows + local_t, 0) * mask.astype(logits.dtype)
    picked = reduce_from_tp(picked, comm=comm)
    return (sumexp.log() - picked).mean()
