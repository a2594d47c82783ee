"""Greedy generation through the paged, prefix-cached KV cache (:mod:`fuelspmd.distributed_cache`).

Each rank runs the same :class:`KVCacheManager` (checked by a :class:`KVCacheCoordinator`
over the model's TP communicator) and keeps the keys and values of its own heads in a
:class:`PagedKVStore`. Prefill computes only the part of a prompt the prefix cache does not
hold; decoding runs the whole batch one token per step, attention reading every sequence
through its block table. Sequence ``i * samples + s`` is sample ``s`` of prompt ``i``;
samples 1.. are forks of sample 0 after its prefill, sharing every block, so the first
token each appends to the shared partial block makes the manager return a copy-on-write
:class:`BlockCopy`, which the store carries out before the token's keys and values are
written.

The model is anything with ``comm`` (its TP communicator), ``kv_layout()`` (layers, key/
value heads this rank stores, head_dim, dtype) and ``step(tokens, *, starts, tables,
store)`` (the logits ``(batch, vocab)`` at the last of the new tokens): a
:class:`~fuelspmd.models.GPT2` or :class:`~fuelspmd.models.Llama`, or a hand-written model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from fuelspmd.distributed_cache import KVCacheCoordinator, KVCacheManager, PagedKVStore
from fuelspmd.dtypes import DType
from fuelspmd.errors import ConfigError
from fuelspmd.tensor import Tensor, realize

__all__ = ["Generation", "PagedModel", "greedy"]


class PagedModel(Protocol):
    comm: Any

    def kv_layout(self) -> tuple[int, int, int, DType]: ...

    def step(self, tokens: np.ndarray, *, starts: list[int], tables: list[list[int]],
             store: PagedKVStore) -> Tensor: ...


@dataclass
class Generation:
    """The tokens of every sequence and what the cache did to produce them."""

    tokens: list[list[int]]
    hit_rate: float
    prefill_tokens_computed: int
    blocks_used: int
    blocks_total: int
    copies: int
    ttft_s: float
    tokens_per_s: float


def greedy(model: PagedModel, prompts: list[list[int]], new_tokens: int, *,
           block_size: int = 16, samples: int = 1, prefix_caching: bool = True,
           check_every: int = 16, coordinate: Literal["check", "leader"] = "check",
           num_blocks: int | None = None) -> Generation:
    """Prefill every prompt (prefix-cached), fork its samples, then decode ``new_tokens``
    greedily; see the module docstring. ``num_blocks``: the pool's size (default: what
    the sequences need, plus one). Collective over ``model.comm``."""
    if new_tokens < 1 or samples < 1 or not prompts or min(map(len, prompts)) < 1:
        raise ConfigError(f"greedy: new_tokens={new_tokens}, samples={samples} and "
                          f"{len(prompts)} prompts: give at least one of each, and no "
                          "empty prompt")
    comm, k, bs = model.comm, samples, block_size
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // bs)
    need = len(prompts) * k * per_seq + 1
    manager = KVCacheManager(need if num_blocks is None else num_blocks, bs,
                             enable_prefix_caching=prefix_caching)
    coord = KVCacheCoordinator(manager, comm=comm, every=check_every, mode=coordinate)
    layers, kv_heads, head_dim, dtype = model.kv_layout()
    store = PagedKVStore(num_layers=layers, num_blocks=manager.pool.num_blocks,
                         block_size=bs, kv_heads=kv_heads, head_dim=head_dim,
                         device=comm.device, dtype=dtype)
    seqs = list(range(len(prompts) * k))
    out: list[list[int]] = [[] for _ in seqs]
    computed, ttft, peak = 0, [], 0
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):  # prefill: only what the cache does not hold
        hit = coord.allocate(i * k, prompt)
        computed += len(prompt) - hit
        logits = model.step(np.asarray([prompt[hit:]]), starts=[hit],
                            tables=[manager.block_table(i * k)], store=store)
        realize(logits, *store.tensors())
        first = int(np.argmax(logits.numpy()[0]))
        for s in range(k):
            if s:
                coord.fork(i * k, i * k + s)
            out[i * k + s].append(first)
        ttft.append(time.perf_counter() - t0)
        peak = max(peak, manager.pool.num_in_use)
    for _ in range(new_tokens - 1):  # decode: the whole batch, one token each
        last = [o[-1] for o in out]
        for q, tok in zip(seqs, last):
            store.copy(coord.append(q, [tok]))
        starts = [manager.num_tokens(q) - 1 for q in seqs]
        logits = model.step(np.asarray(last)[:, None], starts=starts,
                            tables=[manager.block_table(q) for q in seqs], store=store)
        realize(logits, *store.tensors())
        for q, row in zip(seqs, logits.numpy()):
            out[q].append(int(np.argmax(row)))
        peak = max(peak, manager.pool.num_in_use)
        coord.step()
    elapsed = time.perf_counter() - t0
    coord.check()
    stats = manager.stats()
    for q in seqs:
        coord.free(q)
    manager.check_invariants()
    return Generation(tokens=out, hit_rate=stats.hit_rate, prefill_tokens_computed=computed,
                      blocks_used=peak, blocks_total=stats.num_blocks, copies=stats.copies,
                      ttft_s=float(np.mean(ttft)),
                      tokens_per_s=len(seqs) * new_tokens / elapsed)
