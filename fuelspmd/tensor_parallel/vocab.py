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
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, float64, int64
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import DTypeError, ShapeError
from fuelspmd.functional import CheckedIds, ce_checks, check_values, kept_scale, smoothed_nll
from fuelspmd.nn import Module, Spec, full_arrays, make_parameter, seeded_weight, weight_source
from fuelspmd.tensor import Tensor, host, where

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
        if not ids.dtype.is_integer:
            raise DTypeError(f"VocabParallelEmbedding: ids must be integers, got {ids.dtype}")
        checked = CheckedIds("VocabParallelEmbedding", self.vocab)
        if self.comm.size == 1:
            return self.weight.take(host(checked, ids, shape=ids.shape, dtype=ids.dtype), 0)
        rows = _Rows(checked, self.lo, self.hi, "local")
        local = host(rows, ids, shape=ids.shape, dtype=int64)
        keep = host(replace(rows, part="keep"), ids, shape=(*ids.shape, 1), dtype=self.dtype)
        return reduce_from_tp(self.weight.take(local, 0) * keep, comm=self.comm)


@dataclass(frozen=True)
class _Rows:
    """This rank's rows ``lo..hi`` of the table for checked host ids (``fs.host``
    functions, run on every call of a compiled step): ``local`` the row index (0 for ids
    of other ranks), ``keep`` 1 for ids of this rank, as ``(..., 1)``."""

    checked: CheckedIds
    lo: int
    hi: int
    part: str

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        host_ids = self.checked(ids)
        mine = (host_ids >= self.lo) & (host_ids < self.hi)
        if self.part == "local":
            return np.where(mine, host_ids - self.lo, 0)
        return mine[..., None]


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
    if not targets.dtype.is_integer:
        raise DTypeError(f"{op}: targets must be integers, got {targets.dtype}")
    k = logits.shape[-1]
    n = targets.size
    table = _Targets(op, k, comm.rank, comm.size, ignore_index, "index")
    z = logits.reshape(n, k)
    local_max = z.max(-1, keepdims=True).detach()
    shifted = z - comm.all_reduce(local_max, "max").detach()
    lse = reduce_from_tp(shifted.exp().sum(-1), comm=comm).log()
    idx = host(table, targets, shape=(n,), dtype=int64)
    mine = host(replace(table, part="mine"), targets, shape=(n,), dtype="bool")
    picked = shifted.reshape(n * k).take(idx, 0)
    picked = where(mine, picked, 0.0)
    nll = lse - reduce_from_tp(picked, comm=comm)
    smooth = nll
    if label_smoothing:
        total = reduce_from_tp(shifted.sum(-1), comm=comm)
        smooth = lse - total * (1.0 / (k * comm.size))
    keep = host(replace(table, part="keep"), targets, shape=(n,), dtype=nll.dtype)
    scale = host(replace(table, part="scale"), targets, shape=(), dtype=float64)
    return smoothed_nll(nll, smooth, keep, scale, label_smoothing)


@dataclass(frozen=True)
class _Targets:
    """The tables of a vocabulary-parallel cross-entropy from checked host targets
    (``fs.host`` functions): ``index`` row·k + the target's column in this rank's block
    (0 elsewhere), ``mine`` whether the target's column is this rank's, ``keep`` 1 for
    kept rows, ``scale`` 1 / kept rows."""

    op: str
    k: int
    rank: int
    size: int
    ignore_index: int
    part: str

    def __call__(self, targets: np.ndarray) -> np.ndarray:
        t = check_values(self.op, targets, self.k * self.size, what="target",
                         ignore_index=self.ignore_index).reshape(-1)
        keep = t != self.ignore_index
        if self.part == "keep":
            return keep
        if self.part == "scale":
            return kept_scale(keep)
        lo = self.rank * self.k
        mine = keep & (t >= lo) & (t < lo + self.k)
        if self.part == "mine":
            return mine
        return np.arange(t.size, dtype=np.int64) * self.k + np.where(mine, t - lo, 0)
