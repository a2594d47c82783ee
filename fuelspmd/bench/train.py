"""``fuelspmd bench train --vs torch``: one GPT-2 training step, torch eager beside fuelspmd.

    fuelspmd bench train [--vs torch] [--size small,medium] [--rounds 5] [--json]
    mpiexec -n 2 fuelspmd bench train --vs torch --mode tp,dp

The model is GPT-2 shaped: token and position embeddings, pre-norm blocks
``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` (4x wide GELU MLP, causal multi-head attention),
a final norm and an untied head, mean next-token cross-entropy. ``small`` is 2 layers of
width 64, ``medium`` 8 layers of width 512. The step is forward, backward and AdamW,
timed three ways in interleaved rounds (torch, compiled, uncompiled, torch, ...): torch
eager (its CPU build, one thread per rank like fuelspmd), fuelspmd's step under
``fs.compile`` and the same step uncompiled, all from the same float32 weights.

Modes: ``tp1`` one process; under ``mpiexec -n 2``, ``tp`` splits the heads and the MLP
over the ranks (fuelspmd's ``ParallelAttention``/``ParallelMLP``; torch's written
Megatron-style: autograd functions for the conjugate identity / all-reduce pair over
gloo) and ``dp`` replicates the model and averages the gradients (fuelspmd's all_reduce
over MPI in buckets of 4 MiB; torch's ``DistributedDataParallel`` over gloo, in its own
buckets). Torch's process group starts in
the same processes from the MPI rank and size (a file rendezvous in ``--rendezvous``).
The ratios are the medians of compiled / torch and uncompiled / torch.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import functional as F
from fuelspmd import nn, optim
from fuelspmd import tensor_parallel as tp
from fuelspmd.bench import Column, median, parser, print_json, print_table
from fuelspmd.comm import Communicator
from fuelspmd.comm.communicator import BUCKET_BYTES
from fuelspmd.transport import SelfTransport

__all__ = ["GPT", "SIZES", "Size", "batch", "full_weights", "main", "make_step"]


@dataclass(frozen=True)
class Size:
    """A model and its batch: ``batch`` sequences of ``seq`` tokens per rank."""

    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int


SIZES = {"tiny": Size(1, 16, 2, 32, 8, 2), "small": Size(2, 64, 4, 256, 32, 4),
         "medium": Size(8, 512, 8, 1024, 64, 2)}


def full_weights(size: Size, seed: int = 0) -> dict[str, Any]:
    """The unsharded float32 weights, a function of ``seed`` (every rank builds the same)."""
    rng = np.random.default_rng(seed)
    d, f = size.width, 4 * size.width

    def lin(n_in: int, n_out: int) -> list[np.ndarray]:
        return [(rng.standard_normal((n_in, n_out)) * 0.02).astype(np.float32),
                np.zeros(n_out, np.float32)]

    def ln() -> list[np.ndarray]:
        return [np.ones(d, np.float32), np.zeros(d, np.float32)]

    blocks = [{"ln1": ln(), "attn": lin(d, d) + lin(d, d) + lin(d, d) + lin(d, d),
               "ln2": ln(), "mlp": lin(d, f) + lin(f, d)} for _ in range(size.layers)]
    return {"wte": (rng.standard_normal((size.vocab, d)) * 0.02).astype(np.float32),
            "wpe": (rng.standard_normal((size.seq, d)) * 0.01).astype(np.float32),
            "blocks": blocks, "lnf": ln(), "head": lin(d, size.vocab)}


def batch(size: Size, seed: int, step: int, replica: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``(batch, seq)`` and flat next-token targets of one replica's step."""
    rng = np.random.default_rng([seed, step, replica])
    t = rng.integers(0, size.vocab, (size.batch, size.seq + 1))
    return t[:, :-1].copy(), t[:, 1:].reshape(-1).copy()


