"""Random allocate / append / fork / free / evict / preempt / make_room / resume programs
against KVCacheManager.

After every step the machine checks invariant 7 (``check_invariants``: free + evictable +
in-use == total, reference counts == live references) and, independently of the manager's
own bookkeeping, that the keys and values each live sequence would read are its own. The
test simulates the storage layer: every token slot holds the token's *content*, the extra
keys plus the whole prefix up to that token (what its KV depends on). Tokens served from the
prefix cache are not written; copies returned by ``append`` are performed first. A wrong
prefix hit, a write into a shared block or a missed copy makes some sequence read a slot
whose content differs from its own, and the test fails. A preempted sequence's tokens
come back at resume: the part the cache serves must still hold its content, the rest is
rewritten (recomputed). The machine keeps its own age order (allocate, fork and resume
make a sequence the youngest) and resumption order, and :meth:`make_room` must preempt
exactly the youngest, and only when the append does not fit.

Half the runs use a weak hash that collides constantly, so hits must be confirmed.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fuelspmd.distributed_cache import BlockHash, BlockRemoved, BlockStored, KVCacheManager
from fuelspmd.errors import CacheCapacityError, CacheUsageError

EXAMPLES = 120
STEPS = 100
MIN_TOTAL_STEPS = 10_000


def weak_hash(parent: BlockHash | None, tokens: tuple[int, ...], extra: tuple) -> BlockHash:
    """Collides for any two blocks with the same token sum (and ignores parent and keys)."""
    return BlockHash(sum(tokens) % 3)


Content = tuple


def make_machine(tally: Counter[str]) -> type[RuleBasedStateMachine]:
    class KVCacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model: dict[int, tuple[tuple, list[int]]] = {}  # seq -> (extra, tokens)
            self.age: list[int] = []  # running, oldest first
            self.waiting: dict[int, tuple[tuple, list[int]]] = {}  # preempted
            self.resume_order: list[int] = []
            self.freed: list[int] = []
            self.prompts: list[list[int]] = [[]]
            self.next_id = 0
            self.next_unknown = 10_000

        @initialize(
            num_blocks=st.integers(3, 48),
            block_size=st.sampled_from([1, 2, 3, 4, 4]),
            weak=st.booleans(),
            caching=st.sampled_from([True, True, True, False]),
        )
        def setup(self, num_blocks: int, block_size: int, weak: bool, caching: bool) -> None:
            self.bs = block_size
            self.mgr = KVCacheManager(
                num_blocks,
                block_size,
                enable_prefix_caching=caching,
                hash_fn=weak_hash if weak else None,
                record_events=True,
            )
            self.storage: dict[int, list[Content | None]] = {
                b: [None] * block_size for b in range(num_blocks)
            }
            self.names: set[BlockHash] = set()
            self.evictions = 0
            self.preemptions_before = tally["preemptions"]

        # ---- helpers --------------------------------------------------------------------

        def content(self, seq: int, t: int) -> Content:
            extra, tokens = self.model[seq]
            return (extra, tuple(tokens[: t + 1]))

        def write(self, seq: int, start: int) -> None:
            table = self.mgr.block_table(seq)
            for t in range(start, len(self.model[seq][1])):
                self.storage[table[t // self.bs]][t % self.bs] = self.content(seq, t)

        def fresh_tokens(self, k: int) -> list[int]:
            """Distinct ids standing for tokens whose ids the manager is not told."""
            out = list(range(self.next_unknown, self.next_unknown + k))
            self.next_unknown += k
            return out

        # ---- rules ----------------------------------------------------------------------

        @rule(
            data=st.data(),
            suffix=st.lists(st.integers(0, 2), max_size=6),
            extra=st.sampled_from([(), (), ("lora-a",), ("lora-b", 7)]),
            as_count=st.sampled_from([False, False, False, True]),
        )
        def allocate(self, data: st.DataObject, suffix: list[int], extra: tuple, as_count: bool):
            tally["steps"] += 1
            base = data.draw(st.sampled_from(self.prompts[-4:]))  # recent: likely cached
            cut = data.draw(st.sampled_from([len(base), len(base) // 2, len(base) - 1]))
            tokens = base[:cut] + suffix
            seq = self.next_id
            before = self.mgr.digest()
            try:
                served = self.mgr.allocate(
                    seq, len(tokens) if as_count else tokens, extra_keys=extra
                )
            except CacheCapacityError:
                tally["full"] += 1
                assert not self.mgr.can_allocate(len(tokens))  # can_allocate never lies
                assert self.mgr.digest() == before  # atomic
                assert seq not in self.mgr
                return
            self.next_id += 1
            if as_count:
                tokens = self.fresh_tokens(len(tokens))
                assert served == 0
            self.model[seq] = (extra, tokens)
            self.age.append(seq)
            tally["hits"] += served > 0
            self.prompts.append(tokens)
            assert served % self.bs == 0 and served <= max(len(tokens) - 1, 0)
            for t in range(served):  # the cache really holds this sequence's prefix
                table = self.mgr.block_table(seq)
                assert self.storage[table[t // self.bs]][t % self.bs] == self.content(seq, t)
            self.write(seq, served)

        @precondition(lambda self: bool(self.model))
        @rule(
            data=st.data(),
            new=st.lists(st.integers(0, 2), max_size=6),
            as_count=st.sampled_from([False, False, False, True]),
        )
        def append(self, data: st.DataObject, new: list[int], as_count: bool) -> None:
            tally["steps"] += 1
            seq = data.draw(st.sampled_from(sorted(self.model)))
            before = self.mgr.digest()
            try:
                copies = self.mgr.append(seq, len(new) if as_count else new)
            except CacheCapacityError:
                held = len(self.mgr.block_table(seq))
                grow = -(-(len(self.model[seq][1]) + len(new)) // self.bs) - held
                assert grow + 1 > self.mgr.pool.num_available
                assert self.mgr.digest() == before
                return
            start = len(self.model[seq][1])
            assert len(copies) <= 1
            tally["copies"] += len(copies)
            for copy in copies:
                assert copy.num_tokens == start % self.bs > 0
                src, dst = self.storage[copy.src], self.storage[copy.dst]
                dst[: copy.num_tokens] = src[: copy.num_tokens]
            self.model[seq][1].extend(self.fresh_tokens(len(new)) if as_count else new)
            self.write(seq, start)

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def fork(self, data: st.DataObject) -> None:
            tally["steps"] += 1
            parent = data.draw(st.sampled_from(sorted(self.model)))
            child = self.next_id
            self.next_id += 1
            self.mgr.fork(parent, child)
            extra, tokens = self.model[parent]
            self.model[child] = (extra, list(tokens))
            self.age.append(child)

        @precondition(lambda self: bool(self.model) or bool(self.waiting))
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            tally["steps"] += 1
            seq = data.draw(st.sampled_from(sorted([*self.model, *self.waiting])))
            self.mgr.free(seq)
            if seq in self.model:
                del self.model[seq]
                self.age.remove(seq)
            else:
                del self.waiting[seq]
                self.resume_order.remove(seq)
            self.freed.append(seq)

        def preempted(self, seq: int) -> None:
            self.waiting[seq] = self.model.pop(seq)
            self.age.remove(seq)
            self.resume_order.insert(0, seq)
            tally["preemptions"] += 1

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def preempt(self, data: st.DataObject) -> None:
            tally["steps"] += 1
            seq = data.draw(st.sampled_from(sorted(self.model)))
            self.mgr.preempt(seq)
            self.preempted(seq)
            with pytest.raises(CacheUsageError, match="preempted"):
                self.mgr.append(seq, [1])

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=9))
        def make_room(self, data: st.DataObject, new: list[int]) -> None:
            """Preempt the youngest until ``new`` fits, then append it (unless preempted)."""
            tally["steps"] += 1
            seq = data.draw(st.sampled_from(sorted(self.model)))
            before = self.mgr.digest()
            fits = self.mgr.can_append(seq, len(new))
            try:
                out = self.mgr.make_room(seq, len(new))
            except CacheCapacityError:
                need = -(-(len(self.model[seq][1]) + len(new)) // self.bs)
                assert need > self.mgr.pool.num_blocks
                assert self.mgr.digest() == before
                return
            assert (out == []) == fits
            assert out == self.age[::-1][: len(out)]  # the youngest, youngest first
            for victim in out:
                self.preempted(victim)
            if seq in out:
                assert out[-1] == seq
                return
            assert self.mgr.can_append(seq, len(new))
            start = len(self.model[seq][1])
            copies = self.mgr.append(seq, new)
            tally["copies"] += len(copies)
            for copy in copies:
                src, dst = self.storage[copy.src], self.storage[copy.dst]
                dst[: copy.num_tokens] = src[: copy.num_tokens]
            self.model[seq][1].extend(new)
            self.write(seq, start)

        @precondition(lambda self: bool(self.waiting))
        @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=3))
        def resume(self, data: st.DataObject, new: list[int]) -> None:
            tally["steps"] += 1
            seq = data.draw(st.sampled_from(self.resume_order[:2]))
            before = self.mgr.digest()
            try:
                served = self.mgr.resume(seq, new)
            except CacheCapacityError:
                assert self.mgr.digest() == before and seq in self.waiting
                return
            tally["resumes"] += 1
            tally["resume_hits"] += served > 0
            extra, tokens = self.waiting.pop(seq)
            self.resume_order.remove(seq)
            self.model[seq] = (extra, tokens + new)
            self.age.append(seq)
            assert served % self.bs == 0 and served <= max(len(tokens) + len(new) - 1, 0)
            table = self.mgr.block_table(seq)
            for t in range(served):  # what the cache serves is still this sequence's
                assert self.storage[table[t // self.bs]][t % self.bs] == self.content(seq, t)
            self.write(seq, served)  # the rest is recomputed

        @precondition(lambda self: bool(self.freed))
        @rule(data=st.data())
        def double_free(self, data: st.DataObject) -> None:
            tally["steps"] += 1
            seq = data.draw(st.sampled_from(self.freed))
            before = self.mgr.digest()
            with pytest.raises(CacheUsageError, match="not allocated"):
                self.mgr.free(seq)
            assert self.mgr.digest() == before

        @rule(n=st.integers(0, 4))
        def evict(self, n: int) -> None:
            tally["steps"] += 1
            evictable = self.mgr.pool.num_evictable
            order = self.mgr.pool.evictable_order()
            assert self.mgr.evict(n) == min(n, evictable)
            assert self.mgr.pool.evictable_order() == order[min(n, evictable) :]

        # ---- checks after every step ----------------------------------------------------

        @invariant()
        def conserved(self) -> None:
            self.mgr.check_invariants()
            tally["evictions"] += self.mgr.pool.evictions - self.evictions
            self.evictions = self.mgr.pool.evictions
            pool = self.mgr.pool
            assert pool.num_free + pool.num_evictable + pool.num_in_use == pool.num_blocks

        @invariant()
        def ages_and_resumption_order(self) -> None:
            assert self.mgr.running() == self.age
            assert self.mgr.preempted() == self.resume_order
            for seq, (_, tokens) in self.waiting.items():
                assert self.mgr.num_tokens(seq) == len(tokens) and seq not in self.mgr
            stats = self.mgr.stats()
            assert stats.preempted == len(self.waiting)
            assert stats.preemptions == tally["preemptions"] - self.preemptions_before

        @invariant()
        def sequences_read_their_own_cache(self) -> None:
            assert set(self.mgr.block_tables()) == set(self.model)
            for seq, (_, tokens) in self.model.items():
                assert self.mgr.num_tokens(seq) == len(tokens)
                table = self.mgr.block_table(seq)
                for t in range(len(tokens)):
                    assert self.storage[table[t // self.bs]][t % self.bs] == self.content(seq, t)

        @invariant()
        def events_track_the_index(self) -> None:
            for event in self.mgr.take_events():
                if isinstance(event, BlockStored):
                    assert not self.names & set(event.block_hashes)
                    self.names |= set(event.block_hashes)
                else:
                    assert isinstance(event, BlockRemoved)
                    assert set(event.block_hashes) <= self.names
                    self.names -= set(event.block_hashes)
            held = {b.block_hash for b in self.mgr.pool.blocks if b.is_cached}
            assert self.names == held

    return KVCacheMachine


@pytest.mark.timeout(120)
def test_random_programs_conserve_blocks_and_contents() -> None:
    tally: Counter[str] = Counter()
    machine = make_machine(tally)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert tally["steps"] >= MIN_TOTAL_STEPS, tally
    # the programs must reach every path worth checking, not only the easy ones
    for what in ("hits", "copies", "evictions", "full", "preemptions", "resumes"):
        assert tally[what] >= 50, tally
    assert tally["resume_hits"] >= 5, tally  # rarer: the blocks must outlive the preemption
