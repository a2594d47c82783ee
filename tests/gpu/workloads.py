"""The graphs the GPU suite runs, in one registry, and the graphs users build beside them.

A workload takes a device (``"cuda:0"``, ``"cpu:0"``) and returns unrealised tensors. The
GPU tests realise ``GPU_SUITE`` on ``cuda:0`` and compare it with ``cpu:0``; the benchmark
times :func:`bench_chain`. ``tests/unit/test_cupy_kernels_compile.py`` plans every
workload of ``GPU_SUITE`` and ``MORE_DTYPES`` for a CUDA device and compiles each fused
kernel with NVRTC, without a GPU: a kernel the GPU suite meets was compiled in CI first.
A GPU test that builds a graph outside this registry escapes that check.

No import here needs a GPU, cupy or pytest.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

import fuelspmd as fs
import fuelspmd.functional as F
from fuelspmd.dtypes import to_numpy

Workload = Callable[[str], list[fs.Tensor]]
FLOATS = ("float16", "bfloat16", "float32", "float64")


def unit_module(name: str) -> ModuleType:
    """Load ``tests/unit/<name>.py`` (its cases are reused here, not copied)."""
    path = Path(__file__).resolve().parent.parent / "unit" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_unit_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


OPS = unit_module("test_graph_ops")
CASES = OPS.CASES  # name -> (fn, numpy reference, inputs, differentiable inputs)


def _cast(arrays: list[np.ndarray], dt: str) -> list[np.ndarray]:
    """The float inputs in ``dt``; index arrays stay as they are."""
    return [a.astype(to_numpy(dt)) if a.dtype.kind == "f" else a for a in arrays]


def op_forward(name: str, dt: str) -> Workload:
    """Case ``name`` of the op table with its float inputs in ``dt``."""
    fn, _, arrays, _ = CASES[name]

    def build(device: str) -> list[fs.Tensor]:
        return [fn(*(fs.tensor(a, device=device) for a in _cast(arrays, dt)))]
    return build


def op_vjp(name: str, dt: str) -> Workload:
    """The gradients of case ``name`` for a fixed cotangent (its inputs in ``dt``)."""
    fn, _, arrays, diff = CASES[name]

    def build(device: str) -> list[fs.Tensor]:
        ins = [fs.tensor(a, device=device) for a in _cast(arrays, dt)]
        out = fn(*ins)
        cot = np.random.default_rng(7).standard_normal(out.shape).astype(to_numpy(dt))
        return list(fs.vjp(out, [ins[i] for i in diff], fs.tensor(cot, device=device)))
    return build


def float_chain(dt: str) -> Workload:
    """An elementwise chain into a matmul and a sum, in ``dt``."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 8)), rng.standard_normal((8, 3))

    def build(device: str) -> list[fs.Tensor]:
        x, y = (fs.tensor(v.astype(to_numpy(dt)), device=device) for v in (a, b))
        h = ((x * 2.0 + 1.0).tanh() * x - 0.5).abs()
        return [h, ((x * 2.0 + 1.0).tanh() @ y).sum(0), h @ y]
    return build


def functional(dt: str) -> Workload:
    """relu, gelu, softmax, layer_norm, a masked score, half-precision round trips and
    their gradients, in ``dt``.

    The mask value -1e9 is -inf in float16, and the mean of an empty axis multiplies by
    NaN: both kinds of non-finite constant reach a kernel. In float32 the round trips'
    half values are temporaries only, never a kernel's parameter.
    """
    rng = np.random.default_rng(11)
    a, w = rng.standard_normal((6, 8)), rng.standard_normal(8)

    def build(device: str) -> list[fs.Tensor]:
        x, g = (fs.tensor(v.astype(to_numpy(dt)), device=device) for v in (a, w))
        masked = fs.where(x > 0.5, x, -1e9)
        loss = (F.relu(x).maximum(x * 0.25) ** 2 + F.gelu(x) + F.softmax(masked)
                + F.layer_norm(x, g) + x.minimum(0.0) + F.log_softmax(x)
                + fs.where(x != 1.0, x, 1.0) + (x.astype("bfloat16") * 2.0).astype(dt)
                + (x.astype("float16") * 2.0).astype(dt)).sum()
        empty = x[:, :0].mean(-1) + x.sum(-1)
        return [loss, empty, *fs.grad(loss, [x, g])]
    return build


