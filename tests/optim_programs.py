"""Clipping by the global norm of a model sharded over tp and cut over pp, written once,
run under ``mpiexec`` (tests/mpi/test_optim.py) and in a DeviceGroup
(tests/unit/test_optim.py), against ``torch.nn.utils.clip_grad_norm_`` on the unsharded
model.

The model: per pipeline stage two MLP blocks as Megatron shards them, ``W1`` split along
its columns and ``b1`` with them (column-parallel), ``W2`` split along its rows
(row-parallel), ``b2`` and a norm's weight replicated. Every full gradient is a function
of the stage and the parameter's index, so any rank can compute the whole reference (under
mpiexec rank 0 does, and hands it to the others).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import nn, optim
from fuelspmd.mesh import Mesh

H, F = 8, 12  # width and MLP width: divisible by tp 1, 2, 4
# (full shape, split dim over tp or None) of one block's parameters
BLOCK = [((H, F), 1), ((F,), 0), ((F, H), 0), ((H,), None), ((H,), None)]


def full_grads(pp: int) -> list[list[np.ndarray]]:
    """The unsharded gradient of every parameter, by stage (two blocks each)."""
    return [[np.random.default_rng([stage, k]).standard_normal(shape)
             for k, (shape, _) in enumerate(BLOCK * 2)] for stage in range(pp)]


def mesh_for(size: int) -> tuple[int, int]:
    """(tp, pp) for a world of ``size``: 2 x 2 at 4 ranks, tp 2 at 2, else all pipeline."""
    return (2, 2) if size == 4 else (2, 1) if size == 2 else (1, size)


def clip(comm: Any, max_norm: float, mesh: bool = True) -> dict[str, Any]:
    """This rank's shards of the clipped gradients and the norm, from ``clip_grad_norm``
    (given the mesh, or without it: a one-stage model's norm from the specs alone)."""
    tp_, pp_ = mesh_for(comm.size)
    grid = Mesh(comm, tp=tp_, pp=pp_)
    tpc, stage = grid.comm("tp"), grid.coord("pp")
    params, grads = [], []
    for (shape, dim), g in zip(BLOCK * 2, full_grads(pp_)[stage]):
        spec = nn.Spec(shape) if dim is None else nn.Spec(shape, dim, axis="tp", comm=tpc)
        params.append(nn.Parameter(spec=spec, dtype="float64", device=comm.device))
        grads.append(fs.tensor(np.ascontiguousarray(spec.shard(g)), device=comm.device))
    out, norm = optim.clip_grad_norm(params, grads, max_norm, mesh=grid if mesh else None)
    return {"norm": float(norm), "grads": [g.numpy() for g in out], "stage": stage,
            "specs": [p.spec for p in params]}


def reference(pp: int, max_norm: float) -> tuple[float, list[list[np.ndarray]]]:
    """torch's norm and clipped gradients of the whole model, by stage."""
    import torch  # here, not at the top: only the rank that builds the reference needs it

    full = full_grads(pp)
    ts = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True)
          for gs in full for g in gs]
    for t, g in zip(ts, (g for gs in full for g in gs)):
        t.grad = torch.from_numpy(g.copy())
    norm = float(torch.nn.utils.clip_grad_norm_(ts, max_norm))
    flat = [t.grad.numpy() for t in ts]
    n = len(BLOCK) * 2
    return norm, [flat[s * n:(s + 1) * n] for s in range(pp)]


def check(got: dict[str, Any], size: int, max_norm: float,
          ref: tuple[float, list[list[np.ndarray]]] | None = None) -> None:
    """Assert one rank's norm and shards equal torch's on the unsharded model (``ref``:
    ``reference``'s result for this size, when another rank built it)."""
    _, pp_ = mesh_for(size)
    norm, by_stage = reference(pp_, max_norm) if ref is None else ref
    assert abs(got["norm"] - norm) <= 1e-13 * norm, (got["norm"], norm)
    for k, (g, spec, want) in enumerate(zip(got["grads"], got["specs"],
                                            by_stage[got["stage"]])):
        np.testing.assert_allclose(g, spec.shard(want), rtol=1e-13, atol=1e-15,
                                   err_msg=f"stage {got['stage']} parameter {k}")


def scaling(comm: Any) -> list[tuple[bool, float, np.ndarray]]:
    """Five float16 SGD steps under a LossScaler (2^10, growth every 2 good steps); the last
    rank's gradient overflows at step 2. Per step: finite?, the scale, the parameter."""
    p = nn.Parameter(fs.tensor(np.ones(4, np.float16), device=comm.device))
    opt = optim.SGD([p], lr=0.1)
    scaler = optim.LossScaler(2.0 ** 10, interval=2)
    seen = []
    for step in range(5):
        big = 1e4 if (step == 2 and comm.rank == comm.size - 1) else 1.0  # 1e4 * 2^10 > 65504
        grads = fs.grad(scaler.scale((p * big).sum()), [p])
        with np.errstate(over="ignore", invalid="ignore"):  # lazy: runs at `if finite`
            grads, finite = scaler.unscale(grads, comm=comm)
            if finite:
                opt.step(grads)
            scaler.update(finite)
        seen.append((bool(finite), scaler.value, p.numpy().astype(np.float32)))
    return seen


def check_scaling(runs: list[list[tuple[bool, float, np.ndarray]]]) -> None:
    """Every rank skipped step 2, backed the scale off and grew it alike; the skipped step
    left the parameter alone."""
    for seen in runs:
        assert [s[0] for s in seen] == [True, True, False, True, True]
        assert [s[1] for s in seen] == [2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]
        np.testing.assert_array_equal(seen[2][2], seen[1][2])
        np.testing.assert_array_equal(seen[-1][2], runs[0][-1][2])
        assert seen[1][2][0] == np.float16(1 - 0.2)
