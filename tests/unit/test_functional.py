"""fuelspmd.functional against numpy references, with gradients by finite differences."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

import fuelspmd as fs
import fuelspmd.functional as F

DEVICES = ["cpu:0", "strict:0"]
rng = np.random.default_rng(99)
_erf = np.vectorize(math.erf)


def _softmax(a: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(a - a.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _layer_norm(a: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = a.mean(-1, keepdims=True)
    var = ((a - mu) ** 2).mean(-1, keepdims=True)
    return (a - mu) / np.sqrt(var + 1e-5) * w + b


X = rng.standard_normal((4, 6))
T = rng.standard_normal((4, 6))
W, B = rng.uniform(0.5, 1.5, 6), rng.standard_normal(6)
TARGETS = np.array([5, 0, 2, 2])
IDX = np.array([[1, 3, 1], [0, 2, 4]])
TABLE = rng.standard_normal((5, 3))
CASES: dict[str, tuple[Callable[..., fs.Tensor], Callable[..., np.ndarray],
                       list[np.ndarray], tuple[int, ...]]] = {
    "relu": (F.relu, lambda a: np.maximum(a, 0), [X], (0,)),
    "gelu_tanh": (F.gelu, lambda a: 0.5 * a * (1 + np.tanh(
        math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))), [X], (0,)),
    "gelu_exact": (lambda a: F.gelu(a, approximate="none"),
                   lambda a: 0.5 * a * (1 + _erf(a / math.sqrt(2))), [X], (0,)),
    "softmax": (lambda a: F.softmax(a, 0), lambda a: _softmax(a, 0), [X], (0,)),
    "log_softmax": (F.log_softmax, lambda a: np.log(_softmax(a, -1)), [X], (0,)),
    "layer_norm": (F.layer_norm, _layer_norm, [X, W, B], (0, 1, 2)),
    "cross_entropy": (F.cross_entropy,
                      lambda a, t: -np.log(_softmax(a, -1))[np.arange(4), t].mean(),
                      [X, TARGETS], (0,)),
    "mse_loss": (F.mse_loss, lambda a, b: ((a - b) ** 2).mean(), [X, T], (0, 1)),
    "embedding": (F.embedding, lambda i, w: w[i], [IDX, TABLE], (1,)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_numpy(name: str, device: str) -> None:
    fn, ref, arrays, _ = CASES[name]
    got = fn(*(fs.tensor(a, device=device) for a in arrays)).numpy()
    np.testing.assert_allclose(got, ref(*arrays), rtol=1e-7, atol=3e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_finite_differences(name: str, device: str) -> None:
    fn, _, arrays, diff = CASES[name]
    ins = [fs.tensor(a, device=device) for a in arrays]
    out = fn(*ins)
    cot = rng.standard_normal(out.shape)

    def value(arrs: list[np.ndarray]) -> float:
        o = fn(*(fs.tensor(a, device=device) for a in arrs))
        return float((o * fs.tensor(cot, device=device)).sum().numpy())

    grads = fs.vjp(out, [ins[i] for i in diff], fs.tensor(cot, device=device))
    eps = 1e-6
    for g, i in zip(grads, diff):
        num = np.zeros_like(arrays[i])
        for k in np.ndindex(arrays[i].shape):
            hi, lo = [a.copy() for a in arrays], [a.copy() for a in arrays]
            hi[i][k] += eps
            lo[i][k] -= eps
            num[k] = (value(hi) - value(lo)) / (2 * eps)
        np.testing.assert_allclose(g.numpy(), num, rtol=1e-5, atol=1e-6)


def test_erf_is_accurate_to_float64_rounding() -> None:
    a = np.linspace(-6, 6, 20001)
    got = fs.tensor(a).erf().numpy()
    assert np.max(np.abs(got - _erf(a))) <= 2.3e-16
    assert got[0] == -1.0 or abs(got[0] + 1) < 1e-12


def test_float32_training_quantities() -> None:
    logits = fs.tensor(X.astype(np.float32) * 30)  # large logits: the max shift matters
    loss = F.cross_entropy(logits, fs.tensor(TARGETS))
    want = -np.log(_softmax(X * 30, -1))[np.arange(4), TARGETS].mean()
    assert loss.dtype is fs.float32
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_caller_mistakes() -> None:
    with pytest.raises(fs.ConfigError, match="approximate"):
        F.gelu(fs.tensor(X), approximate="fast")
    with pytest.raises(fs.ShapeError, match=r"\(\.\.\., C\)"):
        F.cross_entropy(fs.tensor(X), fs.tensor(TARGETS[:3]))
    with pytest.raises(fs.DTypeError, match="targets must be integers"):
        F.cross_entropy(fs.tensor(X), fs.tensor(X[:, 0]))
    with pytest.raises(fs.ShapeError, match="differ"):
        F.mse_loss(fs.tensor(X), fs.tensor(T[:2]))
