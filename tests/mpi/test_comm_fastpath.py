"""Donation: a leaf the caller gave up (``Tensor.donate``) may be written in place by a
collective, and nothing else the caller holds ever is.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_comm_fastpath.py``
(N = 2..4; at one rank a collective returns its input and there is nothing to donate).
``x = comm.all_reduce(x.donate())`` reuses one buffer, as ``Allreduce(IN_PLACE)`` does;
without ``donate`` (the caller's array, a Tensor, a view, a pending node) the collective
works on a copy, so no caller sees its data change; a donated tensor is spent.
"""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
N = 1000


@pytest.fixture(scope="module")
def world(world: fs.World) -> fs.World:
    if world.size == 1:
        pytest.skip("a size-1 collective returns its input: nothing to donate")
    return world


def _total(size: int) -> float:
    return float(sum(r + 1 for r in range(size)))


def test_a_dead_leaf_is_donated_and_the_sums_are_right(world: fs.World) -> None:
    comm = world.comm
    x = fs.tensor(np.full(N, world.rank + 1.0, np.float32))
    addrs = [x.node.buffer.__array_interface__["data"][0]]
    for _ in range(3):
        x = comm.all_reduce(x.donate())
        x.realize()
        addrs.append(x.node.buffer.__array_interface__["data"][0])
    # no copy was made: where the transport reduces this size in shared memory
    # (init(all_reduce="shm")), the leaf moves once into a lent area (made on every rank
    # at the end of the first all_reduce of its size, which asked for it) and stays there
    moves = [k for k in range(1, len(addrs)) if addrs[k] != addrs[k - 1]]
    assert moves in ([], [1], [2]), addrs
    # three sums: the first gives the total of the ranks' values, each next one x size
    want = _total(world.size) * world.size ** 2
    np.testing.assert_array_equal(x.numpy(), np.full(N, want, np.float32))


def test_a_broadcast_of_a_dead_leaf_is_donated(world: fs.World) -> None:
    comm = world.comm
    x = fs.tensor(np.arange(N, dtype=np.float64) * (world.rank + 1))
    addr = x.node.buffer.__array_interface__["data"][0]
    x = comm.broadcast(x.donate(), root=world.size - 1)
    x.realize()
    assert x.node.buffer.__array_interface__["data"][0] == addr
    np.testing.assert_array_equal(x.numpy(), np.arange(N, dtype=np.float64) * world.size)


def test_the_callers_array_is_never_overwritten(world: fs.World) -> None:
    comm = world.comm
    arr = np.full(N, world.rank + 1.0, np.float32)
    y = comm.all_reduce(fs.tensor(arr)).realize()  # the caller still holds arr
    np.testing.assert_array_equal(arr, np.full(N, world.rank + 1.0, np.float32))
    np.testing.assert_array_equal(y.numpy(), np.full(N, _total(world.size), np.float32))


def test_a_held_tensor_a_view_or_a_pending_reader_forces_the_copy(world: fs.World) -> None:
    comm = world.comm
    mine = world.rank + 1.0
    held = fs.tensor(np.full(N, mine, np.float32))
    comm.all_reduce(held).realize()
    np.testing.assert_array_equal(held.numpy(), np.full(N, mine, np.float32))

    base = np.full(2 * N, mine, np.float32)
    view = fs.tensor(base[:N])  # the leaf's buffer is a view: base would see a write
    view = comm.all_reduce(view)
    view.realize()
    np.testing.assert_array_equal(base, np.full(2 * N, mine, np.float32))

    z = fs.tensor(np.full(N, mine, np.float32))
    doubled = z * 2.0  # a pending node reads the leaf after the all_reduce
    s = comm.all_reduce(z)
    del z
    s.realize()
    np.testing.assert_array_equal(doubled.numpy(), np.full(N, 2 * mine, np.float32))
    np.testing.assert_array_equal(s.numpy(), np.full(N, _total(world.size), np.float32))


def test_a_donated_tensor_is_spent_and_only_writable_arrays_can_be_donated(
        world: fs.World) -> None:
    comm = world.comm
    x = fs.tensor(np.full(N, 1.0, np.float32))
    y = comm.all_reduce(x.donate())
    y.realize()
    with pytest.raises(fs.ConfigError, match="donated"):
        x.numpy()
    with pytest.raises(fs.ConfigError, match="donated"):
        (x + 1).realize()
    frozen = np.ones(N, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(fs.ConfigError, match="writable C-contiguous"):
        fs.tensor(frozen).donate()
    with pytest.raises(fs.ConfigError, match="writable C-contiguous"):
        fs.tensor(np.ones((N, 2), np.float32)[:, 0]).donate()
    np.testing.assert_array_equal(y.numpy(), np.full(N, world.size, np.float32))
