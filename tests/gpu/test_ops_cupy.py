"""The op table on cupy ('cuda:0') against numpy: every case of tests/unit/test_graph_ops.py
forward, its gradient against the same gradient on 'cpu:0', and the dtypes cupy holds."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_support import require_gpus, unit_module

import fuelspmd as fs

cupy = require_gpus(1)
OPS = unit_module("test_graph_ops")
CASES = OPS.CASES
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_numpy(name: str) -> None:
    fn, ref, arrays, _ = CASES[name]
    got = fn(*(fs.tensor(a, device="cuda:0") for a in arrays)).numpy()
    want = np.asarray(ref(*arrays))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-7 if name == "erf" else 1e-10)


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n][3]))
def test_vjp_matches_the_cpu(name: str) -> None:
    fn, _, arrays, diff = CASES[name]
    rng = np.random.default_rng(7)

    def grads(device: str, cot: np.ndarray) -> list[np.ndarray]:
        ins = [fs.tensor(a, device=device) for a in arrays]
        out = fn(*ins)
        gs = fs.vjp(out, [ins[i] for i in diff], fs.tensor(cot, device=device))
        fs.realize(*gs)
        return [g.numpy() for g in gs]

    shape = fn(*(fs.tensor(a) for a in arrays)).shape
    cot = rng.standard_normal(shape)
    for got, want in zip(grads("cuda:0", cot), grads("cpu:0", cot)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
def test_float_dtypes_on_cupy(dt: str) -> None:
    from fuelspmd.dtypes import to_numpy

    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 8)).astype(to_numpy(dt))
    b = rng.standard_normal((8, 3)).astype(to_numpy(dt))
    x, y = fs.tensor(a, device="cuda:0"), fs.tensor(b, device="cuda:0")
    out = ((x * 2.0 + 1.0).tanh() @ y).sum(0)
    want = (np.tanh(a.astype(np.float64) * 2 + 1) @ b.astype(np.float64)).sum(0)
    tol = {"float16": 5e-2, "float32": 1e-5, "float64": 1e-12}[dt]
    np.testing.assert_allclose(out.numpy().astype(np.float64), want, rtol=tol, atol=tol)


def test_integer_and_bool_ops_on_cupy() -> None:
    OPS.test_integer_and_bool_ops("cuda:0")


def _bf16_or_skip() -> np.dtype:
    from fuelspmd.dtypes import bfloat16, to_numpy

    bf16 = to_numpy(bfloat16)
    try:
        cupy.ones(2, dtype=cupy.float32).astype(bf16)
    except Exception as e:  # an older cupy: no bfloat16 arrays
        pytest.skip(f"this cupy ({cupy.__version__}) holds no bfloat16 arrays: {e}")
    return bf16


def test_bfloat16_fused_chain_and_matmul_on_cupy() -> None:
    bf16 = _bf16_or_skip()
    rng = np.random.default_rng(4)
    a = rng.standard_normal((64, 32)).astype(bf16)
    b = rng.standard_normal((32, 16)).astype(bf16)
    x, y = fs.tensor(a, device="cuda:0"), fs.tensor(b, device="cuda:0")
    h = ((x * 2.0 + 1.0).tanh() * x - 0.5).abs()
    out = h @ y
    fs.realize(h, out)
    assert out.dtype.name == "bfloat16"
    af, bf = a.astype(np.float32), b.astype(np.float32)
    hn = np.abs(np.tanh(af * 2 + 1) * af - 0.5)
    np.testing.assert_allclose(h.numpy().astype(np.float32), hn, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(out.numpy().astype(np.float32), hn @ bf, rtol=6e-2, atol=2e-1)
