"""A pipeline-parallel training step written once, run under ``mpiexec`` and in a
``DeviceGroup``, with its single-process numpy reference.

Imported by ``tests/mpi/test_pipeline_executor.py`` and
``tests/unit/test_pipeline_executor.py`` (each puts ``tests/`` on ``sys.path``). The model
is ``V`` plain stages ``y = tanh(x @ W + b)`` (the last without tanh), widths
``3 -> 4 -> ... -> 4 -> 2``, loss the mean squared error averaged over micro-batches (and
over data-parallel replicas); every parameter and batch is a function of fixed seeds, so
every rank computes the whole reference locally.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import nn
from fuelspmd.mesh import Mesh
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule

MB, D_IN, HIDDEN, D_OUT = 2, 3, 4, 2  # micro-batch rows and widths


def widths(v_total: int) -> list[int]:
    return [D_IN] + [HIDDEN] * (v_total - 1) + [D_OUT]


def full_params(v_total: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(W, b) of every virtual stage of the whole model, float64."""
    w = widths(v_total)
    rng = np.random.default_rng([5, v_total])
    return [(rng.standard_normal((w[v], w[v + 1])) * 0.7, rng.standard_normal(w[v + 1]) * 0.1)
            for v in range(v_total)]


def batch(m: int, replica: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Micro-batch inputs and targets of data-parallel replica ``replica``."""
    rng = np.random.default_rng([9, m, replica])
    return ([rng.standard_normal((MB, D_IN)) for _ in range(m)],
            [rng.standard_normal((MB, D_OUT)) for _ in range(m)])


class Stage(nn.Module):
    """One virtual stage: ``tanh(x @ W + b)``, the last without the tanh."""

    def __init__(self, w: np.ndarray, b: np.ndarray, *, last: bool, device: Any) -> None:
        self.weight = nn.Parameter(w, device=device)
        self.bias = nn.Parameter(b, device=device)
        self.last = last

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        y = x @ self.weight + self.bias
        return y if self.last else y.tanh()


def mse(y: fs.Tensor, t: fs.Tensor) -> fs.Tensor:
    return ((y - t) ** 2).mean()


def run(comm: Any, kind: str, m: int, chunks: int, *, dp: int = 1, steps: int = 2,
        sends: str | None = None, recompute: bool = False,
        bucket_bytes: int | None = None, own_grads: bool = False) -> dict[str, Any]:
    """One rank's program: a ``dp x pp`` mesh over ``comm``, ``steps`` steps of ``kind``
    (dp gradient buckets of ``bucket_bytes``, the executor's default when None).

    Returns the loss, this rank's gradients by virtual stage, and the step result.
    """
    mesh = Mesh(comm, pp=comm.size // dp, dp=dp)
    pp = mesh.comm("pp")
    p = pp.size
    sched = schedule(kind, p, m, chunks)
    if sends is not None:
        sched.sends = sends  # type: ignore[assignment]
    v_total = p * chunks
    full = full_params(v_total)
    mine = [j * p + pp.rank for j in range(chunks)]
    ex = PipelineExecutor(
        sched, comm=pp, stages=[Stage(*full[v], last=v == v_total - 1, device=pp.device)
                                for v in mine], loss=mse,
        dp=mesh.comm("dp"), recompute=recompute,
        reduce=(lambda chunk, grads: grads) if own_grads else None,
        **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    xs, ts = batch(m, mesh.coord("dp"))
    for _ in range(steps):  # the same step again: plans cached, nothing left over
        out = ex.step(xs if pp.rank == 0 else None, ts if pp.rank == p - 1 else None)
    grads = {v: [g.numpy() for g in gs] for v, gs in zip(mine, out.grads)}
    return {"loss": float(out.loss), "grads": grads, "result": out, "timeline": ex.timeline()}


def reference(v_total: int, m: int, dp: int = 1) -> tuple[float, dict[int, list[np.ndarray]]]:
    """Loss and gradients of the whole model in one process, by hand-written numpy
    backprop, averaged over micro-batches and replicas."""
    full = full_params(v_total)
    loss = 0.0
    grads = {v: [np.zeros_like(w), np.zeros_like(b)] for v, (w, b) in enumerate(full)}
    scale = 1.0 / (m * dp)
    for replica in range(dp):
        xs, ts = batch(m, replica)
        for x, t in zip(xs, ts):
            acts = [x]
            for v, (w, b) in enumerate(full):
                z = acts[-1] @ w + b
                acts.append(z if v == v_total - 1 else np.tanh(z))
            y = acts[-1]
            loss += float(np.mean((y - t) ** 2)) * scale
            g = 2.0 * (y - t) / y.size * scale
            for v in reversed(range(v_total)):
                if v != v_total - 1:
                    g = g * (1.0 - acts[v + 1] ** 2)
                grads[v][0] += acts[v].T @ g
                grads[v][1] += g.sum(axis=0)
                g = g @ full[v][0].T
    return loss, grads


def check(got: dict[str, Any], v_total: int, m: int, dp: int = 1) -> None:
    """Assert one rank's loss and gradients equal the reference."""
    loss, grads = reference(v_total, m, dp)
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-10)
    assert got["grads"], "this rank got no gradients"
    for v, gs in got["grads"].items():
        for k, (a, b) in enumerate(zip(gs, grads[v])):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12,
                                       err_msg=f"virtual stage {v} param {k}")


