"""Tensor-parallel programs written once, run under ``mpiexec`` (tests/mpi/) and in a
``DeviceGroup`` (tests/unit/), with their single-device numpy references.

Every program builds its layers from the same full float64 weights on every rank, takes a
replicated loss ``sum(output * cotangent)`` and returns the output and the gradients of
the input and of every local parameter shard. The reference computes the full-model
numbers with plain numpy and slices out what rank r should hold. Sizes divide by 1..4
(heads and features 12 or 24), so every world size up to 4 runs every case.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import functional, nn
from fuelspmd import tensor_parallel as tp

DT = "float64"
H, F, BATCH = 12, 24, 5            # MLP: hidden, ffn, rows
AH, HEADS, SEQ, AB = 24, 12, 4, 2  # attention: hidden, heads, seq, batch
V, D, N = 12, 4, 6                 # vocabulary, embedding dim, rows


def _rng(*salt: int) -> np.random.Generator:
    return np.random.default_rng([5, *salt])


def _block(a: np.ndarray, r: int, n: int, axis: int) -> np.ndarray:
    return np.split(a, n, axis=axis)[r]


def _run(comm: Any, x: Any, params: list[fs.Tensor], out: fs.Tensor, cot: np.ndarray,
         extra: dict[str, fs.Tensor] | None = None) -> dict[str, np.ndarray]:
    loss = (out * fs.tensor(cot, device=comm.device)).sum()
    wrt = params if x is None else [x, *params]
    grads = fs.grad(loss, wrt)
    fs.realize(out, *grads)
    got = {"y": out.numpy()}
    if x is not None:
        got["dx"] = grads[0].numpy()
        grads = grads[1:]
    got.update({f"d{i}": g.numpy() for i, g in enumerate(grads)})
    return got


# ---- MLP, and the column/row layers around scatter/gather --------------------------------
def mlp_weights() -> list[np.ndarray]:
    g = _rng(1)
    return [g.standard_normal((H, F)) / 3, g.standard_normal(F), g.standard_normal((F, H)) / 5,
            g.standard_normal(H)]


def mlp_inputs() -> tuple[np.ndarray, np.ndarray]:
    g = _rng(2)
    return g.standard_normal((BATCH, H)), g.standard_normal((BATCH, H))


def mlp_program(comm: Any) -> dict[str, np.ndarray]:
    """ParallelMLP from full weights: output, dx, and the grads of (A_r, a_r, B_r, b)."""
    xa, cot = mlp_inputs()
    mlp = tp.ParallelMLP(H, F, comm=comm, full=mlp_weights(), dtype=DT)
    x = fs.tensor(xa, device=comm.device)
    return _run(comm, x, mlp.parameters(), mlp(x), cot)


def _gelu(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tanh-GELU and its derivative."""
    c = math.sqrt(2 / math.pi)
    th = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * x * (1 + th), 0.5 * (1 + th) + 0.5 * x * (1 - th**2) * c * (1 + 3 * 0.044715
                                                                            * x**2)


def mlp_reference(n: int) -> list[dict[str, np.ndarray]]:
    a, ab, b, bb = mlp_weights()
    x, cot = mlp_inputs()
    h = x @ a + ab
    act, dact = _gelu(h)
    y = act @ b + bb
    dh = (cot @ b.T) * dact
    full = {"y": y, "dx": dh @ a.T}
    return [{**full, "d0": _block(x.T @ dh, r, n, 1), "d1": _block(dh.sum(0), r, n, 0),
             "d2": _block(act.T @ cot, r, n, 0), "d3": cot.sum(0)} for r in range(n)]


def gather_scatter_program(comm: Any) -> dict[str, np.ndarray]:
    """Column(gather_output) then Row(split input): all four mappings, with a seeded
    column layer, so the seeded shard is checked against ``seeded_weight`` too."""
    xa, cot = mlp_inputs()
    _, _, b, bb = mlp_weights()
    col = tp.ColumnParallelLinear(H, F, comm=comm, seed=7, gather_output=True, dtype=DT)
    row = tp.RowParallelLinear(F, H, comm=comm, full=(b, bb), dtype=DT)
    x = fs.tensor(xa, device=comm.device)
    return _run(comm, x, col.parameters() + row.parameters(), row(col(x)), cot)


def gather_scatter_reference(n: int) -> list[dict[str, np.ndarray]]:
    a = tp.seeded_weight(7, H, F)
    _, _, b, bb = mlp_weights()
    x, cot = mlp_inputs()
    h = x @ a
    dh = cot @ b.T
    full = {"y": h @ b + bb, "dx": dh @ a.T}
    return [{**full, "d0": _block(x.T @ dh, r, n, 1), "d1": _block(dh.sum(0), r, n, 0),
             "d2": _block(h.T @ cot, r, n, 0), "d3": cot.sum(0)} for r in range(n)]


