"""PagedKVStore against numpy, and KVCacheCoordinator over the devices of a DeviceGroup.

The store's writes, gathers, copy-on-write copies and paged attention are checked against
plain numpy arrays indexed by the same block tables; the coordinator's agreement check,
divergence report and leader broadcast run on two in-process devices (the same code runs
over MPI in tests/mpi/test_kvcache_coordinator.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph
from fuelspmd.distributed_cache import (
    CacheDivergenceError,
    KVCacheCoordinator,
    KVCacheManager,
    PagedKVStore,
)
from fuelspmd.distributed_cache.store import bucket
from fuelspmd.errors import CacheUsageError, ConfigError, ShapeError

pytestmark = pytest.mark.timeout(60)
BS, H, D = 4, 2, 3


def _store(num_blocks: int = 8, layers: int = 2) -> PagedKVStore:
    return PagedKVStore(num_layers=layers, num_blocks=num_blocks, block_size=BS, kv_heads=H,
                        head_dim=D, dtype="float64")


def _kv(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H, D))


def test_write_then_gather_reads_through_the_block_table() -> None:
    store = _store()
    table = [5, 2, 7]  # 10 tokens over three scattered blocks
    k, v = _kv(10, 1), _kv(10, 2)
    slots = store.slots(table, 0, 10)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    store.write(1, slots, fs.tensor(k), fs.tensor(v))
    gk, gv = store.gather(1, slots)
    fs.realize(gk, gv, *store.tensors())
    assert np.array_equal(gk.numpy(), k) and np.array_equal(gv.numpy(), v)
    pk, _ = store.pages(1)
    expect = np.zeros((8, BS, H, D))
    expect[5], expect[2], expect[7, :2] = k[:4], k[4:8], k[8:]
    assert np.array_equal(pk.numpy(), expect)
    assert not store.pages(0)[0].numpy().any()  # the other layer untouched


def test_overwrite_is_exact_and_leaves_other_slots_alone() -> None:
    store = _store(layers=1)
    a, b = _kv(8, 3), _kv(2, 4)
    store.write(0, np.arange(8), fs.tensor(a), fs.tensor(a))
    store.write(0, np.array([6, 1]), fs.tensor(b), fs.tensor(b))
    store.realize()
    want = a.copy()
    want[6], want[1] = b[0], b[1]
    assert np.array_equal(store.gather(0, np.arange(8))[0].numpy(), want)


def test_a_read_left_lazy_keeps_its_value_or_raises_never_sees_new_pages() -> None:
    """The pages are written in place: a gather made before an overwrite and realised
    after it still gives the old values (the realise of ``tensors()`` realises it first);
    a read left lazy past a later step's realise, and a page tensor the store replaced,
    raise when used: neither shows the new contents."""
    store = _store(layers=1)
    a, b = _kv(4, 7), _kv(4, 8)
    store.write(0, np.arange(4), fs.tensor(a), fs.tensor(a))
    store.realize()
    old_pages = store.tensors()[0]
    before, _ = store.gather(0, np.arange(4))
    store.write(0, np.arange(4), fs.tensor(b), fs.tensor(b))
    store.realize()
    assert np.array_equal(before.numpy(), a)
    assert np.array_equal(store.gather(0, np.arange(4))[0].numpy(), b)
    with pytest.raises(ConfigError, match="was donated"):
        old_pages.numpy()
    late, _ = store.gather(0, np.arange(4))  # reads the current pages, left lazy
    store.realize()  # ... past this step
    store.write(0, np.arange(4), fs.tensor(a), fs.tensor(a))
    store.realize()
    with pytest.raises(ConfigError, match="was donated"):
        late.numpy()


def test_copy_on_write_copies_the_shared_partial_block() -> None:
    m = KVCacheManager(8, BS)
    store = _store(layers=2)
    m.allocate("a", [1, 2, 3, 4, 5, 6])  # one full block, one partial (2 tokens)
    k = _kv(6, 5)
    for layer in range(2):
        store.write(layer, store.slots(m.block_table("a"), 0, 6), fs.tensor(k), fs.tensor(-k))
    m.fork("a", "b")
    copies = m.append("b", [7])
    assert len(copies) == 1 and copies[0].num_tokens == 2
    store.copy(copies)
    new = _kv(1, 6)
    store.write(0, store.slots(m.block_table("b"), 6, 7), fs.tensor(new), fs.tensor(new))
    store.realize()
    for layer in range(2):
        gk, gv = store.gather(layer, store.slots(m.block_table("b"), 0, 6))
        assert np.array_equal(gk.numpy(), k) and np.array_equal(gv.numpy(), -k)
    # the parent's partial block is unchanged by the child's write
    ak, _ = store.gather(0, store.slots(m.block_table("a"), 0, 6))
    assert np.array_equal(ak.numpy(), k)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Reference: q (t, h, d) at positions start.., keys/values (n, h, d), causal."""
    t, n = q.shape[0], k.shape[0]
    s = np.einsum("thd,nhd->htn", q, k) / math.sqrt(D)
    s = s + np.where(np.arange(n)[None, :] <= (start + np.arange(t))[:, None], 0.0, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("htn,nhd->thd", p, v)


@pytest.mark.parametrize("device", ["cpu:0", "strict:0"])
def test_attend_matches_numpy_over_ragged_batches(device: str) -> None:
    """Prefill two sequences of different lengths, then one decode step for both (numpy,
    and array-api-strict, whose scatter is the standard's one-hot matmul)."""
    m = KVCacheManager(16, BS, enable_prefix_caching=False)
    store = PagedKVStore(num_layers=1, num_blocks=16, block_size=BS, kv_heads=H, head_dim=D,
                         dtype="float64", device=device)
    lens = [7, 3]
    full_k = [_kv(n + 1, 10 + i) for i, n in enumerate(lens)]
    full_v = [_kv(n + 1, 20 + i) for i, n in enumerate(lens)]
    full_q = [_kv(n + 1, 30 + i) for i, n in enumerate(lens)]
    for i, n in enumerate(lens):
        m.allocate(i, n)
        q, k, v = (fs.tensor(a[None, :n], device=device)
                   for a in (full_q[i], full_k[i], full_v[i]))
        out = store.attend(0, q, k, v, tables=[m.block_table(i)], starts=[0])
        ref = _attention(full_q[i][:n], full_k[i][:n], full_v[i][:n], 0)
        assert np.allclose(out.numpy()[0], ref, rtol=1e-12, atol=1e-12)
    for i in range(2):
        m.append(i, 1)
    q, k, v = (fs.tensor(np.stack([a[i][lens[i]:] for i in range(2)]), device=device)
               for a in (full_q, full_k, full_v))
    out = store.attend(0, q, k, v, tables=[m.block_table(0), m.block_table(1)],
                       starts=lens).numpy()
    for i, n in enumerate(lens):
        ref = _attention(full_q[i][n:], full_k[i], full_v[i], n)
        assert np.allclose(out[i], ref, rtol=1e-12, atol=1e-12)


def test_grouped_query_attention_reads_each_kv_head_for_its_query_heads() -> None:
    """Four query heads over two key/value heads: query head j reads head j // 2."""
    m = KVCacheManager(16, BS, enable_prefix_caching=False)
    store = _store(num_blocks=16, layers=1)
    n = 6
    k, v, q = _kv(n, 40), _kv(n, 41), np.random.default_rng(42).standard_normal((n, 2 * H, D))
    m.allocate(0, n)
    out = store.attend(0, fs.tensor(q[None]), fs.tensor(k[None]), fs.tensor(v[None]),
                       tables=[m.block_table(0)], starts=[0]).numpy()[0]
    ref = _attention(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), 0)
    assert np.allclose(out, ref, rtol=1e-12, atol=1e-12)


