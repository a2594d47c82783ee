"""The GPU suite's workloads (``workloads.GPU_SUITE``) on cupy ('cuda:0'), each against the
same workload on 'cpu:0', and the op table's forward cases against numpy.

Every fused kernel these graphs make was compiled in CI, without a GPU, by
tests/unit/test_cupy_kernels_compile.py: a graph built here outside the registry escapes it.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import require_gpus
from workloads import CASES, GPU_SUITE, TOLERANCE

import fuelspmd as fs

cupy = require_gpus(1)
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_numpy(name: str) -> None:
    _, ref, arrays, _ = CASES[name]
    (got,) = GPU_SUITE[f"forward/{name}/float64"]("cuda:0")
    want = np.asarray(ref(*arrays))
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6,
                               atol=2e-7 if name == "erf" else 1e-10)


def _bf16_or_skip() -> None:
    from fuelspmd.dtypes import bfloat16, to_numpy

    try:
        cupy.ones(2, dtype=cupy.float32).astype(to_numpy(bfloat16))
    except Exception as e:  # an older cupy: no bfloat16 arrays
        pytest.skip(f"this cupy ({cupy.__version__}) holds no bfloat16 arrays: {e}")


@pytest.mark.parametrize("key", sorted(GPU_SUITE))
def test_workload_matches_the_cpu(key: str) -> None:
    if "bfloat16" in key:
        _bf16_or_skip()
    got, want = GPU_SUITE[key]("cuda:0"), GPU_SUITE[key]("cpu:0")
    fs.realize(*got)
    fs.realize(*want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{key}: output {i}"
        if w.dtype.is_floating:
            tol = TOLERANCE[w.dtype.name]
            np.testing.assert_allclose(g.numpy().astype(np.float64),
                                       w.numpy().astype(np.float64), rtol=tol, atol=tol,
                                       err_msg=f"{key}: output {i}")
        else:
            np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=f"{key}: output {i}")
