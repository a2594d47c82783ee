"""The MPI transport against numpy, at any world size.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_transport.py``
(plain ``pytest`` skips these). Every rank can build every rank's input from a seed, so
each rank computes the expected result locally with numpy, without communicating.
Values are small integers, so sums and products are exact in every float type and the
16-bit results can be compared exactly (avg divides, so it gets a dtype tolerance).
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    DeviceError,
    DTypeError,
    ShapeError,
)
from fuelspmd.transport import Check, Disagreement, ReduceOp, Transport

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]
OPS = [op.value for op in ReduceOp]
TIMEOUT = 20.0  # every wait in this file; a hang fails the test instead of blocking CI
RTOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-6, "float64": 1e-12}


@pytest.fixture(scope="module")
def world() -> Iterator[Transport]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    yield t
    t.barrier().wait()


def data(name: str, rank: int, n: int, dt: str) -> np.ndarray:
    """Rank ``rank``'s input of the test ``name``: n small integers (or bools) of ``dt``."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), rank, n])
    if dt == "bool":
        return rng.random(n) < 0.5
    return rng.integers(-3, 4, n).astype(to_numpy(dt))


def reduce_ref(stack: np.ndarray, op: str, dt: str) -> np.ndarray:
    """The reduction over axis 0 as the transport defines it, computed in float64/int64."""
    if dt == "bool":
        f = {"sum": np.any, "max": np.any, "prod": np.all, "min": np.all}[op]
        return f(stack, axis=0)
    wide = stack.astype(np.float64 if dt.startswith(("float", "bfloat")) else np.int64)
    if op == "avg":
        total = wide.sum(axis=0)
        out = total // len(stack) if dt.startswith("int") else total / len(stack)
    else:
        out = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](wide, axis=0)
    return out.astype(to_numpy(dt))


def check(got: np.ndarray, want: np.ndarray, dt: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dt in RTOL:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=RTOL[dt], atol=RTOL[dt])
    else:
        np.testing.assert_array_equal(got, want)


