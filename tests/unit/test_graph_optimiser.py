"""The optimiser, the plan cache and the executor's memory accounting."""

from __future__ import annotations

import math
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph


def _plan(*ts: fs.Tensor) -> graph.Plan:
    plan, _ = graph.Executor().plan([t.node for t in ts])
    return plan


def _ops(plan: graph.Plan) -> list[str]:
    names = []
    for s in plan.steps:
        names += [ins.op.name for ins, _, _ in s.prog.code] if s.prog else [s.instr.op.name]
    return names


def test_common_subexpressions_are_merged_when_planned() -> None:
    """Building does not merge (two builds are two nodes); the plan computes each
    subexpression once, whoever built it."""
    x = fs.tensor(np.arange(4.0))
    assert (x * 2).node is not (x * 2).node
    z = (x * 2).exp() + (x * 2).exp()
    assert _ops(_plan(z)).count("exp") == 1 and _ops(_plan(z)).count("mul") == 1
    np.testing.assert_allclose(z.numpy(), 2 * np.exp(2 * np.arange(4.0)))


def test_dead_code_is_not_planned() -> None:
    x = fs.tensor(np.arange(1.0, 5.0))
    y = x.exp()
    unused = x.log() * 7  # built, never asked for
    assert "log" not in _ops(_plan(y))
    assert unused.node.buffer is None


def test_constants_fold_at_plan_time() -> None:
    c = fs.ones(3) * 2 + 1
    plan = _plan(c)
    assert _ops(plan) == ["const"]  # one fill of 3.0, no arithmetic left
    np.testing.assert_array_equal(c.numpy(), [3.0, 3.0, 3.0])
    x = fs.tensor(np.arange(3.0))
    y = x * (fs.ones(()) * 4 - 1)
    assert _ops(_plan(y)) == ["mul"]
    np.testing.assert_array_equal(y.numpy(), np.arange(3.0) * 3)


def test_algebraic_simplification() -> None:
    a = np.arange(24.0).reshape(2, 3, 4)
    x = fs.tensor(a)
    y = x.reshape(6, 4).reshape(4, 6).reshape(24)
    assert _ops(_plan(y)) == ["reshape"]
    np.testing.assert_array_equal(y.numpy(), a.reshape(24))
    t = fs.tensor(a).transpose(1, 2, 0).transpose(2, 0, 1)
    assert _plan(t).steps == []  # double transpose is the identity
    np.testing.assert_array_equal(t.numpy(), a)
    z = fs.tensor(a) * 1 + 0
    assert _plan(z).steps == []
    w = (fs.tensor(a) * 1.0).exp()
    assert _ops(_plan(w)) == ["exp"]
    d = (fs.tensor(a).exp().detach() * 2).tanh()  # detach only matters to autograd
    assert "detach" not in _ops(_plan(d))
    np.testing.assert_array_equal(d.numpy(), np.tanh(np.exp(a) * 2))


@pytest.mark.parametrize("device", ["cpu:0", "strict:0"])
def test_an_elementwise_chain_is_one_fused_step(device: str) -> None:
    a = np.linspace(-1, 1, 1000)
    x = fs.tensor(a, device=device)
    y = ((x * 3 + 1).tanh() * 0.5 - x).exp()
    plan = _plan(y)
    assert len(plan.steps) == 1 and plan.n_fused_ops == 6
    if device == "cpu:0":
        assert plan.steps[0].kind == "fused" and len(plan.steps[0].prog.temps) == 1
    np.testing.assert_allclose(y.numpy(), np.exp(np.tanh(a * 3 + 1) * 0.5 - a), rtol=1e-13)



@pytest.mark.parametrize("device", ["cpu:0", "strict:0"])
def test_equal_fused_groups_share_a_program_and_keep_their_own_scalars(device: str) -> None:
    """Two chains alike but for their constants are one program with two sets of scalars;
    another op or another shape is another program. Each computes its own numbers."""
    a = np.linspace(-1, 1, 12).reshape(3, 4)
    x = fs.tensor(a, device=device)
    outs = [(x * 3 + 1).tanh(), (x * -2 + -0.5).tanh(), (x * 4 + 2).exp(),
            (x[:2] * 3 + 1).tanh()]
    plan = _plan(*outs)
    fused = [s for s in plan.steps if s.prog is not None]
    assert len(fused) == 4 and fused[0].prog is fused[1].prog
    assert len({id(s.prog) for s in fused}) == 3
    want = [np.tanh(a * 3 + 1), np.tanh(a * -2 - 0.5), np.exp(a * 4 + 2),
            np.tanh(a[:2] * 3 + 1)]
    fs.realize(*outs)
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-13)


