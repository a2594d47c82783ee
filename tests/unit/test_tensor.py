"""The Tensor front: constructors, dtypes and promotion, indexing, devices, laziness."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph

DEVICES = ["cpu:0", "strict:0"]


def test_constructors_and_default_dtypes() -> None:
    assert fs.tensor([1.0, 2.0]).dtype is fs.float32  # lists of floats: float32
    assert fs.tensor([1, 2]).dtype is fs.int64
    assert fs.tensor([True]).dtype is fs.bool_
    assert fs.tensor(np.zeros(3)).dtype is fs.float64  # arrays keep their dtype
    assert fs.tensor(np.zeros(3), dtype="float32").dtype is fs.float32
    z = fs.zeros((2, 3))
    assert (z.shape, z.dtype, str(z.device)) == ((2, 3), fs.float32, "cpu:0")
    np.testing.assert_array_equal(fs.ones(4, dtype="int32").numpy(), np.ones(4, np.int32))
    np.testing.assert_array_equal(fs.arange(5).numpy(), np.arange(5))
    np.testing.assert_allclose(fs.arange(0.0, 1.0, 0.25).numpy(), [0, 0.25, 0.5, 0.75])
    a, b = fs.randn((3, 2), seed=7), fs.randn((3, 2), seed=7, device="strict:0")
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(a.numpy(), np.random.default_rng(7).standard_normal(
        (3, 2)).astype(np.float32))
    with pytest.raises(fs.DTypeError, match="uint8"):
        fs.tensor(np.zeros(3, np.uint8))
    with pytest.raises(fs.DeviceError):
        fs.tensor([1.0], device="tpu:0")


def test_nothing_runs_until_asked() -> None:
    ex = graph.default_executor()
    runs = ex.runs
    x = fs.tensor(np.arange(4.0))
    y = ((x * 2).exp() @ x).sum()
    assert ex.runs == runs and not y.realised
    assert "lazy" in repr(y)
    y.realize()
    assert ex.runs == runs + 1 and y.realised and "realised" in repr(y)
    y.numpy()
    assert ex.runs == runs + 1  # realised once, read twice


@pytest.mark.parametrize("device", DEVICES)
def test_operators_with_scalars_and_arrays(device: str) -> None:
    a = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]])
    x = fs.tensor(a, device=device)
    for got, want in [(2 - x, 2 - a), (2 / x, 2 / a), (2 ** x, 2 ** a), (x ** 2, a ** 2),
                      (-x, -a), (abs(x), abs(a)), (x / 4, a / 4), (x @ a.T, a @ a.T),
                      (x.maximum(0.5), np.maximum(a, 0.5)), (x.min(1), a.min(1)),
                      ((x > 0) | (x < -1), (a > 0) | (a < -1)), (x == 3.0, a == 3.0),
                      (x != 3.0, a != 3.0), (x >= 1, a >= 1), (x <= 1, a <= 1)]:
        np.testing.assert_allclose(got.numpy(), want)
    if device == "cpu:0":
        np.testing.assert_allclose((a + x).numpy(), 2 * a)  # numpy on the left defers


def test_promotion() -> None:
    i = fs.tensor(np.arange(3, dtype=np.int32))
    assert (i * 2).dtype is fs.int32  # a Python int takes the tensor's dtype
    assert (i * 2.5).dtype is fs.float32  # a float with an integer tensor: float32
    assert (fs.tensor([True]) + 1).dtype is fs.int64
    f32, f64 = fs.ones(2), fs.ones(2, dtype="float64")
    assert (f32 + f64).dtype is fs.float64
    assert (fs.ones(2, dtype="float16") + fs.ones(2, dtype="bfloat16")).dtype is fs.float32
    assert (fs.ones(3) + i.astype("int64")).dtype is fs.float32
    np.testing.assert_allclose((i * 2.5).numpy(), [0, 2.5, 5.0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", [
    (1,), (-1,), (slice(1, None),), (slice(None, None, -1),), (Ellipsis, 1),
    (None, 0), (slice(0, 2), None, slice(None, None, 2)), (1, 2, 3), (slice(5, 9),),
    (Ellipsis,), (0, Ellipsis, None),
])
def test_basic_indexing_matches_numpy(device: str, key: tuple) -> None:
    a = np.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    got = fs.tensor(a, device=device)[key]
    np.testing.assert_array_equal(got.numpy(), a[key])


def test_gather_with_a_tensor_index_and_errors() -> None:
    a = np.arange(12.0).reshape(4, 3)
    idx = np.array([[3, 1], [0, 0]])
    np.testing.assert_array_equal(fs.tensor(a)[fs.tensor(idx)].numpy(), a[idx])
    with pytest.raises(TypeError, match="unsupported index"):
        fs.tensor(a)[[0, 1]]
    with pytest.raises(fs.ShapeError, match="too many indices"):
        fs.tensor(a)[0, 0, 0]


def test_shapes_and_views() -> None:
    a = np.arange(24.0).reshape(2, 3, 4)
    x = fs.tensor(a)
    assert x.T.shape == (4, 3, 2) and len(x) == 2 and x.ndim == 3 and x.size == 24
    np.testing.assert_array_equal(x.T.numpy(), a.T)
    np.testing.assert_array_equal(x.transpose(0, 2, 1).numpy(), a.transpose(0, 2, 1))
    np.testing.assert_array_equal(x.transpose((2, 0, 1)).numpy(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(x.reshape(-1, 4).numpy(), a.reshape(-1, 4))
    np.testing.assert_array_equal(x.reshape((6, 4)).numpy(), a.reshape(6, 4))
    np.testing.assert_array_equal(x.sum().numpy(), a.sum())
    np.testing.assert_allclose(x.mean((0, 2), keepdims=True).numpy(),
                               a.mean((0, 2), keepdims=True))
    np.testing.assert_array_equal(x.max(-1).numpy(), a.max(-1))
    assert float(x.sum()) == a.sum() and int(x[0, 0, 1]) == 1 and bool(x[0, 0, 1])
    with pytest.raises(fs.ShapeError, match="one element"):
        x.item()


@pytest.mark.parametrize("device", DEVICES)
def test_concat_split_where(device: str) -> None:
    a = np.arange(12.0).reshape(3, 4)
    x = fs.tensor(a, device=device)
    parts = fs.split(x, 2, axis=1)
    for p, w in zip(parts, np.split(a, 2, axis=1)):
        np.testing.assert_array_equal(p.numpy(), w)
    parts = fs.split(x, [1, 2], axis=0)
    assert [p.shape for p in parts] == [(1, 4), (2, 4)]
    np.testing.assert_array_equal(fs.concat(parts[::-1], axis=0).numpy(),
                                  np.concatenate([a[1:], a[:1]]))
    np.testing.assert_array_equal(fs.concat([x, x.astype("float32")], axis=-1).numpy(),
                                  np.concatenate([a, a], -1))
    np.testing.assert_array_equal(fs.where(x > 5, x, -1.0).numpy(), np.where(a > 5, a, -1))
    with pytest.raises(fs.ShapeError, match="sum to"):
        fs.split(x, [1, 1], axis=0)


def test_to_moves_between_libraries_and_back() -> None:
    a = np.arange(6.0).reshape(2, 3)
    x = fs.tensor(a)
    assert x.to("cpu:0") is x
    y = x.to("strict:0") * 2
    assert str(y.device) == "strict:0"
    z = (y.to("cpu") + x).numpy()
    np.testing.assert_array_equal(z, 3 * a)
    s = fs.tensor(a, device="strict:0")
    np.testing.assert_array_equal(fs.tensor(s, device="cpu").numpy(), a)


def test_realize_runs_several_outputs_as_one_graph() -> None:
    ex = graph.default_executor()
    x = fs.tensor(np.arange(3.0))
    a, b = x.exp() + 1, x.exp() * 2
    runs = ex.runs
    out = fs.realize(a, b)
    assert out == (a, b) and ex.runs == runs + 1
    np.testing.assert_allclose(b.numpy(), 2 * np.exp(np.arange(3.0)))


def test_numpy_interop_and_iteration() -> None:
    a = np.arange(6.0).reshape(3, 2)
    x = fs.tensor(a) * 2
    np.testing.assert_array_equal(np.asarray(x), 2 * a)  # asking numpy realises
    rows = list(fs.tensor(a))
    assert len(rows) == 3 and all(isinstance(r, fs.Tensor) for r in rows)
    np.testing.assert_array_equal(rows[2].numpy(), a[2])


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_a_strict_device_refuses_16_bit_floats_with_a_typed_error(dt: str) -> None:
    """The Array API standard has no 16-bit floats: a strict device says so (DTypeError,
    naming the dtype and the fix) wherever one would reach it, never the library's own
    TypeError."""
    from fuelspmd.dtypes import to_numpy
    from fuelspmd.errors import DTypeError

    host = np.ones(3, to_numpy(dt))
    with pytest.raises(DTypeError, match=f"no {dt}; use float32"):
        fs.tensor(host, device="strict:0")
    with pytest.raises(DTypeError, match=f"no {dt}; cast to float32"):
        fs.tensor(host).to("strict:0")
    with pytest.raises(DTypeError, match=f"no {dt}; use float32"):
        fs.zeros((3,), dtype=dt, device="strict:0").numpy()
