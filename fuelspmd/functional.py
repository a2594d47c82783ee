"""Composite ops built from the primitives (layer 3); their gradients come from the
primitives' vjps, so nothing here has a backward of its own.

``gelu(approximate="none")`` uses the ``erf`` primitive, whose kernel is a rational
(Chebyshev) approximation written against the Array API: |error| < 1.2e-7, since the
Array API has no erf. Its vjp is the exact derivative 2/sqrt(pi)·exp(-x²).
"""

from __future__ import annotations

import math

from fuelspmd.dtypes import int64
from fuelspmd.errors import ConfigError, DTypeError, ShapeError
from fuelspmd.tensor import Tensor, arange, where

__all__ = ["cross_entropy", "embedding", "gelu", "layer_norm", "log_softmax", "mse_loss",
           "relu", "softmax"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def relu(x: Tensor) -> Tensor:
    """max(x, 0); the gradient at 0 is 0."""
    return where(x > 0, x, 0.0)


def gelu(x: Tensor, *, approximate: str = "tanh") -> Tensor:
    """x·Φ(x). ``approximate="tanh"``: 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)));
    ``"none"``: the exact 0.5x(1 + erf(x/√2))."""
    if approximate == "tanh":
        inner = (x + 0.044715 * (x * x * x)) * _SQRT_2_OVER_PI
        return 0.5 * x * (1.0 + inner.tanh())
    if approximate == "none":
        return 0.5 * x * (1.0 + (x * (1.0 / math.sqrt(2.0))).erf())
    raise ConfigError(f"gelu: approximate must be 'tanh' or 'none', got {approximate!r}")


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """exp(x - max) / sum(exp(x - max)) along ``axis`` (the shift changes nothing but range)."""
    e = (x - x.max(axis, keepdims=True).detach()).exp()
    return e / e.sum(axis, keepdims=True)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """x - max - log(sum(exp(x - max))) along ``axis``."""
    shifted = x - x.max(axis, keepdims=True).detach()
    return shifted - shifted.exp().sum(axis, keepdims=True).log()


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *,
               eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the last axis, then ·weight + bias."""
    mu = x.mean(-1, keepdims=True)
    d = x - mu
    var = (d * d).mean(-1, keepdims=True)
    y = d / (var + eps).sqrt()
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over rows of -log softmax(logits)[row, target]; ``targets`` are class indices.

    logits: (N, C) float; targets: (N,) integer. The pick is a gather on the flattened
    log-probabilities at row·C + target, so its backward is a scatter-add, not a one-hot.
    """
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ShapeError(f"cross_entropy: logits must be (N, C) and targets (N,), got "
                         f"{logits.shape} and {targets.shape}")
    if not targets.dtype.is_integer:
        raise DTypeError(f"cross_entropy: targets must be integer class indices, got "
                         f"{targets.dtype}")
    n, c = logits.shape
    logp = log_softmax(logits, -1).reshape(n * c)
    rows = arange(n, device=logits.device, dtype=int64) * c
    picked = logp.take(rows + targets.astype(int64), 0)
    return -picked.mean()


def mse_loss(pred: Tensor, target: Tensor) -> Tensor:
    """mean((pred - target)²) over every element."""
    if pred.shape != target.shape:
        raise ShapeError(f"mse_loss: pred {pred.shape} and target {target.shape} differ; "
                         "give a target of the prediction's shape")
    d = pred - target
    return (d * d).mean()


def embedding(indices: Tensor, weight: Tensor) -> Tensor:
    """weight[indices]: rows of a (V, D) table for integer indices of any shape."""
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be (V, D), got {weight.shape}")
    return weight.take(indices, 0)
