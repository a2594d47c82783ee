"""Composite ops built from the primitives (layer 3); their gradients come from the
primitives' vjps, so nothing here has a backward of its own.

``gelu(approximate="none")`` uses the ``erf`` primitive (fdlibm's approximation, under one
ulp in float64; its vjp is the exact 2/sqrt(pi)·exp(-x²)).

Integer class targets and embedding ids are checked on the host (:func:`check_values`):
an index outside ``[0, size)`` would otherwise read a neighbouring row silently or fail
inside numpy at run time. Targets are data every rank holds alike, so every rank raises
the same :class:`~fuelspmd.errors.IndexRangeError`. ``embedding`` and ``cross_entropy``
do it, and build their index tables, through :func:`fuelspmd.tensor.host`: before any
node is built in an uncompiled step, and on every call of a compiled one (``fs.compile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fuelspmd.dtypes import float64, to_numpy
from fuelspmd.errors import ConfigError, DTypeError, IndexRangeError, ShapeError
from fuelspmd.tensor import Tensor, concat, host, tensor, where

__all__ = [
    "CheckedIds",
    "ce_checks",
    "check_range",
    "check_values",
    "cross_entropy",
    "embedding",
    "gelu",
    "kept_scale",
    "layer_norm",
    "log_softmax",
    "mse_loss",
    "relu",
    "rms_norm",
    "rope",
    "rope_tables",
    "rotate",
    "silu",
    "smoothed_nll",
    "softmax",
]

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


def silu(x: Tensor) -> Tensor:
    """x·sigmoid(x) = x / (1 + exp(-x)) (SwiGLU's gate)."""
    return x / (1.0 + (-x).exp())


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


def check_range(op: str, indices: Tensor, size: int, *, what: str = "index",
                ignore_index: int | None = None) -> np.ndarray:
    """The host values of integer ``indices``; raise IndexRangeError naming the first
    value outside ``[0, size)`` (other than ``ignore_index``), its position and the count."""
    if not indices.dtype.is_integer:
        raise DTypeError(f"{op}: {what}s must be integers, got {indices.dtype}")
    return check_values(op, np.asarray(indices.numpy()), size, what=what,
                        ignore_index=ignore_index)


def check_values(op: str, host: np.ndarray, size: int, *, what: str = "index",
                 ignore_index: int | None = None) -> np.ndarray:
    """:func:`check_range` of host values ``host``; returns them."""
    bad = (host < 0) | (host >= size)
    if ignore_index is not None:
        bad &= host != ignore_index
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        skip = "" if ignore_index is None else f" and is not ignore_index={ignore_index}"
        raise IndexRangeError(
            f"{op}: {what} {int(host[pos])} at position {pos} is outside [0, {size}){skip} "
            f"({int(bad.sum())} of {host.size} are); give {what}s below {size}"
            + ("" if ignore_index is None else " or mark padding with ignore_index"))
    return host


def ce_checks(op: str, logits: Tensor, targets: Tensor, label_smoothing: float) -> None:
    """The shape and smoothing checks both cross-entropies make."""
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ShapeError(f"{op}: logits must be (..., C) and targets the leading shape, got "
                         f"{logits.shape} and {targets.shape}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ConfigError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")


def smoothed_nll(nll: Tensor, smooth: Tensor, keep: Tensor, scale: Tensor,
                 label_smoothing: float) -> Tensor:
    """torch's reduction: the mean over kept rows of (1-ε)·nll + ε·smooth, where smooth is
    the mean over classes of -log p. ``keep``: 1 for a kept row, 0 else (the rows' dtype);
    ``scale``: 0-d float64, 1 / kept rows (nan when none is kept, as torch)."""
    loss = nll if label_smoothing == 0.0 else \
        (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return (loss * keep).sum() * scale.astype(nll.dtype)


def cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0) -> Tensor:
    """torch.nn.functional.cross_entropy of class-index targets (mean reduction).

    logits: (..., C) float; targets: (...) integer in [0, C) or ``ignore_index`` (rows
    left out of the mean). The pick is a gather on the flattened log-probabilities at
    row·C + target, so its backward is a scatter-add, not a one-hot.
    """
    op = "cross_entropy"
    ce_checks(op, logits, targets, label_smoothing)
    if not targets.dtype.is_integer:
        raise DTypeError(f"{op}: targets must be integers, got {targets.dtype}")
    c = logits.shape[-1]
    n = targets.size
    table = _Targets(op, c, ignore_index, "index")
    idx = host(table, targets, shape=(n,), dtype="int64")
    logp = log_softmax(logits.reshape(n, c), -1)
    nll = -logp.reshape(n * c).take(idx, 0)
    smooth = -logp.mean(-1) if label_smoothing else nll
    keep = host(replace(table, part="keep"), targets, shape=(n,), dtype=nll.dtype)
    scale = host(replace(table, part="scale"), targets, shape=(), dtype=float64)
    return smoothed_nll(nll, smooth, keep, scale, label_smoothing)


@dataclass(frozen=True)
class _Targets:
    """A cross-entropy's tables from its checked host targets (``fs.host`` functions,
    equal from step to step): ``index`` row·C + target (0 for ignored rows), ``keep`` 1 for
    kept rows, ``scale`` 1 / kept rows (nan with none, as torch)."""

    op: str
    classes: int
    ignore_index: int
    part: str

    def __call__(self, targets: np.ndarray) -> np.ndarray:
        t = check_values(self.op, targets, self.classes, what="target",
                         ignore_index=self.ignore_index).reshape(-1)
        keep = t != self.ignore_index
        if self.part == "index":
            return np.arange(t.size, dtype=np.int64) * self.classes + np.where(keep, t, 0)
        if self.part == "keep":
            return keep
        return kept_scale(keep)


def kept_scale(keep: np.ndarray) -> np.ndarray:
    """1 / the number of kept rows as a 0-d float64 array (nan when none is)."""
    kept = int(keep.sum())
    return np.asarray(1.0 / kept if kept else math.nan)


@dataclass(frozen=True)
class CheckedIds:
    """Embedding ids, checked on the host (an ``fs.host`` function)."""

    op: str
    size: int

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return check_values(self.op, ids, self.size, what="id")


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
    if not indices.dtype.is_integer:
        raise DTypeError(f"embedding: ids must be integers, got {indices.dtype}")
    ids = host(CheckedIds("embedding", weight.shape[0]), indices, shape=indices.shape,
               dtype=indices.dtype)
    return weight.take(ids, 0)


def rms_norm(x: Tensor, weight: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x²) + eps) over the last axis, then ·weight (torch.nn.RMSNorm)."""
    y = x / ((x * x).mean(-1, keepdims=True) + eps).sqrt()
    return y if weight is None else y * weight


def rope_tables(positions: Any, dim: int, *, base: float = 10000.0
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape ``positions.shape + (dim,)`` in float64: angle p·base^(-2i/dim)
    for frequency i, the half of the frequencies repeated (the rotate-half layout of
    GPT-NeoX and Llama)."""
    if dim % 2:
        raise ConfigError(f"rope: the rotated dim {dim} must be even (pairs rotate)")
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.asarray(positions, dtype=np.float64)[..., None] * inv
    ang = np.concatenate([ang, ang], -1)
    return np.cos(ang), np.sin(ang)


