"""The MPI transport follows the cost model's all-reduce plan, at any world size.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_all_reduce_policy.py``. The model is a declared topology (so the test
does not depend on this machine's calibration): one shared-memory node, or, at an even
world of 4+, two nodes with a slow network, where the model picks the hierarchical
all-reduce for large sizes. The transport must run, per size, the algorithm the plan
names (checked through the shared window it allocates and through the hierarchical
path's calls), give results equal to MPI's own all-reduce (integers exactly, floats to
rounding) and to a numpy reference, explain itself in words, obey
``$FUELSPMD_ALL_REDUCE``, and plan a split group with the same planner.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fuelspmd.cost import CostModel
from fuelspmd.cost.policy import all_reduce_planner, plan_all_reduce
from fuelspmd.topology import Link, Topology

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

TIMEOUT = 30.0
SIZES = (8, 4096, 1 << 20, 4 << 20)  # bytes of float64 / int64


def declared(size: int) -> CostModel:
    nodes = 2 if size >= 4 and size % 2 == 0 else 1
    return CostModel(Topology.uniform(
        nodes=nodes, devices_per_node=size // nodes, fabric=Link("shm", 3e9, 5e-6), nics=1,
        nic=Link("net", 1.25e8, 50e-6), reduce_bandwidth=3e9))


@pytest.fixture()
def t() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    transport = plugin.world(timeout=TIMEOUT)
    yield transport
    transport.finalize()


def inputs(rank: int, count: int, dt: str) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(dt.encode()), rank, count])
    return rng.integers(-50, 50, count).astype(dt) if dt.startswith("int") else \
        rng.standard_normal(count).astype(dt)


def reference(size: int, count: int, dt: str) -> np.ndarray:
    acc = inputs(0, count, dt)
    for r in range(1, size):
        acc = acc + inputs(r, count, dt)
    return acc


def test_the_transport_runs_the_plan(t: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi4py import MPI

    model = declared(t.size)
    assert t.set_all_reduce_policy(algorithm="auto", planner=all_reduce_planner(model),
                                   cap_bytes=64 << 20) == "auto"
    plan = plan_all_reduce(model, range(t.size))
    hier_calls = []
    if t._hier is not None:  # count the real path's calls (it still runs)
        real = t._hier.all_reduce
        monkeypatch.setattr(t._hier, "all_reduce",
                            lambda *a: (hier_calls.append(a[0].nbytes), real(*a))[1])
    seen = set()
    for nbytes in SIZES:
        want = plan.choose(nbytes).algorithm if t.size > 1 else "mpi"
        assert t.all_reduce_algorithm(nbytes) == want
        words = t.explain_all_reduce(nbytes)
        assert (want in words and "predicted" in words) or t.size == 1, words
        for dt in ("int64", "float64"):
            count = nbytes // 8
            x = inputs(t.rank, count, dt)
            theirs = x.copy()
            t.comm.Allreduce(MPI.IN_PLACE, theirs, MPI.SUM)
            before = t.shared_window_bytes
            t.all_reduce(x, "sum").wait()
            if dt == "int64":
                np.testing.assert_array_equal(x, theirs)
                np.testing.assert_array_equal(x, reference(t.size, count, dt))
            else:
                np.testing.assert_allclose(x, theirs, rtol=1e-12, atol=1e-12)
            if want == "shm":
                assert t.shared_window_bytes >= max(before, 1 << 16)
            seen.add(want)
    if t.size >= 4 and t.size % 2 == 0:
        assert "hierarchical" in seen and hier_calls  # the declared two-node case
    elif t.size > 1:
        assert "shm" in seen and t.shared_window_bytes > 0
    # avg and float16 (which only MPI reduces) take their paths too
    y = inputs(t.rank, 1 << 17, "float32")
    t.all_reduce(y, "avg").wait()
    np.testing.assert_allclose(y, reference(t.size, 1 << 17, "float32") / t.size, rtol=1e-5,
                               atol=1e-5)
    assert t.all_reduce_algorithm(1 << 20, "float16") == "mpi"


def test_manual_hierarchical_and_what_cannot_apply(t: Any) -> None:
    nodes = [r * 2 // t.size for r in range(t.size)] if t.size >= 4 and t.size % 2 == 0 \
        else None
    got = t.set_all_reduce_policy(algorithm="hierarchical", nodes=nodes)
    assert got == ("hierarchical" if nodes else "mpi")
    x = inputs(t.rank, 3001, "int64")
    t.all_reduce(x, "sum").wait()
    np.testing.assert_array_equal(x, reference(t.size, 3001, "int64"))
    if not nodes and t.size > 1:
        assert "does not apply" in t.explain_all_reduce(3001 * 8)


def test_a_split_plans_its_own_group(t: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = CostModel(Topology.uniform(nodes=1, devices_per_node=t.size,
                                       fabric=Link("shm", 3e9, 5e-6), reduce_bandwidth=3e9))
    t.set_all_reduce_policy(algorithm="auto", planner=all_reduce_planner(model))
    sub = t.split(t.rank % 2, t.rank)
    try:
        want = plan_all_reduce(model, sub.world_ranks).choose(1 << 20).algorithm
        assert sub.all_reduce_algorithm(1 << 20) == (want if sub.size > 1 else "mpi")
        x = inputs(t.rank, 1 << 17, "int64")
        sub.all_reduce(x, "sum").wait()
        want_x = sum(inputs(r, 1 << 17, "int64") for r in sub.world_ranks)
        np.testing.assert_array_equal(x, want_x)
    finally:
        sub.finalize()
