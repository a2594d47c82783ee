"""Multi-head self-attention with its heads split across the TP ranks, as real models use
it: grouped-query heads, fused QKV weights, causal and padding masks, rotary positions, a
softmax scale, and a forward through a paged KV cache.

For input X ``(batch, seq, hidden)`` with ``heads`` query heads of ``d = hidden/heads``
features and ``kv_heads`` key/value heads (``heads`` a multiple of it; fewer is GQA, one is
MQA): Q = X Wq + bq, K = X Wk + bk, V = X Wv + bv, query head j reads key/value head
``j // (heads/kv_heads)``, per head ``softmax(scale · Q K^T + M) V`` with M = ``MASKED``
above the diagonal (causal) and on padded keys, and the heads' outputs concatenated times
Wo + bo. Rank r holds query heads ``r*h/N .. (r+1)*h/N - 1`` (Wq column-parallel; Wo
row-parallel over the same blocks) and the key/value heads they read: a block of them when
N divides ``kv_heads``, else (N a multiple of ``kv_heads``) the one head its queries
share, from replicated Wk, Wv read through ``copy_to_tp`` so that each rank's partial
gradient of the shared head is summed into the full gradient on every rank.

Heads never interact, so the communication is ``copy_to_tp`` of X (all_reduce of dX
backward), the output layer's all_reduce forward, and with shared key/value heads one
all_reduce of their weight gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.functional import rope, rotate, softmax
from fuelspmd.nn import Dropout, DropoutRNG, Linear, Module, weight_source
from fuelspmd.tensor import Tensor, tensor

from .layers import ColumnParallelLinear, RowParallelLinear, check_divides
from .mappings import copy_to_tp

__all__ = ["MASKED", "KVCache", "ParallelAttention", "causal_mask"]

MASKED = -1e9  # exp underflows to exactly 0 in float32 and float64


def causal_mask(seq: int) -> np.ndarray:
    """The additive (seq, seq) mask: 0 on and below the diagonal, ``MASKED`` above."""
    return np.triu(np.full((seq, seq), MASKED), k=1)


class KVCache(Protocol):
    """What :meth:`ParallelAttention.forward` needs of a KV cache for one layer and step
    (:meth:`fuelspmd.distributed_cache.PagedKVStore.view` gives one)."""

    def rotary(self, t: int, dim: int, base: float) -> tuple[Tensor, Tensor]:
        """cos and sin ``(batch, t, 1, dim)`` of the step's new tokens' positions."""
        ...

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
        """Store the new k, v ``(b, t, kv, d)``; attention of q ``(b, t, h, d)`` over each
        sequence's cached keys; ``(b, t, h, d)``."""
        ...


def _split_fused(full: Sequence[Any], q: int, kv: int) -> list[Any]:
    """(Wqkv, bqkv, Wo, bo) with [Q | K | V] columns -> the 8 arrays of the unfused form."""
    w, b = np.asarray(full[0]), None if full[1] is None else np.asarray(full[1])
    if w.ndim != 2 or w.shape[1] != q + 2 * kv:
        raise ShapeError(f"ParallelAttention: the fused qkv weight has shape {w.shape}, "
                         f"expected (hidden, {q + 2 * kv}) ([Q | K | V] columns)")
    cuts = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    out: list[Any] = []
    for lo, hi in cuts:
        out += [w[:, lo:hi], None if b is None else b[lo:hi]]
    return [*out, full[2], full[3]]


