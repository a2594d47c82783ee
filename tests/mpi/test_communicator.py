"""The lazy Communicator over the guarded MPI world, at any world size.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_communicator.py``
(N = 1..4). The programs are the ones tests/unit/test_device_group.py runs in a
DeviceGroup of the same size (tests/spmd_programs.py), checked against the same numpy
references: one SPMD function, the same numbers in both modes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.errors import CollectiveMismatchError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import spmd_programs as P

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
TIMEOUT = 20.0


def test_every_collective_matches_numpy(world: fs.World) -> None:
    comm = world.comm
    got = P.every_collective(comm, P.rank_input(comm.rank, comm.size))
    want = P.every_collective_reference(comm.size)[comm.rank]
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=P.RTOL, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_sixteen_bit_collectives_at_every_threshold(world: fs.World, dt: str) -> None:
    """float16 and bfloat16 through every collective, alone and bucketed, at sizes past
    each threshold of the path (inline check records, spare buffers, shared-memory chunks,
    buckets): exact results, as in a DeviceGroup (tests/unit/test_device_group.py)."""
    comm = world.comm
    for nbytes in P.SIXTEEN_BIT_BYTES:
        got = P.sixteen_bit(comm, P.sixteen_bit_input(comm.rank, comm.size, dt, nbytes))
        want = P.sixteen_bit_reference(comm.size, dt, nbytes)[comm.rank]
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{nbytes} B {k}")


def test_gradients_through_collectives(world: fs.World) -> None:
    comm = world.comm
    x, w, cot = P.grad_inputs(comm.rank, comm.size)
    got = P.grad_program(comm, x, w, cot)
    np.testing.assert_allclose(got, P.grad_reference(comm.size)[comm.rank], rtol=1e-9,
                               atol=1e-9)


def test_realising_a_later_collective_first(world: fs.World) -> None:
    """Ranks realise in different orders; the transport still sees creation order."""
    comm = world.comm
    n = comm.size
    t = fs.tensor(np.full(5, float(comm.rank + 1)), device=comm.device)
    a = comm.all_reduce(t)
    b = comm.all_gather(t[:2] * 10.0, axis=0)
    c = comm.all_reduce(t * 100.0, "max")
    if comm.rank % 2 == 0:
        c.realize()
        assert a.realised and (b.realised or n == 1)
    else:
        b.realize()
        assert a.realised
        assert not c.realised or n == 1  # size 1: c is t * 100.0, no collective
    total = n * (n + 1) / 2
    np.testing.assert_array_equal(a.numpy(), np.full(5, total))
    np.testing.assert_array_equal(b.numpy(), np.repeat(np.arange(1, n + 1) * 10.0, 2))
    np.testing.assert_array_equal(c.numpy(), np.full(5, 100.0 * n))


def test_intermediate_input_is_donated_and_leaf_is_not(world: fs.World) -> None:
    """An all_reduce whose input dies at the step reuses that buffer; a leaf's array (the
    caller's memory) is never overwritten."""
    comm = world.comm
    base = np.arange(6.0)
    t = fs.tensor(base, device=comm.device)
    y = comm.all_reduce(t)
    z = comm.all_reduce(t * 2.0)
    fs.realize(y, z)
    np.testing.assert_array_equal(base, np.arange(6.0))  # the leaf is untouched
    np.testing.assert_array_equal(y.numpy(), np.arange(6.0) * comm.size)
    np.testing.assert_array_equal(z.numpy(), np.arange(6.0) * 2 * comm.size)


def test_bucketed_all_reduces_match_numpy(world: fs.World) -> None:
    """All_reduces realised together go out in buckets over the guarded world transport."""
    comm = fs.Communicator(world.comm.transport, device=world.device, timeout=TIMEOUT,
                           bucket_bytes=256)
    r, n = comm.rank, comm.size
    shapes = [(3, 4), (7,), (2, 2, 2), (5,), (16,)]
    xs = [np.random.default_rng([k, r]).standard_normal(s) for k, s in enumerate(shapes)]
    ys = [comm.all_reduce(fs.tensor(x, device=comm.device) * 2.0) for x in xs]
    ys.append(comm.all_reduce(ys[0] + 1.0))  # reads a member: goes in a later call
    fs.realize(*ys)
    for k, s in enumerate(shapes):
        want = sum(2.0 * np.random.default_rng([k, q]).standard_normal(s) for q in range(n))
        np.testing.assert_allclose(ys[k].numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ys[-1].numpy(), n * (ys[0].numpy() + 1.0), rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_mismatch_through_world_comm_raises_on_every_rank(world: fs.World) -> None:
    """The last rank reduces with max, the others with sum (same bytes, so the data
    operation itself is well formed): every rank gets CollectiveMismatchError.

    On a communicator split off the world, closed afterwards, so the world's guard stays
    clean for later tests in this process."""
    sub = world.comm.split(0, world.rank)
    try:
        op = "max" if sub.rank == sub.size - 1 else "sum"
        y = sub.all_reduce(fs.tensor(np.ones((2, 3)), device=sub.device), op)
        with pytest.raises(CollectiveMismatchError, match="reduce"):
            y.numpy()
    finally:
        sub.transport.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_world_transport_is_checked_before_any_data_moves(world: fs.World) -> None:
    """``world.transport`` (the first API the quickstart shows) is the checked transport:
    ranks all-reducing 1,024 and 2,048 floats raise on every rank, before MPI sees the
    mismatched calls, and every buffer is as its rank left it. (On a split, closed
    afterwards, so the world's own guard stays clean.)"""
    from fuelspmd.comm import GuardedTransport

    assert isinstance(world.transport, GuardedTransport) and world.check == "default"
    sub = world.transport.split(0, world.rank)
    try:
        buf = np.full(1024 * (1 + (sub.rank == 1)), 3.0, np.float32)
        with pytest.raises(CollectiveMismatchError, match="shape"):
            sub.all_reduce(buf, "sum").wait()
        np.testing.assert_array_equal(buf, 3.0)
    finally:
        sub.close()