def test_fused_step_writes_into_a_dying_input_buffer() -> None:
    n = 1 << 16
    x = fs.tensor(np.ones((n,)))
    w = fs.tensor(np.full((1, 1), 2.0))
    m = x.reshape(n, 1) @ w  # a buffer the executor owns, dead after the next op
    y = (m + 1).tanh() * 2
    ex = graph.Executor()
    plan, leaves = ex.plan([y.node])
    (out,) = ex.run(plan, leaves)
    assert ex.allocations == 1  # the matmul's buffer is reused by the fused chain
    assert ex.peak_bytes == n * 8
    np.testing.assert_allclose(out.ravel(), np.tanh(3.0) * 2)


def test_a_fused_step_writes_its_outputs_into_donated_leaves_and_their_reshapes() -> None:
    """A donated leaf read through a reshape (all of its buffer, in order) lends that
    buffer to the root, and a donated leaf that dies at an exported member lends its
    buffer to that export: the step allocates only its scratch (the square root's)."""
    n = 1 << 12
    xa, ma = np.arange(n, dtype=np.float64), np.full((n // 4, 4), 3.0)
    x, m = fs.tensor(xa.copy()).donate(), fs.tensor(ma.copy()).donate()
    xbuf, mbuf = x.node.buffer, m.node.buffer
    m_new = m * 0.5 + 1.0  # an output, and read again below: an export
    y = x.reshape(n // 4, 4) * 2.0 + m_new.sqrt()
    ex = graph.Executor()
    ex.realize([y.node, m_new.node])
    assert ex.allocations == 1
    assert np.shares_memory(y.node.buffer, xbuf) and np.shares_memory(m_new.node.buffer, mbuf)
    np.testing.assert_array_equal(m_new.numpy(), ma * 0.5 + 1.0)
    np.testing.assert_array_equal(y.numpy(), xa.reshape(n // 4, 4) * 2.0 + np.sqrt(ma * 0.5 + 1.0))


def test_released_buffers_are_reused_by_later_steps() -> None:
    n = 64
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n)) / 8
    x, w = fs.tensor(a), fs.tensor(b)
    y = ((x @ w) @ w) @ w
    ex = graph.Executor()
    plan, leaves = ex.plan([y.node])
    (out,) = ex.run(plan, leaves)
    assert ex.allocations == 2  # three products in two buffers
    assert ex.peak_bytes == 2 * n * n * 8
    np.testing.assert_allclose(out, a @ b @ b @ b, rtol=1e-12)


def test_peak_bytes_count_what_is_live_and_agree_with_tracemalloc() -> None:
    n = 100_000
    x = fs.tensor(np.linspace(0, 1, n))
    e = x.exp()
    out = e.sum() + e.max()
    ex = graph.Executor()
    plan, leaves = ex.plan([out.node])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ex.run(plan, leaves)
        traced = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert n * 8 <= ex.peak_bytes <= n * 8 + 64
    assert abs(traced - ex.peak_bytes) < 8 * 1024


def test_realised_history_is_dropped() -> None:
    x = fs.tensor(np.arange(3.0))
    mid = x * 2
    out = mid.exp()
    ref = weakref.ref(mid.node)
    del mid
    out.realize()
    assert out.node.inputs == () and out.node.buffer is not None
    assert ref() is None  # nothing keeps the intermediate alive
    again = out + 1  # a realised tensor is a leaf for what follows
    np.testing.assert_allclose(again.numpy(), np.exp(2 * np.arange(3.0)) + 1)


def test_plan_key_is_structure_not_data() -> None:
    ex = graph.Executor()

    def build(a: np.ndarray) -> fs.Tensor:
        return (fs.tensor(a) * 2).sum(0)

    for k in range(3):
        ex.realize([build(np.full((4, 5), float(k))).node])
    assert (ex.cache.misses, ex.cache.hits) == (1, 2)
    ex.realize([build(np.ones((5, 4))).node])  # another shape: another plan
    ex.realize([build(np.ones((4, 5), np.float32)).node])  # another dtype too
    assert (ex.cache.misses, ex.cache.hits) == (3, 2)


def test_training_loop_hits_the_plan_cache_from_step_two() -> None:
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((32, 8)), rng.standard_normal((32, 2))
    w_np = rng.standard_normal((8, 2)) * 0.1
    w = fs.tensor(w_np)
    cache = graph.default_executor().cache
    counts = []
    for _ in range(5):
        before = (cache.misses, cache.hits)
        loss = ((fs.tensor(xs) @ w - fs.tensor(ys)) ** 2).mean()
        (g,) = fs.grad(loss, [w])
        w = w - 0.1 * g
        fs.realize(loss, w)
        counts.append((cache.misses - before[0], cache.hits - before[1]))
        gw = 2 * xs.T @ (xs @ w_np - ys) / ys.size
        w_np = w_np - 0.1 * gw
        np.testing.assert_allclose(w.numpy(), w_np, rtol=1e-12)
    assert counts[0] == (1, 0)
    assert all(c == (0, 1) for c in counts[1:])


def test_deep_graphs_build_plan_and_run_without_recursion() -> None:
    x = fs.tensor(np.array([0.5]))
    y = x
    for _ in range(5000):
        y = (y * 0.999).tanh() + 0.001
    want = np.array([0.5])
    for _ in range(5000):
        want = np.tanh(want * 0.999) + 0.001
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12)


def test_several_outputs_share_work_and_keep_distinct_buffers() -> None:
    a = np.arange(6.0).reshape(2, 3)
    x = fs.tensor(a)
    e = x.exp()
    s, m, v = fs.realize(e.sum(), e * 2, e.reshape(3, 2))
    np.testing.assert_allclose(s.numpy(), np.exp(a).sum())
    np.testing.assert_allclose(m.numpy(), 2 * np.exp(a))
    np.testing.assert_allclose(v.numpy(), np.exp(a).reshape(3, 2))


def test_fused_chunks_handle_broadcasts_scratch_and_a_partial_last_chunk() -> None:
    from fuelspmd.graph.fused import CHUNK_ELEMENTS

    rng = np.random.default_rng(3)
    rows = CHUNK_ELEMENTS // 37 * 2 + 116  # two full chunks and a short one
    a, b, c = rng.standard_normal((rows, 37)), rng.standard_normal(37), rng.standard_normal(
        (rows, 1))
    x, y, z = fs.tensor(a), fs.tensor(b), fs.tensor(c)
    out = (x * y + z).tanh() * ((x - z).exp() + y * 2)  # two subtrees: a scratch temp
    plan = _plan(out)
    step = plan.steps[-1]  # y * 2 is smaller than the root: a step of its own
    assert step.runner.rows and step.runner.scratch
    np.testing.assert_allclose(out.numpy(), np.tanh(a * b + c) * (np.exp(a - c) + b * 2),
                               rtol=1e-13)


_RUNS: list[int] = []


def _effectful_op() -> graph.Op:
    """A real effectful primitive (a copy that counts its runs), the shape collectives
    will have: never merged, folded or dropped."""
    name = "test_counted_copy"
    if name not in graph.OPS:
        def kernel(be: object, attrs: tuple, x: object) -> object:
            _RUNS.append(1)
            return be.xp.asarray(x, copy=True)  # type: ignore[attr-defined]

        def rule(ins: tuple, attrs: tuple) -> tuple:
            return ins[0].shape, ins[0].dtype, ins[0].device

        graph.register(graph.Op(name, rule, kernel, None, "other", effectful=True))
    return graph.OPS[name]


def test_effectful_ops_are_never_merged_or_folded() -> None:
    op = _effectful_op()
    c = fs.ones(3)
    a = fs.Tensor(graph.make(op.name, (c.node,)))
    b = fs.Tensor(graph.make(op.name, (c.node,)))
    assert a.node is not b.node
    before = len(_RUNS)
    out = (a + b).numpy()
    assert len(_RUNS) - before == 2  # both ran, at run time, on a constant input
    np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])


