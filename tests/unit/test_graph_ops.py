"""Every primitive of the op table: forward against plain numpy, vjp against central
finite differences in float64, on numpy ('cpu:0') and on array-api-strict ('strict:0')."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph
from fuelspmd.errors import DTypeError, ShapeError

DEVICES = ["cpu:0", "strict:0"]
rng = np.random.default_rng(1234)
_erf = np.vectorize(math.erf)


def _pos(*shape: int) -> np.ndarray:
    return rng.uniform(0.5, 2.0, shape)


def _any(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def _distinct(*shape: int) -> np.ndarray:
    """Values far apart, so max/abs/maximum have no ties or kinks near the FD step."""
    n = math.prod(shape)
    v = (rng.permutation(n) - n / 2 + 0.5) * 0.37
    return v.reshape(shape)


def _mk(name: str, *attrs: object) -> Callable[..., fs.Tensor]:
    return lambda *ts: fs.Tensor(graph.make(name, tuple(t.node for t in ts), tuple(attrs)))


IDX = np.array([[2, 0], [2, 3]])
PUT_IDX = np.array([[4, 0], [2, 1]])  # distinct, as put requires
# name -> (lazy fn on tensors, numpy reference, inputs, which inputs are differentiable)
CASES: dict[str, tuple[Callable[..., fs.Tensor], Callable[..., np.ndarray], list[np.ndarray],
                       tuple[int, ...]]] = {
    "neg": (lambda a: -a, np.negative, [_any(3, 4)], (0,)),
    "exp": (lambda a: a.exp(), np.exp, [_any(3, 4)], (0,)),
    "log": (lambda a: a.log(), np.log, [_pos(3, 4)], (0,)),
    "tanh": (lambda a: a.tanh(), np.tanh, [_any(3, 4)], (0,)),
    "sqrt": (lambda a: a.sqrt(), np.sqrt, [_pos(3, 4)], (0,)),
    "sin": (lambda a: a.sin(), np.sin, [_any(3, 4)], (0,)),
    "cos": (lambda a: a.cos(), np.cos, [_any(3, 4)], (0,)),
    "abs": (lambda a: abs(a), np.abs, [_distinct(3, 4)], (0,)),
    "erf": (lambda a: a.erf(), _erf, [_any(3, 4) * 2], (0,)),
    "add": (lambda a, b: a + b, np.add, [_any(3, 4), _any(4)], (0, 1)),
    "sub": (lambda a, b: a - b, np.subtract, [_any(3, 1), _any(2, 1, 4)], (0, 1)),
    "mul": (lambda a, b: a * b, np.multiply, [_any(3, 4), _any(1, 4)], (0, 1)),
    "div": (lambda a, b: a / b, np.divide, [_any(3, 4), _pos(3, 4)], (0, 1)),
    "pow": (lambda a, b: a ** b, np.power, [_pos(3, 4), _any(4)], (0, 1)),
    "maximum": (lambda a, b: a.maximum(b), np.maximum, [_distinct(3, 4), _distinct(4) + 0.1],
                (0, 1)),
    "minimum": (lambda a, b: a.minimum(b), np.minimum, [_distinct(3, 4), _distinct(4) + 0.1],
                (0, 1)),
    "where": (lambda c, a, b: fs.where(c > 0, a, b), lambda c, a, b: np.where(c > 0, a, b),
              [_any(3, 4), _any(3, 4), _any(4)], (1, 2)),
    "astype": (lambda a: a.astype("float32").astype("float64") * 2,
               lambda a: a.astype(np.float32).astype(np.float64) * 2, [_any(3, 4)], ()),
    "reshape": (lambda a: a.reshape(2, 6), lambda a: a.reshape(2, 6), [_any(3, 4)], (0,)),
    "transpose": (lambda a: a.transpose(2, 0, 1), lambda a: a.transpose(2, 0, 1),
                  [_any(2, 3, 4)], (0,)),
    "broadcast_to": (lambda a: a.broadcast_to((2, 3, 4)), lambda a: np.broadcast_to(a, (2, 3, 4)),
                     [_any(3, 1)], (0,)),
    "slice": (lambda a: a[1:, ::2], lambda a: a[1:, ::2], [_any(3, 5)], (0,)),
    "slice_neg_step": (lambda a: a[::-2, 1], lambda a: a[::-2, 1], [_any(5, 3)], (0,)),
    "unslice": (_mk("unslice", (4, 5), ((1, 3, 1), (0, 5, 2))),
                lambda g: _unslice_ref(g),
                [_any(2, 3)], (0,)),
    "concat": (lambda a, b: fs.concat([a, b], axis=1), lambda a, b: np.concatenate([a, b], 1),
               [_any(3, 2), _any(3, 4)], (0, 1)),
    "take": (lambda a, i: a.take(i, 0), lambda a, i: a[i], [_any(4, 3), IDX], (0,)),
    "take_axis1": (lambda a, i: a.take(i, 1), lambda a, i: np.take(a, i, 1), [_any(2, 4, 3), IDX],
                   (0,)),
    "scatter_add": (_mk("scatter_add", 0, (4, 3)), lambda g, i: _scatter_ref(g, i),
                    [_any(2, 2, 3), IDX], (0,)),
    "put": (_mk("put", 0), lambda d, i, v: _put_ref(d, i, v, 0),
            [_any(5, 3), PUT_IDX, _any(2, 2, 3)], (0, 2)),
    "put_axis1": (_mk("put", 1), lambda d, i, v: _put_ref(d, i, v, 1),
                  [_any(2, 5, 3), PUT_IDX, _any(2, 2, 2, 3)], (0, 2)),
    "sum": (lambda a: a.sum((0, 2)), lambda a: a.sum((0, 2)), [_any(2, 3, 4)], (0,)),
    "sum_keepdims": (lambda a: a.sum(1, keepdims=True), lambda a: a.sum(1, keepdims=True),
                     [_any(2, 3, 4)], (0,)),
    "sum_all": (lambda a: a.sum(), lambda a: a.sum(), [_any(3, 4)], (0,)),
    "mean": (lambda a: a.mean(-1), lambda a: a.mean(-1), [_any(3, 4)], (0,)),
    "max": (lambda a: a.max(1), lambda a: a.max(1), [_distinct(3, 4)], (0,)),
    "max_keepdims": (lambda a: a.max(0, keepdims=True), lambda a: a.max(0, keepdims=True),
                     [_distinct(3, 4)], (0,)),
    "matmul": (lambda a, b: a @ b, np.matmul, [_any(3, 4), _any(4, 2)], (0, 1)),
    "matmul_batched": (lambda a, b: a @ b, np.matmul, [_any(2, 3, 4), _any(4, 5)], (0, 1)),
    "matmul_broadcast": (lambda a, b: a @ b, np.matmul, [_any(2, 1, 3, 4), _any(3, 4, 2)],
                         (0, 1)),
    "matvec": (lambda a, b: a @ b, np.matmul, [_any(3, 4), _any(4)], (0, 1)),
}


def _unslice_ref(g: np.ndarray) -> np.ndarray:
    out = np.zeros((4, 5))
    out[1:3, 0:5:2] = g
    return out


def _scatter_ref(g: np.ndarray, i: np.ndarray) -> np.ndarray:
    out = np.zeros((4, 3))
    np.add.at(out, i, g)
    return out


def _put_ref(d: np.ndarray, i: np.ndarray, v: np.ndarray, axis: int) -> np.ndarray:
    out = d.copy()
    index = (slice(None),) * axis + (i.reshape(-1),)
    out[index] = v.reshape((*d.shape[:axis], i.size, *d.shape[axis + 1:]))
    return out


def _leaves(arrays: list[np.ndarray], device: str) -> list[fs.Tensor]:
    return [fs.tensor(a, device=device) for a in arrays]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_numpy(name: str, device: str) -> None:
    fn, ref, arrays, _ = CASES[name]
    got = fn(*_leaves(arrays, device)).numpy()
    want = np.asarray(ref(*arrays))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-12)


def _value(fn: Callable[..., fs.Tensor], arrays: list[np.ndarray], device: str,
           cot: np.ndarray) -> float:
    out = fn(*_leaves(arrays, device))
    return float((out * fs.tensor(cot, device=device)).sum().numpy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n][3]))
def test_vjp_matches_finite_differences(name: str, device: str) -> None:
    fn, _, arrays, diff = CASES[name]
    ins = _leaves(arrays, device)
    out = fn(*ins)
    cot = rng.standard_normal(out.shape)
    grads = fs.vjp(out, [ins[i] for i in diff], fs.tensor(cot, device=device))
    fs.realize(*grads)
    eps = 1e-6
    for g, i in zip(grads, diff):
        num = np.zeros_like(arrays[i])
        for k in np.ndindex(arrays[i].shape):
            hi = [a.copy() for a in arrays]
            lo = [a.copy() for a in arrays]
            hi[i][k] += eps
            lo[i][k] -= eps
            num[k] = (_value(fn, hi, device, cot) - _value(fn, lo, device, cot)) / (2 * eps)
        np.testing.assert_allclose(g.numpy(), num, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: gradient of input {i}")


def test_vjp_of_device_move_comes_back() -> None:
    a = _any(3, 4)
    x = fs.tensor(a)
    y = x.to("strict:0")
    assert str(y.device) == "strict:0"
    (g,) = fs.grad((y * y).sum(), [x])
    assert g.device == x.device
    np.testing.assert_allclose(g.numpy(), 2 * a)


def test_detach_stops_the_gradient() -> None:
    x = fs.tensor(_any(3))
    (g,) = fs.grad((x * x.detach()).sum(), [x])
    np.testing.assert_allclose(g.numpy(), x.numpy())


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64"])
def test_float_dtypes_on_numpy(dt: str) -> None:
    from fuelspmd.dtypes import to_numpy

    npdt = to_numpy(dt)
    a = _any(4, 8).astype(npdt)
    b = _any(8, 3).astype(npdt)
    x, y = fs.tensor(a), fs.tensor(b)
    out = ((x * 2.0 + 1.0).tanh() @ y).sum(0)
    assert out.dtype.name == dt
    want = (np.tanh(a.astype(np.float64) * 2 + 1) @ b.astype(np.float64)).sum(0)
    tol = {"float16": 5e-2, "bfloat16": 1.5e-1, "float32": 1e-5, "float64": 1e-12}[dt]
    np.testing.assert_allclose(out.numpy().astype(np.float64), want, rtol=tol, atol=tol)
    assert out.numpy().dtype == npdt


@pytest.mark.parametrize("device", DEVICES)
def test_integer_and_bool_ops(device: str) -> None:
    a = rng.integers(-5, 5, (3, 4)).astype(np.int32)
    b = rng.integers(1, 5, (4,)).astype(np.int64)
    x, y = fs.tensor(a, device=device), fs.tensor(b, device=device)
    s = x + y  # int32 + int64 -> int64
    assert s.dtype is fs.int64
    np.testing.assert_array_equal(s.numpy(), a + b)
    m = (x > 0) & (y < 3)
    assert m.dtype is fs.bool_
    np.testing.assert_array_equal(m.numpy(), (a > 0) & (b < 3))
    np.testing.assert_array_equal((~m).numpy(), ~((a > 0) & (b < 3)))
    np.testing.assert_array_equal(m.sum().numpy(), ((a > 0) & (b < 3)).sum())
    np.testing.assert_array_equal(x.max(0).numpy(), a.max(0))
    np.testing.assert_allclose((x / 2).numpy(), a / 2)  # true division gives a float


def test_shape_errors_are_raised_when_the_node_is_built() -> None:
    x = fs.tensor(np.zeros((64, 1024), np.float32))
    w = fs.tensor(np.zeros((512, 4096), np.float32))
    with pytest.raises(ShapeError, match=r"matmul.*\(64, 1024\).*\(512, 4096\)"):
        x @ w
    with pytest.raises(ShapeError, match=r"add.*\(64, 1024\).*\(3,\)"):
        x + fs.tensor(np.zeros(3, np.float32))
    with pytest.raises(ShapeError, match="reshape"):
        x.reshape(3, -1)
    with pytest.raises(ShapeError, match="concat"):
        fs.concat([x, w], axis=0)
    with pytest.raises(ShapeError, match="out of bounds"):
        x[64]
    with pytest.raises(ShapeError, match=r"divide into 3.*\[1, 2, 4"):
        fs.split(x, 3, axis=0)
    with pytest.raises(DTypeError, match="floating"):
        fs.tensor(np.arange(3)).exp()
    with pytest.raises(DTypeError, match="int32 or int64"):
        x.take(fs.tensor(np.zeros(2, np.float32)), 0)


def test_mixing_devices_in_one_op_is_a_device_error() -> None:
    with pytest.raises(fs.DeviceError, match=r"\.to\("):
        fs.tensor(np.ones(3)) + fs.tensor(np.ones(3), device="strict:0")


@pytest.mark.parametrize("shapes", [((6, 5), (5, 7)), ((2, 3, 5), (5, 4)), ((2, 3, 5), (2, 5, 4))])
def test_a_float16_matmul_is_the_float32_product_rounded_once(shapes: tuple) -> None:
    """numpy has no float16 BLAS (its loop is some hundred times slower): the product is
    taken in float32 and rounded to float16 once, as torch's CPU kernels accumulate."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    got = (fs.tensor(a) @ fs.tensor(b)).numpy()
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.matmul(a.astype(np.float32), b.astype(np.float32))
                                  .astype(np.float16))
