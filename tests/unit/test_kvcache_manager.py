"""Regression tests for KVCacheManager and BlockPool: each pins one rule of the bookkeeping."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fuelspmd.distributed_cache import (
    BlockCopy,
    BlockHash,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    hash_blocks,
    sha256_block_hash,
)
from fuelspmd.distributed_cache.block_pool import Block, BlockId, BlockQueue
from fuelspmd.errors import CacheCapacityError, CacheUsageError, ConfigError


def checked(mgr: KVCacheManager) -> KVCacheManager:
    mgr.check_invariants()
    return mgr


# ---- prompts and prefix hits --------------------------------------------------------------


def test_prompt_shorter_than_one_block_is_never_shared() -> None:
    mgr = KVCacheManager(4, 4)
    assert mgr.allocate("a", [1, 2, 3]) == 0
    assert mgr.allocate("b", [1, 2, 3]) == 0
    assert len(mgr.block_table("a")) == 1
    assert mgr.block_table("a") != mgr.block_table("b")
    assert mgr.pool.num_cached == 0
    assert mgr.stats().hit_tokens == 0
    mgr.free("a")
    checked(mgr)
    assert mgr.pool.num_free == 3 and mgr.pool.num_evictable == 0


def test_empty_prompt_holds_no_block_and_grows() -> None:
    mgr = KVCacheManager(2, 4)
    assert mgr.allocate(0, []) == 0
    assert mgr.block_table(0) == []
    assert mgr.append(0, [5, 6, 7, 8, 9]) == []
    assert len(mgr.block_table(0)) == 2
    checked(mgr)


def test_shared_prefix_reuses_full_blocks_and_leaves_a_token_to_compute() -> None:
    mgr = KVCacheManager(16, 4)
    prompt = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert mgr.allocate("a", prompt) == 0
    assert mgr.allocate("b", prompt) == 8
    assert mgr.block_table("a")[:2] == mgr.block_table("b")[:2]
    assert mgr.block_table("a")[2] != mgr.block_table("b")[2]
    # an aligned prompt: its last full block is recomputed so the model gets logits
    assert mgr.allocate("c", prompt[:8]) == 4
    assert mgr.allocate("d", [*prompt[:8], 99]) == 8
    stats = checked(mgr).stats()
    assert stats.prompt_tokens == 37 and stats.hit_tokens == 20
    assert stats.hit_rate == pytest.approx(20 / 37)


def test_prefix_caching_off_shares_nothing() -> None:
    mgr = KVCacheManager(8, 2, enable_prefix_caching=False)
    assert mgr.allocate(1, [1, 2, 3, 4, 5]) == 0
    assert mgr.allocate(2, [1, 2, 3, 4, 5]) == 0
    assert not set(mgr.block_table(1)) & set(mgr.block_table(2))
    assert mgr.pool.num_cached == 0
    checked(mgr)


def test_blocks_completed_by_append_are_cached() -> None:
    mgr = KVCacheManager(8, 4)
    mgr.allocate("a", [1, 2])
    mgr.append("a", [3, 4, 5])
    mgr.append("a", [6, 7, 8, 9])
    assert mgr.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert mgr.block_table("b")[:2] == mgr.block_table("a")[:2]
    # a count appended makes the content unknown: later blocks are not named
    mgr.append("a", 10)
    assert mgr.pool.num_cached == 2
    checked(mgr)


def test_extra_keys_separate_caches() -> None:
    mgr = KVCacheManager(16, 4)
    prompt = list(range(9))
    mgr.allocate("a", prompt, extra_keys=("adapter-1",))
    assert mgr.allocate("b", prompt, extra_keys=("adapter-2",)) == 0
    assert mgr.allocate("c", prompt) == 0
    assert mgr.allocate("d", prompt, extra_keys=("adapter-1",)) == 8
    assert not set(mgr.block_table("a")) & set(mgr.block_table("b"))
    assert mgr.block_table("d")[:2] == mgr.block_table("a")[:2]
    with_keys = hash_blocks(prompt, 4, extra_keys=("adapter-1",))
    assert with_keys != hash_blocks(prompt, 4) != hash_blocks(prompt, 4, extra_keys=("x",))
    checked(mgr)


def test_forced_collision_never_hands_out_another_prompts_cache() -> None:
    def same(parent: BlockHash | None, tokens: tuple[int, ...], extra: tuple) -> BlockHash:
        return BlockHash(42)

    mgr = KVCacheManager(16, 2, hash_fn=same)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    assert mgr.allocate("b", [7, 8, 9, 9, 5]) == 0  # every name collides with a's
    assert not set(mgr.block_table("a")) & set(mgr.block_table("b"))
    assert mgr.allocate("c", [1, 2, 3, 4, 0]) == 4  # the real match still hits
    assert mgr.block_table("c")[:2] == mgr.block_table("a")[:2]
    assert mgr.allocate("d", [7, 8, 9, 9, 0]) == 4
    assert mgr.block_table("d")[:2] == mgr.block_table("b")[:2]
    checked(mgr)


def test_collision_in_the_parent_is_caught_by_the_chain() -> None:
    """Blocks (1, 2) and (2, 1) collide and the hash ignores the parent, so block (5, 5)
    has one name after either; the hit must follow the confirmed parent."""

    def weak(parent: BlockHash | None, tokens: tuple[int, ...], extra: tuple) -> BlockHash:
        return BlockHash(sum(tokens))

    mgr = KVCacheManager(16, 2, hash_fn=weak)
    mgr.allocate("x", [1, 2, 5, 5, 9])
    mgr.allocate("y", [2, 1, 5, 5, 9])
    assert mgr.allocate("w", [2, 1, 5, 5, 3]) == 4
    assert mgr.block_table("w")[:2] == mgr.block_table("y")[:2]
    assert mgr.allocate("v", [1, 2, 5, 5, 3]) == 4
    assert mgr.block_table("v")[:2] == mgr.block_table("x")[:2]
    checked(mgr)


# ---- eviction -----------------------------------------------------------------------------


def test_free_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    mgr = KVCacheManager(6, 2, record_events=True)
    mgr.allocate("a", [1, 2, 3, 4, 5])  # 2 named blocks + 1 partial
    mgr.free("a")
    assert mgr.pool.num_free == 4 and mgr.pool.num_evictable == 2
    mgr.take_events()
    mgr.allocate("b", 7)  # 4 blocks: exactly the free ones
    assert mgr.stats().evictions == 0 and mgr.take_events() == []
    mgr.allocate("c", 1)
    assert mgr.stats().evictions == 1
    checked(mgr)


def test_eviction_is_least_recently_released_first_and_a_hit_touches() -> None:
    mgr = KVCacheManager(6, 2, record_events=True)
    names = {}
    for seq, first in (("a", 10), ("b", 20), ("c", 30)):
        prompt = [first, first + 1]
        mgr.allocate(seq, prompt)
        names[seq] = hash_blocks(prompt, 2)[0]
    for seq in ("a", "b", "c"):
        mgr.free(seq)
    assert mgr.pool.num_evictable == 3
    # touch b: a hit takes it out of the LRU order, releasing it makes it the newest
    assert mgr.allocate("b2", [20, 21, 0]) == 2
    mgr.free("b2")
    mgr.take_events()
    order = []
    for i in range(3):
        mgr.allocate(f"n{i}", 2 if i else 7)  # the first takes the 3 free blocks and one more
        events = mgr.take_events()
        order += [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert order == [names["a"], names["c"], names["b"]]
    checked(mgr)


def test_a_sequence_releases_its_tail_before_its_root() -> None:
    mgr = KVCacheManager(4, 1)
    mgr.allocate("a", [1, 2, 3, 4])
    table = mgr.block_table("a")
    mgr.free("a")
    assert mgr.pool.evictable_order() == table[::-1]


def test_explicit_evict_drops_names_in_lru_order() -> None:
    mgr = KVCacheManager(8, 2)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    first = mgr.block_table("a")[0]
    mgr.free("a")
    assert mgr.evict(1) == 1
    assert mgr.pool.evictable_order() == [first]
    assert mgr.evict(5) == 1 and mgr.pool.num_evictable == 0
    assert mgr.allocate("b", [1, 2, 3, 4, 5]) == 0
    checked(mgr)


# ---- fork and copy-on-write ---------------------------------------------------------------


def test_fork_shares_blocks_and_the_first_append_copies_the_partial_block() -> None:
    mgr = KVCacheManager(8, 4)
    mgr.allocate("a", [1, 2, 3, 4, 5, 6])
    full, partial = mgr.block_table("a")
    mgr.fork("a", "b")
    mgr.fork("a", "c")
    assert mgr.block_table("b") == mgr.block_table("c") == [full, partial]
    assert mgr.pool.blocks[partial].ref_count == 3
    checked(mgr)
    (copy,) = mgr.append("b", [7])
    assert copy.src == partial and copy.num_tokens == 2
    assert mgr.block_table("b") == [full, copy.dst] and copy.dst not in (full, partial)
    (copy_c,) = mgr.append("c", [8])
    assert copy_c == BlockCopy(partial, mgr.block_table("c")[1], 2)
    assert mgr.append("a", [9]) == []  # the last holder writes in place
    assert mgr.block_table("a") == [full, partial]
    assert mgr.stats().copies == 2
    checked(mgr)


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    mgr = KVCacheManager(8, 2)
    mgr.allocate("a", [1, 2, 3, 4])
    mgr.fork("a", "b")
    assert mgr.append("b", [5]) == [] and mgr.append("a", [6]) == []
    assert mgr.block_table("a")[:2] == mgr.block_table("b")[:2]
    assert mgr.block_table("a")[2] != mgr.block_table("b")[2]
    assert mgr.allocate("c", [1, 2, 3, 4, 6]) == 4
    checked(mgr)


def test_forked_sequences_free_independently() -> None:
    mgr = KVCacheManager(4, 2)
    mgr.allocate("a", [1, 2, 3])
    mgr.fork("a", "b")
    mgr.free("a")
    assert mgr.pool.num_in_use == 2
    mgr.free("b")
    assert mgr.pool.num_in_use == 0
    checked(mgr)


# ---- caller mistakes and capacity ---------------------------------------------------------


def test_double_free_raises_and_changes_nothing() -> None:
    mgr = KVCacheManager(4, 2)
    mgr.allocate("a", [1, 2, 3])
    mgr.free("a")
    before = mgr.digest()
    with pytest.raises(CacheUsageError, match="'a' is not allocated"):
        mgr.free("a")
    with pytest.raises(CacheUsageError, match="not allocated"):
        mgr.free("never")
    assert mgr.digest() == before
    checked(mgr)


def test_caller_mistakes_are_typed_value_errors() -> None:
    mgr = KVCacheManager(4, 2)
    mgr.allocate("a", [1])
    cases = [
        lambda: mgr.allocate("a", [1]),
        lambda: mgr.allocate(1.5, [1]),  # type: ignore[arg-type]
        lambda: mgr.allocate("b", -1),
        lambda: mgr.allocate("c", [1, -2]),
        lambda: mgr.allocate("c", [1, 2.0]),  # type: ignore[list-item]
        lambda: mgr.allocate("c", "abc"),  # type: ignore[arg-type]
        lambda: mgr.append("a", 1.0),  # type: ignore[arg-type]
        lambda: mgr.allocate("d", [1], extra_keys=(1.5,)),  # type: ignore[arg-type]
        lambda: mgr.append("zz", [1]),
        lambda: mgr.fork("a", "a"),
    ]
    for case in cases:
        with pytest.raises(CacheUsageError) as info:
            case()
        assert isinstance(info.value, ValueError)
    assert list(mgr.block_tables()) == ["a"]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ConfigError, match="positive integer"):
            BlockPool(bad, 4)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="positive integer"):
            KVCacheManager(4, bad)  # type: ignore[arg-type]
    checked(mgr)


def test_capacity_error_gives_the_numbers_and_the_fix_and_changes_nothing() -> None:
    mgr = KVCacheManager(8, 4)
    mgr.allocate("a", list(range(9)))  # 3 blocks, 2 named
    mgr.allocate("b", list(range(100, 109)))  # 3 blocks
    mgr.free("a")  # 2 evictable, 1 free; 3 in use by b
    before = mgr.digest()
    assert not mgr.can_allocate(24) and mgr.can_allocate(20)
    with pytest.raises(CacheCapacityError) as info:
        mgr.allocate("c", list(range(200, 224)))
    msg = str(info.value)
    for part in (
        "needs 6 more blocks",
        "24 tokens at block_size 4",
        "only 5 can be taken",
        "3 free + 2 cached-evictable",
        "3 of 8 total in use",
        "1 short",
        "num_blocks >= 9",
        "free some of the 1 live sequences",
    ):
        assert part in msg, (part, msg)
    assert isinstance(info.value, ValueError)
    assert mgr.digest() == before
    with pytest.raises(CacheCapacityError, match="alone needs more than all 8 blocks"):
        mgr.allocate("d", 40)
    with pytest.raises(CacheCapacityError, match="sequence 'b' needs 6 more blocks"):
        mgr.append("b", 24)
    assert mgr.digest() == before
    assert mgr.allocate("e", list(range(300, 320))) == 0  # 5 blocks: evicts both names
    assert mgr.stats().evictions == 2
    checked(mgr)


def test_stats_report_usage() -> None:
    mgr = KVCacheManager(10, 2)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    stats = mgr.stats()
    assert (stats.in_use, stats.free, stats.evictable, stats.num_sequences) == (3, 7, 0, 1)
    assert stats.usage == pytest.approx(0.3)


# ---- determinism --------------------------------------------------------------------------


def _script(seed_calls: str) -> str:
    return textwrap.dedent(
        f"""
        from fuelspmd.distributed_cache import KVCacheManager, hash_blocks
        m = KVCacheManager(32, 4)
        {seed_calls}
        print(m.digest(), hash_blocks(list(range(12)), 4, extra_keys=("lora", b"x", 3, None)))
        """
    )


CALLS = (
    'm.allocate("req-1", list(range(30)), extra_keys=("lora",)); '
    'm.allocate(7, list(range(20))); m.fork("req-1", "beam"); m.append("beam", [1, 2]); '
    'm.free(7); m.allocate("req-2", list(range(25)))'
)


def test_digest_and_names_agree_across_processes() -> None:
    """Python salts ``hash()`` of str per process; names and digests must not depend on it."""
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _script(CALLS)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outs.add(proc.stdout)
    assert len(outs) == 1
    mgr = KVCacheManager(32, 4)
    exec(CALLS, {"m": mgr})
    assert mgr.digest() in outs.pop()


def test_digest_tracks_block_tables() -> None:
    a, b = KVCacheManager(16, 4), KVCacheManager(16, 4)
    for mgr in (a, b):
        mgr.allocate(1, list(range(10)))
        mgr.allocate(2, list(range(6)))
    assert a.digest() == b.digest()
    a.append(1, [3])
    b.append(2, [3])
    assert a.digest() != b.digest()
    b.append(1, [3])
    a.append(2, [3])
    assert a.digest() == b.digest()


def test_default_hash_is_a_63_bit_chain() -> None:
    first = sha256_block_hash(None, (1, 2), ())
    assert 0 <= first < 2**63
    assert sha256_block_hash(first, (3, 4), ()) != sha256_block_hash(None, (3, 4), ())
    assert hash_blocks([1, 2, 3, 4, 5], 2) == [first, sha256_block_hash(first, (3, 4), ())]
    assert sha256_block_hash(None, (1, 2), ("a",)) != sha256_block_hash(None, (1, 2), (("a",),))


# ---- the pool's structures ----------------------------------------------------------------


def test_block_queue_removes_from_the_middle() -> None:
    blocks = [Block(BlockId(i)) for i in range(5)]
    queue = BlockQueue("q")
    for block in blocks:
        queue.append(block)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3, 4] and len(queue) == 5
    assert queue.popleft() is blocks[2] and queue.peek() is blocks[0]
    with pytest.raises(RuntimeError, match="already in the q queue"):
        queue.append(blocks[0])
    with pytest.raises(RuntimeError, match="not in the q queue"):
        queue.remove(blocks[2])


def test_check_invariants_catches_a_leak() -> None:
    mgr = KVCacheManager(4, 2)
    mgr.allocate("a", [1, 2, 3])
    mgr.pool.blocks[mgr.block_table("a")[0]].ref_count += 1
    with pytest.raises(RuntimeError, match="live references"):
        mgr.check_invariants()


def test_pool_events_report_names_held() -> None:
    pool_mgr = KVCacheManager(4, 2, record_events=True)
    pool_mgr.allocate("a", [1, 2, 3, 4, 5])
    names = hash_blocks([1, 2, 3, 4], 2)
    assert pool_mgr.take_events() == [BlockStored(tuple(names))]
    pool_mgr.free("a")
    pool_mgr.evict(2)
    assert pool_mgr.take_events() == [BlockRemoved((names[1], names[0]))]
    assert pool_mgr.take_events() == []


# ---- preemption ---------------------------------------------------------------------------


def test_make_room_evicts_unheld_cached_blocks_before_preempting() -> None:
    mgr = KVCacheManager(4, 2)
    mgr.allocate("old", [1, 2, 3, 4])          # 2 named blocks
    mgr.free("old")                            # now cached-evictable
    mgr.allocate("a", [7])
    mgr.allocate("b", [8])
    assert mgr.pool.num_free == 0 and mgr.pool.num_evictable == 2
    assert mgr.make_room("a", 3) == []         # the two cached blocks are taken instead
    mgr.append("a", [1, 2, 3])
    assert checked(mgr).stats().evictions == 1 and mgr.stats().preemptions == 0


def test_make_room_preempts_youngest_first_and_resume_hits_its_own_blocks() -> None:
    mgr = KVCacheManager(5, 2)
    mgr.allocate("a", [1, 2])
    mgr.allocate("b", [3, 4, 5, 6])            # 2 named blocks
    mgr.fork("a", "a2")                        # the youngest
    assert mgr.running() == ["a", "b", "a2"]
    assert mgr.make_room("a", 6) == ["a2", "b"]
    assert mgr.preempted() == ["b", "a2"] and "b" not in mgr
    assert mgr.num_tokens("b") == 4 and checked(mgr).stats().preempted == 2
    mgr.append("a", [9] * 6)
    with pytest.raises(CacheUsageError, match="is preempted"):
        mgr.append("b", [1])
    with pytest.raises(CacheUsageError, match="already preempted"):
        mgr.allocate("b", [1])
    mgr.free("a")
    # b's blocks were released last-first, so a's append evicted b's second block, not its
    # first: the first is served
    assert mgr.resume("b", [7]) == 2
    assert mgr.running() == ["b"] and mgr.num_tokens("b") == 5
    assert mgr.resume("a2") == 0 and checked(mgr).stats().preemptions == 2
    with pytest.raises(CacheUsageError, match="not preempted"):
        mgr.resume("a2")


def test_make_room_refuses_what_no_preemption_cures_and_changes_nothing() -> None:
    mgr = KVCacheManager(3, 2)
    mgr.allocate("a", [1, 2, 3])
    mgr.allocate("b", [4])
    before = mgr.digest()
    with pytest.raises(CacheCapacityError, match="more than all 3 blocks") as info:
        mgr.make_room("a", 4)                  # 7 tokens = 4 blocks
    assert "num_blocks >= 4" in str(info.value) and mgr.digest() == before
    assert mgr.make_room("b", 2) == ["b"]      # the youngest asks: it preempts itself


def test_resume_that_does_not_fit_changes_nothing() -> None:
    mgr = KVCacheManager(2, 2)
    mgr.allocate("a", [1, 2, 3])
    mgr.preempt("a")
    mgr.allocate("b", [5])
    before = mgr.digest()
    with pytest.raises(CacheCapacityError):
        mgr.resume("a")
    assert mgr.digest() == before and mgr.preempted() == ["a"]
    mgr.free("a")                              # a preempted sequence can be dropped
    assert checked(mgr).preempted() == []


def test_digest_covers_the_ages_that_decide_preemption() -> None:
    one, two = KVCacheManager(8, 2), KVCacheManager(8, 2)
    for m, children in ((one, ("c1", "c2")), (two, ("c2", "c1"))):
        m.allocate("p", [1, 2, 3])
        for c in children:
            m.fork("p", c)
    assert one.block_tables() == two.block_tables()  # same tables, other youngest
    assert one.sequence_digests() == two.sequence_digests()
    assert one.digest() != two.digest() and one.order_digest() != two.order_digest()
    three = KVCacheManager(8, 2)
    three.allocate("p", [1, 2, 3])
    three.preempt("p")
    assert three.sequence_digests()["p"] != KVCacheManager(8, 2).sequence_digests().get("p")