def _decode(num_blocks: int, steps: int) -> tuple[list[int], list[bool], list[int], np.ndarray]:
    """Two sequences decoding ``steps`` tokens through a store of ``num_blocks`` blocks:
    per step the plan-cache misses, whether the pages kept their buffer, the live-bytes
    peak; and the last step's output."""
    ex = graph.default_executor()
    m = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    store = _store(num_blocks=num_blocks, layers=1)
    g = np.random.default_rng(3)
    m.allocate(0, 3)
    m.allocate(1, 6)
    misses, same, peak = [], [], []
    for _ in range(steps):
        for s in (0, 1):
            m.append(s, 1)
        q, k, v = (fs.tensor(g.standard_normal((2, 1, H, D))) for _ in range(3))
        before, buf = ex.cache.misses, store.tensors()[0].node.buffer
        out = store.attend(0, q, k, v, tables=[m.block_table(0), m.block_table(1)],
                           starts=[m.num_tokens(s) - 1 for s in (0, 1)])
        fs.realize(out, *store.tensors())
        misses.append(ex.cache.misses - before)
        same.append(store.tensors()[0].node.buffer is buf)
        peak.append(ex.peak_bytes)
    return misses, same, peak, out.numpy()


def test_decode_steps_write_in_place_and_reuse_the_plan_of_their_bucket() -> None:
    """The longer sequence grows from 7 to 16 tokens, 2 to 4 blocks: buckets 2 and 4, so a
    plan is made at the first step of each bucket and every other step reuses it. The
    pages keep their buffers, and a pool 16x larger changes neither the live-bytes peak
    (nothing of the pool's size is allocated) nor a bit of the output."""
    small = _decode(8, 10)
    misses, same, peak, out = small
    buckets = [bucket(-(-(7 + i) // BS)) for i in range(10)]
    first_of_bucket = [i == 0 or buckets[i] != buckets[i - 1] for i in range(10)]
    assert misses == [int(f) for f in first_of_bucket] and sum(misses) == 2
    assert all(same)
    big = _decode(128, 10)
    assert big[0] == misses and all(big[1]) and big[2] == peak
    assert np.array_equal(big[3], out)


def test_mistakes_raise_typed_errors() -> None:
    store = _store()
    with pytest.raises(CacheUsageError, match=r"positions 0\.\.8 do not fit a block table of 2"):
        store.slots([0, 1], 0, 9)
    with pytest.raises(CacheUsageError, match=r"outside 0\.\.7"):
        store.slots([9], 0, 1)
    with pytest.raises(ShapeError, match=r"must both be \(2, 2, 3\)"):
        store.write(0, np.array([0, 1]), fs.tensor(_kv(3, 0)), fs.tensor(_kv(3, 0)))
    with pytest.raises(CacheUsageError, match=r"layer 2 is outside 0\.\.1"):
        store.gather(2, np.array([0]))
    with pytest.raises(ConfigError, match="num_blocks=0"):
        PagedKVStore(num_layers=1, num_blocks=0, block_size=4, kv_heads=1, head_dim=1)


# ---- the coordinator on two devices of one process ------------------------------------------
def _ops(m: KVCacheManager | KVCacheCoordinator, salt: int = 0) -> None:
    m.allocate(0, list(range(10)))
    m.allocate(1, [*list(range(8)), salt, 99])
    m.append(0, [3, 4, 5])
    m.fork(1, "child")
    m.append("child", [7])


def test_coordinator_agrees_when_every_rank_makes_the_same_calls() -> None:
    def prog(comm: object, _: int) -> tuple[str, int]:
        m = KVCacheManager(32, BS)
        coord = KVCacheCoordinator(m, comm=comm, every=2)
        _ops(coord)
        assert [coord.step() for _ in range(4)] == [False, True, False, True]
        return m.digest(), coord.checks

    (d0, c0), (d1, c1) = fs.DeviceGroup.cpu(2, timeout=20).run(prog, [0, 1])
    assert d0 == d1 and c0 == c1 == 2


def test_divergence_names_the_ranks_and_the_first_sequence() -> None:
    def prog(comm: object, salt: int) -> str:
        m = KVCacheManager(32, BS)
        coord = KVCacheCoordinator(m, comm=comm, every=1)
        _ops(m)
        m.allocate("late", 5 + salt)  # rank 1 takes one more block for the same sequence
        try:
            coord.step()
        except CacheDivergenceError as e:
            return str(e)
        return "no error"

    msgs = fs.DeviceGroup.cpu(2, timeout=20).run(prog, [0, 4])
    for msg in msgs:
        assert "ranks [1] disagree with rank 0 of 2" in msg
        assert "first differing sequence is 'late'" in msg


def test_leader_mode_replays_rank_0s_calls() -> None:
    """Ranks fed different prompts end with rank 0's tables and the same digest."""
    def prog(comm: object, salt: int) -> tuple[str, dict[object, list[int]], int]:
        m = KVCacheManager(32, BS)
        coord = KVCacheCoordinator(m, comm=comm, every=1, mode="leader")
        _ops(coord, salt=salt)
        hit = coord.allocate("x", [*list(range(8)), salt])
        coord.free("child")
        coord.evict(1 + salt)
        coord.step()
        return m.digest(), m.block_tables(), hit

    got = fs.DeviceGroup.cpu(2, timeout=20).run(prog, [0, 7])
    ref = KVCacheManager(32, BS)
    _ops(ref, salt=0)
    hit = ref.allocate("x", [*list(range(8)), 0])
    ref.free("child")
    ref.evict(1)
    for digest, tables, h in got:
        assert digest == ref.digest() and tables == ref.block_tables() and h == hit == 8


def test_leader_mode_catches_a_rank_making_another_call() -> None:
    def prog(comm: object, rank: int) -> str:
        coord = KVCacheCoordinator(KVCacheManager(8, BS), comm=comm, mode="leader")
        coord.allocate("a", [1, 2, 3])
        try:
            if rank == 0:
                coord.append("a", [4])
            else:
                coord.free("a")
        except CacheUsageError as e:
            return str(e)
        return "no error"

    for msg in fs.DeviceGroup.cpu(2, timeout=20).run(prog, [0, 1]):
        assert "the ranks disagree (call: rank 0 has append, rank 1 has free)" in msg, msg


def test_coordinator_rejects_bad_configuration() -> None:
    comm = fs.DeviceGroup.cpu(1).comms[0]
    with pytest.raises(ConfigError, match="every=0"):
        KVCacheCoordinator(KVCacheManager(4, BS), comm=comm, every=0)
    with pytest.raises(ConfigError, match="mode='boss'"):
        KVCacheCoordinator(KVCacheManager(4, BS), comm=comm, mode="boss")  # type: ignore[arg-type]


def test_a_step_index_is_each_key_slot_through_its_block_table() -> None:
    """Every entry of a step's index, computed key by key from the block tables: the new
    tokens' slots, the slots read (padding and later keys read slot 0), the additive mask
    (0 where query j of sequence i may read key p: p <= start + j) and the positions; at a
    decode step the keys pad to the power-of-two bucket of blocks."""
    from fuelspmd.distributed_cache.store import MASKED

    rng = np.random.default_rng(7)
    for _ in range(200):
        nb = int(rng.integers(6, 40))
        store = PagedKVStore(num_layers=1, num_blocks=nb, block_size=BS, kv_heads=H,
                             head_dim=D, dtype="float64")
        t = int(rng.choice([1, 1, 2, 5]))
        free = rng.permutation(nb).tolist()
        tables, starts = [], []
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(-(-t // BS), 4))
            tb, free = free[:n], free[n:]
            if len(tb) < n:
                break
            tables.append(tb)
            starts.append(int(rng.integers(0, n * BS - t + 1)))
        if not tables:
            continue
        ix = {k: v.numpy() for k, v in store.index(tables, starts, t).items()}
        blocks = max(-(-(s + t) // BS) for s in starts)
        keys = (bucket(blocks) if t == 1 else blocks) * BS
        for i, (tb, s) in enumerate(zip(tables, starts)):
            slot = [tb[p // BS] * BS + p % BS for p in range(len(tb) * BS)]
            assert ix["new"][i].tolist() == slot[s:s + t]
            assert ix["positions"][i].tolist() == list(range(s, s + t))
            assert ix["read"][i].tolist() == [slot[p] if p < s + t else 0 for p in range(keys)]
            mask = ix["mask"][i].reshape(t, keys)
            for j in range(t):
                assert mask[j].tolist() == [0.0 if p <= s + j else MASKED for p in range(keys)]