# ---- attention ---------------------------------------------------------------------------
def attn_weights() -> list[np.ndarray]:
    g = _rng(3)
    out: list[np.ndarray] = []
    for _ in range(4):
        out += [g.standard_normal((AH, AH)) / 5, g.standard_normal(AH) / 5]
    return out


def attn_inputs() -> tuple[np.ndarray, np.ndarray]:
    g = _rng(4)
    return g.standard_normal((AB, SEQ, AH)), g.standard_normal((AB, SEQ, AH))


def attn_program(comm: Any) -> dict[str, np.ndarray]:
    xa, cot = attn_inputs()
    att = tp.ParallelAttention(AH, HEADS, comm=comm, full=attn_weights(), dtype=DT)
    x = fs.tensor(xa, device=comm.device)
    return _run(comm, x, att.parameters(), att(x), cot)


def attn_forward(x: np.ndarray, w: list[np.ndarray]) -> np.ndarray:
    """Plain numpy causal multi-head attention (the single-device model)."""
    b, t, hid = x.shape
    d = hid // HEADS

    def heads(y: np.ndarray) -> np.ndarray:
        return y.reshape(b, t, HEADS, d).transpose(0, 2, 1, 3)

    q, k, v = (heads(x @ w[2 * i] + w[2 * i + 1]) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + np.triu(np.full((t, t), -1e9), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, hid)
    return ctx @ w[6] + w[7]


def numeric_grad(f: Callable[[], float], a: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of ``f`` in every entry of ``a`` (changed in place, restored)."""
    g = np.empty_like(a)
    flat, gf = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = f()
        flat[i] = keep - eps
        gf[i] = (up - f()) / (2 * eps)
        flat[i] = keep
    return g


def attn_reference(n: int) -> list[dict[str, np.ndarray]]:
    w = [a.copy() for a in attn_weights()]
    x, cot = attn_inputs()

    def loss() -> float:
        return float((attn_forward(x, w) * cot).sum())

    full = {"y": attn_forward(x, w), "dx": numeric_grad(loss, x)}
    gw = [numeric_grad(loss, a) for a in w]
    refs = []
    for r in range(n):
        ref = dict(full)
        for i in range(3):  # q, k, v: column blocks of W and b
            ref[f"d{2 * i}"] = _block(gw[2 * i], r, n, 1)
            ref[f"d{2 * i + 1}"] = _block(gw[2 * i + 1], r, n, 0)
        ref["d6"], ref["d7"] = _block(gw[6], r, n, 0), gw[7]
        refs.append(ref)
    return refs


# ---- embedding and cross-entropy ---------------------------------------------------------
def vocab_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Embedding table, ids (2, N) that hit every block, its cotangent, logits (N, V) and
    targets (N,)."""
    g = _rng(6)
    ids = np.array([[0, 11, 3, 3, 7, 5], [6, 2, 9, 11, 1, 4]], dtype=np.int64)
    return (g.standard_normal((V, D)), ids, g.standard_normal((*ids.shape, D)),
            g.standard_normal((N, V)) * 3, np.array([0, 11, 5, 6, 2, 9], dtype=np.int64))


def embedding_program(comm: Any) -> dict[str, np.ndarray]:
    table, ids, cot, _, _ = vocab_inputs()
    emb = tp.VocabParallelEmbedding(V, D, comm=comm, full=table, dtype=DT)
    return _run(comm, None, emb.parameters(), emb(fs.tensor(ids, device=comm.device)), cot)


def embedding_reference(n: int) -> list[dict[str, np.ndarray]]:
    table, ids, cot, _, _ = vocab_inputs()
    dw = np.zeros_like(table)
    np.add.at(dw, ids.reshape(-1), cot.reshape(-1, D))
    return [{"y": table[ids], "d0": _block(dw, r, n, 0)} for r in range(n)]


def cross_entropy_program(comm: Any) -> dict[str, np.ndarray]:
    _, _, _, logits, targets = vocab_inputs()
    z = fs.tensor(_block(logits, comm.rank, comm.size, 1), device=comm.device)
    loss = tp.vocab_parallel_cross_entropy(z, fs.tensor(targets, device=comm.device),
                                           comm=comm)
    (g,) = fs.grad(loss, [z])
    fs.realize(loss, g)
    return {"loss": loss.numpy(), "dz": g.numpy()}


def cross_entropy_reference(n: int) -> list[dict[str, np.ndarray]]:
    _, _, _, z, t = vocab_inputs()
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = -np.log(p[np.arange(N), t]).mean()
    onehot = np.eye(V)[t]
    dz = (p - onehot) / N
    return [{"loss": np.array(loss), "dz": _block(dz, r, n, 1)} for r in range(n)]


# ---- a tied-embedding language model ------------------------------------------------------
def tied_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Table (V, D), ids (2, N), targets (2, N) with two ignored, and a (D, D) mixing weight."""
    table, ids, _, _, _ = vocab_inputs()
    targets = np.roll(ids, -1, axis=1)
    targets[0, -1] = targets[1, 2] = -100
    return table, ids, targets, _rng(7).standard_normal((D, D))


def tied_program(comm: Any) -> dict[str, np.ndarray]:
    """Embedding -> tanh(e W) -> LM head sharing the embedding's table -> loss: the head's
    input is replicated and its logits vocabulary-split, the case a hand-written
    ``h @ E.T`` gets wrong silently at TP 2 (no copy_to_tp: every rank's dh partial)."""
    table, ids, targets, mix = tied_inputs()
    dev = comm.device
    emb = tp.VocabParallelEmbedding(V, D, comm=comm, full=table, dtype=DT)
    head = tp.ParallelLMHead(D, V, comm=comm, tie=emb)
    w = nn.Parameter(fs.tensor(mix, device=dev))
    h = (emb(fs.tensor(ids, device=dev)) @ w).tanh()
    loss = tp.vocab_parallel_cross_entropy(head(h), fs.tensor(targets, device=dev), comm=comm)
    params = [emb.weight, w]
    assert head.parameters() == [emb.weight]  # one Parameter, two uses
    grads = fs.grad(loss, params)
    fs.realize(loss, *grads)
    return {"loss": loss.numpy(), **{f"d{i}": g.numpy() for i, g in enumerate(grads)}}


def tied_reference(n: int) -> list[dict[str, np.ndarray]]:
    import torch

    table, ids, targets, mix = tied_inputs()
    e = torch.tensor(table, requires_grad=True)
    w = torch.tensor(mix, requires_grad=True)
    h = (e[torch.tensor(ids)] @ w).tanh()
    loss = torch.nn.functional.cross_entropy((h @ e.T).reshape(-1, V),
                                             torch.tensor(targets).reshape(-1))
    loss.backward()
    return [{"loss": loss.detach().numpy(), "d0": _block(e.grad.numpy(), r, n, 0),
             "d1": w.grad.numpy()} for r in range(n)]


def bad_index_program(comm: Any) -> list[str]:
    """Every out-of-range target or id, as this rank saw it: 'ErrorType: message'."""
    dev = comm.device
    _, ids, _, logits, targets = vocab_inputs()
    k = V // comm.size
    z = fs.tensor(_block(logits, comm.rank, comm.size, 1), device=dev)
    emb = tp.VocabParallelEmbedding(V, D, comm=comm, seed=1, dtype=DT)
    bad_t, bad_ids = targets.copy(), ids.copy()
    bad_t[3], bad_ids[1, 2] = V, -1
    attempts = [
        lambda: tp.vocab_parallel_cross_entropy(z, fs.tensor(bad_t, device=dev), comm=comm),
        lambda: functional.cross_entropy(fs.tensor(logits, device=dev),
                                            fs.tensor(bad_t, device=dev)),
        lambda: emb(fs.tensor(bad_ids, device=dev)),
        lambda: functional.embedding(fs.tensor(ids + k * comm.size, device=dev),
                                        fs.tensor(logits.T.copy(), device=dev)),
    ]
    seen = []
    for attempt in attempts:
        try:
            attempt()
        except fs.IndexRangeError as e:
            seen.append(f"{type(e).__name__}: {e}")
        else:
            seen.append("no error")
    comm.barrier()  # every rank got here: none was left waiting in a collective
    return seen


CASES: dict[str, tuple[Callable[[Any], dict[str, np.ndarray]],
                       Callable[[int], list[dict[str, np.ndarray]]]]] = {
    "mlp": (mlp_program, mlp_reference),
    "gather_scatter": (gather_scatter_program, gather_scatter_reference),
    "attention": (attn_program, attn_reference),
    "embedding": (embedding_program, embedding_reference),
    "cross_entropy": (cross_entropy_program, cross_entropy_reference),
    "tied_lm": (tied_program, tied_reference),
}


def check(got: dict[str, np.ndarray], want: dict[str, np.ndarray], *, rtol: float = 1e-9,
          atol: float = 1e-9) -> None:
    """Every key matches (finite-difference references get the looser tolerances)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)