def integer_and_bool(dt: str) -> Workload:
    """Arithmetic, abs, pow, maximum, minimum, where, casts and comparisons on ``dt``
    integers (with an int32 operand promoted), then logic on the bool results."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(-5, 5, (3, 4)), rng.integers(0, 4, (4,))

    def build(device: str) -> list[fs.Tensor]:
        x = fs.tensor(a.astype(to_numpy(dt)), device=device)
        y = fs.tensor(b.astype(np.int32), device=device)
        m = (x > 0) & (y < 3) | ~(x == -2) | (x >= y) & (x <= 1) & (x != y)
        return [abs(x) * 3 - x ** y + x.maximum(y).minimum(4) - (-x), fs.where(m, x, -7),
                fs.where(x > 1, m, ~m), (x + y).astype("float32") / 2, x.max(0), m.sum()]
    return build


def exports_chain(device: str) -> list[fs.Tensor]:
    """A fused group whose member ``t`` is read outside it: the kernel exports it."""
    rng = np.random.default_rng(0)
    x = fs.tensor(rng.standard_normal((256, 33)), device=device)
    y = fs.tensor(rng.standard_normal(33), device=device)
    h = x * y + 1
    t = h.tanh()
    return [fs.where(h > 0, t * 2, abs(h) - t), t]


def mlp_step(device: str) -> list[fs.Tensor]:
    """The loss and gradients of a two-layer GELU MLP with an MSE loss, float32."""
    rng = np.random.default_rng(1)
    x, t, *params = (fs.tensor(rng.standard_normal(s).astype(np.float32), device=device)
                     for s in ((16, 32), (16, 8), (32, 64), (64,), (64, 8), (8,)))
    w1, b1, w2, b2 = params
    loss = F.mse_loss(F.gelu(x @ w1 + b1) @ w2 + b2, t)
    return [loss, *fs.grad(loss, params)]


def bench_chain(x: fs.Tensor) -> fs.Tensor:
    """The benchmark's chain of 12 elementwise ops (one fused kernel)."""
    return ((x * 1.5 + 0.5).tanh() * x - (x * x) * 0.25 + x.exp() * 0.125).abs().sqrt()


def bench(device: str) -> list[fs.Tensor]:
    """:func:`bench_chain` on float32, as ``bench_gpu.py`` times it (fewer elements)."""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    return [bench_chain(fs.tensor(x, device=device))]


def scale(device: str) -> list[fs.Tensor]:
    """``x * 2.0`` in float32: the fused step before the collective of the NCCL and
    DeviceGroup tests (their graphs hold a communicator, so they are not planned here)."""
    return [fs.tensor(np.arange(8, dtype=np.float32), device=device) * 2.0]


def _ops_in(dts: tuple[str, ...]) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    for dt in dts:
        for name, (_, _, _, diff) in CASES.items():
            out[f"forward/{name}/{dt}"] = op_forward(name, dt)
            if diff:
                out[f"vjp/{name}/{dt}"] = op_vjp(name, dt)
    return out


GPU_SUITE: dict[str, Workload] = {
    **_ops_in(("float64",)),
    **{f"chain/{dt}": float_chain(dt) for dt in FLOATS},
    **{f"integer/{dt}": integer_and_bool(dt) for dt in ("int32", "int64")},
    "exports": exports_chain,
    "mlp": mlp_step,
    "bench": bench,
    "scale": scale,
}
# what users build beside: every op and gradient in the other float dtypes, and the
# composite functions (relu's 0.0, the -inf of a mask, the NaN of an empty mean)
MORE_DTYPES: dict[str, Workload] = {
    **_ops_in(("float16", "bfloat16", "float32")),
    **{f"functional/{dt}": functional(dt) for dt in FLOATS},
}
# cuda against cpu, relative and absolute, by the result's dtype (integers and bools: equal)
TOLERANCE = {"float16": 5e-2, "bfloat16": 1.5e-1, "float32": 1e-4, "float64": 1e-6}
