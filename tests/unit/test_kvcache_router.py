"""PrefixRouter against real KVCacheManagers, one per replica, exchanging their events."""

from __future__ import annotations

from collections import Counter

import pytest

from fuelspmd.distributed_cache import BlockStored, KVCacheManager, PrefixRouter, hash_blocks
from fuelspmd.errors import CacheUsageError, ConfigError

BS = 4


class Fleet:
    """Replicas, each a manager, whose events reach the router after every request."""

    def __init__(self, n: int, *, load_penalty: float | None = None) -> None:
        self.managers = {f"r{i}": KVCacheManager(64, BS, record_events=True) for i in range(n)}
        self.router = PrefixRouter(list(self.managers), block_size=BS, load_penalty=load_penalty)
        self.count = 0

    def submit(self, tokens: list[int], extra: tuple = ()) -> tuple[str, int, int]:
        route = self.router.route(tokens, extra_keys=extra)
        replica = str(route.replica)
        mgr = self.managers[replica]
        served = mgr.allocate(self.count, tokens, extra_keys=extra)
        self.count += 1
        self.router.apply(replica, mgr.take_events())
        return replica, route.matched_tokens, served


def test_misses_spread_evenly_with_and_without_finish() -> None:
    router = PrefixRouter(4, block_size=BS)
    held = Counter(router.route([i, i + 1, i + 2]).replica for i in range(100))
    assert held == {0: 25, 1: 25, 2: 25, 3: 25}
    router = PrefixRouter(3, block_size=BS)
    seen = []
    for i in range(30):
        route = router.route([i] * 9)
        seen.append(route.replica)
        router.finish(route.replica)
    assert Counter(seen) == {0: 10, 1: 10, 2: 10}
    assert seen[:3] == [0, 1, 2]


def test_requests_follow_their_cached_prefix_and_the_manager_agrees() -> None:
    fleet = Fleet(3)
    system = list(range(1000, 1016))  # 4 full blocks
    first, matched, served = fleet.submit([*system, 1, 2])
    assert matched == served == 0
    fleet.router.finish(first)
    for tail in ([3], [4, 5], [6, 7, 8]):
        replica, matched, served = fleet.submit([*system, *tail])
        fleet.router.finish(replica)
        assert replica == first
        assert matched == served == 16  # the router's estimate is what the replica serves
    other, matched, _ = fleet.submit([7, 7, 7, 7, 7, 7])
    assert other != first and matched == 0


def test_load_outweighs_a_prefix_only_past_the_penalty() -> None:
    fleet = Fleet(2, load_penalty=8.0)  # one in-flight request is worth 8 cached tokens
    system = list(range(50, 66))  # 16 tokens = 4 blocks
    home, _, _ = fleet.submit([*system, 0])  # load home 1, other 0
    placements = [fleet.submit([*system, i])[0] for i in range(1, 5)]
    # home scores 16 - 8 * load; the other replica 0 until it also caches the prefix
    assert placements[0] == home  # 16 - 8 = 8 > 0
    assert placements[1] != home  # 16 - 16 = 0 ties 0 - 0: the least loaded wins
    assert fleet.router.matched_tokens([*system, 9]) == {"r0": 16, "r1": 16}


def test_evicted_blocks_leave_the_index() -> None:
    fleet = Fleet(2)
    prompt = list(range(9))
    replica, _, _ = fleet.submit(prompt)
    assert fleet.router.num_held(replica) == 2
    mgr = fleet.managers[replica]
    mgr.free(0)
    mgr.evict(1)  # the tail block goes first; the root is still held
    fleet.router.apply(replica, mgr.take_events())
    assert fleet.router.num_held(replica) == 1
    assert fleet.router.matched_tokens(prompt)[replica] == 4
    mgr.evict(1)
    fleet.router.apply(replica, mgr.take_events())
    assert fleet.router.matched_tokens(prompt) == {"r0": 0, "r1": 0}


def test_extra_keys_are_part_of_the_route() -> None:
    fleet = Fleet(2)
    prompt = list(range(20))
    home, _, _ = fleet.submit(prompt, ("lora-a",))
    assert fleet.router.matched_tokens(prompt, extra_keys=("lora-a",))[home] == 16
    assert fleet.router.matched_tokens(prompt, extra_keys=("lora-b",))[home] == 0
    assert fleet.router.matched_tokens(prompt)[home] == 0


def test_ties_go_to_the_least_loaded_then_round_robin() -> None:
    router = PrefixRouter(["a", "b", "c"], block_size=BS)
    router.report_load("a", 2)
    router.report_load("b", 1)
    router.report_load("c", 3)
    assert router.route([1]).replica == "b"
    router.apply("c", [BlockStored(tuple(hash_blocks(list(range(40)), BS)))])
    router.report_load("c", 0)
    route = router.route(list(range(41)))
    assert (route.replica, route.matched_tokens) == ("c", 40)
    assert route.score == 40.0


def test_router_mistakes_raise() -> None:
    with pytest.raises(ConfigError):
        PrefixRouter(0, block_size=BS)
    with pytest.raises(ConfigError):
        PrefixRouter(["x", "x"], block_size=BS)
    with pytest.raises(ConfigError):
        PrefixRouter(2, block_size=0)
    router = PrefixRouter(2, block_size=BS)
    with pytest.raises(CacheUsageError, match="unknown replica 'z'"):
        router.apply("z", [])
    with pytest.raises(CacheUsageError, match="without a routed request"):
        router.finish(1)
    with pytest.raises(CacheUsageError, match="not a KV cache event"):
        router.apply(0, ["stored"])  # type: ignore[list-item]