def test_cupy_kernel_source_for_a_fused_group() -> None:
    from fuelspmd.graph.fused import build_program, cupy_source, encode

    x = fs.tensor(np.ones((4, 3), np.float32))
    y = fs.tensor(np.ones(3, np.float32))
    out = fs.where(x > 0, (x * 2 + y).tanh(), 0.5)
    sigs, _, outs = graph.lower([out.node])
    ir, _, _ = graph.optimise(sigs, outs)
    members = [i for i, ins in enumerate(ir) if ins.op.kind == "elementwise"]
    ext = [i for i, ins in enumerate(ir) if ins.op.kind == "leaf"]
    group, consts = encode(ir, members, ext, set())
    src = cupy_source(build_program(group), [ir[u].attrs[0] for u in consts])
    assert src.in_params == "float32 x0, float32 x1"  # numpy dtype names: cupy reads those
    assert src.out_params == "float32 out"
    body = src.body
    assert body.startswith("bool t0 = (x0) > (0.0f);\nfloat t1 = ")  # C types in the body
    assert "tanh(" in body and "? " in body and "(2.0f)" in body and "(0.5f)" in body
    assert body.strip().splitlines()[-1].startswith("out = t")
    assert src.preamble == ""


@pytest.mark.parametrize(("value", "dt", "want"), [
    (0.5, "float32", "0.5f"), (0.1, "float32", "0.10000000149011612f"), (2, "float64", "2.0"),
    (0.0, "float16", "((float16)0.0f)"), (1.0, "bfloat16", "((bfloat16)1.0f)"),
    (1e9, "float16", "((float16)__int_as_float(2139095040))"),  # past float16's range: inf
    (-math.inf, "float32", "__int_as_float(-8388608)"),
    (math.inf, "float64", "__longlong_as_double(9218868437227405312LL)"),
    (3, "int32", "((int)(3))"), (-2, "int64", "((long long)(-2LL))"),
    (-(1 << 63), "int64", "((long long)(-9223372036854775807LL - 1))"),
    (True, "bool", "true")])
