"""The shared-memory all-reduce of the MPI transport, at any world size.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_shm_allreduce.py`` (plain ``pytest`` skips these). Every rank rebuilds every
rank's input from a seed, so the expected result is computed locally: the shm path folds
in rank order, so its result must equal numpy's left fold ``((x_0 op x_1) op x_2) ...``
bitwise, floats included; MPI's own Allreduce on the same inputs must agree with it
bitwise for integers and to rounding for floats. With one rank the policy reports "mpi"
and the same checks hold through the size-1 path.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fuelspmd.errors import CollectiveMismatchError, ConfigError
from fuelspmd.transport import ReduceOp

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

DTYPES = ["float32", "float64", "int32", "int64"]
OPS = [op.value for op in ReduceOp]
TIMEOUT = 20.0
MIN_CLASS = 1 << 16
NEED_CAP = 64 << 20  # the windows these tests make, per rank


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    chosen = t.set_all_reduce_policy(algorithm="shm")
    assert chosen == ("shm" if t.size > 1 else "mpi")
    shm = t._shm
    if shm is not None and shm.cap_bytes < NEED_CAP:  # every rank agrees on the cap
        t.finalize()
        pytest.skip(f"/dev/shm holds too little for these tests' windows ({shm.cap_note}); "
                    f"they need a cap of {NEED_CAP >> 20} MiB per rank")
    yield t
    t.finalize()
    assert t.shared_window_bytes == 0


def data(name: str, rank: int, count: int, dt: str) -> np.ndarray:
    """Rank ``rank``'s input: normal floats (so the fold order shows), small integers."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), rank, count])
    if dt.startswith("int"):
        return rng.integers(-3, 4, count).astype(dt)
    return rng.standard_normal(count).astype(dt)


def fold(name: str, size: int, count: int, dt: str, op: str) -> np.ndarray:
    """The shm path's definition: a left fold in rank order in ``dt``; avg divides after."""
    f = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
         "max": np.maximum}[op]
    acc = data(name, 0, count, dt)
    for r in range(1, size):
        f(acc, data(name, r, count, dt), out=acc)
    if op == "avg":
        if dt.startswith("int"):
            np.floor_divide(acc, size, out=acc)
        else:
            np.divide(acc, size, out=acc)
    return acc


def lent(t: Any, count: int, dt: str) -> np.ndarray:
    """``count`` elements of ``dt`` at the start of a lent area, on every rank that reduces
    that size in shared memory (a plain array elsewhere): the first ``lend`` of a size
    asks, and the size's next all_reduce (collective) makes the area on every rank."""
    d = np.dtype(dt)
    nbytes = count * d.itemsize
    area = t.lend(nbytes, d)
    if area is None and t.all_reduce_algorithm(nbytes, d) == "shm":
        t.all_reduce(np.zeros(count, d), "sum").wait()
        area = t.lend(nbytes, d)
        assert area is not None
    return np.empty(count, d) if area is None else area[:nbytes].view(d)


def mpi_result(t: Any, x: np.ndarray, op: str) -> np.ndarray:
    """MPICH's own Allreduce of ``x`` (avg: sum, then the transport's division)."""
    from mpi4py import MPI

    out = x.copy()
    mop = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
    t.comm.Allreduce(MPI.IN_PLACE, out, mop[op])
    if op == "avg":
        if out.dtype.kind == "i":
            np.floor_divide(out, t.size, out=out)
        else:
            np.divide(out, t.size, out=out)
    return out


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_every_op_and_dtype_matches_the_fold_and_mpi(world: Any, op: str, dt: str) -> None:
    for count in (1, world.size + 1, 1001, 40_003):  # odd, not divisible by the size
        name = f"ops-{op}-{dt}"
        x = data(name, world.rank, count, dt)
        want = fold(name, world.size, count, dt, op)
        theirs = mpi_result(world, x, op)
        world.all_reduce(x, op).wait()
        np.testing.assert_array_equal(x, want)
        if dt.startswith("int"):
            np.testing.assert_array_equal(theirs, want)
        else:
            tol = 1e-5 if dt == "float32" else 1e-12
            np.testing.assert_allclose(theirs, want, rtol=tol, atol=tol)
    if world.size > 1:
        assert world.shared_window_bytes >= MIN_CLASS  # it went through a window


