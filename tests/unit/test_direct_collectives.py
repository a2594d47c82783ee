"""Collectives of realised values (gradients after a realised backward, a parameter's
broadcast) go the one realise path: their plan is made once and found again the next step,
they are issued in creation order, bucketed by the planner's one rule, with numpy's results.

Run in process on ``DeviceGroup.cpu(n)``: its transport raises CollectiveMismatchError when
devices issue different collectives at the same sequence number, so an out-of-order issue
on one device cannot pass unnoticed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.device_group import DeviceGroup
from fuelspmd.graph import default_executor
from fuelspmd.graph.plan import joins_bucket

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 10.0
SHAPES = [(3, 4), (7,), (), (2, 2, 2), (5,), (16,)]


def _inputs(n: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(11)
    return [[rng.standard_normal(s) for s in SHAPES] for _ in range(n)]


def _gradients(comm: fs.Communicator, xs: list[np.ndarray]) -> list[Any]:
    """All_reduces of leaves, plus a max and a float32 one that no sum bucket may take;
    two steps of them, new leaves each (as a training loop's gradients)."""
    steps = []
    for _ in range(2):
        leaves = [fs.tensor(x, device=comm.device) for x in xs]
        misses = default_executor().cache.misses
        ys = [comm.all_reduce(t) for t in leaves]
        ys.append(comm.all_reduce(leaves[1], "max"))
        ys.append(comm.all_reduce(fs.tensor(xs[4].astype(np.float32), device=comm.device)))
        ys.append(comm.all_reduce(leaves[0]))
        fs.realize(*ys)
        steps.append(default_executor().cache.misses - misses)
    return [[y.numpy() for y in ys], steps[1]]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bucket", [0, 200, 1 << 20])
def test_collectives_of_leaves_match_numpy_and_their_plan_is_found_again(
        n: int, bucket: int) -> None:
    per = _inputs(n)
    outs = DeviceGroup.cpu(n, timeout=TIMEOUT, bucket_bytes=bucket).run(_gradients, per)
    for got, misses in outs:
        assert misses == 0  # the second step bound the first step's plan
        for k in range(len(SHAPES)):
            want = sum(p[k] for p in per)
            np.testing.assert_allclose(got[k], want, rtol=1e-12, atol=1e-12)
            assert got[k].shape == SHAPES[k]
        np.testing.assert_array_equal(got[-3], np.maximum.reduce([p[1] for p in per]))
        want32 = sum(p[4].astype(np.float32) for p in per)
        assert got[-2].dtype == np.float32
        np.testing.assert_allclose(got[-2], want32, rtol=1e-6)
        np.testing.assert_allclose(got[-1], sum(p[0] for p in per), rtol=1e-12)
    first = outs[0][0]
    for got, _ in outs[1:]:  # every device holds the same numbers
        for a, b in zip(first, got):
            np.testing.assert_array_equal(a, b)


def test_a_bucket_hands_out_views_of_one_reduced_buffer() -> None:
    """256 small all_reduces in one bucket: the results are views of one array (no copy
    out), and the callers' inputs are untouched."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> list[Any]:
        arrays = [x * (k + 1) for k in range(256)]
        keep = [a.copy() for a in arrays]
        ys = fs.realize(*[comm.all_reduce(fs.tensor(a, device=comm.device)) for a in arrays])
        out = [y.numpy() for y in ys]
        assert all(np.array_equal(a, b) for a, b in zip(arrays, keep))
        return out

    n = 2
    xs = [np.full((4, 2), r + 1.0) for r in range(n)]
    outs = DeviceGroup.cpu(n, timeout=TIMEOUT, bucket_bytes=1 << 20).run(fn, xs)
    for out in outs:
        base = out[0].base
        assert base is not None and all(o.base is base for o in out)
        for k, o in enumerate(out):
            np.testing.assert_array_equal(o, np.full((4, 2), 3.0 * (k + 1)))


def test_realising_in_reverse_still_issues_in_creation_order() -> None:
    """Device 0 realises its collectives last-first, device 1 first-last: the shapes
    differ, so any order but creation order on either device is a mismatch."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> list[np.ndarray]:
        a, b, c = (fs.tensor(v, device=comm.device) for v in (x, x[:2].copy(), x[:1].copy()))
        ys = [comm.all_reduce(a), comm.broadcast(b, 0), comm.all_reduce(b, "max"),
              comm.all_gather(c, 0), comm.all_reduce(a)]
        fs.realize(*(ys[::-1] if comm.rank == 0 else ys))
        return [y.numpy() for y in ys]

    xs = [np.arange(4.0) + r for r in range(2)]
    for out in DeviceGroup.cpu(2, timeout=TIMEOUT, bucket_bytes=1 << 20).run(fn, xs):
        np.testing.assert_array_equal(out[0], xs[0] + xs[1])
        np.testing.assert_array_equal(out[1], xs[0][:2])
        np.testing.assert_array_equal(out[2], xs[1][:2])
        np.testing.assert_array_equal(out[3], np.array([0.0, 1.0]))
        np.testing.assert_array_equal(out[4], xs[0] + xs[1])


def test_bucket_rule_is_the_planners() -> None:
    """joins_bucket splits the collectives as the planner does, whether their inputs are
    leaves or computed: 96 + 56 bytes fit 200, the next 64 opens a new bucket."""
    comm = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    per = _inputs(1)[0]
    ys = [comm.all_reduce(fs.tensor(per[k], device="cpu:0")) for k in (0, 1, 3, 4)]
    nodes = [y.node for y in ys]
    runs: list[int] = []
    size = 0
    for k, node in enumerate(nodes):
        fit = joins_bucket(nodes[k - runs[-1]], node, size) if k else -1
        if fit >= 0:
            runs[-1] += 1
            size = fit
        else:
            runs.append(1)
            size = node.size * node.dtype.itemsize
    assert runs == [2, 2]
    plan, _ = default_executor().plan(nodes)
    assert [len(s.members) for s in plan.steps if s.kind == "bucket_start"] == runs
    other = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    computed = [other.all_reduce(fs.tensor(per[k], device="cpu:0") * 2.0) for k in (0, 1, 3, 4)]
    plan, _ = default_executor().plan([y.node for y in computed])
    assert [len(s.members) for s in plan.steps if s.kind == "bucket_start"] == runs


def test_two_communicators_realised_together() -> None:
    """Collectives of two communicators in one realise: each keeps its own order (one in
    flight per communicator), the sums are numpy's."""
    def fn(comm: fs.Communicator, x: np.ndarray) -> list[np.ndarray]:
        sub = comm.split(0, comm.rank)  # the same devices, another communicator
        a, b = fs.tensor(x, device=comm.device), fs.tensor(x * 10.0, device=comm.device)
        ys = [comm.all_reduce(a), sub.all_gather(b, 0), comm.all_reduce(b), sub.all_reduce(a)]
        fs.realize(*ys)
        return [y.numpy() for y in ys]

    xs = [np.arange(3.0) + r for r in range(2)]
    for out in DeviceGroup.cpu(2, timeout=TIMEOUT, bucket_bytes=1 << 20).run(fn, xs):
        np.testing.assert_array_equal(out[0], xs[0] + xs[1])
        np.testing.assert_array_equal(out[1], np.concatenate([xs[0], xs[1]]) * 10.0)
        np.testing.assert_array_equal(out[2], (xs[0] + xs[1]) * 10.0)
        np.testing.assert_array_equal(out[3], xs[0] + xs[1])
