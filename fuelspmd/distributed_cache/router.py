"""PrefixRouter: send each request to the data-parallel replica that already caches its prefix.

Each replica runs its own :class:`KVCacheManager` (built with ``record_events=True``) and
publishes the :class:`BlockStored` / :class:`BlockRemoved` events it takes from it; how the
events travel (a transport, a queue, a function call) is not the router's business. The
router keeps one global index, block name -> replicas holding it, and for a request walks
the request's hash chain: replica ``r`` has matched ``i`` blocks if it holds the first ``i``
names. Names are the same chain hashes the managers compute, so router and replicas must
share ``block_size``, ``hash_fn`` and the request's ``extra_keys``.

Choice: ``score(r) = matched_tokens(r) - load_penalty * load(r)``; the highest score wins,
ties go to the least loaded replica, and remaining ties to the first replica after the
previous choice in round-robin order. Routing a request adds one to the chosen replica's
load until :meth:`finish`, so a burst of misses spreads over all replicas, and a hot prefix
stays on its replica only until the load there outweighs the prefill it saves. The index
is a hint: a replica confirms every hit itself, so a stale or colliding name costs only a
worse placement.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from fuelspmd.distributed_cache.block_pool import BlockRemoved, BlockStored, KVEvent
from fuelspmd.distributed_cache.prefix import (
    BlockHash,
    ExtraKey,
    HashFn,
    hash_blocks,
    sha256_block_hash,
)
from fuelspmd.errors import CacheUsageError, ConfigError

__all__ = ["PrefixRouter", "Route"]


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request went: the replica, its cached prefix there in tokens, and its score."""

    replica: Hashable
    matched_tokens: int
    score: float


class PrefixRouter:
    """Global prefix index over data-parallel replicas, routing by cached prefix and load.

    ``replicas`` is a count (replicas are then named ``0 .. n-1``) or a sequence of distinct
    names. ``load_penalty`` is how many cached prefix tokens one in-flight request is worth
    (default ``4 * block_size``).
    """

    def __init__(
        self,
        replicas: int | Sequence[Hashable],
        *,
        block_size: int,
        hash_fn: HashFn | None = None,
        load_penalty: float | None = None,
    ) -> None:
        names = list(range(replicas)) if isinstance(replicas, int) else list(replicas)
        if not names or len(set(names)) != len(names):
            raise ConfigError(
                f"PrefixRouter needs at least one replica, each named once; got {replicas!r}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.replicas: tuple[Hashable, ...] = tuple(names)
        self.block_size = block_size
        self.hash_fn: HashFn = sha256_block_hash if hash_fn is None else hash_fn
        self.load_penalty = float(4 * block_size if load_penalty is None else load_penalty)
        if self.load_penalty < 0:
            raise ConfigError(f"load_penalty must be >= 0, got {load_penalty}")
        self._index_of = {name: i for i, name in enumerate(names)}
        self._holders: dict[BlockHash, set[int]] = {}
        self._held = [0] * len(names)
        self._load = [0.0] * len(names)
        self._next = 0

    def _replica(self, replica: Hashable) -> int:
        try:
            return self._index_of[replica]
        except (KeyError, TypeError):
            raise CacheUsageError(
                f"unknown replica {replica!r}; the router knows {list(self.replicas)}"
            ) from None

    def apply(self, replica: Hashable, events: Iterable[KVEvent]) -> None:
        """Update the index with events a replica published, in the order it recorded them."""
        r = self._replica(replica)
        for event in events:
            if isinstance(event, BlockStored):
                for name in event.block_hashes:
                    holders = self._holders.setdefault(name, set())
                    if r not in holders:
                        holders.add(r)
                        self._held[r] += 1
            elif isinstance(event, BlockRemoved):
                for name in event.block_hashes:
                    holders = self._holders.get(name)
                    if holders is not None and r in holders:
                        holders.discard(r)
                        self._held[r] -= 1
                        if not holders:
                            del self._holders[name]
            else:
                raise CacheUsageError(f"not a KV cache event: {event!r}; pass the events a "
                                      "KVCacheManager reports")

    def num_held(self, replica: Hashable) -> int:
        """How many block names the index says ``replica`` holds."""
        return self._held[self._replica(replica)]

    def load(self, replica: Hashable) -> float:
        """The load the router counts for ``replica``."""
        return self._load[self._replica(replica)]

    def matched_tokens(
        self, tokens: Sequence[int], *, extra_keys: tuple[ExtraKey, ...] = ()
    ) -> dict[Hashable, int]:
        """Cached prefix length, in tokens, that each replica would serve for ``tokens``.

        Capped like :meth:`KVCacheManager.allocate`: at least one token is left to compute.
        """
        usable = max(len(tokens) - 1, 0) // self.block_size
        names = hash_blocks(
            tokens,
            self.block_size,
            extra_keys=tuple(extra_keys),
            hash_fn=self.hash_fn,
            max_blocks=usable,
        )
        matched = [0] * len(self.replicas)
        alive = set(range(len(self.replicas)))
        for depth, name in enumerate(names, start=1):
            alive &= self._holders.get(name, set())
            if not alive:
                break
            for r in alive:
                matched[r] = depth * self.block_size
        return {self.replicas[r]: m for r, m in enumerate(matched)}

    def route(self, tokens: Sequence[int], *, extra_keys: tuple[ExtraKey, ...] = ()) -> Route:
        """Choose a replica for a new request and count it as load there until :meth:`finish`."""
        matched = list(self.matched_tokens(tokens, extra_keys=extra_keys).values())
        n = len(self.replicas)
        order = [(self._next + i) % n for i in range(n)]
        best = max(
            order,
            key=lambda r: (matched[r] - self.load_penalty * self._load[r], -self._load[r]),
        )
        self._load[best] += 1.0
        self._next = (best + 1) % n
        score = matched[best] - self.load_penalty * (self._load[best] - 1.0)
        return Route(self.replicas[best], matched[best], score)

    def finish(self, replica: Hashable) -> None:
        """A request routed to ``replica`` has completed: take its load back."""
        r = self._replica(replica)
        if self._load[r] < 1.0:
            raise CacheUsageError(
                f"finish({replica!r}) without a routed request in flight there "
                f"(load {self._load[r]})"
            )
        self._load[r] -= 1.0

    def report_load(self, replica: Hashable, load: float) -> None:
        """Replace the load counted for ``replica`` with a measured one (e.g. queued requests)."""
        if load < 0:
            raise CacheUsageError(f"load must be >= 0, got {load} for replica {replica!r}")
        self._load[self._replica(replica)] = float(load)
