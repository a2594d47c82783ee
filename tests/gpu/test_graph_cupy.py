"""The cupy path: fused groups as generated ElementwiseKernels, against numpy.

Skipped without a CUDA device (DESIGN.md: GPU tests belong in tests/gpu/, run from one
prepared script on a machine that has one; this file can move there as it is)."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
import fuelspmd.functional as F
from fuelspmd import graph
from fuelspmd.backend import cuda_device_count

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU and cupy")]


def test_fused_kernels_with_exports_match_numpy() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 33)), rng.standard_normal(33)
    x, y = fs.tensor(a, device="cuda:0"), fs.tensor(b, device="cuda:0")
    h = x * y + 1
    t = h.tanh()
    out = fs.where(h > 0, t * 2, abs(h) - t)
    plan, _ = graph.Executor().plan([out.node, t.node])
    assert any(s.kind == "fused_cupy" for s in plan.steps)
    fs.realize(out, t)
    hn = a * b + 1
    np.testing.assert_allclose(out.numpy(), np.where(hn > 0, np.tanh(hn) * 2,
                                                     np.abs(hn) - np.tanh(hn)), rtol=1e-12)
    np.testing.assert_allclose(t.numpy(), np.tanh(hn), rtol=1e-12)


def test_mlp_step_on_the_gpu_matches_the_cpu() -> None:
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(np.float32)
              for s in ((16, 32), (16, 8), (32, 64), (64,), (64, 8), (8,))]

    def step(device: str) -> list[np.ndarray]:
        x, t, *params = (fs.tensor(a, device=device) for a in arrays)
        w1, b1, w2, b2 = params
        loss = F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, t)
        grads = fs.grad(loss, params)
        fs.realize(loss, *grads)
        return [g.numpy() for g in (loss, *grads)]

    for got, want in zip(step("cuda:0"), step("cpu:0")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
