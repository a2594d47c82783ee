"""``put`` (an indexed write) in place: the planner writes the destination's own buffer only
when the graph owns it (an intermediate, or a leaf the caller donated) and it dies at the
write; the result is exactly the functional one, and a caller's array is never written."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph
from fuelspmd.errors import ConfigError
from fuelspmd.graph import default_executor

pytestmark = pytest.mark.timeout(60)
rng = np.random.default_rng(7)


def put(dest: fs.Tensor, idx: np.ndarray, values: fs.Tensor) -> fs.Tensor:
    i = fs.tensor(np.asarray(idx, dtype=np.int64))
    return fs.Tensor(graph.make("put", (dest.node, i.node, values.node), (0,)))


def functional(dest: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = dest.copy()
    out[idx] = values
    return out


def test_donated_destination_is_written_in_place_with_the_functional_result() -> None:
    pool, idx, vals = rng.standard_normal((64, 2, 3)), np.array([5, 60, 7]), \
        rng.standard_normal((3, 2, 3))
    want = functional(pool, idx, vals)
    kept = fs.tensor(pool.copy())
    plain = put(kept, idx, fs.tensor(vals)).numpy()  # not donated: a copy is written
    assert np.array_equal(plain, want)
    assert np.array_equal(kept.numpy(), pool)  # the caller's array is untouched
    buf = pool.copy()
    dest = fs.tensor(buf).donate()
    out = put(dest, idx, fs.tensor(vals))
    fs.realize(out)
    assert default_executor().allocations == 0  # O(values): no buffer of the pool's size
    assert np.shares_memory(out.numpy(), buf) and np.array_equal(out.numpy(), want)
    with pytest.raises(ConfigError, match="was donated"):
        (dest + 1).numpy()  # spent: its buffer now holds the result


def test_a_chain_of_writes_reuses_one_buffer() -> None:
    buf = np.zeros((16, 4))
    a, b = rng.standard_normal((2, 4)), rng.standard_normal((3, 4))
    out = put(put(fs.tensor(buf).donate(), np.array([1, 9]), fs.tensor(a)),
              np.array([9, 2, 15]), fs.tensor(b))
    want = functional(functional(np.zeros((16, 4)), np.array([1, 9]), a),
                      np.array([9, 2, 15]), b)
    assert np.shares_memory(out.numpy(), buf) and np.array_equal(out.numpy(), want)


def test_old_value_read_elsewhere_in_the_graph_is_not_overwritten() -> None:
    """Where the old destination is read by another step too, the write may not land in
    its buffer before that read: both results are exactly the functional ones."""
    pool = rng.standard_normal((8, 3))
    for order in (0, 1):
        dest = fs.tensor(pool.copy()).donate()
        idx, vals = np.array([0, 3]), rng.standard_normal((2, 3))
        written = put(dest, idx, fs.tensor(vals))
        old = dest.take(fs.tensor(np.arange(8)), 0) * 2.0
        targets = (written, old) if order == 0 else (old, written)
        fs.realize(*targets)
        assert np.array_equal(written.numpy(), functional(pool, idx, vals))
        assert np.array_equal(old.numpy(), pool * 2.0)


def test_put_checks_shapes_and_dtypes_when_built() -> None:
    dest = fs.tensor(np.zeros((4, 3)))
    with pytest.raises(fs.ShapeError, match=r"put: values \(2, 2\) do not match \(2, 3\)"):
        put(dest, np.array([0, 1]), fs.tensor(np.zeros((2, 2))))
    with pytest.raises(fs.DTypeError, match="cast the values first"):
        put(dest, np.array([0, 1]), fs.tensor(np.zeros((2, 3), np.float32)))
