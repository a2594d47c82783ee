"""Collectives of realised inputs under ``mpiexec``: issued without a plan, bucketed, in
creation order whatever order each rank realises them in, equal to numpy.

Run on every rank (any N; at one rank a collective returns its input):
``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_direct_collectives.py``
"""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.graph import default_executor

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
TIMEOUT = 20.0


def _value(k: int, r: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([k, r]).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bucket", [0, 4 << 10, 4 << 20])
def test_many_small_all_reduces_of_leaves_match_numpy(world: fs.World, bucket: int) -> None:
    comm = fs.Communicator(world.comm.transport, device=world.device, timeout=TIMEOUT,
                           bucket_bytes=bucket)
    r, n = comm.rank, comm.size
    shapes = [(64,), (8, 8), (3,), (), (16, 4)] * 20
    leaves = [fs.tensor(_value(k, r, s)) for k, s in enumerate(shapes)]
    misses = []
    for _ in range(2):  # the second step reuses the bucket buffer of the first
        ys = [comm.all_reduce(t) for t in leaves]
        fs.realize(*(ys[::-1] if r % 2 else ys))  # odd ranks realise last-first
        misses.append(default_executor().cache.misses)
        for k, s in enumerate(shapes):
            want = sum(_value(k, q, s).astype(np.float64) for q in range(n))
            np.testing.assert_allclose(ys[k].numpy(), want, rtol=1e-5, atol=1e-5)
            assert ys[k].shape == s
        del ys
    assert misses[1] == misses[0]  # the second step bound the first step's plan
    for t, (k, s) in zip(leaves, enumerate(shapes)):  # the inputs are untouched
        np.testing.assert_array_equal(t.numpy(), _value(k, r, s))


def test_mixed_collectives_realised_in_reverse(world: fs.World) -> None:
    comm = fs.Communicator(world.comm.transport, device=world.device, timeout=TIMEOUT,
                           bucket_bytes=1 << 20)
    r, n = comm.rank, comm.size
    a = fs.tensor(np.arange(6.0) + r)
    b = fs.tensor(np.full(n * 2, float(r)))
    ys = [comm.all_reduce(a), comm.broadcast(b, n - 1), comm.all_reduce(a, "max"),
          comm.reduce_scatter(b, 0), comm.all_reduce(b)]
    fs.realize(*(ys[::-1] if r == 0 else ys))
    np.testing.assert_array_equal(ys[0].numpy(), n * np.arange(6.0) + sum(range(n)))
    np.testing.assert_array_equal(ys[1].numpy(), np.full(n * 2, float(n - 1)))
    np.testing.assert_array_equal(ys[2].numpy(), np.arange(6.0) + n - 1)
    np.testing.assert_array_equal(ys[3].numpy(), np.full(2, float(sum(range(n)))))
    np.testing.assert_array_equal(ys[4].numpy(), np.full(n * 2, float(sum(range(n)))))


def test_results_placed_in_the_shared_window_are_right_and_kept(world: fs.World) -> None:
    """Where the transport reduces in shared memory (the transport's ``lend``), the graph puts the
    input there: ``x = comm.all_reduce(x)`` then runs in place step after step (from the
    second: the first asks for the size's area, which its call adds), a result still held
    keeps its values while the next all_reduces run, and a bucket is reduced in the window
    too."""
    t = world.comm.transport
    comm = fs.Communicator(t, device=world.device, timeout=TIMEOUT, bucket_bytes=4 << 20)
    r, n = comm.rank, comm.size
    count = 1 << 20  # 4 MiB of float32: shm on one node with a core per rank
    placed = ("route" in t.capabilities
              and t.all_reduce_algorithm(count * 4, np.float32) == "shm")  # type: ignore[attr-defined]
    x = fs.tensor(_value(1, r, (count,)))
    want = sum(_value(1, q, (count,)).astype(np.float64) for q in range(n))
    addresses = []
    for step in range(3):
        x = comm.all_reduce(x.donate())
        x.realize()
        np.testing.assert_allclose(x.numpy(), want * n ** step, rtol=1e-5, atol=1e-5 * n ** step)
        addresses.append(x.numpy().__array_interface__["data"][0])
    if placed:
        assert addresses[1] == addresses[2]  # reduced where it lay: nothing copied
    kept = x  # held: the next all_reduce of this size may not use the window
    other = comm.all_reduce(fs.tensor(_value(2, r, (count,))))
    other.realize()
    np.testing.assert_allclose(other.numpy(), sum(_value(2, q, (count,)) for q in range(n)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kept.numpy(), want * n ** 2, rtol=1e-5, atol=1e-4)
    del x, kept, other
    shapes = [(1 << 14,)] * 64  # one 4 MiB bucket
    leaves = [fs.tensor(_value(10 + k, r, s)) for k, s in enumerate(shapes)]
    first = [comm.all_reduce(v) for v in leaves]
    fs.realize(*first)
    second = [comm.all_reduce(v) for v in leaves]  # the window is held by `first`
    fs.realize(*second)
    for k, s in enumerate(shapes):
        ref = sum(_value(10 + k, q, s).astype(np.float64) for q in range(n))
        np.testing.assert_allclose(first[k].numpy(), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(second[k].numpy(), ref, rtol=1e-5, atol=1e-5)


def test_every_bucket_of_a_step_is_reduced_in_a_lent_area_once_there_are_enough(
        world: fs.World) -> None:
    """Four buckets of one size per step: each step places the buckets that find a free
    area and asks for more (the class's next all_reduce adds one, after its header sync);
    by the fourth step every bucket is placed (its results are views of a lent area),
    each step's results right while the previous step's are held."""
    t = world.comm.transport
    comm = fs.Communicator(t, device=world.device, timeout=TIMEOUT, bucket_bytes=1 << 20)
    r, n = comm.rank, comm.size
    shapes = [(1 << 16,)] * 16  # 256 KiB each: four 1 MiB buckets
    leaves = [fs.tensor(_value(40 + k, r, s)) for k, s in enumerate(shapes)]
    refs = [sum(_value(40 + k, q, s).astype(np.float64) for q in range(n))
            for k, s in enumerate(shapes)]
    placed = (n > 1 and "route" in t.capabilities
              and t.all_reduce_algorithm(1 << 20, np.float32) == "shm")  # type: ignore[attr-defined]
    shm = t.inner._shm if placed else None  # type: ignore[attr-defined]  # room for 4 areas
    placed = placed and shm is not None and shm.cap_bytes >= 8 << 20
    held: list[fs.Tensor] = []
    for step in range(4):
        ys = [comm.all_reduce(v) for v in leaves]
        fs.realize(*ys)
        for y, ref in zip(ys, refs):
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
        for y, ref in zip(held, refs):  # the last step's results, untouched
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
        if placed and step == 3:
            assert all(t.lent(y.numpy()) for y in ys)  # type: ignore[attr-defined]
        held = ys if step == 0 else []  # the second step runs while the first's are held
        del ys
