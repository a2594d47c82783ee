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


# Sizes that cross every threshold a 16-bit buffer meets on its way (bytes of one
# all_reduce's input): one element, the MPI check record's inline payload (512 B), the
# spare-buffer pool and the shared-memory chunk (256 KiB), the dp gradient bucket (1 MiB).
SIXTEEN_BIT_BYTES = (24, 600, 300 << 10, 1200 << 10)


def sixteen_bit_input(rank: int, n: int, dt: str, nbytes: int) -> np.ndarray:
    """Rank ``rank``'s (12, m) input of about ``nbytes``: small integers, exact in float16
    and bfloat16 and in their sums over four ranks, so every result is exact."""
    m = max(1, nbytes // (2 * 12))
    rng = np.random.default_rng([29, rank, n, m])
    return rng.integers(-3, 4, (12, m)).astype(fs.dtypes.to_numpy(dt))


def sixteen_bit(comm: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """Every collective on a float16 or bfloat16 ``x``: an all_reduce alone and a bucket
    of three realised together (one transport call), an average whose sum overflows
    float16, the rest as :func:`every_collective`."""
    r, n = comm.rank, comm.size
    t = fs.tensor(x, device=comm.device)
    out = {"sum": comm.all_reduce(t * 2.0 + 1.0), "max": comm.all_reduce(t, "max"),
           # the sum of the ranks' 40000s overflows float16 (65504): the mean must not
           "avg": comm.all_reduce(t * 0.0 + 40000.0, "avg")}
    fs.realize(*out.values())
    bucket = [comm.all_reduce(t + float(k)) for k in range(3)]
    fs.realize(*bucket)
    out.update({f"bucket{k}": b for k, b in enumerate(bucket)})
    out.update({
        "gather": comm.all_gather(t, axis=1),
        "scatter": comm.reduce_scatter(t, axis=0),
        "bcast": comm.broadcast(t, root=n - 1),
        "a2a": comm.all_to_all(t, split_axis=0, concat_axis=1),
    })
    if r % 2 == 0:
        comm.send(t * 3.0, (r + 1) % n)
        out["ring"] = comm.recv(x.shape, t.dtype, (r - 1) % n)
    else:
        out["ring"] = comm.recv(x.shape, t.dtype, (r - 1) % n)
        comm.send(t * 3.0, (r + 1) % n)
    fs.realize(*out.values())
    comm.barrier()  # issues an odd rank's send, built after the last realised node
    return {k: v.numpy() for k, v in out.items()}


def sixteen_bit_reference(n: int, dt: str, nbytes: int) -> list[dict[str, np.ndarray]]:
    """The exact result of :func:`sixteen_bit` on every rank of a size-``n`` group."""
    xs = [sixteen_bit_input(r, n, dt, nbytes).astype(np.float64) for r in range(n)]
    total = sum(xs)
    dtype = fs.dtypes.to_numpy(dt)
    refs = []
    for r in range(n):
        ref = {"sum": sum(x * 2.0 + 1.0 for x in xs), "max": np.maximum.reduce(xs),
               "avg": np.full_like(xs[0], 40000.0),
               **{f"bucket{k}": sum(x + k for x in xs) for k in range(3)},
               "gather": np.concatenate(xs, axis=1),
               "scatter": np.split(total, n, axis=0)[r],
               "bcast": xs[n - 1],
               "a2a": np.concatenate([np.split(xs[s], n, axis=0)[r] for s in range(n)], axis=1),
               "ring": xs[(r - 1) % n] * 3.0}
        refs.append({k: v.astype(dtype) for k, v in ref.items()})
    return refs
