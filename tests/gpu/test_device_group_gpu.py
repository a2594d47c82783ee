"""DeviceGroup with GPUs: a ``cuda:0`` + ``cpu:0`` group (staged through the host), and
GPU-only groups (collectives on the GPUs, peer copies) where there are several GPUs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gpu_support import require_gpus

import fuelspmd as fs

cupy = require_gpus(1)
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def _step(comm: Any, a: np.ndarray) -> np.ndarray:
    x = fs.tensor(a, device=comm.device)
    return comm.all_reduce(x * 2.0).numpy()


def _check(devices: list[str]) -> None:
    rng = np.random.default_rng(5)
    shards = [rng.standard_normal((64, 33)).astype(np.float32) for _ in devices]
    outs = fs.DeviceGroup(devices, timeout=60.0).run(_step, shards)
    want = sum(s * 2.0 for s in shards)
    for got in outs:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_and_cpu_all_reduce() -> None:
    _check(["cuda:0", "cpu:0"])


def test_cuda_cpu_strict_every_collective() -> None:
    devices = ["cuda:0", "cpu:0", "strict:0"]
    n = len(devices)
    data = [np.arange(6 * n, dtype=np.float32) + 10 * r for r in range(n)]

    def step(comm: Any, a: np.ndarray) -> list[np.ndarray]:
        x = fs.tensor(a, device=comm.device)
        outs = [comm.all_gather(x, 0), comm.reduce_scatter(x, 0, "sum"),
                comm.broadcast(x, 1), comm.all_to_all(x.reshape(n, 6), 0, 0)]
        fs.realize(*outs)
        return [o.numpy() for o in outs]

    res = fs.DeviceGroup(devices, timeout=60.0).run(step, data)
    for r, (gath, rs, bc, a2a) in enumerate(res):
        np.testing.assert_array_equal(gath, np.concatenate(data))
        np.testing.assert_array_equal(rs, np.sum(data, 0)[6 * r:6 * (r + 1)])
        np.testing.assert_array_equal(bc, data[1])
        np.testing.assert_array_equal(a2a.reshape(-1), np.concatenate(
            [d[6 * r:6 * (r + 1)] for d in data]))


def test_gpu_only_groups() -> None:
    gpus = cupy.cuda.runtime.getDeviceCount()
    if gpus < 2:
        pytest.skip(f"a GPU-only group of several devices needs 2 GPUs, found {gpus}")
    _check([f"cuda:{i}" for i in range(gpus)])


def test_a_tensor_from_another_gpus_array_lands_on_its_device() -> None:
    """``fs.tensor`` of a cupy array on GPU 1 for ``cuda:0`` copies it to GPU 0 (an array
    already there is not copied): the buffer lies where the graph says it does."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    with cupy.cuda.Device(1):
        src = cupy.arange(12, dtype=cupy.float32)
    moved = fs.tensor(src, device="cuda:0")
    assert moved.node.buffer.device.id == 0
    np.testing.assert_array_equal(moved.numpy(), np.arange(12, dtype=np.float32))
    with cupy.cuda.Device(0):
        here = cupy.arange(3, dtype=cupy.float32)
    assert fs.tensor(here, device="cuda:0").node.buffer is here
