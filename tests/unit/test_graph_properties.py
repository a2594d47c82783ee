"""Property tests: random expression graphs, realised lazily, against the same expression
in eager numpy (values), and against finite differences (gradients); numpy and strict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuelspmd as fs

SHAPES = [(4, 4), (4, 1), (1, 4), (4,)]  # all broadcast to (4, 4)
IDX = np.array([3, 0, 0, 2])


def _sq(x: Any, lib: str) -> Any:
    """Broadcast to (4, 4) (for ops that need a full square)."""
    return x.broadcast_to((4, 4)) if lib == "fs" else np.broadcast_to(x, (4, 4))


# name -> (arity, smooth, fn(lib, *operands))
OPS: dict[str, tuple[int, bool, Callable[..., Any]]] = {
    "tanh": (1, True, lambda L, a: a.tanh() if L == "fs" else np.tanh(a)),
    "sin": (1, True, lambda L, a: a.sin() if L == "fs" else np.sin(a)),
    "neg": (1, True, lambda L, a: -a),
    "abs": (1, False, lambda L, a: abs(a)),
    "exp_tanh": (1, True, lambda L, a: a.tanh().exp() if L == "fs" else np.exp(np.tanh(a))),
    "log1sq": (1, True, lambda L, a: (a * a + 1).log() if L == "fs" else np.log(a * a + 1)),
    "scale": (1, True, lambda L, a: a * 0.5 + 0.25),
    "add": (2, True, lambda L, a, b: a + b),
    "sub": (2, True, lambda L, a, b: a - b),
    "mul": (2, True, lambda L, a, b: a * b),
    "div": (2, True, lambda L, a, b: a / (b * b + 1)),
    "maximum": (2, False, lambda L, a, b: a.maximum(b) if L == "fs" else np.maximum(a, b)),
    "where": (2, False, lambda L, a, b: fs.where(a > b, a, b * 0.5) if L == "fs"
              else np.where(a > b, a, b * 0.5)),
    "sum_keep": (1, True, lambda L, a: a.sum(-1, keepdims=True)),
    "mean_keep": (1, True, lambda L, a: a.mean(0, keepdims=True)),
    "max_keep": (1, False, lambda L, a: a.max(-1, keepdims=True)),
    "T": (1, True, lambda L, a: _sq(a, L).T),
    "matmul": (2, True, lambda L, a, b: (_sq(a, L) @ _sq(b, L)) * 0.25),
    "flip": (1, True, lambda L, a: _sq(a, L)[::-1]),
    "reshape": (1, True, lambda L, a: _sq(a, L).reshape(16).reshape(4, 4)),
    "concat_slice": (2, True, lambda L, a, b: (
        fs.concat([_sq(a, L), _sq(b, L)], 0)[2:6] if L == "fs"
        else np.concatenate([_sq(a, L), _sq(b, L)], 0)[2:6])),
    "take": (1, True, lambda L, a: _sq(a, L).take(fs.tensor(IDX, device=a.device), 0)
             if L == "fs" else _sq(a, L)[IDX]),
}


@st.composite
def programs(draw: st.DrawFn, smooth_only: bool = False) -> tuple[list[np.ndarray], list]:
    n_in = draw(st.integers(1, 3))
    arrays = [np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(
        draw(st.sampled_from(SHAPES))) for _ in range(n_in)]
    names = sorted(n for n, (_, smooth, _) in OPS.items() if smooth or not smooth_only)
    prog = []
    for k in range(draw(st.integers(1, 8))):
        name = draw(st.sampled_from(names))
        args = [draw(st.integers(0, n_in + k - 1)) for _ in range(OPS[name][0])]
        prog.append((name, args))
    return arrays, prog


def _run(lib: str, inputs: list[Any], prog: list) -> list[Any]:
    vals = list(inputs)
    for name, args in prog:
        vals.append(OPS[name][2](lib, *(vals[i] for i in args)))
    return vals


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu:0", "strict:0"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=programs())
def test_random_graphs_match_eager_numpy(device: str, case: tuple) -> None:
    arrays, prog = case
    want = _run("np", arrays, prog)
    got = _run("fs", [fs.tensor(a, device=device) for a in arrays], prog)
    outs = got[len(arrays):]
    fs.realize(*outs[-2:])  # two outputs as one graph, then each remaining one alone
    for g, w in zip(got[len(arrays):], want[len(arrays):]):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu:0", "strict:0"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=programs(smooth_only=True))
def test_random_graph_gradients_match_finite_differences(device: str, case: tuple) -> None:
    arrays, prog = case

    def loss(arrs: list[np.ndarray]) -> fs.Tensor:
        ins = [fs.tensor(a, device=device) for a in arrs]
        vals = _run("fs", ins, prog)
        return sum((v * (0.3 + i)).sum() for i, v in enumerate(vals[len(arrs):])), ins

    out, ins = loss(arrays)
    grads = fs.grad(out, ins)
    fs.realize(out, *grads)
    eps = 1e-6
    for i, g in enumerate(grads):
        num = np.zeros_like(arrays[i])
        for k in np.ndindex(arrays[i].shape):
            hi = [a.copy() for a in arrays]
            lo = [a.copy() for a in arrays]
            hi[i][k] += eps
            lo[i][k] -= eps
            num[k] = (float(loss(hi)[0].numpy()) - float(loss(lo)[0].numpy())) / (2 * eps)
        np.testing.assert_allclose(g.numpy(), num, rtol=1e-5, atol=1e-6)


BIG = 20_011  # rows: several cache-sized chunks and a short last one
ELEMENTWISE = sorted({"tanh", "sin", "neg", "abs", "exp_tanh", "log1sq", "scale", "add", "sub",
                      "mul", "div", "maximum", "where", "sum_keep", "mean_keep", "max_keep"})


@st.composite
def big_programs(draw: st.DrawFn) -> tuple[list[np.ndarray], list]:
    n_in = draw(st.integers(1, 3))
    shapes = [(BIG, 4), (BIG, 1), (1, 4), (4,)]
    arrays = [np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(
        draw(st.sampled_from(shapes))) for _ in range(n_in)]
    prog = []
    for k in range(draw(st.integers(2, 10))):
        name = draw(st.sampled_from(ELEMENTWISE))
        prog.append((name, [draw(st.integers(0, n_in + k - 1)) for _ in range(OPS[name][0])]))
    return arrays, prog


@pytest.mark.timeout(120)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=big_programs())
def test_large_fused_groups_run_in_chunks_and_match_numpy(case: tuple) -> None:
    """Big enough that fused steps run in row chunks, write into dying inputs and export
    values other steps read: every path of the numpy runner, against eager numpy."""
    arrays, prog = case
    want = _run("np", arrays, prog)
    got = _run("fs", [fs.tensor(a) for a in arrays], prog)
    fs.realize(*got[len(arrays):])
    for g, w in zip(got[len(arrays):], want[len(arrays):]):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-12)
