"""The executor's direct path: collectives whose inputs are all realised (gradients after a
realised backward, a parameter's broadcast) are issued without lowering or planning, in
creation order, bucketed by the planner's own rule, with numpy's results.

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
from fuelspmd.graph.executor import _direct, _one_bucket
from fuelspmd.graph.plan import joins_bucket, take_bucket

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 10.0
SHAPES = [(3, 4), (7,), (), (2, 2, 2), (5,), (16,)]


def _inputs(n: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(11)
    return [[rng.standard_normal(s) for s in SHAPES] for _ in range(n)]


def _gradients(comm: fs.Communicator, xs: list[np.ndarray]) -> list[Any]:
    """All_reduces of leaves, plus a max and a float32 one that no sum bucket may take."""
    leaves = [fs.tensor(x, device=comm.device) for x in xs]
    misses = default_executor().cache.misses
    ys = [comm.all_reduce(t) for t in leaves]
    ys.append(comm.all_reduce(leaves[1], "max"))
    ys.append(comm.all_reduce(fs.tensor(xs[4].astype(np.float32), device=comm.device)))
    ys.append(comm.all_reduce(leaves[0]))
    fs.realize(*ys)
    out = [y.numpy() for y in ys]
    return [out, default_executor().cache.misses - misses]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bucket", [0, 200, 1 << 20])
def test_collectives_of_leaves_match_numpy_without_a_plan(n: int, bucket: int) -> None:
    per = _inputs(n)
    outs = DeviceGroup.cpu(n, timeout=TIMEOUT, bucket_bytes=bucket).run(_gradients, per)
    for got, misses in outs:
        assert misses == 0  # nothing was lowered or planned
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


def test_direct_path_is_taken_only_for_realised_inputs() -> None:
    comm = DeviceGroup.cpu(2).comms[0]
    t = fs.tensor(np.ones(4))
    a = comm.all_reduce(t)
    b = comm.all_reduce(t * 2.0)  # its input is computed: the planner runs this graph
    c = comm.all_reduce(t, "max")
    assert _direct([a.node]) == [a.node]
    assert _direct([b.node]) is None
    assert _direct([c.node]) is None  # its chain reaches b
    assert _direct([(t * 3.0).node]) is None
    d = DeviceGroup.cpu(2).comms[0]
    x, y = d.all_reduce(t), d.all_reduce(t)
    assert _direct([y.node, x.node]) == [x.node, y.node]  # the chain, oldest first


def test_bucket_rule_is_the_planners() -> None:
    """The direct path and the planner split the same collectives into the same buckets:
    96 + 56 bytes fit 200, the next 64 opens a new bucket."""
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
    other = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    computed = [other.all_reduce(fs.tensor(per[k], device="cpu:0") * 2.0) for k in (0, 1, 3, 4)]
    plan, _ = default_executor().plan([y.node for y in computed])
    assert [len(s.members) for s in plan.steps if s.kind == "bucket_start"] == runs


def test_take_bucket_applies_the_rule_to_the_end_of_the_todo_list() -> None:
    """take_bucket takes members from the end of ``todo`` (the next to start) while they
    are alike and the bucket stays within its bytes (an exact fit joins), leaving the rest
    in order; a member of another reduce op, or one past the limit, stops it."""
    comm = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    t = [fs.tensor(np.ones(k, np.float64), device="cpu:0") for k in (10, 7, 9, 3, 1)]
    a, b, c = comm.all_reduce(t[0]), comm.all_reduce(t[1]), comm.all_reduce(t[2])
    d, e = comm.all_reduce(t[3], "max"), comm.all_reduce(t[4])
    head, *rest = [x.node for x in (a, b, c, d, e)]
    todo = rest[::-1]  # popped from the end, as the executor keeps it
    assert take_bucket(head, todo) == [head, b.node]  # 80 + 56 bytes; + 72 > 200
    assert todo == [e.node, d.node, c.node]
    assert take_bucket(todo.pop(), todo) == [c.node]  # the next one is a max
    assert take_bucket(todo.pop(), todo) == [d.node]
    assert todo == [e.node]
    exact = DeviceGroup.cpu(2, bucket_bytes=24).comms[0]  # 2 + 1 float64: 24 bytes
    ns = [exact.all_reduce(x).node for x in
          (fs.tensor(np.ones(2), device="cpu:0"), fs.tensor(np.ones(1), device="cpu:0"))]
    assert take_bucket(ns[0], [ns[1]]) == ns


def test_one_bucket_takes_a_strict_chain_of_alike_all_reduces_that_fits() -> None:
    """The realise's one-pass bucket: every target one communicator's all_reduce of one
    dtype, each ordered after the one before it, all within the bucket; anything else
    (another op, a repeated node, another order, a computed input, too many bytes) is
    left to the general direct path."""
    comm = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    t = [fs.tensor(np.ones(k, np.float64), device="cpu:0") for k in (10, 7, 9, 3)]
    a, b, c = comm.all_reduce(t[0]), comm.all_reduce(t[1]), comm.all_reduce(t[3])
    found = _one_bucket([a.node, b.node, c.node])
    assert found is not None
    bufs, shapes, total = found
    assert all(x is y.node.buffer for x, y in zip(bufs, (t[0], t[1], t[3])))
    assert shapes == [(10,), (7,), (3,)] and total == 20
    assert _one_bucket([a.node, c.node]) is None  # c is ordered after b, not a
    assert _one_bucket([b.node, a.node]) is None
    assert _one_bucket([a.node, b.node, a.node]) is None
    assert _one_bucket([a.node, b.node, c.node, comm.all_reduce(t[2]).node]) is None  # 232 B
    d = comm.all_reduce(t[0], "max")
    assert _one_bucket([d.node, comm.all_reduce(t[1]).node]) is None
    other = DeviceGroup.cpu(2, bucket_bytes=200).comms[0]
    x = other.all_reduce(t[0])
    assert _one_bucket([x.node, other.all_reduce(t[1] * 2.0).node]) is None


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
