"""KVCacheManager: which blocks each sequence holds, with prefix reuse and copy-on-write.

A sequence of ``n`` tokens holds a *block table*: ``ceil(n / block_size)`` block ids, token
``t`` living in slot ``t % block_size`` of block ``table[t // block_size]``. Every decision
here is a pure function of the calls made (no clock, no randomness, no ``hash()``), so
tensor-parallel ranks that make the same calls hold identical tables; :meth:`digest` lets a
coordinator check that cheaply.

Sharing rules:

* A *full* block is immutable once written, so any number of sequences may hold it: after
  a prefix-cache hit, or after :meth:`fork`.
* The last, *partial* block of a sequence is never named, so it is never a prefix hit. A
  fork shares it, and the first :meth:`append` to a sequence whose partial last block has
  other holders copies it (copy-on-write): the sequence gets a fresh block and the call
  returns :class:`BlockCopy` ``(src, dst, num_tokens)``, which the storage layer must carry
  out before writing the new tokens. The last holder writes in place, so a fork followed by
  appends to both sides costs exactly one copy.
* When prefix caching is on and a sequence's token ids are known, each block is named and
  indexed the moment it becomes full (at :meth:`allocate` for the prompt, at
  :meth:`append` later). Appending a count instead of ids makes the content unknown, and
  no later block of that sequence is named.

Preemption (vLLM's recompute policy). When the pool cannot hold a sequence's next tokens,
:meth:`make_room` preempts the *youngest* running sequences (the most recently allocated,
forked or resumed) until they fit: a preempted sequence releases its blocks but keeps its
token record, and :meth:`resume` later gives it blocks again, its tokens to be recomputed
except those the prefix cache still serves (its own full blocks, unless evicted since).
Unheld cached blocks are always taken before anything is preempted, because an allocation
takes free blocks, then evictable ones, and preemption starts only when both run short.
Preempting the youngest first means the oldest running sequence always makes progress, so
a workload whose every sequence fits the pool alone finishes. Resumption order is the
reverse of preemption order (the last preempted, the oldest of a batch, first).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from fuelspmd.distributed_cache.block_pool import Block, BlockId, BlockPool, KVEvent
from fuelspmd.distributed_cache.prefix import (
    BlockHash,
    ExtraKey,
    HashFn,
    encode_key,
    encode_tokens,
    hash_blocks,
    sha256_block_hash,
)
from fuelspmd.errors import CacheCapacityError, CacheUsageError

__all__ = ["BlockCopy", "CacheStats", "KVCacheManager", "SeqId"]

SeqId: TypeAlias = int | str
"""A sequence's name; int or str so that it encodes the same way on every rank."""


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the first ``num_tokens`` slots of block ``src`` into block ``dst``."""

    src: BlockId
    dst: BlockId
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the manager's counters; ``usage`` and ``hit_rate`` are fractions."""

    num_blocks: int
    block_size: int
    num_sequences: int
    in_use: int
    free: int
    evictable: int
    usage: float
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    evictions: int
    copies: int
    preempted: int
    preemptions: int


@dataclass(eq=False, slots=True)
class _Sequence:
    blocks: list[Block]
    num_tokens: int
    tokens: list[int] | None
    extra_keys: tuple[ExtraKey, ...]
    hashes: list[BlockHash]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _id_order(seq_id: SeqId) -> tuple[bool, SeqId]:
    """Sort key for mixed int and str ids: ints first."""
    return isinstance(seq_id, str), seq_id