def test_world_matches_mpi(world: Transport) -> None:
    from mpi4py import MPI

    assert (world.rank, world.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    assert world.world_ranks == tuple(range(world.size))
    assert world.name == "mpi" and isinstance(world, Transport)
    assert f"world ranks {list(range(world.size))}" in world.describe()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dt", DTYPES)
def test_all_reduce(world: Transport, dt: str, op: str) -> None:
    if dt == "bool" and op == "avg":
        with pytest.raises(DTypeError, match="avg is not defined for bool"):
            world.all_reduce(data("ar", 0, 3, dt), op)
        return
    for n in (0, 1, 7, 1001):
        name = f"all_reduce/{dt}/{op}"
        buf = data(name, world.rank, n, dt)
        world.all_reduce(buf, op).wait()
        want = reduce_ref(np.stack([data(name, r, n, dt) for r in range(world.size)]), op, dt)
        check(buf, want, dt)
    grid = data("grid", world.rank, 15, dt).reshape(3, 5)  # n-d buffers reduce elementwise
    world.all_reduce(grid, ReduceOp.parse(op)).wait()
    want = reduce_ref(np.stack([data("grid", r, 15, dt) for r in range(world.size)]), op, dt)
    check(grid, want.reshape(3, 5), dt)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dt", DTYPES)
def test_reduce_scatter(world: Transport, dt: str, op: str) -> None:
    if dt == "bool" and op == "avg":
        with pytest.raises(DTypeError):
            world.reduce_scatter(data("rs", 0, world.size, dt), np.empty(1, bool), op)
        return
    size = world.size
    for n in (0, 1, 5):
        name = f"reduce_scatter/{dt}/{op}/{n}"
        recv = np.empty(n, to_numpy(dt))
        world.reduce_scatter(data(name, world.rank, n * size, dt), recv, op).wait()
        full = reduce_ref(np.stack([data(name, r, n * size, dt) for r in range(size)]), op, dt)
        check(recv, full[world.rank * n:(world.rank + 1) * n], dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_all_gather(world: Transport, dt: str) -> None:
    for n in (0, 1, 7, 1001):
        name = f"all_gather/{dt}/{n}"
        recv = np.empty(n * world.size, to_numpy(dt))
        world.all_gather(data(name, world.rank, n, dt), recv).wait()
        check(recv, np.concatenate([data(name, r, n, dt) for r in range(world.size)]), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_broadcast_from_every_root(world: Transport, dt: str) -> None:
    for root in range(world.size):
        for n in (0, 1, 33):
            name = f"broadcast/{dt}/{root}/{n}"
            buf = data(name, world.rank, n, dt)
            world.broadcast(buf, root).wait()
            check(buf, data(name, root, n, dt), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_all_to_all(world: Transport, dt: str) -> None:
    size, rank = world.size, world.rank
    for n in (0, 1, 3):
        name = f"all_to_all/{dt}/{n}"
        recv = np.empty(n * size, to_numpy(dt))
        world.all_to_all(data(name, rank, n * size, dt), recv).wait()
        want = np.concatenate([data(name, r, n * size, dt)[rank * n:(rank + 1) * n]
                               for r in range(size)])
        check(recv, want, dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_send_recv_ring(world: Transport, dt: str) -> None:
    """Each rank sends to the next and receives from the previous (to itself at size 1)."""
    size, rank = world.size, world.rank
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    for n in (0, 1, 17):
        name = f"ring/{dt}/{n}"
        recv = np.empty(n, to_numpy(dt))
        r = world.recv(recv, prev, 5)
        s = world.send(data(name, rank, n, dt), nxt, 5)
        s.wait()
        r.wait()
        assert r.test() and s.test()
        check(recv, data(name, prev, n, dt), dt)


def test_tags_keep_messages_apart(world: Transport) -> None:
    size, rank = world.size, world.rank
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    a, b = np.empty(4, np.int64), np.empty(4, np.int64)
    rb, ra = world.recv(b, prev, 2), world.recv(a, prev, 1)  # posted in the other order
    sends = [world.send(np.full(4, 10 * rank + t, np.int64), nxt, t) for t in (1, 2)]
    for w in (*sends, ra, rb):
        w.wait()
    np.testing.assert_array_equal(a, np.full(4, 10 * prev + 1))
    np.testing.assert_array_equal(b, np.full(4, 10 * prev + 2))


def test_recv_shorter_than_the_message(world: Transport) -> None:
    """A receive buffer smaller than the message is a mismatch, reported on the receiver."""
    size, rank = world.size, world.rank
    r = world.recv(np.empty(3, np.float32), (rank - 1) % size, 6)
    s = world.send(np.ones(5, np.float32), (rank + 1) % size, 6)
    with pytest.raises(CollectiveMismatchError, match=r"recv #\d+ from peer .* longer than"):
        r.wait()
    s.wait()
    world.barrier().wait()


def test_split(world: Transport) -> None:
    """Split by parity, ordered by descending world rank; reduce and split again inside."""
    size, rank = world.size, world.rank
    sub = world.split(rank % 2, -rank)
    members = sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)
    try:
        assert sub.size == len(members) and sub.rank == members.index(rank)
        assert sub.world_ranks == tuple(members)
        assert f"color={rank % 2}" in sub.describe()
        buf = data("split", rank, 9, "float32")
        sub.all_reduce(buf, "sum").wait()
        check(buf, reduce_ref(np.stack([data("split", r, 9, "float32") for r in members]),
                              "sum", "float32"), "float32")
        gathered = np.empty(sub.size, np.int64)
        sub.all_gather(np.array([rank], np.int64), gathered).wait()
        np.testing.assert_array_equal(gathered, members)
        inner = sub.split(0, sub.rank)  # one color: a copy of sub, in sub's order
        assert inner.world_ranks == sub.world_ranks
        inner.barrier().wait()
        inner.finalize()
    finally:
        sub.finalize()


class DeviceLike:
    """A contiguous array of another library (as a cupy array looks to the transport)."""

    def __init__(self, a: np.ndarray) -> None:
        self.flags, self.dtype, self.size, self.shape = a.flags, a.dtype, a.size, a.shape


def test_bad_input_raises_before_communicating(world: Transport) -> None:
    """Every rank raises the same typed error, and the group stays usable afterwards."""
    size = world.size
    f32 = np.zeros(4 * size, np.float32)
    with pytest.raises(ShapeError, match="C-contiguous"):
        world.all_reduce(np.zeros((4, 4), np.float32)[:, ::2], "sum")
    with pytest.raises(ShapeError, match=f"recv must have {3 * size}"):
        world.all_gather(np.zeros(3, np.float32), np.zeros(3 * size + 1, np.float32))
    with pytest.raises(DTypeError, match="use one dtype"):
        world.all_gather(np.zeros(1, np.float32), np.zeros(size, np.float64))
    with pytest.raises(DTypeError, match="not supported"):
        world.all_reduce(np.zeros(2, np.complex64), "sum")
    with pytest.raises(ShapeError):
        world.reduce_scatter(np.zeros(4 * size + 1, np.float32), np.zeros(4, np.float32), "sum")
    with pytest.raises(ShapeError):
        world.all_to_all(np.zeros(4 * size, np.float32), np.zeros(4 * size + 1, np.float32))
    if size > 1:
        with pytest.raises(ShapeError, match="not divisible"):
            world.all_to_all(np.zeros(4 * size + 1, np.float32),
                             np.zeros(4 * size + 1, np.float32))
    with pytest.raises(ConfigError, match=f"valid: 0..{size - 1}"):
        world.broadcast(f32, size)
    with pytest.raises(ConfigError, match="outside the group"):
        world.send(f32, -1, 0)
    with pytest.raises(ConfigError, match="outside the group"):
        world.recv(f32, size, 0)
    with pytest.raises(ConfigError, match="tag"):
        world.send(f32, 0, -3)
    with pytest.raises(ConfigError, match="unknown reduce op"):
        world.all_reduce(f32, "mean")
    with pytest.raises(ConfigError, match="color"):
        world.split(-1, 0)
    with pytest.raises(DeviceError, match="host"):
        world.all_reduce(DeviceLike(np.zeros(4, np.float32)), "sum")
    with pytest.raises(DeviceError, match="host"):
        world.all_gather(np.zeros(2, np.float32), DeviceLike(np.zeros(2 * size, np.float32)))
    buf = np.ones(3, np.float32)
    world.all_reduce(buf, "sum").wait()
    np.testing.assert_array_equal(buf, np.full(3, size, np.float32))


def test_recv_nobody_sends_times_out(world: Transport) -> None:
    """Every rank waits 0.5 s on a receive with a tag nobody uses, then cancels it."""
    peer = (world.rank + 1) % world.size
    work = world.recv(np.empty(2, np.float32), peer, 4242)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as err:
        work.wait(0.5)
    took = time.monotonic() - start
    assert 0.5 <= took < 5.0, took
    text = str(err.value)
    assert "recv #" in text and f"from peer {peer}" in text and "tag 4242" in text
    assert "0.5 s" in text and "world ranks" in text
    assert not work.test()
    assert work.cancel() is True
    world.barrier().wait()


def test_default_timeout_comes_from_world() -> None:
    from fuelspmd_mpi import plugin

    short = plugin.world(timeout=0.3)
    work = short.recv(np.empty(1, np.int32), short.rank, 4343)  # nobody sends it
    with pytest.raises(CommTimeoutError, match=r"0\.3 s"):
        work.wait()
    work.cancel()
    with pytest.raises(ConfigError, match="positive"):
        plugin.world(timeout=0)


@pytest.mark.mpi(min_size=2)
def test_collective_with_a_missing_rank_times_out(world: Transport) -> None:
    """The last rank joins 2 s late: the others time out at 0.5 s, then all complete."""
    sub = world.split(0, world.rank)  # a private group, so the late rank cannot reorder
    last = sub.size - 1
    try:
        buf = np.full(5, sub.rank, np.float64)
        world.barrier().wait()
        if sub.rank == last:
            time.sleep(2.0)
            sub.all_reduce(buf, "sum").wait()
        else:
            work = sub.all_reduce(buf, "sum")
            start = time.monotonic()
            with pytest.raises(CommTimeoutError) as err:
                work.wait(0.5)
            assert time.monotonic() - start < 2.0
            text = str(err.value)
            assert "all_reduce #0" in text and "color=0" in text and "0.5 s" in text
            work.wait()  # the late rank joins; the collective completes and the group is clean
        np.testing.assert_array_equal(buf, np.full(5, sum(range(sub.size)), np.float64))
        sub.barrier().wait()
    finally:
        sub.finalize()


@pytest.mark.mpi(min_size=2)
def test_a_check_meeting_that_timed_out_refuses_the_next(world: Transport) -> None:
    """The last rank meets 2 s late: the others' check times out at 0.5 s and leaves the
    meeting posted, so their next check raises CommError without touching MPI (a second
    meeting would start while the first may still be matched); the late rank's meeting
    then completes against the posted one."""
    from fuelspmd.errors import CommError

    sub = world.split(0, world.rank)  # type: ignore[attr-defined]
    last = sub.size - 1

    def meet(timeout: float) -> None:
        sub.checked(Check([7, 0, 0], lambda rows: all(r == rows[0] for r in rows),
                          timeout=timeout), "barrier")

    try:
        world.barrier().wait()
        if sub.rank == last:
            time.sleep(2.0)
            meet(TIMEOUT)
        else:
            with pytest.raises(CommTimeoutError, match=r"barrier \(check\) #0"):
                meet(0.5)
            with pytest.raises(CommError, match=r"the check of barrier #0 failed "
                               r"\(CommTimeoutError\); the job must end"):
                meet(TIMEOUT)
        world.barrier().wait()  # progress: the posted meeting completes on every rank
    finally:
        sub.finalize()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_temporary_buffers_live_until_the_work_completes(world: Transport) -> None:
    """A Work keeps its buffers: MPI must never write into memory the caller let go of."""
    import gc

    n = world.size
    count = 512 * 1024  # 2 MiB of float32: large enough for MPI's rendezvous path
    works = []
    for _ in range(4):
        works.append(world.all_reduce(np.ones(count, np.float32), ReduceOp.SUM))
        works.append(world.all_gather(np.ones(count // 8, np.float32),
                                      np.empty(count // 8 * n, np.float32)))
        gc.collect()
        _ = [np.random.rand(4096) for _ in range(64)]  # reuse freed memory if any was freed
    for w in works:
        w.wait(30)


class _Device:
    """A stand-in GPU array: the face the staging reads, counting its copies to the host."""

    __cuda_array_interface__: Any = None  # only its presence is read

    def __init__(self, n: int) -> None:
        self.host = np.ones(n, np.float32)
        self.dtype, self.size, self.shape = self.host.dtype, n, (n,)
        self.nbytes, self.flags, self.copies = self.host.nbytes, {"C_CONTIGUOUS": True}, 0
        self.device = types.SimpleNamespace(id=0)

    def get(self, out: np.ndarray, stream: Any = None) -> None:
        self.copies += 1
        out[...] = self.host

    def set(self, host: np.ndarray) -> None:
        self.host[...] = host


def test_a_checked_gpu_all_reduce_meets_before_its_host_copy_moves(
        world: Transport, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged all_reduce is reduced on a host copy outside the check, so its words meet
    first: ranks that disagree raise Disagreement before any copy is made (MPI never sees
    the mismatched collective); ranks that agree get the sum back on the device."""
    stream = types.SimpleNamespace(synchronize=lambda: None)
    cuda = types.SimpleNamespace(alloc_pinned_memory=bytearray, get_current_stream=lambda: stream,
                                 Device=lambda index: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    t = world.split(0, world.rank)  # type: ignore[attr-defined]
    t.cuda_aware = (False, "stand-in GPU buffers are staged")

    def checked(buf: _Device) -> None:
        words = [buf.size, 0, 0]
        t.checked(Check(words, lambda rows: all(r == rows[0] for r in rows), timeout=TIMEOUT),
                  "all_reduce", buf, ReduceOp.SUM).wait(TIMEOUT)

    try:
        if world.size > 1:
            bad = _Device(4 if world.rank == 0 else 8)
            with pytest.raises(Disagreement):
                checked(bad)
            assert bad.copies == 0
        good = _Device(5)
        checked(good)
        assert good.copies == 1
        np.testing.assert_array_equal(good.host, np.full(5, world.size, np.float32))
    finally:
        t.finalize()


def test_a_checked_avg_of_a_scalar_is_divided(world: Transport) -> None:
    """A small all_reduce rides whole in the check record and is reduced there: a 0-d
    buffer's avg is divided too, the first call and the next (which reuses its views)."""
    def agrees(rows: list[list[int]]) -> bool:
        return all(r == rows[0] for r in rows)

    for _ in range(2):
        buf = np.array(float(world.rank), np.float32)
        world.checked(Check([1, 2, 3], agrees, timeout=TIMEOUT),  # type: ignore[attr-defined]
                      "all_reduce", buf, ReduceOp.AVG).wait(TIMEOUT)
        assert buf.shape == () and buf == np.float32(sum(range(world.size)) / world.size)


@pytest.mark.parametrize("dt", ["float32", "float64", "int64", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_a_checked_small_all_reduce_is_the_fold_in_rank_order(
        world: Transport, op: str, dt: str) -> None:
    """A small all_reduce reduced in its check record: every rank gets the left fold
    ``((x_0 op x_1) op x_2) ...`` bit for bit (normal floats, so the order shows), in the
    staging dtype where there is one (float16: float32), 0-d and strided shapes alike, on
    the first call of a kind and on the next, which reuses that kind's views."""
    f = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
         "max": np.maximum}[op]
    wide = np.float32 if dt == "float16" else to_numpy(dt)
    for shape in [(), (1,), (3, 2)]:
        for call in range(2):
            rng = [np.random.default_rng([call, len(shape), r]) for r in range(world.size)]
            xs = [g.standard_normal(shape).astype(to_numpy(dt)) for g in rng]
            acc = np.array(xs[0], wide)
            for x in xs[1:]:
                f(acc, x.astype(wide), out=acc)
            if op == "avg":
                acc = acc // world.size if acc.dtype.kind == "i" else acc / world.size
            buf = xs[world.rank].copy()
            world.checked(Check([4, 5, 6], lambda rows: all(r == rows[0] for r in rows),
                                timeout=TIMEOUT),  # type: ignore[attr-defined]
                          "all_reduce", buf, ReduceOp.parse(op)).wait(TIMEOUT)
            assert buf.shape == shape
            assert buf.tobytes() == np.asarray(acc).astype(buf.dtype).tobytes(), (shape, call)