class Block(nn.Module):
    """``x + attn(ln1(x))``, ``x + mlp(ln2(x))``; heads and MLP features split over comm."""

    def __init__(self, size: Size, w: dict[str, Any], *, comm: Communicator, dtype: str) -> None:
        kw: dict[str, Any] = {"device": comm.device, "dtype": dtype}
        self.ln1 = nn.LayerNorm(size.width, full=w["ln1"], **kw)
        self.attn = tp.ParallelAttention(size.width, size.heads, full=w["attn"], comm=comm,
                                         dtype=dtype)
        self.ln2 = nn.LayerNorm(size.width, full=w["ln2"], **kw)
        self.mlp = tp.ParallelMLP(size.width, 4 * size.width, full=w["mlp"], comm=comm,
                                  dtype=dtype)

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The GPT-2-shaped model of the module docstring on one TP rank of ``comm``."""

    def __init__(self, size: Size, w: dict[str, Any], *, comm: Communicator,
                 dtype: str = "float32") -> None:
        self.size = size
        kw: dict[str, Any] = {"device": comm.device, "dtype": dtype}
        self.wte = nn.Embedding(size.vocab, size.width, full=w["wte"], **kw)
        self.wpe = nn.Parameter(fs.tensor(w["wpe"], device=comm.device, dtype=dtype))
        self.blocks = [Block(size, b, comm=comm, dtype=dtype) for b in w["blocks"]]
        self.lnf = nn.LayerNorm(size.width, full=w["lnf"], **kw)
        self.head = tp.ColumnParallelLinear(size.width, size.vocab, full=tuple(w["head"]),
                                            comm=comm, gather_output=True, dtype=dtype)

    def loss(self, ids: fs.Tensor, targets: fs.Tensor) -> fs.Tensor:
        """Mean next-token cross-entropy (in float32 at least)."""
        x = self.wte(ids) + self.wpe
        for block in self.blocks:
            x = block(x)
        z = self.head(self.lnf(x)).reshape(-1, self.size.vocab)
        return F.cross_entropy(z if z.dtype.itemsize >= 4 else z.astype(fs.float32), targets)


def make_step(model: GPT, opt: Any, *, dp: Communicator | None = None) -> Any:
    """``step(ids, targets) -> loss``: forward, backward, the dp-mean of the gradients
    (unless the optimiser is ZeRO-1, which reduce-scatters them itself), realised as one
    graph (the loss with them: else its forward would run again), then the update."""
    params = model.parameters()
    mean = dp is not None and dp.size > 1 and not isinstance(opt, optim.ZeRO1)

    def step(ids: fs.Tensor, targets: fs.Tensor) -> fs.Tensor:
        loss = model.loss(ids, targets)
        grads = fs.grad(loss, params)
        if mean:
            assert dp is not None
            grads = [dp.all_reduce(g, "avg") for g in grads]
        fs.realize(loss, *grads)
        opt.step(grads)
        return loss

    return step


# ---- torch: the same model, eager ---------------------------------------------------------
def torch_model(size: Size, w: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1,
                group: Any = None) -> Any:
    """The model in torch with the same weights; with ``tp_size > 1`` this rank's Megatron
    shards (column blocks of q, k, v, the MLP's first layer and the head; row blocks of
    the attention output and the MLP's second layer) and the conjugate pair over gloo."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as tF

    class Copy(torch.autograd.Function):  # identity forward, all-reduce backward
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            g = g.clone()
            dist.all_reduce(g, group=group)
            return g

    class Reduce(torch.autograd.Function):  # all-reduce forward, identity backward
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    def copy(x: Any) -> Any:
        return Copy.apply(x) if tp_size > 1 else x

    def reduce(x: Any) -> Any:
        return Reduce.apply(x) if tp_size > 1 else x

    def cols(a: np.ndarray) -> Any:
        k = a.shape[-1] // tp_size
        return torch.nn.Parameter(torch.tensor(a[..., tp_rank * k:(tp_rank + 1) * k].copy()))

    def rows(a: np.ndarray) -> Any:
        k = a.shape[0] // tp_size
        return torch.nn.Parameter(torch.tensor(a[tp_rank * k:(tp_rank + 1) * k].copy()))

    def full(a: np.ndarray) -> Any:
        return torch.nn.Parameter(torch.tensor(a))

    d, heads = size.width, size.heads // tp_size
    hd = size.width // size.heads
    mask = torch.triu(torch.full((size.seq, size.seq), float("-inf")), 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = full(w["wte"]), full(w["wpe"])
            self.blocks = torch.nn.ModuleList()
            for b in w["blocks"]:
                m = torch.nn.Module()
                a = b["attn"]
                m.ln1 = torch.nn.ParameterList([full(b["ln1"][0]), full(b["ln1"][1])])
                m.qkv = torch.nn.ParameterList([cols(x) for x in a[:6]])
                m.o = torch.nn.ParameterList([rows(a[6]), full(a[7])])
                m.ln2 = torch.nn.ParameterList([full(b["ln2"][0]), full(b["ln2"][1])])
                f = b["mlp"]
                m.mlp = torch.nn.ParameterList([cols(f[0]), cols(f[1]), rows(f[2]), full(f[3])])
                self.blocks.append(m)
            self.lnf = torch.nn.ParameterList([full(w["lnf"][0]), full(w["lnf"][1])])
            self.head = torch.nn.ParameterList([cols(w["head"][0]), cols(w["head"][1])])

        def forward(self, ids: Any, targets: Any) -> Any:
            bsz, t = ids.shape
            x = self.wte[ids] + self.wpe
            for m in self.blocks:
                h = copy(tF.layer_norm(x, (d,), m.ln1[0], m.ln1[1]))
                q, k, v = (h @ m.qkv[2 * i] + m.qkv[2 * i + 1] for i in range(3))
                q, k, v = (y.reshape(bsz, t, heads, hd).transpose(1, 2) for y in (q, k, v))
                s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(hd)) + mask[:t, :t]
                ctx = (s.softmax(-1) @ v).transpose(1, 2).reshape(bsz, t, heads * hd)
                x = x + reduce(ctx @ m.o[0]) + m.o[1]
                h = copy(tF.layer_norm(x, (d,), m.ln2[0], m.ln2[1]))
                u = tF.gelu(h @ m.mlp[0] + m.mlp[1], approximate="tanh")
                x = x + reduce(u @ m.mlp[2]) + m.mlp[3]
            h = copy(tF.layer_norm(x, (d,), self.lnf[0], self.lnf[1]))
            z = h @ self.head[0] + self.head[1]
            if tp_size > 1:
                from torch.distributed.nn.functional import all_gather
                z = torch.cat(all_gather(z, group=group), -1)
            return tF.cross_entropy(z.reshape(-1, size.vocab), targets)

    return Model()


# ---- the runs -----------------------------------------------------------------------------
def _fuelspmd(size: Size, mode: str, world: Any, compiled: bool) -> Callable[[int], None]:
    """One fuelspmd candidate: ``run(i)`` takes step ``i`` (forward, backward, AdamW)."""
    solo = Communicator(SelfTransport(), device=world.device)
    comm = world.comm if mode == "tp" else solo
    dp = None
    if mode == "dp":  # the gradients' all-reduces bucketed, as DDP's are
        dp = Communicator(world.comm.transport.split(0, world.rank), device=world.device,
                          timeout=world.comm.timeout, bucket_bytes=BUCKET_BYTES)
    model = GPT(size, full_weights(size), comm=comm)
    step = make_step(model, optim.AdamW(model.parameters(), lr=1e-3), dp=dp)
    fn = fs.compile(step) if compiled else step
    replica = world.rank if mode == "dp" else 0

    def run(i: int) -> None:
        ids, targets = batch(size, 1, i, replica)
        fn(fs.tensor(ids, device=world.device), fs.tensor(targets, device=world.device)
           ).numpy()
    return run


def _torch(size: Size, mode: str, rank: int, n: int) -> Callable[[int], None]:
    import torch

    tp_size = n if mode == "tp" else 1
    model = torch_model(size, full_weights(size), tp_rank=rank if mode == "tp" else 0,
                        tp_size=tp_size)
    if mode == "dp" and n > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    replica = rank if mode == "dp" else 0

    def run(i: int) -> None:
        ids, targets = batch(size, 1, i, replica)
        loss = model(torch.from_numpy(ids), torch.from_numpy(targets))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    return run


def _torch_group(world: Any, rendezvous: str | None) -> None:
    """Start torch's gloo group in these processes (a file rendezvous rank 0 names)."""
    import torch.distributed as dist
    from mpi4py import MPI

    path = rendezvous
    if path is None:
        path = MPI.COMM_WORLD.bcast(tempfile.mktemp(prefix="fuelspmd-gloo-")
                                    if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=world.rank,
                            world_size=world.size)


def measure(size: Size, label: str, world: Any, *, rounds: int, reps: int, vs_torch: bool,
            barrier: Callable[[], None]) -> dict[str, Any]:
    """Interleaved rounds of each candidate (after four warm-up steps each: plans made, the
    compiled step captured): the median seconds per step and the ratios to torch."""
    mode = "tp" if label == "tp1" else label
    cands: dict[str, Callable[[int], None]] = {}
    if vs_torch:
        cands["torch"] = _torch(size, mode, world.rank, world.size)
    cands["compiled"] = _fuelspmd(size, mode, world, True)
    cands["uncompiled"] = _fuelspmd(size, mode, world, False)
    count = {k: 0 for k in cands}

    def timed(name: str) -> float:
        run = cands[name]
        barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            run(count[name])
            count[name] += 1
        return (time.perf_counter() - t0) / reps

    for name in cands:
        for _ in range(4):
            run = cands[name]
            run(count[name])
            count[name] += 1
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(rounds):
        for name in cands:
            times[name].append(timed(name))
    row: dict[str, Any] = {"size": _size_name(size), "mode": label, "ranks": world.size}
    for name, ts in times.items():
        row[f"{name}_ms"] = median(ts) * 1e3
    if vs_torch:
        row["compiled_vs_torch"] = row["compiled_ms"] / row["torch_ms"]
        row["uncompiled_vs_torch"] = row["uncompiled_ms"] / row["torch_ms"]
    row["compiled_vs_uncompiled"] = row["compiled_ms"] / row["uncompiled_ms"]
    return row


def _size_name(size: Size) -> str:
    return next(k for k, v in SIZES.items() if v == size)


def main(argv: list[str] | None = None) -> int:
    p = parser("fuelspmd bench train", __doc__ or "")
    p.add_argument("--vs", choices=["torch", "none"], default="torch")
    p.add_argument("--size", default="small,medium", help="comma list of " + ",".join(SIZES))
    p.add_argument("--mode", default=None, help="tp1 (one process; the default there), or "
                   "tp,dp under mpiexec (the default there)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="steps per round")
    p.add_argument("--rendezvous", default=None, help="torch's file rendezvous path")
    p.add_argument("--json", action="store_true")
    try:
        args = p.parse_args(argv)
        sizes = [SIZES[s] for s in args.size.split(",")]
        if args.rounds < 1 or args.reps < 1:
            raise ValueError("--rounds and --reps must be at least 1")
    except (KeyError, ValueError) as e:
        print(f"fuelspmd bench train: {e}; sizes are {', '.join(SIZES)}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return int(e.code or 0)
    from threadpoolctl import threadpool_limits

    world = fs.init()
    modes = (args.mode or ("tp,dp" if world.size > 1 else "tp1")).split(",")
    bad = [m for m in modes if m not in ("tp1", "tp", "dp") or (m == "tp1") != (world.size == 1)]
    if bad:
        print(f"fuelspmd bench train: mode {bad} does not fit {world.size} ranks; use tp1 in "
              "one process, tp or dp under mpiexec -n 2", file=sys.stderr)
        return 2
    vs_torch = args.vs == "torch"
    if vs_torch:
        import torch

        torch.set_num_threads(1)
        if world.size > 1:
            _torch_group(world, args.rendezvous)

    def barrier() -> None:
        world.comm.barrier()

    rows = []
    with threadpool_limits(1):
        for size in sizes:
            for mode in modes:
                rows.append(measure(size, mode, world,
                                    rounds=args.rounds, reps=args.reps, vs_torch=vs_torch,
                                    barrier=barrier))
    if world.rank != 0:
        return 0
    if args.json:
        print_json({"bench": "train", "rows": rows})
        return 0
    cols = [Column("size", "size"), Column("mode", "mode"), Column("ranks", "ranks")]
    if vs_torch:
        cols.append(Column("torch ms", "torch_ms", "{:.2f}"))
    cols += [Column("compiled ms", "compiled_ms", "{:.2f}"),
             Column("uncompiled ms", "uncompiled_ms", "{:.2f}")]
    if vs_torch:
        cols += [Column("compiled/torch", "compiled_vs_torch", "{:.2f}"),
                 Column("uncompiled/torch", "uncompiled_vs_torch", "{:.2f}")]
    cols.append(Column("compiled/uncompiled", "compiled_vs_uncompiled", "{:.2f}"))
    print_table("one GPT-2 training step (fwd + bwd + AdamW), interleaved rounds; medians",
                cols, rows)
    return 0