def test_two_dimensional_buffer_and_empty(world: Any) -> None:
    x = data("2d", world.rank, 3 * 37, "float64").reshape(3, 37)
    world.all_reduce(x, "sum").wait()
    np.testing.assert_array_equal(x, fold("2d", world.size, 3 * 37, "float64", "sum")
                                  .reshape(3, 37))
    empty = np.empty((0, 4), np.float32)
    world.all_reduce(empty, "sum").wait()
    assert empty.shape == (0, 4)


def test_repeated_calls_reuse_the_window(world: Any) -> None:
    count = 70_001  # float32: 280 KiB, class 512 KiB
    x = data("reuse", world.rank, count, "float32")
    world.all_reduce(x, "max").wait()
    held = world.shared_window_bytes
    for i in range(5):
        y = data(f"reuse{i}", world.rank, count - i, "float32")
        world.all_reduce(y, "sum").wait()
        np.testing.assert_array_equal(y, fold(f"reuse{i}", world.size, count - i, "float32",
                                              "sum"))
    assert world.shared_window_bytes == held


def test_buffer_already_in_the_window(world: Any) -> None:
    count = 5003
    b = lent(world, count, "float64")
    assert world.size == 1 or world.lent(b)
    b[...] = data("zc", world.rank, count, "float64")
    world.all_reduce(b, "sum").wait()
    np.testing.assert_array_equal(b, fold("zc", world.size, count, "float64", "sum"))
    # inside the window but not at its start: copied in and out, still right
    inner = b[1:]
    inner[...] = data("zc-inner", world.rank, count - 1, "float64")
    world.all_reduce(inner, "min").wait()
    np.testing.assert_array_equal(inner, fold("zc-inner", world.size, count - 1, "float64",
                                              "min"))


def test_dtypes_it_leaves_to_mpi(world: Any) -> None:
    x = np.full(999, world.rank % 2 == 0)
    world.all_reduce(x, "sum").wait()  # logical or
    assert x.all()
    h = np.full(999, 1.0, np.float16)
    world.all_reduce(h, "sum").wait()
    np.testing.assert_array_equal(h, np.full(999, world.size, np.float16))


def test_policy_range_and_switching_off(world: Any) -> None:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)  # a transport of its own: the policy starts off
    try:
        assert t.shared_window_bytes == 0
        t.set_all_reduce_policy(algorithm="shm", min_bytes=1 << 20, max_bytes=4 << 20)
        small = data("small", t.rank, 1000, "int64")
        t.all_reduce(small, "sum").wait()
        np.testing.assert_array_equal(small, fold("small", t.size, 1000, "int64", "sum"))
        assert t.shared_window_bytes == 0  # below min_bytes: MPI
        big = data("big", t.rank, 1 << 18, "int64")  # 2 MiB
        t.all_reduce(big, "sum").wait()
        np.testing.assert_array_equal(big, fold("big", t.size, 1 << 18, "int64", "sum"))
        assert t.shared_window_bytes == (2 << 20 if t.size > 1 else 0)
        huge = data("huge", t.rank, 1 << 20, "int32")  # 4 MiB + 0: still in range
        t.all_reduce(huge, "prod").wait()
        np.testing.assert_array_equal(huge, fold("huge", t.size, 1 << 20, "int32", "prod"))
        assert t.set_all_reduce_policy(algorithm="mpi") == "mpi"
        assert t.shared_window_bytes == 0
        assert t.lend(800, np.dtype(np.int64)) is None  # without shm, nothing to lend
        big = data("big2", t.rank, 1 << 18, "int64")
        t.all_reduce(big, "sum").wait()
        np.testing.assert_array_equal(big, fold("big2", t.size, 1 << 18, "int64", "sum"))
    finally:
        t.finalize()


