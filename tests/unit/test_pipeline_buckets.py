"""Gradient buckets: the size check, and the dp Communicator's stamps the executor reports."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.comm import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel.buckets import check_bucket_bytes
from fuelspmd.transport import SelfTransport

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1M"])
def test_bucket_bytes_is_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="bucket_bytes"):
        check_bucket_bytes(bad)


def _stamps(comm: Communicator, bucket_bytes: int) -> list[list[float]]:
    c = Communicator(comm.split(0, comm.rank).transport, device=comm.device,
                     bucket_bytes=bucket_bytes, record_times=True)
    xs = [fs.tensor(np.arange(3.0) + k + comm.rank, device=comm.device) for k in range(3)]
    outs = fs.realize(*[c.all_reduce(x, "avg") for x in xs])
    for k, o in enumerate(outs):
        np.testing.assert_array_equal(o.numpy(), np.arange(3.0) + k + 0.5)
    assert c.times is not None
    return c.times


@pytest.mark.parametrize(("bucket_bytes", "calls"), [(24, 3), (48, 2), (72, 1)])
def test_record_times_stamps_each_transport_call_once(bucket_bytes: int, calls: int) -> None:
    """Consecutive all-reduces that fit one bucket (24 bytes each) are one transport call,
    so one stamp; each call is issued after the one before it finished."""
    for times in DeviceGroup(["cpu:0", "cpu:1"], timeout=30).run(
            lambda c: _stamps(c, bucket_bytes)):
        assert len(times) == calls
        for (i0, d0), (i1, d1) in itertools.pairwise(times):
            assert i0 <= d0 <= i1 <= d1


def test_without_record_times_nothing_is_kept() -> None:
    comm = Communicator(SelfTransport(), device="cpu")
    comm.all_reduce(fs.tensor(np.ones(2))).realize()
    assert comm.times is None
