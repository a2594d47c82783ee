"""Fixed-size KV cache blocks: reference counts, free lists, and the prefix-cache index.

Every block is in exactly one of three states, and the pool keeps one structure per state
so that invariant 7 of DESIGN.md (free + cached-evictable + in-use == total) is a count, not
a search:

* **in use**: ``ref_count > 0``; held by one or more sequences (several after a prefix hit
  or a fork).
* **cached-evictable**: ``ref_count == 0`` but the block still holds a full, named block of
  some earlier sequence. It waits in the *evictable* queue in least-recently-released order
  (head = evicted first); a prefix hit takes it back out from the middle ("touch").
* **free**: ``ref_count == 0`` and no name; its contents are garbage.

Allocation takes free blocks first (they are worth nothing) and only then evicts from the
head of the evictable queue, dropping the block's name. Both queues are intrusive doubly
linked lists through the blocks themselves, because a prefix hit must remove a block from
the middle of the LRU order in O(1); a ``deque`` would make that O(n).

A name is never trusted alone: each cached block stores the tokens and extra keys it was
filled from and the *entry* (a serial number, never reused) of the block before it in its
sequence. A hit on block ``i`` is confirmed only if the tokens and keys are equal and its
parent entry is one of the blocks confirmed at ``i - 1``, so by induction the whole prefix
equals the request's, whatever the hash function does.

Imports only the standard library, :mod:`fuelspmd.errors` and :mod:`.prefix`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType, TypeAlias

from fuelspmd.distributed_cache.prefix import BlockHash, ExtraKey
from fuelspmd.errors import CacheCapacityError, ConfigError

__all__ = [
    "Block",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
]

BlockId = NewType("BlockId", int)
"""Index of a block in the pool, ``0 <= id < num_blocks``; the storage layer's page index."""

_NO_ENTRY = -1


@dataclass(eq=False, slots=True)
class Block:
    """One KV cache block's bookkeeping; the keys and values live in the storage layer."""

    block_id: BlockId
    ref_count: int = 0
    block_hash: BlockHash | None = None
    tokens: tuple[int, ...] | None = None
    extra_keys: tuple[ExtraKey, ...] = ()
    entry: int = _NO_ENTRY
    parent_entry: int = _NO_ENTRY
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    queue: str | None = field(default=None, repr=False)

    @property
    def is_cached(self) -> bool:
        """Whether the block holds a named full block that a prefix hit may reuse."""
        return self.block_hash is not None


