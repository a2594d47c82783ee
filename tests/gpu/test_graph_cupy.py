"""The cupy path's plan: a fused group is one generated ElementwiseKernel that also writes
the members later steps read (exports), against numpy.

Skipped without a CUDA device (DESIGN.md: GPU tests belong in tests/gpu/, run from one
prepared script on a machine that has one)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import require_gpus
from workloads import exports_chain

from fuelspmd import graph

cupy = require_gpus(1)
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_fused_kernels_with_exports_match_numpy() -> None:
    out, t = exports_chain("cuda:0")
    plan, _ = graph.Executor().plan([out.node, t.node])
    fused = [s for s in plan.steps if s.kind == "fused_cupy"]
    assert fused and any(s.exports for s in fused)
    got_out, got_t = out.numpy(), t.numpy()
    rng = np.random.default_rng(0)  # the inputs exports_chain draws
    a, b = rng.standard_normal((256, 33)), rng.standard_normal(33)
    hn = a * b + 1
    np.testing.assert_allclose(got_t, np.tanh(hn), rtol=1e-12)
    np.testing.assert_allclose(got_out, np.where(hn > 0, np.tanh(hn) * 2,
                                                 np.abs(hn) - np.tanh(hn)), rtol=1e-12)
