"""The executor's one path: a cached plan binds only the graph it was made for, and
``lower`` (its traversal order), checked against plain numpy and a reference walk."""

from __future__ import annotations

import numpy as np

import fuelspmd as fs
from fuelspmd import graph
from fuelspmd.graph.node import Node
from fuelspmd.graph.passes import lower


def _reference_order(targets: list[Node]) -> list[Node]:
    """Depth-first post-order, first input first, each node once (the documented order)."""
    seen: set[int] = set()
    out: list[Node] = []

    def visit(n: Node) -> None:
        if id(n) in seen:
            return
        if n.buffer is None:
            for x in n.inputs:
                visit(x)
        seen.add(id(n))
        out.append(n)

    for t in targets:
        visit(t)
    return out


def test_lower_walks_in_post_order_with_shared_nodes_once() -> None:
    a, b = fs.tensor(np.arange(6.0).reshape(2, 3)), fs.tensor(np.ones((2, 3)))
    u = (a * b + 1.0).exp()
    v = u - a
    w = (v * u).sum(axis=1)
    targets = [w.node, v.node]
    sigs, leaves, outs = lower(targets)
    ref = _reference_order(targets)
    assert [s[0].name for s in sigs] == [("leaf" if n.buffer is not None else n.op.name)
                                          for n in ref]
    assert [id(x) for x in leaves] == [id(n) for n in ref if n.buffer is not None]
    pos = {id(n): i for i, n in enumerate(ref)}
    assert outs == (pos[id(w.node)], pos[id(v.node)])
    for i, s in enumerate(sigs):
        assert all(j < i for j in s[1])  # topological


def test_graphs_alike_but_for_an_op_get_their_own_plans() -> None:
    """Graphs alike but for an op each get their plan, and each step finds its own."""
    ex = graph.Executor()
    x = np.arange(1.0, 5.0)
    results = []
    for k in range(2):
        for op in ("add", "mul", "add", "mul"):
            t = fs.tensor(x + k)
            y = t + 3.0 if op == "add" else t * 3.0
            ex.realize([y.node])
            results.append(np.asarray(y.node.buffer))
    assert (ex.cache.misses, ex.cache.hits) == (2, 6)
    for k in range(2):
        np.testing.assert_array_equal(results[4 * k], x + k + 3.0)
        np.testing.assert_array_equal(results[4 * k + 1], (x + k) * 3.0)


def test_alike_graphs_on_more_devices_than_variants_keep_their_plans() -> None:
    """A DeviceGroup's devices run the same graphs in one process: each device's plans are
    kept (under one key, more devices than its VARIANTS evicted each other every step, and
    a compiled step on a DeviceGroup of 4 with an interleaved pipeline never replayed)."""
    ex = graph.Executor()
    devices = [f"cpu:{i}" for i in range(graph.PlanCache.VARIANTS + 2)]
    for k in range(3):
        for d in devices:
            y = fs.tensor(np.arange(4.0) + k, device=d) * 2.0 + 1.0
            ex.realize([y.node])
            np.testing.assert_array_equal(y.node.buffer, (np.arange(4.0) + k) * 2.0 + 1.0)
    assert (ex.cache.misses, ex.cache.hits) == (len(devices), 2 * len(devices))


def test_a_plan_binds_only_its_own_sharing() -> None:
    """f(x, x) and f(x1, x2) look alike node by node; a plan made for one never runs the
    other (the binding checks that nodes are shared exactly where they were)."""
    ex = graph.Executor()
    a, b = fs.tensor(np.arange(4.0)), fs.tensor(np.arange(4.0) * 10)
    same = (a * 2.0) + (a * 2.0)
    ex.realize([same.node])
    np.testing.assert_array_equal(same.node.buffer, np.arange(4.0) * 4)
    two = (a * 2.0) + (b * 2.0)
    ex.realize([two.node])
    np.testing.assert_array_equal(two.node.buffer, np.arange(4.0) * 22)
    shared = a * 2.0
    once = shared + shared
    ex.realize([once.node])
    np.testing.assert_array_equal(once.node.buffer, np.arange(4.0) * 4)
    assert ex.cache.misses == 3


def test_negative_zero_is_its_own_constant() -> None:
    """-0.0 and 0.0 are equal as Python numbers; as constants they are two (1 / -0.0 is
    -inf), so a plan made for one never serves the other."""
    ex = graph.Executor()
    x = fs.tensor(np.ones(3))
    for sign, want in ((1.0, np.inf), (-1.0, -np.inf), (1.0, np.inf)):
        y = x / (fs.zeros(3, dtype="float64") * sign)  # folded to a fill of +-0.0
        with np.errstate(divide="ignore"):
            ex.realize([y.node])
        np.testing.assert_array_equal(y.node.buffer, np.full(3, want))