def rope(x: Tensor, positions: Any, *, base: float = 10000.0) -> Tensor:
    """Rotary position embedding of ``x`` (batch, seq, heads, d) at integer ``positions``
    (seq,) or (batch, seq): x·cos + rotate_half(x)·sin, rotate_half([a, b]) = [-b, a]."""
    if x.ndim != 4:
        raise ShapeError(f"rope: x must be (batch, seq, heads, head_dim), got {x.shape}")
    b, t, _, d = x.shape
    pos = np.asarray(positions)
    if pos.shape not in ((t,), (b, t)):
        raise ShapeError(f"rope: positions of shape {pos.shape} for x {x.shape}; give "
                         f"({t},) or ({b}, {t})")
    cos, sin = rope_tables(pos, d, base=base)
    shape = (1, t, 1, d) if pos.ndim == 1 else (b, t, 1, d)
    dt = to_numpy(x.dtype)
    c = tensor(cos.reshape(shape).astype(dt), device=x.device)
    s = tensor(sin.reshape(shape).astype(dt), device=x.device)
    return rotate(x, c, s)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding of ``x`` (batch, seq, heads, d) from tables that broadcast to it
    (:func:`rope_tables`): x·cos + rotate_half(x)·sin. Tables given as tensors let a
    compiled step take them as arguments."""
    half = x.shape[-1] // 2
    return x * cos + concat([-x[..., half:], x[..., :half]], -1) * sin
