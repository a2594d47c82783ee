"""Distributed KV cache: block bookkeeping (pure policy), prefix caching, replica routing.

Layer 7, but the bookkeeping here imports only :mod:`fuelspmd.errors` and the standard
library: no tensors, no transport. Every decision is a deterministic function of the calls
made, so ranks that make the same calls hold the same block tables
(:meth:`KVCacheManager.digest` checks that) and tests run in one process.

* :class:`BlockPool` — blocks, reference counts, free and LRU-evictable queues, the
  prefix-cache index.
* :mod:`.prefix` — the cross-process hash chain that names full blocks.
* :class:`KVCacheManager` — per-sequence block tables: allocate with prefix reuse, append,
  fork with copy-on-write, free, stats, digest, invariant 7.
* :class:`PrefixRouter` — data-parallel request routing by cached prefix and load.
* :class:`KVCacheCoordinator` — digest checks (or leader broadcast) so TP ranks agree.
* :class:`PagedKVStore` — the pages themselves, as lazy tensors (imports the Tensor front).
"""

from __future__ import annotations

from fuelspmd.distributed_cache.block_pool import (
    Block,
    BlockId,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from fuelspmd.distributed_cache.coordinator import CacheDivergenceError, KVCacheCoordinator
from fuelspmd.distributed_cache.manager import BlockCopy, CacheStats, KVCacheManager, SeqId
from fuelspmd.distributed_cache.prefix import (
    BlockHash,
    ExtraKey,
    HashFn,
    hash_blocks,
    sha256_block_hash,
)
from fuelspmd.distributed_cache.router import PrefixRouter, Route
from fuelspmd.distributed_cache.store import PagedKVStore

__all__ = [
    "Block",
    "BlockCopy",
    "BlockHash",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheDivergenceError",
    "CacheStats",
    "ExtraKey",
    "HashFn",
    "KVCacheCoordinator",
    "KVCacheManager",
    "KVEvent",
    "PagedKVStore",
    "PrefixRouter",
    "Route",
    "SeqId",
    "hash_blocks",
    "sha256_block_hash",
]