def test_cupy_literals_are_typed(value: float, dt: str, want: str) -> None:
    from fuelspmd.dtypes import dtype
    from fuelspmd.graph.fused import c_literal

    assert c_literal(value, dtype(dt)) == want


def test_cupy_kernel_source_in_half_and_integer_dtypes() -> None:
    from fuelspmd.graph.fused import build_program, cupy_source, encode

    def source(out: fs.Tensor) -> Any:
        sigs, _, outs = graph.lower([out.node])
        ir, _, _ = graph.optimise(sigs, outs)
        members = [i for i, ins in enumerate(ir) if ins.op.kind == "elementwise"]
        ext = [i for i, ins in enumerate(ir) if ins.op.kind == "leaf"]
        group, consts = encode(ir, members, ext, set())
        return cupy_source(build_program(group), [ir[u].attrs[0] for u in consts])

    x = fs.tensor(np.ones(3, np.float32))
    half = source((x.astype("bfloat16") * 2.0).astype("float32"))
    assert half.in_params == "float32 x0" and half.out_params == "float32 out"
    assert half.preamble == '#include "cupy/bfloat16.cuh"'  # a temporary's type
    n = fs.tensor(np.ones(3, np.int64))
    ints = source(abs(n) ** n)
    assert ints.in_params == "int64 x0" and "long long t" in ints.body
    assert "fabs(long long" in ints.preamble and "pow(long long" in ints.preamble


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 1, 4, 6), (2, 6, 0, 3)])
def test_a_stacked_matmul_by_a_matrix_agrees_with_numpy(shape: tuple[int, ...]) -> None:
    """A stacked ``a`` (contiguous, or transposed: its rows do not merge) times a matrix
    runs as one 2-d product where the rows merge as a view; either way matmul's numbers."""
    rng = np.random.default_rng(0)
    *lead, k, n = shape
    a = rng.standard_normal((*lead, k))
    b = rng.standard_normal((k, n))
    got = (fs.tensor(a) @ fs.tensor(b)).numpy()
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)
    at = np.ascontiguousarray(np.swapaxes(a, 0, 1))  # (lead1, lead0, k)
    got_t = (fs.tensor(at).transpose((1, 0, 2)) @ fs.tensor(b)).numpy()
    np.testing.assert_allclose(got_t, a @ b, rtol=1e-12, atol=1e-12)
