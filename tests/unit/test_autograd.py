"""fs.grad and fs.vjp: lazy gradients built as graph, checked against closed forms."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph


def test_grad_matches_the_closed_form_and_is_lazy() -> None:
    a, b = np.array([1.0, 2.0, -0.5]), np.array([0.3, -1.0, 2.0])
    x, y = fs.tensor(a), fs.tensor(b)
    out = (x * y + x.exp() * x).sum()
    runs = graph.default_executor().runs
    gx, gy = fs.grad(out, [x, y])
    assert graph.default_executor().runs == runs and not gx.realised
    fs.realize(out, gx, gy)
    np.testing.assert_allclose(gx.numpy(), b + np.exp(a) * (1 + a))
    np.testing.assert_allclose(gy.numpy(), a)


def test_a_value_used_twice_accumulates() -> None:
    x = fs.tensor(np.array([3.0]))
    h = x * x
    (g,) = fs.grad((h * h + h).sum(), [x])  # x^4 + x^2 -> 4x^3 + 2x
    np.testing.assert_allclose(g.numpy(), [4 * 27 + 6])


def test_unreached_and_integer_inputs_get_zeros() -> None:
    x, unused = fs.tensor(np.ones(2)), fs.tensor(np.ones((3, 3)))
    idx = fs.tensor(np.array([1, 0]))
    out = (x.take(idx, 0) * 2).sum()
    gx, gu, gi = fs.grad(out, [x, unused, idx])
    np.testing.assert_array_equal(gx.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(gu.numpy(), np.zeros((3, 3)))
    assert gi.dtype is fs.int64
    np.testing.assert_array_equal(gi.numpy(), [0, 0])


def test_vjp_with_several_outputs_sums_their_contributions() -> None:
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    x = fs.tensor(a)
    c1, c2 = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0])
    (g,) = fs.vjp([x * 3, (x * x).sum(0)], [x], [fs.tensor(c1), fs.tensor(c2)])
    np.testing.assert_allclose(g.numpy(), 3 * c1 + 2 * a * c2)


def test_second_order_gradients_are_graphs_too() -> None:
    a = np.array([0.5, -1.5, 2.0])
    x = fs.tensor(a)
    (g,) = fs.grad((x * x * x).sum(), [x])
    (h,) = fs.grad(g.sum(), [x])
    np.testing.assert_allclose(h.numpy(), 6 * a)


def test_gradient_dtype_follows_the_input() -> None:
    w = fs.tensor(np.array([1.0, 2.0], np.float32))
    x = fs.tensor(np.array([3.0, 4.0]))  # float64: the product is float64
    out = (w * x).sum()
    assert out.dtype is fs.float64
    (gw,) = fs.grad(out, [w])
    assert gw.dtype is fs.float32
    np.testing.assert_allclose(gw.numpy(), [3.0, 4.0])


def test_realised_tensors_are_leaves_for_grad() -> None:
    x = fs.tensor(np.array([2.0]))
    h = (x * x).realize()  # history dropped: h is a leaf now
    gx, gh = fs.grad((h * 3).sum(), [x, h])
    np.testing.assert_array_equal(gx.numpy(), [0.0])
    np.testing.assert_array_equal(gh.numpy(), [3.0])


def test_caller_mistakes_raise_typed_errors() -> None:
    x = fs.tensor(np.ones((2, 2)))
    with pytest.raises(fs.ShapeError, match=r"shape \(2, 2\).*scalar"):
        fs.grad(x * 2, [x])
    with pytest.raises(fs.ShapeError, match="cotangent"):
        fs.vjp(x * 2, [x], fs.tensor(np.ones(3)))
    with pytest.raises(fs.ShapeError, match="2 outputs but 1 cotangents"):
        fs.vjp([x, x], [x], [fs.tensor(np.ones((2, 2)))])
    with pytest.raises(fs.DTypeError, match="not floating"):
        fs.vjp(x > 0, [x], fs.tensor(np.ones((2, 2), bool)))
