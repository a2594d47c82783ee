"""Vocabulary-parallel embedding, LM head and cross-entropy: rank r owns vocabulary rows
``r*V/N .. (r+1)*V/N - 1`` and the full ``(…, V)`` logits are never gathered.

Embedding: each rank looks up the ids in its range (others read row 0 and are zeroed),
and ``reduce_from_tp`` sums the partial lookups: exactly one rank contributes each row.

LM head: logits_r = copy_to_tp(h) · E_r^T, this rank's vocabulary columns. ``h`` is
replicated and each rank's logits read all of it, so dh is the *sum* over ranks of
dlogits_r · E_r: the ``copy_to_tp`` all_reduce, which a hand-written ``h @ E.T`` lacks
(its forward is right and every rank's dh silently partial). Tied to a
:class:`VocabParallelEmbedding`, the head holds the embedding's Parameter itself, so the
weight's gradient is the sum of both uses, each local to the rank's rows.

Cross-entropy of logits Z (N, V) split by columns, targets t: with m = max over ranks of
the local row maxima (all_reduce max, no gradient: the shift cancels), the loss of row i is
``log sum_r sum_j exp(Z_r[i, j] - m_i) - (Z[i, t_i] - m_i)``. The sum of exponentials and the
picked logit are each a (N,) all_reduce (sum) of local parts, so the communication is three
(N,) all_reduces instead of an (N, V) gather (a fourth, the row sums, with label
smoothing: the smoothing term is ``lse_i - mean_j (Z[i, j] - m_i)``). Rows whose target is
``ignore_index`` are left out of the mean, as in torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, int64, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ShapeError
from fuelspmd.functional import ce_checks, check_range, smoothed_nll
from fuelspmd.nn import Module, Spec, full_arrays, make_parameter, seeded_weight, weight_source
from fuelspmd.tensor import Tensor, tensor, where

from .layers import AXIS, check_divides
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp

__all__ = ["ParallelLMHead", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def _table(owner: str, vocab: int, dim: int, *, comm: Any, full: Any, seed: Any, empty: bool,
           device: Device | str | None, dtype: DType) -> Any:
    """The (vocab, dim) table split by rows over ``comm``, as a Parameter."""
    src = weight_source(owner, full, seed, empty)
    check_divides(owner, "vocab", vocab, comm.size)
    w = (full_arrays(owner, [full], [(vocab, dim)])[0] if src == "full" else
         None if src == "empty" else seeded_weight(0 if seed is None else seed, vocab, dim))
    return make_parameter(Spec((vocab, dim), 0, AXIS, comm), w, dtype=dtype,
                          device=comm.device if device is None else device)


class VocabParallelEmbedding(Module):
    """E[ids] for a (V, D) table split by rows over ``comm``; ``full=weight``, ``seed=``
    (a seeded table is ``seeded_weight(seed, V, D)``: N(0, 1/V) entries, same at every TP
    size) or ``empty=True``. Ids outside [0, V) raise IndexRangeError on every rank."""

    def __init__(self, vocab: int, dim: int, *, comm: Any, full: Any = None,
                 seed: int | Sequence[int] | None = None, empty: bool = False,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        self.comm, self.vocab, self.dim = comm, int(vocab), int(dim)
        self.dtype = as_dtype(dtype)
        self.weight = _table("VocabParallelEmbedding", self.vocab, self.dim, comm=comm,
                             full=full, seed=seed, empty=empty, device=device,
                             dtype=self.dtype)
        k = self.vocab // comm.size
        self.lo, self.hi = comm.rank * k, (comm.rank + 1) * k

    def forward(self, ids: Tensor) -> Tensor:
        host = check_range("VocabParallelEmbedding", ids, self.vocab, what="id")
        if self.comm.size == 1:
            return self.weight.take(ids, 0)
        mine = (host >= self.lo) & (host < self.hi)
        local = tensor(np.where(mine, host - self.lo, 0).astype(np.int64), device=ids.device)
        keep = tensor(mine.astype(to_numpy(self.dtype))[..., None], device=ids.device)
        return reduce_from_tp(self.weight.take(local, 0) * keep, comm=self.comm)


class ParallelLMHead(Module):
    """Vocabulary-parallel logits ``h · E^T``, this rank's ``V/N`` columns; see the module
    docstring. ``tie=`` an embedding shares its table; otherwise ``full=``/``seed=``/
    ``empty=`` build a (V, hidden) table of its own. ``gather_output`` all_gathers the full
    logits (for sampling; the loss takes the split ones)."""

    def __init__(self, hidden: int, vocab: int, *, comm: Any,
                 tie: VocabParallelEmbedding | None = None, full: Any = None,
                 seed: int | Sequence[int] | None = None, empty: bool = False,
                 gather_output: bool = False, device: Device | str | None = None,
                 dtype: DType | str | Any = "float32") -> None:
        self.comm, self.gather_output = comm, bool(gather_output)
        if tie is not None:
            weight_source("ParallelLMHead(tie=...)", tie if full is None else full,
                          seed, empty)
            if (tie.vocab, tie.dim) != (vocab, hidden):
                raise ShapeError(f"ParallelLMHead: tie= an embedding of ({tie.vocab}, "
                                 f"{tie.dim}) for a head of (vocab {vocab}, hidden {hidden});"
                                 " give the embedding of the same vocabulary and width")
            self.weight = tie.weight
        else:
            self.weight = _table("ParallelLMHead", vocab, hidden, comm=comm, full=full,
                                 seed=seed, empty=empty, device=device,
                                 dtype=as_dtype(dtype))

    def forward(self, h: Tensor) -> Tensor:
        y = copy_to_tp(h, comm=self.comm) @ self.weight.T
        return gather_from_tp(y, comm=self.comm) if self.gather_output else y


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, *, comm: Any,
                                 ignore_index: int = -100, label_smoothing: float = 0.0
                                 ) -> Tensor:
    """Mean over kept rows of the cross-entropy of vocabulary-split logits; see the module
    docs. logits: this rank's (..., V/size) columns; targets: (...) class indices in
    [0, V) or ``ignore_index``, the same on every rank. Returns the replicated loss."""
    op = "vocab_parallel_cross_entropy"
    ce_checks(op, logits, targets, label_smoothing)
    k = logits.shape[-1]
    host = check_range(op, targets, k * comm.size, what="target",
                       ignore_index=ignore_index).reshape(-1)
    n = host.size
    keep = host != ignore_index
    z = logits.reshape(n, k)
    local_max = z.max(-1, keepdims=True).detach()
    shifted = z - comm.all_reduce(local_max, "max").detach()
    lse = reduce_from_tp(shifted.exp().sum(-1), comm=comm).log()
    lo = comm.rank * k
    mine = keep & (host >= lo) & (host < lo + k)
    idx = np.arange(n, dtype=np.int64) * k + np.where(mine, host - lo, 0)
    picked = shifted.reshape(n * k).take(tensor(idx, device=z.device, dtype=int64), 0)
    picked = where(tensor(mine, device=z.device), picked, 0.0)
    nll = lse - reduce_from_tp(picked, comm=comm)
    smooth = nll
    if label_smoothing:
        total = reduce_from_tp(shifted.sum(-1), comm=comm)
        smooth = lse - total * (1.0 / (k * comm.size))
    return smoothed_nll(nll, smooth, keep, label_smoothing)