def check_buckets(result: Any, sched: Any, rank: int, buckets: int) -> None:
    """Assert the dp all-reduces of one rank's step: ``buckets`` per chunk, issued in order
    inside the chunk's last backward action (B, or W in a split schedule), one in flight."""
    last = {}
    for a in sched.actions[rank]:
        if a.kind in ("B", "W"):
            last[a.chunk] = a
    got = [(c, b) for c, b, _, _ in result.reduces]
    assert got == [(c, b) for c in sorted(last, key=lambda c: result.times[last[c]][0])
                   for b in range(buckets)], got
    for c, b, issued, done in result.reduces:
        start, end = result.times[last[c]]
        assert start <= issued <= done <= end, (c, b, start, issued, done, end)
    for (_, _, i0, d0), (_, _, i1, _) in zip(result.reduces, result.reduces[1:]):
        assert i0 < i1 and d0 <= i1  # one in flight, each started when its bucket was ready


def factorizations(size: int) -> list[tuple[int, int]]:
    """Every (tp, pp) whose product divides ``size``."""
    return [(t, p) for t in range(1, size + 1) for p in range(1, size + 1)
            if size % (t * p) == 0]


def mesh_program(comm: Any, tp: int, pp: int) -> dict[str, Any]:
    """Build ``Mesh(comm, tp=, pp=)``; per axis, all-gather the group ranks of its members
    and sum them (so a wrong split shows as wrong members or a wrong order)."""
    mesh = Mesh(comm, tp=tp, pp=pp)
    me = fs.tensor(np.array([float(comm.rank)]), device=comm.device)
    out: dict[str, Any] = {"shape": dict(mesh.shape)}
    for axis in ("dp", "pp", "tp"):
        c = mesh.comm(axis)
        gathered, total = c.all_gather(me, axis=0), c.all_reduce(me)
        out[axis] = (mesh.coord(axis), c.rank, c.size, gathered.numpy().astype(int).tolist(),
                     float(total.numpy()[0]))
    return out


def mesh_reference(size: int, tp: int, pp: int, rank: int) -> dict[str, Any]:
    """What :func:`mesh_program` must return on ``rank``: tp fastest, then pp, then dp."""
    dp = size // (tp * pp)
    coords = {r: {"dp": r // (tp * pp), "pp": (r // tp) % pp, "tp": r % tp} for r in range(size)}
    out: dict[str, Any] = {"shape": {"dp": dp, "pp": pp, "tp": tp}}
    for axis in ("dp", "pp", "tp"):
        others = [a for a in ("dp", "pp", "tp") if a != axis]
        members = sorted((r for r in range(size)
                          if all(coords[r][a] == coords[rank][a] for a in others)),
                         key=lambda r: coords[r][axis])
        out[axis] = (coords[rank][axis], coords[rank][axis], len(members), members,
                     float(sum(members)))
    return out