class ParallelAttention(Module):
    """Self-attention, heads split over ``comm``; see the module docstring.

    ``full=(Wq, bq, Wk, bk, Wv, bv, Wo, bo)`` or the fused ``(Wqkv, bqkv, Wo, bo)``
    (``[Q | K | V]`` columns, as GPT-2's ``c_attn``), biases None without bias; or ``seed=``
    (Wq, Wk, Wv, Wo drawn from ``[seed, 0..3]``) or ``empty=True``. ``scale`` defaults to
    1/sqrt(head_dim); ``rope_base`` turns on rotary position embeddings of q and k.
    ``head_dim`` defaults to hidden/heads; given, Q is ``heads * head_dim`` wide (as
    Llama configs with an explicit ``head_dim`` have it) and Wo maps that back to hidden.
    ``dropout``: on the attention probabilities in training mode (keyed by ``rng`` and
    ``layer``), not through a cache.
    """

    def __init__(self, hidden: int, heads: int, *, comm: Any, kv_heads: int | None = None,
                 bias: bool = True, causal: bool = True, scale: float | None = None,
                 rope_base: float | None = None, head_dim: int | None = None,
                 full: Sequence[Any] | None = None, seed: int | None = None,
                 empty: bool = False, dropout: float = 0.0, rng: DropoutRNG | None = None,
                 layer: int = 0,
                 device: Device | str | None = None, dtype: DType | str | Any = "float32"
                 ) -> None:
        weight_source("ParallelAttention", full, seed, empty)
        if head_dim is None and hidden % heads:
            raise ConfigError(f"ParallelAttention: hidden={hidden} is not divisible by "
                              f"heads={heads}; each head needs hidden/heads features (or "
                              "give head_dim=)")
        kv = heads if kv_heads is None else int(kv_heads)
        if kv < 1 or heads % kv:
            raise ConfigError(f"ParallelAttention: heads={heads} is not a multiple of "
                              f"kv_heads={kv}; give kv_heads dividing {heads}")
        n = comm.size
        self.local_heads = check_divides("ParallelAttention", "heads", heads, n)
        if kv % n and n % kv:
            raise ConfigError(f"ParallelAttention: kv_heads={kv} and the TP size {n}: one "
                              f"must divide the other (heads split, or each shared by "
                              f"{n}/kv_heads ranks); change kv_heads or the TP size")
        if full is not None and len(full) not in (4, 8):
            raise ConfigError(f"ParallelAttention: full= takes (Wq, bq, Wk, bk, Wv, bv, Wo, "
                              f"bo) or (Wqkv, bqkv, Wo, bo), got {len(full)} items")
        self.comm, self.heads, self.kv_heads = comm, heads, kv
        self.hidden = int(hidden)
        self.head_dim = d = hidden // heads if head_dim is None else int(head_dim)
        self.shared_kv = kv % n != 0  # each rank reads one replicated key/value head
        self.local_kv_heads = 1 if self.shared_kv else kv // n
        self.causal, self.rope_base = bool(causal), rope_base
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.dtype = as_dtype(dtype)
        if full is not None and len(full) == 4:
            full = _split_fused(full, heads * d, kv * d)
        s = 0 if seed is None else seed
        kw: dict[str, Any] = dict(bias=bias, device=comm.device if device is None else device,
                                  dtype=dtype, empty=empty)

        def part(i: int) -> dict[str, Any]:
            if full is not None:
                return {"full": (full[2 * i], full[2 * i + 1])}
            return {} if empty else {"seed": [s, i]}

        self.q = ColumnParallelLinear(hidden, heads * d, comm=comm, **kw, **part(0))
        if self.shared_kv:
            self.k, self.v = (Linear(hidden, kv * d, **kw, **part(i)) for i in (1, 2))
        else:
            self.k, self.v = (ColumnParallelLinear(hidden, kv * d, comm=comm, **kw, **part(i))
                              for i in (1, 2))
        self.out = RowParallelLinear(heads * d, hidden, comm=comm, input_is_parallel=True,
                                     **kw, **part(3))
        # on the probabilities (batch, heads, q, k): each rank its heads' block of the mask
        self.drop = Dropout(dropout, rng=rng, layer=layer, comm=comm, dim=1)
        self._masks: dict[int, Tensor] = {}

    @property
    def cache_heads(self) -> tuple[int, int]:
        """(key/value heads this rank stores, head_dim): the shape a KV store needs."""
        return self.local_kv_heads, self.head_dim

    def _kv(self, layer: Any, xc: Tensor) -> Tensor:
        if not self.shared_kv:
            return layer.local(xc)
        # rank r's queries read head r // (N / kv_heads); copy_to_tp sums the partial
        # gradients of the replicated weight over the ranks
        g = self.comm.rank // (self.comm.size // self.kv_heads)
        cols = slice(g * self.head_dim, (g + 1) * self.head_dim)
        y = xc @ copy_to_tp(layer.weight, comm=self.comm)[:, cols]
        return y if layer.bias is None else y + copy_to_tp(layer.bias, comm=self.comm)[cols]

    def forward(self, x: Tensor, *, mask: Any = None, positions: Any = None,
                cache: KVCache | None = None) -> Tensor:
        """Attention of ``x`` (batch, seq, hidden). ``mask``: (batch, seq) key padding,
        true/1 for a real token; ``positions``: (seq,) or (batch, seq) for the rotary
        embedding (default 0..seq-1); ``cache``: a :class:`KVCache` for this layer and step
        (it gives the positions and masks by sequence)."""
        h, d = self.local_heads, self.head_dim
        if x.ndim != 3 or x.shape[2] != self.hidden:
            raise ShapeError(f"ParallelAttention: input must be (batch, seq, "
                             f"{self.hidden}), got {x.shape}")
        if cache is not None and (mask is not None or positions is not None):
            raise ConfigError("ParallelAttention: with cache=, the cache gives positions and "
                              "masks; pass neither mask= nor positions=")
        b, t, _ = x.shape
        xc = copy_to_tp(x, comm=self.comm)  # one all_reduce backward for q, k and v
        q = self.q.local(xc).reshape(b, t, h, d)
        k, v = (self._kv(m, xc).reshape(b, t, self.local_kv_heads, d)
                for m in (self.k, self.v))
        if self.rope_base is not None and cache is not None:
            cos, sin = cache.rotary(t, d, self.rope_base)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        elif self.rope_base is not None:
            pos = np.arange(t) if positions is None else positions
            q, k = (rope(y, pos, base=self.rope_base) for y in (q, k))
        ctx = (cache.attend(q, k, v, scale=self.scale) if cache is not None else
               self._attend(q, k, v, mask))
        return self.out(ctx.reshape(b, t, h * d))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Any) -> Tensor:
        b, t, h, d = q.shape
        kvl = self.local_kv_heads

        def heads(y: Tensor) -> Tensor:  # (b, t, kvl, d) -> (b, h, t, d), each head repeated
            y = y.transpose(0, 2, 1, 3)
            if kvl == h:
                return y
            return y.reshape(b, kvl, 1, t, d).broadcast_to((b, kvl, h // kvl, t, d)
                                                           ).reshape(b, h, t, d)

        qh, kh, vh = q.transpose(0, 2, 1, 3), heads(k), heads(v)
        scores = (qh @ kh.transpose(0, 1, 3, 2)) * self.scale
        if self.causal:
            scores = scores + self._mask(t, q.device)
        if mask is not None:
            keep = np.asarray(mask.numpy() if isinstance(mask, Tensor) else mask)
            if keep.shape != (b, t):
                raise ShapeError(f"ParallelAttention: mask has shape {keep.shape}, expected "
                                 f"(batch, seq) = ({b}, {t}) with 1 for a real token")
            add = np.where(keep.astype(bool), 0.0, MASKED).reshape(b, 1, 1, t)
            scores = scores + tensor(add.astype(to_numpy(self.dtype)), device=q.device)
        p = self.drop(softmax(scores, -1))
        return (p @ vh).transpose(0, 2, 1, 3)

    def _mask(self, seq: int, device: Any) -> Tensor:
        m = self._masks.get(seq)
        if m is None:
            arr = causal_mask(seq).astype(to_numpy(self.dtype))
            m = self._masks[seq] = tensor(arr, device=device, dtype=self.dtype)
        return m
