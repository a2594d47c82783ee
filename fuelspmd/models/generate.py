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

Scheduling, as vLLM's: each round first admits waiting sequences in order while the pool
holds them (preempted ones first, in the manager's resumption order, then new prompts) and
prefills them, in steps that batch consecutive sequences with the same number of uncached
tokens while their tokens total at most ``max_batch_tokens`` (a step takes at least one);
then one decode step runs every running sequence, oldest first. A sequence whose next token
does not fit makes the manager preempt the youngest (:meth:`KVCacheManager.make_room`);
those are younger than it, so none has appended in this step. A preempted sequence resumes
with its prompt and generated tokens, and the part the cache no longer serves is
recomputed in one prefill whose logits give its next token, so the tokens are the ones an
unpreempted run gives. A finished sequence is freed at once. A sequence is allocated at
most one prefill step before its own, and every admitted one is computed before any decode
step, so no block named at allocation is read before it is written: a later
sequence that hits an earlier one's blocks is in the same prefill step or a later one, and
a step writes its keys and values before attention reads any.

The model is anything with ``comm`` (its TP communicator), ``kv_layout()`` (layers, key/
value heads this rank stores, head_dim, dtype) and ``step(tokens, *, starts, tables,
store, compiled)`` (the logits ``(batch, vocab)`` at the last of the new tokens; a model
that never compiles ignores ``compiled``): a
:class:`~fuelspmd.models.GPT2` or :class:`~fuelspmd.models.Llama`, or a hand-written model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from fuelspmd.distributed_cache import KVCacheCoordinator, KVCacheManager, PagedKVStore
from fuelspmd.dtypes import DType
from fuelspmd.errors import CacheCapacityError, ConfigError
from fuelspmd.tensor import Tensor, realize

__all__ = ["Generation", "PagedModel", "greedy"]


class PagedModel(Protocol):
    comm: Any

    def kv_layout(self) -> tuple[int, int, int, DType]: ...

    def step(self, tokens: np.ndarray, *, starts: list[int], tables: list[list[int]],
             store: PagedKVStore, compiled: bool = True) -> Tensor: ...


@dataclass
class Generation:
    """The tokens of every sequence and what the cache did to produce them.

    ``recomputed_tokens``: tokens computed again after preemptions (each resumption's
    prefill also computes the token its sequence was about to decode). Per prompt, in
    order: ``first_token_s``, the time from the start to its first token (``ttft_s`` is
    their mean), and ``first_token_work``, the tokens every step had computed by then (what
    that time would be in proportion to, were a step's cost its token count).
    ``decode_step_s``: the seconds of each decode step, its tokens read back included.
    """

    tokens: list[list[int]]
    hit_rate: float
    prefill_tokens_computed: int
    blocks_used: int
    blocks_total: int
    copies: int
    ttft_s: float
    tokens_per_s: float
    preemptions: int
    recomputed_tokens: int
    first_token_s: list[float]
    first_token_work: list[int]
    decode_step_s: list[float]


def greedy(model: PagedModel, prompts: list[list[int]], new_tokens: int, *,
           block_size: int = 16, samples: int = 1, prefix_caching: bool = True,
           check_every: int = 16, coordinate: Literal["check", "leader"] = "check",
           num_blocks: int | None = None, max_batch_tokens: int = 512,
           compiled: bool = True) -> Generation:
    """Prefill every prompt (prefix-cached), fork its samples, then decode ``new_tokens``
    greedily, preempting and recomputing when ``num_blocks`` (default: what every sequence
    needs at once) runs short; a prefill step takes at most ``max_batch_tokens`` tokens
    (and at least one sequence); ``compiled``: decode steps replay a compiled step
    (``fs.compile``) or build their graph each time (the same tokens). See the module
    docstring. Collective over ``model.comm``."""
    if new_tokens < 1 or samples < 1 or not prompts or min(map(len, prompts)) < 1:
        raise ConfigError(f"greedy: new_tokens={new_tokens}, samples={samples} and "
                          f"{len(prompts)} prompts: give at least one of each, and no "
                          "empty prompt")
    if max_batch_tokens < 1:
        raise ConfigError(f"greedy: max_batch_tokens={max_batch_tokens}: give at least 1 "
                          "(1 prefills one sequence per step)")
    comm, k, bs = model.comm, samples, block_size
    longest = max(map(len, prompts)) + new_tokens - 1  # the last token is never cached
    if num_blocks is None:
        num_blocks = len(prompts) * k * -(-(longest + 1) // bs) + 1
    elif -(-longest // bs) > num_blocks:
        raise CacheCapacityError(
            f"greedy: a sequence grows to {longest} tokens = {-(-longest // bs)} blocks of "
            f"{bs}, more than num_blocks={num_blocks}; give num_blocks >= "
            f"{-(-longest // bs)}, a larger block_size, or fewer new_tokens")
    manager = KVCacheManager(num_blocks, bs, enable_prefix_caching=prefix_caching)
    coord = KVCacheCoordinator(manager, comm=comm, every=check_every, mode=coordinate)
    layers, kv_heads, head_dim, dtype = model.kv_layout()
    store = PagedKVStore(num_layers=layers, num_blocks=manager.pool.num_blocks,
                         block_size=bs, kv_heads=kv_heads, head_dim=head_dim,
                         device=comm.device, dtype=dtype)
    total = len(prompts) * k
    out: list[list[int]] = [[] for _ in range(total)]
    computed = recomputed = peak = work = 0
    ttft: list[float] = []
    ttft_work: list[int] = []
    new_prompts = list(range(len(prompts)))[::-1]  # popped from the end: prompt 0 first
    t0 = time.perf_counter()
    steps: list[float] = []

    def run(seqs: list[int], tokens: list[list[int]], starts: list[int]) -> list[int]:
        nonlocal peak, work
        work += sum(map(len, tokens))
        logits = model.step(np.asarray(tokens), starts=starts,
                            tables=[manager.block_table(q) for q in seqs], store=store,
                            compiled=compiled)
        realize(logits, *store.tensors())
        peak = max(peak, manager.pool.num_in_use)
        return logits.numpy().argmax(axis=1).tolist()

    def finish(q: int, token: int) -> None:
        out[q].append(token)
        if len(out[q]) == new_tokens:
            coord.free(q)

    def admit() -> tuple[int, list[int], int, bool]:
        """Allocate (or resume) the next waiting sequence: (seq, uncached tokens, start,
        whether it is a new prompt); CacheCapacityError, changing nothing, if it does not fit."""
        nonlocal computed, recomputed
        if manager.preempted():
            q = manager.preempted()[0]
            full = prompts[q // k] + out[q]
            hit = coord.resume(q, out[q][-1:])
            recomputed += len(full) - 1 - hit  # the last was never computed: it is new
        else:
            q = new_prompts[-1] * k
            full = prompts[q // k]
            hit = coord.allocate(q, full)
            new_prompts.pop()
            computed += len(full) - hit
        return q, full[hit:], hit, not out[q]

    def prefill(batch: list[tuple[int, list[int], int, bool]]) -> None:
        firsts = run([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
        for (q, _, _, fresh), tok in zip(batch, firsts):
            if fresh:
                ttft.append(time.perf_counter() - t0)
                ttft_work.append(work)
                for s in range(1, k):
                    coord.fork(q, q + s)
                    finish(q + s, tok)
            finish(q, tok)

    while manager.running() or manager.preempted() or new_prompts:
        batch: list[tuple[int, list[int], int, bool]] = []
        admitted = False
        while manager.preempted() or new_prompts:  # first come first served, while they fit
            try:
                item = admit()
            except CacheCapacityError:
                break
            admitted = True
            t = len(batch[0][1]) if batch else 0
            if batch and (len(item[1]) != t or (len(batch) + 1) * t > max_batch_tokens):
                prefill(batch)  # the new one is allocated and goes first in the next step
                batch = []
            batch.append(item)
        if batch:
            prefill(batch)
        seqs: list[int] = []
        for q in manager.running():  # decode: oldest first, so preemption takes the unstepped
            if q not in manager:  # preempted for an older one, with all younger than it
                break
            if not manager.can_append(q, 1):
                gone = coord.make_room(q, 1)
                assert not set(gone) & set(seqs), "preempted a sequence that already appended"
                if q in gone:
                    break
            store.copy(coord.append(q, out[q][-1:]))
            seqs.append(q)
        if not seqs:
            if not admitted:  # nothing fits and nothing runs: the sizing check is wrong
                raise RuntimeError(f"greedy: no sequence could run in a pool of {num_blocks} "
                                   f"blocks ({len(manager.preempted())} preempted, "
                                   f"{len(new_prompts)} prompts waiting)")
            continue
        t1 = time.perf_counter()
        nexts = run(seqs, [out[q][-1:] for q in seqs],
                    [manager.num_tokens(q) - 1 for q in seqs])
        steps.append(time.perf_counter() - t1)
        for q, tok in zip(seqs, nexts):
            finish(q, tok)
        coord.step()
    elapsed = time.perf_counter() - t0
    coord.check()
    stats = manager.stats()
    manager.check_invariants()
    return Generation(tokens=out, hit_rate=stats.hit_rate, prefill_tokens_computed=computed,
                      blocks_used=peak, blocks_total=stats.num_blocks, copies=stats.copies,
                      ttft_s=float(np.mean(ttft)), tokens_per_s=total * new_tokens / elapsed,
                      preemptions=stats.preemptions, recomputed_tokens=recomputed,
                      first_token_s=ttft, first_token_work=ttft_work, decode_step_s=steps)
