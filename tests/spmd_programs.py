"""SPMD programs written once, run under ``mpiexec`` and in a ``DeviceGroup``, with their
numpy references.

Imported by ``tests/mpi/test_communicator.py`` and ``tests/unit/test_device_group.py``
(each puts ``tests/`` on ``sys.path``). Every rank's input is a function of (rank, size),
so the reference for every rank is computed locally with plain numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import fuelspmd as fs

RTOL = 1e-10  # float64 throughout: sums in another order differ in the last bits


def rank_input(rank: int, n: int, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s (2n, 3n) float64 input: both axes divide by the group size."""
    return np.random.default_rng([11, salt, rank, n]).standard_normal((2 * n, 3 * n))


def every_collective(comm: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """Use every collective of ``comm`` (send/recv, split and barrier included) on ``x``."""
    r, n = comm.rank, comm.size
    t = fs.tensor(x, device=comm.device)
    out = {
        "sum": comm.all_reduce(t * 2.0 + 1.0),
        "max": comm.all_reduce(t, "max"),
        "avg": comm.all_reduce(t, "avg"),
        "gather0": comm.all_gather(t[:1], axis=0),
        "gather1": comm.all_gather(t, axis=1),
        "scatter": comm.reduce_scatter(t, axis=0),
        "bcast": comm.broadcast(t, root=n - 1),
        "a2a": comm.all_to_all(t, split_axis=1, concat_axis=0),
    }
    # a ring: even ranks send first, odd ranks receive first, so a blocking send never
    # waits on a peer that is itself blocked sending (sizes 1..4)
    if r % 2 == 0:
        comm.send(t * 3.0, (r + 1) % n)
        out["ring"] = comm.recv(x.shape, "float64", (r - 1) % n)
    else:
        out["ring"] = comm.recv(x.shape, "float64", (r - 1) % n)
        comm.send(t * 3.0, (r + 1) % n)
    fs.realize(*out.values())
    sub = comm.split(r % 2, -r)  # parity groups, ranks in reverse order
    out["sub"] = sub.all_gather(sub.all_reduce(t)[:1] + float(sub.rank), axis=0)
    comm.barrier()
    return {k: v.numpy() for k, v in out.items()}


def every_collective_reference(n: int) -> list[dict[str, np.ndarray]]:
    """The numpy result of :func:`every_collective` on every rank of a size-``n`` group."""
    xs = [rank_input(r, n) for r in range(n)]
    total = sum(xs)
    refs = []
    for r in range(n):
        sub = [k for k in range(n) if k % 2 == r % 2][::-1]  # key -k: reverse rank order
        subsum = sum(xs[k] for k in sub)
        refs.append({
            "sum": sum(x * 2.0 + 1.0 for x in xs),
            "max": np.maximum.reduce(xs),
            "avg": total / n,
            "gather0": np.concatenate([x[:1] for x in xs], axis=0),
            "gather1": np.concatenate(xs, axis=1),
            "scatter": np.split(total, n, axis=0)[r],
            "bcast": xs[n - 1],
            "a2a": np.concatenate([np.split(xs[s], n, axis=1)[r] for s in range(n)], axis=0),
            "ring": xs[(r - 1) % n] * 3.0,
            "sub": np.concatenate([subsum[:1] + float(i) for i in range(len(sub))], axis=0),
        })
    return refs


def grad_program(comm: Any, x: np.ndarray, w: np.ndarray, cot: list[np.ndarray]
                 ) -> np.ndarray:
    """d(sum over ranks of the local losses)/dw through all_reduce, all_gather,
    reduce_scatter, broadcast and all_to_all; returns this rank's gradient."""
    dev = comm.device
    tx, tw = fs.tensor(x, device=dev), fs.tensor(w, device=dev)
    p = tx @ tw
    c = [fs.tensor(v, device=dev) for v in cot]
    loss = ((comm.all_reduce(p) * c[0]).sum()
            + (comm.all_gather(p, axis=0) * c[1]).sum()
            + (comm.reduce_scatter(p, axis=0) * c[2]).sum()
            + (comm.broadcast(p, root=0) * c[3]).sum()
            + (comm.all_to_all(p, split_axis=1, concat_axis=0) * c[4]).sum())
    (g,) = fs.grad(loss, [tw])
    return g.numpy()


def grad_inputs(rank: int, n: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Rank ``rank``'s x (2n, 3n), w (3n, 3n) and the five loss weights."""
    rng = np.random.default_rng([23, rank, n])
    x = rng.standard_normal((2 * n, 3 * n))
    w = rng.standard_normal((3 * n, 3 * n))
    shapes = [(2 * n, 3 * n), (2 * n * n, 3 * n), (2, 3 * n), (2 * n, 3 * n), (2 * n * n, 3)]
    return x, w, [rng.standard_normal(s) for s in shapes]


def grad_reference(n: int) -> list[np.ndarray]:
    """dL/dw_r by hand, L = sum_r loss_r (see :func:`grad_program`), for every rank."""
    ins = [grad_inputs(r, n) for r in range(n)]
    xs = [x for x, _, _ in ins]
    cs = [c for _, _, c in ins]
    grads = []
    for r in range(n):
        d_ar = sum(c[0] for c in cs)
        d_ag = np.split(sum(c[1] for c in cs), n, axis=0)[r]
        d_rs = np.concatenate([c[2] for c in cs], axis=0)
        d_bc = sum(c[3] for c in cs) if r == 0 else np.zeros_like(cs[0][3])
        d_a2a = np.concatenate([np.split(cs[k][4], n, axis=0)[r] for k in range(n)], axis=1)
        grads.append(xs[r].T @ (d_ar + d_ag + d_rs + d_bc + d_a2a))
    return grads
