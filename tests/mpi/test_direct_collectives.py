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


@pytest.fixture(scope="module")
def world() -> fs.World:
    return fs.init(timeout=TIMEOUT)


def _value(k: int, r: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([k, r]).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bucket", [0, 4 << 10, 4 << 20])
def test_many_small_all_reduces_of_leaves_match_numpy(world: fs.World, bucket: int) -> None:
    comm = fs.Communicator(world.comm.transport, device=world.device, timeout=TIMEOUT,
                           bucket_bytes=bucket)
    r, n = comm.rank, comm.size
    shapes = [(64,), (8, 8), (3,), (), (16, 4)] * 20
    leaves = [fs.tensor(_value(k, r, s)) for k, s in enumerate(shapes)]
    misses = default_executor().cache.misses
    for _ in range(2):  # the second step reuses the bucket buffer of the first
        ys = [comm.all_reduce(t) for t in leaves]
        fs.realize(*(ys[::-1] if r % 2 else ys))  # odd ranks realise last-first
        for k, s in enumerate(shapes):
            want = sum(_value(k, q, s).astype(np.float64) for q in range(n))
            np.testing.assert_allclose(ys[k].numpy(), want, rtol=1e-5, atol=1e-5)
            assert ys[k].shape == s
        del ys
    assert default_executor().cache.misses == misses  # no graph was planned
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