def test_cap_bounds_the_windows(world: Any) -> None:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    try:
        with pytest.raises(ConfigError, match="cap_bytes"):
            t.set_all_reduce_policy(algorithm="shm", cap_bytes=1000)
        if t.set_all_reduce_policy(algorithm="shm", cap_bytes=2 * MIN_CLASS) == "mpi":
            return
        x = data("cap", t.rank, 1 << 18, "float32")  # 1 MiB: beyond the cap, MPI takes it
        want = fold("cap", t.size, 1 << 18, "float32", "sum")
        t.all_reduce(x, "sum").wait()
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)
        assert t.shared_window_bytes == 0
        assert t.lend(1 << 20, np.dtype(np.float32)) is None
        assert "above the cap of" in t.explain_all_reduce(1 << 20)
    finally:
        t.finalize()


def test_a_small_dev_shm_caps_the_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window whose pages do not fit in /dev/shm would kill its rank with SIGBUS at the
    first store (a container's /dev/shm is 64 MiB by default): the cap per rank is at most
    a quarter of the free space over the ranks, what does not fit runs MPI's own (and is
    lent nothing), and explain_all_reduce says how to give /dev/shm more."""
    import fuelspmd_mpi._shm as shm_module
    from fuelspmd_mpi import plugin

    monkeypatch.setattr(shm_module, "_shm_free", lambda: 2 << 20)  # 2 MiB free
    t = plugin.world(timeout=TIMEOUT)
    try:
        if t.set_all_reduce_policy(algorithm="shm") == "mpi":
            return  # one rank
        assert t._shm.cap_bytes == (2 << 20) // (4 * t.size)
        assert t.all_reduce_algorithm(4 << 10, np.float32) == "shm"
        assert t.all_reduce_algorithm(1 << 20, np.float32) == "mpi"
        assert re.search(r"/dev/shm has 2 MiB free.*--shm-size",
                         t.explain_all_reduce(1 << 20))
        x = data("small-shm", t.rank, 1 << 18, "float32")  # 1 MiB: MPI's own
        t.all_reduce(x, "sum").wait()
        np.testing.assert_allclose(x, fold("small-shm", t.size, 1 << 18, "float32", "sum"),
                                   rtol=1e-5, atol=1e-5)
        assert t.lend(1 << 20, np.dtype(np.float32)) is None
    finally:
        t.finalize()


def test_bad_policy_arguments(world: Any) -> None:
    with pytest.raises(ConfigError, match="algorithm must be one of"):
        world.set_all_reduce_policy(algorithm="ring")
    with pytest.raises(ConfigError, match="min_bytes <= max_bytes"):
        world.set_all_reduce_policy(algorithm="shm", min_bytes=10, max_bytes=5)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_raise_on_every_rank(world: Any) -> None:
    with pytest.raises(CollectiveMismatchError, match=r"the ranks disagree .min_bytes"):
        world.set_all_reduce_policy(algorithm="shm", min_bytes=world.rank)
    # the same size class, different counts: caught by the segment headers, not a hang
    x = np.ones(1000 + world.rank, np.float32)
    with pytest.raises(CollectiveMismatchError, match="count"):
        world.all_reduce(x, "sum").wait()
    # different size classes: the headers share one flag line, so the counts differ there
    # (or, on a rank that reads them after a peer already raised and wrote its next call's
    # header, the call numbers: a raise either way)
    world.all_reduce(np.ones(1000, np.float32), "sum").wait()
    world.all_reduce(np.ones(100_000, np.float32), "sum").wait()
    z = np.ones(1000 if world.rank == 0 else 100_000, np.float32)
    with pytest.raises(CollectiveMismatchError, match=r"disagree on (count|call number)"):
        world.all_reduce(z, "sum").wait()
    y = data("after", world.rank, 1000, "float32")  # the path still works afterwards
    world.all_reduce(y, "sum").wait()
    np.testing.assert_array_equal(y, fold("after", world.size, 1000, "float32", "sum"))


def test_bench_correctness_check(world: Any) -> None:
    if world.size == 1:
        pytest.skip("the shm bench needs 2+ ranks")
    from fuelspmd.bench.shm import run

    rows = run(world, sizes=[4096, 65_540], rounds=2)
    assert [r["bytes"] for r in rows] == [4096, 65_540]
    assert all(r["correct"] for r in rows)
    assert all(r["mpi_ms"] > 0 and r["speedup_shm"] > 0 for r in rows)


def test_split_groups_start_off_and_reduce_their_own_ranks(world: Any) -> None:
    color = world.rank % 2
    sub = world.split(color, world.rank)
    try:
        assert sub.shared_window_bytes == 0
        assert sub.set_all_reduce_policy(algorithm="shm") == ("shm" if sub.size > 1 else "mpi")
        members = [r for r in range(world.size) if r % 2 == color]
        x = data(f"split-{world.rank}", 0, 3001, "float64")
        want = data(f"split-{members[0]}", 0, 3001, "float64")
        for r in members[1:]:
            np.add(want, data(f"split-{r}", 0, 3001, "float64"), out=want)
        sub.all_reduce(x, "sum").wait()
        np.testing.assert_array_equal(x, want)
    finally:
        sub.finalize()


def test_pipelined_path_matches_the_fold(world: Any) -> None:
    """From PIPE_MIN bytes, when every rank has a core, the all-reduce runs in chunks
    through two small slots: the same left fold, bitwise, chunk edges included."""
    from fuelspmd_mpi._shm import PIPE_MIN

    shm = world._shm
    count = PIPE_MIN // 8 + 12_345  # not a whole number of chunks, nor of ranks
    for dt, op in (("float64", "sum"), ("int64", "avg"), ("float32", "max")):
        name = f"pipe-{dt}-{op}"
        x = data(name, world.rank, count, dt)
        world.all_reduce(x, op).wait()
        np.testing.assert_array_equal(x, fold(name, world.size, count, dt, op))
    if shm is not None and shm.pipelined:
        assert shm._pipe_chunks > 0  # it went through the slots
        if world.size > 1:
            y = np.ones(count + world.rank, np.float64)  # ranks disagree on the count
            with pytest.raises(CollectiveMismatchError, match="count"):
                world.all_reduce(y, "sum").wait()


def test_one_rank_that_lost_its_core_sends_everyone_down_the_whole_size_path(
        world: Any) -> None:
    from fuelspmd_mpi._shm import PIPE_MIN

    shm = world._shm
    if shm is None or not shm.pipelined or world.size == 1:
        pytest.skip("needs the pipelined path: 2+ ranks, each with a core")
    count = PIPE_MIN // 8 + 7
    if world.rank == 0:
        shm._slow_left = 1  # as after a call whose handshakes waited for a time slice
    before = shm._pipe_chunks
    x = data("vote", world.rank, count, "float64")
    world.all_reduce(x, "sum").wait()
    np.testing.assert_array_equal(x, fold("vote", world.size, count, "float64", "sum"))
    assert shm._pipe_chunks == before  # no rank ran a chunk: they all agreed


def test_inputs_in_the_lent_area_reduce_in_place(world: Any) -> None:
    """Every rank's input in its lent area (the in-window path), then one rank's only
    (mixed: that rank copies in like the others), then none: the same fold each time,
    at a whole-size and at a pipelined size."""
    for count in (70_001, (4 << 20) // 4 + 3):
        area = lent(world, count, "float32")
        for placed in ("all", "rank 0", "none"):
            name = f"lent-{count}-{placed}"
            here = placed == "all" or (placed == "rank 0" and world.rank == 0)
            x = area if here else np.empty(count, np.float32)
            x[...] = data(name, world.rank, count, "float32")
            world.all_reduce(x, "sum").wait()
            np.testing.assert_array_equal(x, fold(name, world.size, count, "float32", "sum"))
        del area, x


def test_placed_inputs_take_two_phase_syncs_at_every_size(world: Any) -> None:
    """Inputs placed on every rank meet twice (the header, then after the fold that writes
    every rank's area): no vote for the pipelined path, no copy-out phase; each rank's
    area then holds the whole result."""
    shm = world._shm
    if shm is None or world.size == 1:
        pytest.skip("needs the shared-memory path: 2+ ranks on one node")
    for count in (70_001, (4 << 20) // 4 + 3):
        area = lent(world, count, "float32")
        area[...] = data(f"syncs-{count}", world.rank, count, "float32")
        before = shm._syncs
        world.all_reduce(area, "sum").wait()
        assert shm._syncs - before == 2
        np.testing.assert_array_equal(area, fold(f"syncs-{count}", world.size, count,
                                                 "float32", "sum"))
        del area


def test_a_rank_that_never_comes_is_a_timeout_not_a_hang(world: Any) -> None:
    """Rank 0 all-reduces through shared memory, the others never call: it raises
    CommTimeoutError at the transport's deadline (measured from the start of its wait, not
    from its last yield of the core), naming the operation."""
    import time

    from fuelspmd.errors import CommTimeoutError

    if world.size == 1:
        pytest.skip("needs a peer that does not come")
    t = world.split(0, world.rank)  # its own windows and flags: the world's stay in step
    try:
        assert t.set_all_reduce_policy(algorithm="shm") == "shm"
        t._shm.timeout = 0.5
        if world.rank == 0:
            start = time.monotonic()
            with pytest.raises(CommTimeoutError, match=r"shared memory.*0\.5 s"):
                t.all_reduce(np.ones(1 << 16, np.float32), "sum")
            assert time.monotonic() - start < 5.0
        world.barrier().wait()
    finally:
        t.finalize()


def test_a_new_lent_size_is_made_only_where_the_ranks_meet(world: Any) -> None:
    """lend is local: a size's first area is made by that size's next all_reduce, after
    its header sync, where every rank is known to be in the same call of the same size. A
    rank whose peers never come gets CommTimeoutError there; ranks that lent different
    sizes raise CollectiveMismatchError on every rank, and no window is made."""
    import time

    from fuelspmd.errors import CommTimeoutError

    if world.size == 1:
        pytest.skip("needs a peer")
    f32 = np.dtype(np.float32)
    for case in ("absent", "other size"):
        t = world.split(0, world.rank)
        try:
            assert t.set_all_reduce_policy(algorithm="shm") == "shm"
            t._shm.timeout = 0.5
            count = (3 << 18) if case == "absent" or world.rank == 0 else (1 << 18)
            assert t.lend(count * 4, f32) is None  # asks, allocates nothing
            assert t.shared_window_bytes == 0
            start = time.monotonic()
            if case == "absent" and world.rank == 0:
                with pytest.raises(CommTimeoutError, match="shared memory"):
                    t.all_reduce(np.ones(count, np.float32), "sum")
                assert time.monotonic() - start < 5.0
            elif case == "other size":
                with pytest.raises(CollectiveMismatchError, match="disagree on count"):
                    t.all_reduce(np.ones(count, np.float32), "sum")
            assert t.shared_window_bytes == 0
            world.barrier().wait()
        finally:
            t.finalize()


def test_a_held_lent_area_is_never_overwritten(world: Any) -> None:
    """lend lends the area only while nobody holds a view of it (the first ask
    of a class gets none: the class's next all_reduce makes it, on every rank, after its
    header sync); an all_reduce of a private buffer of the same size class never writes
    it."""
    count = 300_000  # float32, 1.2 MiB (the policy here: shm at every size)
    area = world.lend(count * 4, np.dtype(np.float32))
    if world.size == 1:
        assert area is None  # one rank: nothing is reduced in shared memory
        return
    if area is None:  # the class's first ask (no test before made it)
        first = data("first", world.rank, count, "float32")
        world.all_reduce(first, "sum").wait()  # copied in; adds the area it asked for
        np.testing.assert_array_equal(first, fold("first", world.size, count, "float32",
                                                  "sum"))
        area = world.lend(count * 4, np.dtype(np.float32))
    assert area is not None and area.nbytes >= count * 4
    held = area[:count * 4].view(np.float32)
    del area
    held[...] = data("held", world.rank, count, "float32")
    world.all_reduce(held, "sum").wait()
    want = fold("held", world.size, count, "float32", "sum")
    np.testing.assert_array_equal(held, want)
    assert world.lend(count * 4, np.dtype(np.float32)) is None  # held
    other = data("other", world.rank, count - 5, "float32")  # same size class, private
    world.all_reduce(other, "max").wait()
    np.testing.assert_array_equal(other, fold("other", world.size, count - 5, "float32", "max"))
    np.testing.assert_array_equal(held, want)  # untouched
    del held
    assert world.lend(count * 4, np.dtype(np.float32)) is not None  # free again
    assert world.lend(count * 4, np.dtype(np.float16)) is None  # MPI reduces it


def test_a_class_gets_another_lent_area_while_its_areas_are_held(world: Any) -> None:
    """The buckets of one step hold several results of one size at once: a rank that asks
    for a free area and finds them all held makes the class's next all_reduce add one on
    every rank; both areas then reduce in place, each keeping its own result."""
    count = 300_000  # float32, 1.2 MiB: class 2 MiB
    f32 = np.dtype(np.float32)
    first = world.lend(count * 4, f32)
    if world.size == 1:
        assert first is None
        return
    a = first[:count * 4].view(np.float32)
    del first
    a[...] = data("grow-a", world.rank, count, "float32")
    world.all_reduce(a, "sum").wait()
    others = []  # areas an earlier test had the class add: held too
    while (more := world.lend(count * 4, f32)) is not None:
        others.append(more)
    before = world.shared_window_bytes  # every area held, and one more asked for
    b = data("grow-b", world.rank, count, "float32")  # the call that adds it
    world.all_reduce(b, "sum").wait()
    assert world.shared_window_bytes > before
    second = world.lend(count * 4, f32)
    assert second is not None
    c = second[:count * 4].view(np.float32)
    del second
    c[...] = data("grow-c", world.rank, count, "float32")
    world.all_reduce(c, "max").wait()
    np.testing.assert_array_equal(a, fold("grow-a", world.size, count, "float32", "sum"))
    np.testing.assert_array_equal(b, fold("grow-b", world.size, count, "float32", "sum"))
    np.testing.assert_array_equal(c, fold("grow-c", world.size, count, "float32", "max"))
    # placed in different areas on different ranks (rank 0 swaps): still one reduction
    if world.rank == 0:
        a, c = c, a
    a[...] = data("grow-mixed", world.rank, count, "float32")
    world.all_reduce(a, "sum").wait()
    np.testing.assert_array_equal(a, fold("grow-mixed", world.size, count, "float32", "sum"))
    del a, c, others


def test_a_held_lent_area_outlives_a_policy_change() -> None:
    """A result that lives in a lent area stays readable after the windows are freed."""
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    try:
        t.set_all_reduce_policy(algorithm="shm")
        x = lent(t, 4096, "float64")
        x[...] = data("outlive", t.rank, 4096, "float64")
        t.all_reduce(x, "sum").wait()
        t.set_all_reduce_policy(algorithm="mpi")  # frees the windows, but not this one
        np.testing.assert_array_equal(x, fold("outlive", t.size, 4096, "float64", "sum"))
    finally:
        t.finalize()


def test_placed_inputs_allocate_nothing_more() -> None:
    """The size's first all_reduce (a buffer of its own) makes the copy-in window and the
    lent area it was asked for; placed calls after it add no window, and a call with one
    rank's input placed and the others' not reduces through the copy-in window."""
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    try:
        if t.set_all_reduce_policy(algorithm="shm") != "shm":
            return  # one rank
        count = 200_000  # float32, 800 KB: class 1 MiB, below the pipelined sizes
        area = lent(t, count, "float32")
        assert t.shared_window_bytes == 2 << 20  # the copy-in window and the lent one
        for i in range(3):
            area[...] = data(f"only-placed{i}", t.rank, count, "float32")
            t.all_reduce(area, "sum").wait()
            np.testing.assert_array_equal(area, fold(f"only-placed{i}", t.size, count,
                                                     "float32", "sum"))
        mixed = area if t.rank == 0 else np.empty(count, np.float32)
        mixed[...] = data("first-copied", t.rank, count, "float32")
        t.all_reduce(mixed, "max").wait()
        np.testing.assert_array_equal(mixed, fold("first-copied", t.size, count, "float32",
                                                  "max"))
        assert t.shared_window_bytes == 2 << 20
        del area, mixed
    finally:
        t.finalize()
