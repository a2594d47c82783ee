"""The size-1 transport: identity collectives, self send/recv, and the same input checks
every transport makes."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.transport import ReduceOp, SelfTransport, Transport, Work


def test_self_transport_is_a_transport() -> None:
    t = SelfTransport()
    assert isinstance(t, Transport)
    assert isinstance(t.barrier(), Work)
    assert isinstance(t.split(3, 0), SelfTransport)


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64", "int32", "int64",
                                "bool"])
def test_collectives_are_the_identity(dt: str) -> None:
    t = SelfTransport()
    x = np.arange(7).astype(fs.dtypes.to_numpy(dt))
    buf = x.copy()
    for op in ReduceOp:
        t.all_reduce(buf, op).wait(1.0)
        np.testing.assert_array_equal(buf, x)
    out = np.empty_like(x)
    t.all_gather(x, out).wait()
    np.testing.assert_array_equal(out, x)
    out[...] = 0
    t.reduce_scatter(x, out, ReduceOp.SUM).wait()
    np.testing.assert_array_equal(out, x)
    out[...] = 0
    t.all_to_all(x, out).wait()
    np.testing.assert_array_equal(out, x)
    t.broadcast(buf, 0).wait()
    np.testing.assert_array_equal(buf, x)


def test_send_to_self_then_recv_matches_by_tag() -> None:
    t = SelfTransport()
    a, b = np.arange(3.0), np.arange(3.0) + 10
    t.send(a, 0, tag=1).wait()
    t.send(b, 0, tag=2).wait()
    out = np.empty(3)
    t.recv(out, 0, tag=2).wait()
    np.testing.assert_array_equal(out, b)
    pending = t.recv(out, 0, tag=5)
    assert not pending.test()
    with pytest.raises(fs.CommTimeoutError, match="tag 5"):
        pending.wait(0.01)
    t.recv(out, 0, tag=1).wait()
    np.testing.assert_array_equal(out, a)


def test_bad_buffers_get_typed_errors() -> None:
    t = SelfTransport()
    with pytest.raises(fs.ShapeError, match="C-contiguous"):
        t.all_reduce(np.zeros((4, 4))[:, 0], ReduceOp.SUM)
    with pytest.raises(fs.ShapeError, match="recv must have 3"):
        t.all_gather(np.zeros(3), np.zeros(4))
    with pytest.raises(fs.DTypeError, match="use one dtype"):
        t.all_gather(np.zeros(3), np.zeros(3, dtype=np.float32))
    with pytest.raises(fs.DTypeError, match="not supported"):
        t.all_reduce(np.zeros(3, dtype=np.complex64), ReduceOp.SUM)
    with pytest.raises(fs.ConfigError, match=r"outside the group of 1 ranks \(valid: 0..0\)"):
        t.send(np.zeros(3), 1, tag=0)
    with pytest.raises(fs.ConfigError, match="root 2"):
        t.broadcast(np.zeros(3), 2)


def test_reduce_op_parse() -> None:
    assert ReduceOp.parse("AVG") is ReduceOp.AVG
    assert ReduceOp.parse(ReduceOp.MIN) is ReduceOp.MIN
    with pytest.raises(fs.ConfigError, match="use one of"):
        ReduceOp.parse("mean")
