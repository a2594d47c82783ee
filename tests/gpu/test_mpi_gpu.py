"""The MPI transport with GPU (cupy) buffers: straight through a CUDA-aware MPI, staged
through pinned host memory otherwise (the PyPI MPICH is not CUDA-aware). One rank (MPI as
a singleton, or under ``mpiexec -n 1``): the staging round trip is what is checked."""

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
    from fuelspmd_mpi import plugin

    yield plugin.world(timeout=60.0)


def test_cuda_awareness_is_decided(t: Any) -> None:
    aware, why = t.cuda_aware
    print(f"MPI CUDA-aware: {aware} ({why})")
    assert isinstance(aware, bool) and why


def test_device_buffers_round_trip(t: Any) -> None:
    a = np.arange(10, dtype=np.float32)
    buf = cupy.asarray(a)
    t.all_reduce(buf, "sum").wait()
    np.testing.assert_array_equal(cupy.asnumpy(buf), a * t.size)
    recv = cupy.zeros(10 * t.size, cupy.float32)
    t.all_gather(cupy.asarray(a), recv).wait()
    np.testing.assert_array_equal(cupy.asnumpy(recv), np.tile(a, t.size))
    h = cupy.asarray(a.astype(np.float16))
    t.all_reduce(h, "avg").wait()
    np.testing.assert_allclose(cupy.asnumpy(h), a, rtol=1e-3)
    if t.size == 1:
        out = cupy.zeros(10, cupy.float32)
        w_send = t.send(cupy.asarray(a + 1), 0, 3)
        t.recv(out, 0, 3).wait()
        w_send.wait()
        np.testing.assert_array_equal(cupy.asnumpy(out), a + 1)