class KVCacheManager:
    """Block tables for live sequences over one :class:`BlockPool`.

    ``hash_fn(parent, block_tokens, extra_keys) -> BlockHash`` names full blocks (default:
    SHA-256, see :mod:`.prefix`); it must be deterministic across processes. With
    ``record_events`` the pool records :class:`BlockStored`/:class:`BlockRemoved` events for
    :meth:`take_events`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
        record_events: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, record_events=record_events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn: HashFn = sha256_block_hash if hash_fn is None else hash_fn
        self._seqs: dict[SeqId, _Sequence] = {}  # running, oldest first (age order)
        self._preempted: dict[SeqId, _Sequence] = {}  # no blocks; in preemption order
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._copies = 0
        self._preemptions = 0

    # ---- queries ------------------------------------------------------------------------

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` is running (holds blocks); a preempted one is not."""
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether a new sequence of ``n_tokens`` fits whatever the prefix cache holds.

        Exact for a miss and never optimistic: a hit on a block someone holds saves one
        taken block, and a hit on an evictable block takes it out of the same supply.
        """
        return _ceil_div(n_tokens, self.block_size) <= self.pool.num_available

    def can_append(self, seq_id: SeqId, n_tokens: int) -> bool:
        """Whether :meth:`append` of ``n_tokens`` to ``seq_id`` fits without preempting."""
        grow, cow = self._append_need(self._get(seq_id), self._as_tokens(n_tokens)[1])
        return grow + cow <= self.pool.num_available

    def running(self) -> list[SeqId]:
        """Running sequences, oldest first: the last is the next to be preempted."""
        return list(self._seqs)

    def preempted(self) -> list[SeqId]:
        """Preempted sequences in the order to resume them (the last preempted first)."""
        return list(reversed(self._preempted))

    def block_table(self, seq_id: SeqId) -> list[BlockId]:
        """The block ids of ``seq_id``, in token order."""
        return [b.block_id for b in self._get(seq_id).blocks]

    def block_tables(self) -> dict[SeqId, list[BlockId]]:
        """Every live sequence's block table, in allocation order."""
        return {s: [b.block_id for b in q.blocks] for s, q in self._seqs.items()}

    def num_tokens(self, seq_id: SeqId) -> int:
        """How many tokens ``seq_id`` holds (a preempted one: how many it will recompute)."""
        seq = self._preempted.get(seq_id) if isinstance(seq_id, (int, str)) else None
        return (seq or self._get(seq_id)).num_tokens

    def stats(self) -> CacheStats:
        """Usage, prefix hit rate (hit prompt tokens / prompt tokens), evictions, copies,
        sequences preempted now and preemptions so far."""
        pool = self.pool
        return CacheStats(
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            num_sequences=len(self._seqs),
            in_use=pool.num_in_use,
            free=pool.num_free,
            evictable=pool.num_evictable,
            usage=pool.num_in_use / pool.num_blocks,
            prompt_tokens=self._prompt_tokens,
            hit_tokens=self._hit_tokens,
            hit_rate=self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            evictions=pool.evictions,
            copies=self._copies,
            preempted=len(self._preempted),
            preemptions=self._preemptions,
        )

    def sequence_digests(self) -> dict[SeqId, str]:
        """SHA-256 (hex) per sequence, running or preempted: its state, tokens and table."""
        out: dict[SeqId, str] = {}
        for state, seqs in ((0, self._seqs), (1, self._preempted)):
            for seq_id, seq in seqs.items():
                parts: list[bytes] = []
                encode_key(seq_id, parts)
                parts.append(encode_tokens([state, seq.num_tokens, len(seq.blocks),
                                            *(b.block_id for b in seq.blocks)]))
                out[seq_id] = hashlib.sha256(b"".join(parts)).hexdigest()
        return out

    def order_digest(self) -> str:
        """SHA-256 (hex) of the orders that decide later calls: the running sequences'
        ages (who is preempted next), the resumption order, the free and evictable queues."""
        parts: list[bytes] = []
        for seqs in (self.running(), self.preempted()):
            parts.append(encode_tokens([len(seqs)]))
            for seq_id in seqs:
                encode_key(seq_id, parts)
        for order in (self.pool.free_order(), self.pool.evictable_order()):
            parts.append(encode_tokens([len(order), *order]))
        return hashlib.sha256(b"".join(parts)).hexdigest()

    def digest(self) -> str:
        """SHA-256 (hex) of every sequence's digest (sorted by id) and the order digest.

        Identical on every rank that made the same calls; the orders are included because
        they decide every later allocation and preemption, so a divergence shows up before
        it reaches a block table.
        """
        seqs = self.sequence_digests()
        parts = [bytes.fromhex(seqs[s]) for s in sorted(seqs, key=_id_order)]
        parts.append(bytes.fromhex(self.order_digest()))
        return hashlib.sha256(b"".join(parts)).hexdigest()

    def take_events(self) -> list[KVEvent]:
        """The pool's recorded stored/removed events since the last call."""
        return self.pool.take_events()

    # ---- operations ---------------------------------------------------------------------

    def allocate(
        self,
        seq_id: SeqId,
        tokens: Sequence[int] | int,
        *,
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> int:
        """Give a new sequence blocks for its prompt; return how many tokens the cache served.

        The hit is the longest run of cached full blocks equal to the prompt's, capped so at
        least one prompt token is left to compute (its forward yields the first logits).
        ``tokens`` may be a count when the ids are unknown; such a prompt is never cached.
        Atomic: on error nothing changed.
        """
        self._check_new(seq_id, "allocate it")
        ids, n = self._as_tokens(tokens)
        extra = tuple(extra_keys)
        encode_key(extra, [])
        hit = self._admit(seq_id, ids, n, extra, f"new sequence {seq_id!r}")
        self._prompt_tokens += n
        self._hit_tokens += hit
        return hit

    def resume(self, seq_id: SeqId, tokens: Sequence[int] | int = ()) -> int:
        """Give preempted ``seq_id`` blocks again for its tokens plus ``tokens`` (those it
        was about to append); return how many tokens the cache served.

        The rest must be recomputed. The hit is capped as at :meth:`allocate`, and the
        sequence becomes the youngest. Atomic: on error nothing changed.
        """
        try:
            rec = self._preempted[seq_id]
        except (KeyError, TypeError):
            raise CacheUsageError(
                f"sequence {seq_id!r} is not preempted ({len(self._preempted)} are: "
                f"{self.preempted()[:4]}); resume only what make_room or preempt preempted"
            ) from None
        ids, k = self._as_tokens(tokens)
        known = None if rec.tokens is None or ids is None else rec.tokens + ids
        hit = self._admit(seq_id, known, rec.num_tokens + k, rec.extra_keys,
                          f"preempted sequence {seq_id!r}")
        del self._preempted[seq_id]
        return hit

    def append(self, seq_id: SeqId, tokens: Sequence[int] | int) -> list[BlockCopy]:
        """Grow ``seq_id`` by new tokens (ids, or a count); return the copies to perform first.

        The list is empty unless the sequence's partial last block has other holders (after
        a fork); then it holds one :class:`BlockCopy` into the sequence's new private block.
        Blocks that become full are named and cached. Atomic: on error nothing changed.
        """
        seq = self._get(seq_id)
        ids, k = self._as_tokens(tokens)
        if k == 0:
            return []
        filled = seq.num_tokens % self.block_size
        grow, cow = self._append_need(seq, k)
        if grow + cow > self.pool.num_available:
            raise self._capacity_error(f"sequence {seq_id!r}", k, 0, grow + cow)
        copies: list[BlockCopy] = []
        if cow:
            (dst,) = self.pool.allocate(1)
            src = seq.blocks[-1]
            self.pool.release([src])
            seq.blocks[-1] = dst
            copies.append(BlockCopy(src.block_id, dst.block_id, filled))
            self._copies += 1
        seq.blocks.extend(self.pool.allocate(grow))
        seq.num_tokens += k
        if ids is None or seq.tokens is None:
            seq.tokens = None
        else:
            seq.tokens.extend(ids)
            if self.enable_prefix_caching:
                self._cache_full_blocks(seq)
        return copies

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """Make ``child`` a copy of ``parent`` that shares all its blocks (no copy now).

        Full blocks stay shared for good; the shared partial last block, if any, is copied
        by whichever of the two appends first (see :meth:`append`).
        """
        seq = self._get(parent)
        self._check_new(child, f"fork {parent!r} into {child!r}")
        for block in seq.blocks:
            self.pool.acquire(block)
        self._seqs[child] = _Sequence(
            list(seq.blocks),
            seq.num_tokens,
            None if seq.tokens is None else list(seq.tokens),
            seq.extra_keys,
            list(seq.hashes),
        )

    def free(self, seq_id: SeqId) -> None:
        """Release every block of ``seq_id`` (or forget a preempted one); cached blocks stay
        reusable until evicted."""
        if isinstance(seq_id, (int, str)) and seq_id in self._preempted:
            del self._preempted[seq_id]
            return
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self.pool.release(seq.blocks[::-1])

    def preempt(self, seq_id: SeqId) -> None:
        """Release ``seq_id``'s blocks but keep its tokens, to recompute after :meth:`resume`.

        Its blocks are released last-first like :meth:`free`'s, so its named full blocks
        wait in the evictable queue and a resumption soon after hits them.
        """
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self.pool.release(seq.blocks[::-1])
        self._preempted[seq_id] = _Sequence([], seq.num_tokens, seq.tokens, seq.extra_keys, [])
        self._preemptions += 1

    def make_room(self, seq_id: SeqId, n_tokens: int) -> list[SeqId]:
        """Preempt the youngest sequences until ``n_tokens`` more fit ``seq_id``; return the
        preempted, youngest first (empty when the append fits already).

        ``seq_id`` itself is preempted when it is the youngest left and still does not fit;
        then it must not append. Raises :class:`CacheCapacityError`, changing nothing, when
        the sequence would need more blocks than the whole pool, which no preemption cures.
        """
        seq = self._get(seq_id)
        _, k = self._as_tokens(n_tokens)
        need = _ceil_div(seq.num_tokens + k, self.block_size)
        if need > self.pool.num_blocks:
            raise CacheCapacityError(
                f"sequence {seq_id!r} would hold {seq.num_tokens + k} tokens = {need} blocks "
                f"of {self.block_size}, more than all {self.pool.num_blocks} blocks of the "
                "pool, so no preemption makes room; build the manager with num_blocks >= "
                f"{need} or a larger block_size, or stop the sequence sooner")
        out: list[SeqId] = []
        while sum(self._append_need(seq, k)) > self.pool.num_available:
            youngest = next(reversed(self._seqs))
            self.preempt(youngest)
            out.append(youngest)
            if youngest == seq_id:
                break
        return out

    def evict(self, n: int) -> int:
        """Drop up to ``n`` least recently released cached blocks; return how many."""
        return self.pool.evict(n)

    # ---- invariant 7 --------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify invariant 7 and every table's shape exhaustively (RuntimeError on failure).

        free + cached-evictable + in-use == total; each block's reference count equals the
        number of block tables holding it; each table has ``ceil(tokens / block_size)``
        distinct blocks; named blocks are exactly the full blocks whose content is known,
        with the sequence's chain names; a partial last block is never named; a preempted
        sequence holds no block and is not running.
        """
        bs = self.block_size
        refs: dict[BlockId, int] = {}
        for seq_id, seq in self._preempted.items():
            if seq_id in self._seqs or seq.blocks or seq.hashes or (
                    seq.tokens is not None and len(seq.tokens) != seq.num_tokens):
                raise RuntimeError(f"preempted sequence {seq_id!r}: blocks {seq.blocks}, "
                                   f"running {seq_id in self._seqs}, or token record out of "
                                   "step")
        for seq_id, seq in self._seqs.items():
            ids = [b.block_id for b in seq.blocks]
            if len(ids) != _ceil_div(seq.num_tokens, bs) or len(set(ids)) != len(ids):
                raise RuntimeError(f"sequence {seq_id!r}: {seq.num_tokens} tokens in blocks {ids}")
            if seq.tokens is not None and len(seq.tokens) != seq.num_tokens:
                raise RuntimeError(f"sequence {seq_id!r}: token record out of step")
            full = seq.num_tokens // bs
            expect = 0
            if self.enable_prefix_caching:
                expect = full if seq.tokens is not None else min(len(seq.hashes), full)
            if len(seq.hashes) != expect:
                raise RuntimeError(
                    f"sequence {seq_id!r}: {len(seq.hashes)} names for {full} full blocks"
                )
            for i, block in enumerate(seq.blocks):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                want = seq.hashes[i] if i < len(seq.hashes) else None
                if block.block_hash != want:
                    raise RuntimeError(
                        f"sequence {seq_id!r} block {i} (id {block.block_id}) is named "
                        f"{block.block_hash}, expected {want}"
                    )
        self.pool.check_invariants(refs)

    # ---- helpers ------------------------------------------------------------------------

    def _check_new(self, seq_id: SeqId, verb: str) -> None:
        if not isinstance(seq_id, (int, str)) or isinstance(seq_id, bool):
            raise CacheUsageError(f"sequence ids are int or str, got {seq_id!r}; use one of those")
        for seqs, state in ((self._seqs, "allocated"), (self._preempted, "preempted")):
            if seq_id in seqs:
                raise CacheUsageError(
                    f"cannot {verb}: sequence {seq_id!r} is already {state} "
                    f"({seqs[seq_id].num_tokens} tokens); free it first or pick a new id")

    def _admit(self, seq_id: SeqId, ids: list[int] | None, n: int,
               extra: tuple[ExtraKey, ...], what: str) -> int:
        """Blocks for ``n`` tokens with prefix reuse; the sequence becomes the youngest."""
        bs = self.block_size
        hashes: list[BlockHash] = []
        block_tokens: list[tuple[int, ...]] = []
        hit: list[Block] = []
        if self.enable_prefix_caching and ids is not None:
            hashes = hash_blocks(ids, bs, extra_keys=extra, hash_fn=self.hash_fn)
            block_tokens = [tuple(ids[i * bs : (i + 1) * bs]) for i in range(len(hashes))]
            usable = max(n - 1, 0) // bs
            hit = self.pool.match_prefix(hashes[:usable], block_tokens[:usable], extra)
        n_new = _ceil_div(n, bs) - len(hit)
        taken = n_new + sum(1 for b in hit if b.ref_count == 0)
        if taken > self.pool.num_available:
            raise self._capacity_error(what, n, len(hit) * bs, taken)
        for block in hit:
            self.pool.acquire(block)
        blocks = hit + self.pool.allocate(n_new)
        for i in range(len(hit), len(hashes)):
            parent = blocks[i - 1] if i else None
            self.pool.cache(blocks[i], hashes[i], block_tokens[i], extra, parent)
        self._seqs[seq_id] = _Sequence(blocks, n, ids, extra, hashes)
        return len(hit) * bs

    def _append_need(self, seq: _Sequence, k: int) -> tuple[int, int]:
        """(new blocks, copy-on-write blocks) that appending ``k`` tokens to ``seq`` takes."""
        if k == 0:
            return 0, 0
        filled = seq.num_tokens % self.block_size
        cow = int(filled != 0 and seq.blocks[-1].ref_count > 1)
        return _ceil_div(seq.num_tokens + k, self.block_size) - len(seq.blocks), cow

    def _get(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            if isinstance(seq_id, (int, str)) and seq_id in self._preempted:
                raise CacheUsageError(
                    f"sequence {seq_id!r} is preempted (it holds no blocks); resume it first"
                ) from None
            raise CacheUsageError(
                f"sequence {seq_id!r} is not allocated: it was freed already or never "
                f"allocated ({len(self._seqs)} live sequences); allocate it first"
            ) from None

    @staticmethod
    def _as_tokens(tokens: Sequence[int] | int) -> tuple[list[int] | None, int]:
        """Token ids as a list of ints (numpy ints welcome, floats refused), or a count."""
        if isinstance(tokens, bool):
            raise CacheUsageError(f"expected token ids or a token count, got {tokens!r}")
        if not hasattr(tokens, "__len__"):
            try:
                count = operator.index(tokens)
            except TypeError:
                raise CacheUsageError(
                    f"expected token ids or a token count, got {type(tokens).__name__}"
                ) from None
            if count < 0:
                raise CacheUsageError(f"token count must be >= 0, got {count}")
            return None, count
        try:
            ids = [operator.index(t) for t in tokens]
        except TypeError:
            bad = [t for t in tokens if not hasattr(t, "__index__")][:3]
            raise CacheUsageError(
                f"token ids must be integers, got {bad!r}: pass token ids, not text or floats"
            ) from None
        encode_tokens(ids)
        return ids, len(ids)

    def _cache_full_blocks(self, seq: _Sequence) -> None:
        bs = self.block_size
        assert seq.tokens is not None
        for i in range(len(seq.hashes), seq.num_tokens // bs):
            block_tokens = tuple(seq.tokens[i * bs : (i + 1) * bs])
            parent_hash = seq.hashes[-1] if seq.hashes else None
            name = self.hash_fn(parent_hash, block_tokens, seq.extra_keys)
            parent = seq.blocks[i - 1] if i else None
            self.pool.cache(seq.blocks[i], name, block_tokens, seq.extra_keys, parent)
            seq.hashes.append(name)

    def _capacity_error(self, what: str, n_tokens: int, hit: int, taken: int) -> CacheCapacityError:
        pool = self.pool
        lack = taken - pool.num_available
        fix = (
            f"build the manager with num_blocks >= {pool.num_in_use + taken}"
            f" (now {pool.num_blocks}), shorten the prompt, or free some of the "
            f"{len(self._seqs)} live sequences"
        )
        if taken > pool.num_blocks:
            fix = (
                f"this request alone needs more than all {pool.num_blocks} blocks: build the "
                f"manager with num_blocks >= {taken} or a larger block_size, or shorten the prompt"
            )
        return CacheCapacityError(
            f"{what} needs {taken} more blocks ({n_tokens} tokens at block_size "
            f"{self.block_size}, {hit} served from the prefix cache) but only "
            f"{pool.num_available} can be taken ({pool.num_free} free + {pool.num_evictable} "
            f"cached-evictable; {pool.num_in_use} of {pool.num_blocks} total in use), "
            f"{lack} short. Fix: {fix}."
        )