class BlockQueue:
    """Intrusive doubly linked list of blocks with O(1) push, pop and removal from the middle.

    Two sentinels bracket the list so no operation special-cases an empty queue or an end.
    Each block records which queue holds it (``Block.queue``), so a block can never be
    linked twice.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._head = Block(BlockId(-1))
        self._tail = Block(BlockId(-1))
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def _link(self, block: Block, before: Block) -> None:
        if block.queue is not None:
            raise RuntimeError(
                f"block {block.block_id} is already in the {block.queue} queue; "
                f"cannot also add it to {self.name}"
            )
        after = before.prev
        assert after is not None
        after.next = block
        block.prev = after
        block.next = before
        before.prev = block
        block.queue = self.name
        self._len += 1

    def append(self, block: Block) -> None:
        """Put ``block`` at the tail (taken last)."""
        self._link(block, self._tail)

    def appendleft(self, block: Block) -> None:
        """Put ``block`` at the head (taken first)."""
        first = self._head.next
        assert first is not None
        self._link(block, first)

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from wherever it sits."""
        if block.queue != self.name:
            raise RuntimeError(f"block {block.block_id} is not in the {self.name} queue")
        assert block.prev is not None and block.next is not None
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        block.queue = None
        self._len -= 1

    def popleft(self) -> Block:
        """Remove and return the head."""
        first = self._head.next
        if first is None or first is self._tail:
            raise RuntimeError(f"pop from the empty {self.name} queue")
        self.remove(first)
        return first

    def peek(self) -> Block | None:
        """The head, or None when empty."""
        first = self._head.next
        return None if first is self._tail else first


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Names that this cache now holds (each was absent before)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Names that this cache no longer holds (their last block was evicted)."""

    block_hashes: tuple[BlockHash, ...]


KVEvent: TypeAlias = BlockStored | BlockRemoved
"""What a replica publishes about its prefix cache; plain data, picklable."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each, and the prefix-cache index.

    The pool knows blocks, not sequences: the :class:`KVCacheManager` decides which blocks a
    sequence holds and tells the pool through :meth:`allocate`, :meth:`acquire`,
    :meth:`release` and :meth:`cache`. When ``record_events`` is set, every change in the
    set of names held is recorded as a :class:`BlockStored` / :class:`BlockRemoved` event
    for :meth:`take_events` (a replica publishes these to a :class:`PrefixRouter`).
    """

    def __init__(self, num_blocks: int, block_size: int, *, record_events: bool = False) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.record_events = record_events
        self.blocks: tuple[Block, ...] = tuple(Block(BlockId(i)) for i in range(num_blocks))
        self._free = BlockQueue("free")
        self._evictable = BlockQueue("evictable")
        for block in self.blocks:
            self._free.append(block)
        self._by_hash: dict[BlockHash, dict[BlockId, Block]] = {}
        self._by_entry: dict[int, Block] = {}
        self._next_entry = 0
        self._events: list[KVEvent] = []
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody holds: reusable by a prefix hit, reclaimable by eviction."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks with at least one holder."""
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        """Blocks carrying a name, held or not."""
        return len(self._by_entry)

    def evictable_order(self) -> list[BlockId]:
        """Evictable block ids, next to be evicted first."""
        return [b.block_id for b in self._evictable]

    def free_order(self) -> list[BlockId]:
        """Free block ids, next to be allocated first."""
        return [b.block_id for b in self._free]

    # ---- allocation and reference counts ------------------------------------------------

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks, free ones first, then evicting least recently released."""
        if n > self.num_available:
            raise CacheCapacityError(
                f"asked for {n} blocks but only {self.num_available} are available "
                f"({self.num_free} free, {self.num_evictable} cached-evictable, "
                f"{self.num_blocks} total); free sequences or build the pool with more blocks"
            )
        out: list[Block] = []
        for _ in range(n):
            if len(self._free):
                block = self._free.popleft()
            else:
                block = self._evictable.popleft()
                self._uncache(block)
                self.evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def acquire(self, block: Block) -> None:
        """Add a holder; a cached block nobody held leaves the evictable queue (touch)."""
        if block.ref_count == 0:
            if not block.is_cached:
                raise RuntimeError(f"block {block.block_id} is free; acquire only held or cached")
            self._evictable.remove(block)
        block.ref_count += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one holder of each block, in the order given.

        A block whose last holder leaves goes to the tail of the evictable queue if it is
        cached (so it is evicted after every block released before it) and to the free
        list otherwise. Callers pass a sequence's blocks last-first, so the tail of a
        prefix is evicted before its root: a child without its parent can never be hit.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(
                    f"block {block.block_id} released with ref_count {block.ref_count}"
                )
            block.ref_count -= 1
            if block.ref_count == 0:
                (self._evictable if block.is_cached else self._free).append(block)

    def evict(self, n: int) -> int:
        """Drop the names of up to ``n`` LRU evictable blocks; return how many."""
        done = 0
        while done < n and len(self._evictable):
            block = self._evictable.popleft()
            self._uncache(block)
            self._free.append(block)
            self.evictions += 1
            done += 1
        return done

    # ---- prefix cache -------------------------------------------------------------------

    def cache(
        self,
        block: Block,
        block_hash: BlockHash,
        tokens: tuple[int, ...],
        extra_keys: tuple[ExtraKey, ...],
        parent: Block | None,
    ) -> None:
        """Name a full, held block so later requests may hit it; ``parent`` is block i - 1."""
        if block.ref_count <= 0 or block.is_cached:
            raise RuntimeError(
                f"block {block.block_id} cannot be cached: ref_count {block.ref_count}, "
                f"name {block.block_hash}"
            )
        if len(tokens) != self.block_size:
            raise RuntimeError(f"caching a block of {len(tokens)} tokens, not {self.block_size}")
        if parent is not None and not parent.is_cached:
            raise RuntimeError(f"parent block {parent.block_id} of a cached block has no name")
        block.block_hash = block_hash
        block.tokens = tokens
        block.extra_keys = extra_keys
        block.parent_entry = _NO_ENTRY if parent is None else parent.entry
        block.entry = self._next_entry
        self._next_entry += 1
        self._by_entry[block.entry] = block
        holders = self._by_hash.setdefault(block_hash, {})
        holders[block.block_id] = block
        if len(holders) == 1:
            self._record(BlockStored((block_hash,)))

    def match_prefix(
        self,
        hashes: Sequence[BlockHash],
        block_tokens: Sequence[tuple[int, ...]],
        extra_keys: tuple[ExtraKey, ...],
    ) -> list[Block]:
        """The longest chain of cached blocks equal to the request's first full blocks.

        Level ``i`` keeps every candidate named ``hashes[i]`` whose tokens and keys equal
        the request's and whose parent entry was confirmed at level ``i - 1`` (several
        survive when identical blocks were cached twice). The chain returned is read back
        from the first survivor of the deepest level, so it is the same on every rank.
        Changes nothing.
        """
        confirmed: list[list[Block]] = []
        parents = {_NO_ENTRY}
        for block_hash, tokens in zip(hashes, block_tokens):
            level = [
                b
                for b in self._by_hash.get(block_hash, {}).values()
                if b.parent_entry in parents and b.tokens == tokens and b.extra_keys == extra_keys
            ]
            if not level:
                break
            confirmed.append(level)
            parents = {b.entry for b in level}
        chain: list[Block] = []
        if confirmed:
            block = confirmed[-1][0]
            chain.append(block)
            for _ in range(len(confirmed) - 1):
                block = self._by_entry[block.parent_entry]
                chain.append(block)
            chain.reverse()
        return chain

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        holders = self._by_hash[block.block_hash]
        del holders[block.block_id]
        if not holders:
            del self._by_hash[block.block_hash]
            self._record(BlockRemoved((block.block_hash,)))
        del self._by_entry[block.entry]
        block.block_hash = None
        block.tokens = None
        block.extra_keys = ()
        block.entry = block.parent_entry = _NO_ENTRY

    # ---- events -------------------------------------------------------------------------

    def _record(self, event: KVEvent) -> None:
        if not self.record_events:
            return
        last = self._events[-1] if self._events else None
        if type(last) is type(event):
            assert last is not None
            self._events[-1] = type(event)(last.block_hashes + event.block_hashes)
        else:
            self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """Return and clear the events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- invariant 7 --------------------------------------------------------------------

    def check_invariants(self, expected_refs: Mapping[BlockId, int] | None = None) -> None:
        """Verify every structural invariant exhaustively; RuntimeError names the first broken.

        ``expected_refs`` (block id -> live references, absent = 0), when given, must equal
        each block's reference count.
        """
        seen: dict[BlockId, str] = {}
        for queue in (self._free, self._evictable):
            count = 0
            prev = queue._head
            for block in queue:
                if block.prev is not prev or block.queue != queue.name:
                    raise RuntimeError(f"{queue.name} queue links broken at block {block.block_id}")
                if block.block_id in seen:
                    raise RuntimeError(
                        f"block {block.block_id} is in the {queue.name} queue and the "
                        f"{seen[block.block_id]} queue"
                    )
                seen[block.block_id] = queue.name
                if block.ref_count != 0:
                    raise RuntimeError(
                        f"block {block.block_id} in the {queue.name} queue has ref_count "
                        f"{block.ref_count}"
                    )
                if block.is_cached != (queue is self._evictable):
                    raise RuntimeError(
                        f"block {block.block_id} in the {queue.name} queue has name "
                        f"{block.block_hash}"
                    )
                prev = block
                count += 1
            if count != len(queue) or queue._tail.prev is not prev:
                raise RuntimeError(f"{queue.name} queue holds {count} blocks, counts {len(queue)}")
        in_use = 0
        for block in self.blocks:
            want = 0 if expected_refs is None else expected_refs.get(block.block_id, 0)
            if block.ref_count < 0 or (block.block_id not in seen) != (block.ref_count > 0):
                raise RuntimeError(
                    f"block {block.block_id} has ref_count {block.ref_count} but is in "
                    f"{seen.get(block.block_id, 'no')} queue"
                )
            if expected_refs is not None and block.ref_count != want:
                raise RuntimeError(
                    f"block {block.block_id} has ref_count {block.ref_count} but {want} "
                    "live references"
                )
            in_use += block.ref_count > 0
            if block.is_cached:
                assert block.block_hash is not None
                if self._by_hash.get(block.block_hash, {}).get(block.block_id) is not block:
                    raise RuntimeError(f"cached block {block.block_id} missing from the index")
                if self._by_entry.get(block.entry) is not block:
                    raise RuntimeError(f"cached block {block.block_id} missing from the entries")
                if block.tokens is None or len(block.tokens) != self.block_size:
                    raise RuntimeError(f"cached block {block.block_id} has no full token record")
        if self.num_free + self.num_evictable + in_use != self.num_blocks:
            raise RuntimeError(
                f"free {self.num_free} + evictable {self.num_evictable} + in use {in_use} "
                f"!= total {self.num_blocks}"
            )
        indexed = sum(len(h) for h in self._by_hash.values())
        if indexed != len(self._by_entry) or any(not h for h in self._by_hash.values()):
            raise RuntimeError(
                f"prefix index holds {indexed} blocks but {len(self._by_entry)} entries"
            )
        for block_hash, holders in self._by_hash.items():
            for block_id, block in holders.items():
                if block.block_id != block_id or block.block_hash != block_hash:
                    raise RuntimeError(f"prefix index entry {block_hash}:{block_id} is stale")
