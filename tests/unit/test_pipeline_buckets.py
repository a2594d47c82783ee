"""Gradient buckets: packing (pure) and the clocked transport's stamps."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel.buckets import (
    Bucket,
    ClockedTransport,
    check_bucket_bytes,
    plan_buckets,
)
from fuelspmd.transport import ReduceOp, SelfTransport

pytestmark = pytest.mark.timeout(60)


def _t(*shape: int, dtype: str = "float32") -> fs.Tensor:
    return fs.tensor(np.zeros(shape, dtype))


def test_buckets_pack_last_parameter_first_up_to_the_limit() -> None:
    params = [_t(4, 4), _t(4), _t(4, 4), _t(4)]  # W1 b1 W2 b2: 64, 16, 64, 16 bytes
    assert plan_buckets(params, 80) == [Bucket((3, 2), 80), Bucket((1, 0), 80)]
    assert plan_buckets(params, 79) == [Bucket((3,), 16), Bucket((2,), 64), Bucket((1,), 16),
                                        Bucket((0,), 64)]
    assert plan_buckets(params, 1 << 20) == [Bucket((3, 2, 1, 0), 160)]


def test_a_large_parameter_and_a_dtype_change_start_buckets() -> None:
    params = [_t(2, dtype="float64"), _t(100), _t(2)]  # 16, 400, 8 bytes
    assert plan_buckets(params, 64) == [Bucket((2,), 8), Bucket((1,), 400), Bucket((0,), 16)]
    assert plan_buckets([_t(2), _t(2, dtype="float64")], 1 << 20) == [
        Bucket((1,), 16), Bucket((0,), 8)]
    assert plan_buckets([], 64) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1M"])
def test_bucket_bytes_is_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="bucket_bytes"):
        check_bucket_bytes(bad)


def test_clocked_transport_stamps_issue_and_completion() -> None:
    clock = ClockedTransport(SelfTransport())
    buf = np.arange(3.0)
    work = clock.all_reduce(buf, ReduceOp.SUM)
    work.wait(1.0)
    assert len(clock.log) == 1 and clock.log[0][0] <= clock.log[0][1]
    assert (buf == np.arange(3.0)).all()  # one rank: the sum is the input
