"""The NCCL transport on real GPUs, its unique id bootstrapped over MPI.

Run as ``mpiexec -n 1 python -m pytest tests/gpu/test_nccl.py`` (one GPU: NCCL refuses
two ranks on one device) or ``mpiexec -n N`` with N GPUs; without a launcher MPI starts
as a singleton of one rank. Every Transport op runs through NCCL at any size, checked
against numpy on rank-dependent data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_support import require_gpus

cupy = require_gpus(1)
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def t() -> Iterator[Any]:
    from fuelspmd_nccl import plugin

    transport = plugin.world(timeout=60.0)
    yield transport
    transport.finalize()


def _dev(t: Any, a: np.ndarray) -> Any:
    with cupy.cuda.Device(t.device.index):
        return cupy.asarray(a)


def _data(t: Any, r: int, n: int = 12, dtype: Any = np.float32) -> np.ndarray:
    return (np.arange(n) * (r + 1) + r).astype(dtype)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64])
def test_all_reduce(t: Any, op: str, dtype: Any) -> None:
    ranks = [_data(t, r, dtype=dtype) for r in range(t.size)]
    if op == "prod":  # small factors: exact in every dtype at 8 ranks (3**8 < 2**15)
        ranks = [(np.arange(12) % 2 + 1 + r % 2).astype(dtype) for r in range(t.size)]
    buf = _dev(t, ranks[t.rank])
    t.all_reduce(buf, op).wait()
    stack = np.stack([a.astype(np.float64) for a in ranks])
    want = {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0),
            "max": stack.max(0), "avg": stack.sum(0) / t.size}[op]
    if op == "avg" and np.dtype(dtype).kind == "i":
        want = np.floor_divide(stack.sum(0), t.size)
    tol = 1e-2 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(cupy.asnumpy(buf).astype(np.float64), want, rtol=tol)


def test_all_reduce_bfloat16(t: Any) -> None:
    from fuelspmd.dtypes import bfloat16, to_numpy

    bf16 = to_numpy(bfloat16)
    try:
        with cupy.cuda.Device(t.device.index):
            buf = cupy.asarray(_data(t, t.rank, 16)).astype(bf16)
    except Exception as e:  # an older cupy: no bfloat16 arrays
        pytest.skip(f"this cupy ({cupy.__version__}) holds no bfloat16 arrays: {e}")
    t.all_reduce(buf, "avg").wait()
    want = np.mean([_data(t, r, 16) for r in range(t.size)], 0)
    np.testing.assert_allclose(cupy.asnumpy(buf.astype(cupy.float32)), want, rtol=2e-2)


def test_all_reduce_bool_is_or_and_and(t: Any) -> None:
    mine = np.array([t.rank == 0, False, True, t.rank % 2 == 1])
    every = [np.array([r == 0, False, True, r % 2 == 1]) for r in range(t.size)]
    a, b = _dev(t, mine), _dev(t, mine)
    t.all_reduce(a, "sum").wait()
    t.all_reduce(b, "prod").wait()
    np.testing.assert_array_equal(cupy.asnumpy(a), np.logical_or.reduce(every))
    np.testing.assert_array_equal(cupy.asnumpy(b), np.logical_and.reduce(every))


def test_all_gather_reduce_scatter_all_to_all_broadcast(t: Any) -> None:
    n, size, rank = 6, t.size, t.rank
    ranks = [_data(t, r, n * size) for r in range(size)]
    send = _dev(t, ranks[rank][:n])
    recv = _dev(t, np.zeros(n * size, np.float32))
    t.all_gather(send, recv).wait()
    np.testing.assert_array_equal(cupy.asnumpy(recv), np.concatenate([a[:n] for a in ranks]))

    out = _dev(t, np.zeros(n, np.float32))
    t.reduce_scatter(_dev(t, ranks[rank]), out, "sum").wait()
    np.testing.assert_allclose(cupy.asnumpy(out), np.sum(ranks, 0)[rank * n:(rank + 1) * n])

    got = _dev(t, np.zeros(n * size, np.float32))
    t.all_to_all(_dev(t, ranks[rank]), got).wait()
    np.testing.assert_array_equal(cupy.asnumpy(got), np.concatenate(
        [ranks[r][rank * n:(rank + 1) * n] for r in range(size)]))

    root = size - 1
    buf = _dev(t, ranks[rank])
    t.broadcast(buf, root).wait()
    np.testing.assert_array_equal(cupy.asnumpy(buf), ranks[root])


def test_send_recv_ring_and_self(t: Any) -> None:
    size, rank = t.size, t.rank
    mine = _dev(t, _data(t, rank))
    got = _dev(t, np.zeros(12, np.float32))
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        works = ([t.send(mine, right, 5), t.recv(got, left, 5)] if rank % 2 == 0 else
                 [t.recv(got, left, 5), t.send(mine, right, 5)])
        for w in works:
            w.wait()
        np.testing.assert_array_equal(cupy.asnumpy(got), _data(t, left))
    back = _dev(t, np.zeros(12, np.float32))
    t.send(mine, rank, 9).wait()
    t.recv(back, rank, 9).wait()
    np.testing.assert_array_equal(cupy.asnumpy(back), _data(t, rank))


def test_barrier_split_and_a_non_default_stream(t: Any) -> None:
    t.barrier().wait()
    sub = t.split(t.rank % 2, t.rank)
    try:
        buf = _dev(sub, np.ones(1000, np.float32))
        with cupy.cuda.Device(t.device.index):
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                work = sub.all_reduce(buf, "sum")
            work.wait()
            assert work.test()
        np.testing.assert_array_equal(cupy.asnumpy(buf), np.full(1000, sub.size, np.float32))
        assert sub.async_error() is None
    finally:
        sub.finalize()


def test_host_buffers_go_over_mpi(t: Any) -> None:
    buf = np.full(4, t.rank + 1.0)
    t.all_reduce(buf, "sum").wait()
    np.testing.assert_array_equal(buf, np.full(4, t.size * (t.size + 1) / 2))


def test_lazy_communicator_over_nccl() -> None:
    import fuelspmd as fs

    world = fs.init(transport="nccl", timeout=60.0)
    try:
        assert world.transport.name == "nccl" and world.device.kind == "cuda"
        x = fs.tensor(np.arange(8, dtype=np.float32) + world.rank, device=world.device)
        y = world.comm.all_reduce(x * 2.0)
        want = sum((np.arange(8) + r) * 2.0 for r in range(world.size))
        np.testing.assert_allclose(y.numpy(), want)
    finally:
        world.finalize()
