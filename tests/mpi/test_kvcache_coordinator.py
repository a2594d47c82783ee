"""KVCacheCoordinator over the MPI world, at any world size.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_kvcache_coordinator.py`` (N = 1..4). The same checks run on two devices of
one process in tests/unit/test_kvcache_store.py.
"""

from __future__ import annotations

import pytest

import fuelspmd as fs
from fuelspmd.distributed_cache import CacheDivergenceError, KVCacheCoordinator, KVCacheManager

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
BS = 4


def _two_or_more(world: fs.World, blocks: int, *, every: int
                 ) -> tuple[fs.Communicator, KVCacheManager, KVCacheCoordinator]:
    """The world's comm and a checked manager of ``blocks`` blocks; skip at one rank (one
    rank cannot diverge)."""
    if world.comm.size == 1:
        pytest.skip("one rank cannot diverge")
    m = KVCacheManager(blocks, BS)
    return world.comm, m, KVCacheCoordinator(m, comm=world.comm, every=every)


def _ops(m: KVCacheManager | KVCacheCoordinator, salt: int) -> None:
    m.allocate(0, list(range(10)))
    m.allocate("req-1", [*list(range(8)), salt, 99])
    m.append(0, [3, 4, 5])
    m.fork("req-1", "child")
    m.append("child", [7])
    m.free(0)


def test_same_calls_agree_at_every_check(world: fs.World) -> None:
    m = KVCacheManager(32, BS)
    coord = KVCacheCoordinator(m, comm=world.comm, every=3)
    _ops(coord, salt=0)
    assert [coord.step() for _ in range(6)] == [False, False, True] * 2
    coord.check()
    assert coord.checks == 3


def test_divergence_raises_on_every_rank_naming_ranks_and_sequence(world: fs.World) -> None:
    comm, m, coord = _two_or_more(world, 32, every=1)
    _ops(m, salt=0)
    # the last rank appends one token more to "req-1" than the others
    m.append("req-1", [1, 2, 3] if comm.rank == comm.size - 1 else [1, 2])
    with pytest.raises(CacheDivergenceError) as info:
        coord.step()
    msg = str(info.value)
    assert f"ranks [{comm.size - 1}] disagree with rank 0 of {comm.size}" in msg
    assert "first differing sequence is 'req-1'" in msg
    comm.barrier()  # every rank got here: the report left nobody in a collective


def test_pool_order_divergence_is_reported(world: fs.World) -> None:
    comm, m, coord = _two_or_more(world, 32, every=1)
    # same tables at the end, but rank 0 freed its two sequences in the other order
    m.allocate("a", 8)
    m.allocate("b", 8)
    for s in (("a", "b") if comm.rank == 0 else ("b", "a")):
        m.free(s)
    with pytest.raises(CacheDivergenceError, match="an order differs: the pool"):
        coord.check()
    comm.barrier()


def test_leader_mode_gives_every_rank_rank_0s_decisions(world: fs.World) -> None:
    comm = world.comm
    m = KVCacheManager(32, BS)
    coord = KVCacheCoordinator(m, comm=comm, every=1, mode="leader")
    _ops(coord, salt=comm.rank)           # each rank is fed its own prompt
    coord.allocate(f"r{comm.rank}", 5)    # and its own sequence name
    coord.evict(comm.rank + 1)
    coord.step()                          # the digest check passes
    ref = KVCacheManager(32, BS)
    _ops(ref, salt=0)
    ref.allocate("r0", 5)
    ref.evict(1)
    assert m.block_tables() == ref.block_tables() and m.digest() == ref.digest()


def _three_by_age(m: KVCacheManager | KVCacheCoordinator, order: tuple[str, ...]) -> None:
    for s in order:
        m.allocate(s, 4)  # one block each: 3 of 4 held, 1 free


def test_make_room_preempts_the_same_youngest_everywhere(world: fs.World) -> None:
    m = KVCacheManager(4, BS)
    coord = KVCacheCoordinator(m, comm=world.comm, every=1000)
    _three_by_age(coord, ("a", "b", "c"))
    assert coord.make_room("a", 8) == ["c"]   # 3 blocks for a: the youngest goes
    assert coord.checks == 1                   # the decision was checked at once
    coord.append("a", 8)
    assert coord.make_room("b", 1) == ["b"]   # b is the youngest left: it preempts itself
    assert m.preempted() == ["b", "c"] and coord.checks == 2
    assert coord.make_room("a", 4) == [] and coord.checks == 2  # fits: no collective


def test_ranks_that_would_preempt_different_sequences_are_stopped(world: fs.World) -> None:
    comm, m, coord = _two_or_more(world, 4, every=1000)
    # the last rank admitted b and c in the other order: its youngest is b
    _three_by_age(m, ("a", "c", "b") if comm.rank == comm.size - 1 else ("a", "b", "c"))
    with pytest.raises(CacheDivergenceError) as info:
        coord.make_room("a", 8)
    assert f"ranks [{comm.size - 1}] disagree with rank 0 of {comm.size}" in str(info.value)
    comm.barrier()


def test_leader_mode_replays_rank_0s_preemption_calls(world: fs.World) -> None:
    comm = world.comm
    m = KVCacheManager(4, BS)
    coord = KVCacheCoordinator(m, comm=comm, every=1, mode="leader")
    _three_by_age(coord, ("a", "b", "c"))
    # each rank asks for its own amount; rank 0's (8 tokens: one preemption) is made
    assert coord.make_room("a", 8 + 4 * comm.rank) == ["c"]
    coord.preempt("b" if comm.rank == 0 else "a")
    assert coord.resume("c" if comm.rank == 0 else "b", [1, 2]) == 0
    ref = KVCacheManager(4, BS)
    _three_by_age(ref, ("a", "b", "c"))
    ref.make_room("a", 8)
    ref.preempt("b")
    ref.resume("c", [1, 2])
    assert m.digest() == ref.digest() and m.running() == ["a", "c"]
