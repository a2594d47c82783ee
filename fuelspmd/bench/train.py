"""``fuelspmd bench train --vs torch``: one GPT-2 training step, torch eager beside fuelspmd.

    fuelspmd bench train [--vs torch] [--size small,medium] [--rounds 5] [--json]
    mpiexec -n 2 fuelspmd bench train --vs torch --mode tp,dp

The model is :class:`fuelspmd.models.GPT2` (learned positions, pre-norm blocks, tanh GELU,
the head tied to the token embedding) from a :class:`~fuelspmd.models.GPT2Config` of the
size, its weights seeded; mean next-token cross-entropy. ``small`` is 2 layers of width
64, ``medium`` 8 layers of width 512. Torch gets the same weights through the model's
``save_pretrained`` directory (each rank writes its own): transformers'
``GPT2LMHeadModel`` loads it for one process and for dp; for tp the same arrays go into a
Megatron-style torch model (below). The step is forward, backward and AdamW, timed three
ways in interleaved rounds (torch, compiled, uncompiled, torch, ...): torch eager (its
CPU build, one thread per rank like fuelspmd), fuelspmd's step under ``fs.compile`` and
the same step uncompiled. Each row also gives the two first losses' relative difference
(the same weights and batch: float32 rounding apart).

Modes: ``tp1`` one process; under ``mpiexec -n 2``, ``tp`` splits the heads, the MLP and
the vocabulary over the ranks (fuelspmd's model over the world Communicator: its
vocabulary-parallel embedding, head and cross-entropy; torch's the same Megatron layout,
autograd functions for the conjugate identity / all-reduce pair and a vocabulary-parallel
cross-entropy over gloo) and ``dp`` replicates the model and averages the gradients
(fuelspmd's all_reduce over MPI in buckets of 4 MiB; torch's ``DistributedDataParallel``
over gloo, in its own buckets). Torch's process group starts in the same processes from the
MPI rank and size (a file rendezvous in ``--rendezvous``). The ratios are the medians of
compiled / torch and uncompiled / torch.
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
from fuelspmd import models, optim
from fuelspmd.bench import Column, median, parser, print_json, print_table
from fuelspmd.comm import Communicator
from fuelspmd.comm.communicator import BUCKET_BYTES
from fuelspmd.tensor_parallel import vocab_parallel_cross_entropy
from fuelspmd.transport import SelfTransport

__all__ = ["SIZES", "Size", "batch", "config", "gpt2", "loss", "main", "make_step",
           "save_weights", "torch_model"]


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


def config(size: Size) -> models.GPT2Config:
    """The GPT-2 config of a size (positions: the sequence length)."""
    return models.GPT2Config(vocab_size=size.vocab, n_embd=size.width, n_layer=size.layers,
                             n_head=size.heads, n_positions=size.seq)


def gpt2(size: Size, *, comm: Communicator, dtype: str = "float32") -> models.GPT2:
    """The bench's model on one TP rank of ``comm``, seeded (the same numbers at any TP
    size), its head leaving the logits vocabulary-split for :func:`loss`."""
    model = models.GPT2(config(size), comm=comm, seed=0, dtype=dtype)
    model.head.gather_output = False
    return model


def batch(size: Size, seed: int, step: int, replica: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``(batch, seq)`` and flat next-token targets of one replica's step."""
    rng = np.random.default_rng([seed, step, replica])
    t = rng.integers(0, size.vocab, (size.batch, size.seq + 1))
    return t[:, :-1].copy(), t[:, 1:].reshape(-1).copy()


def loss(model: models.GPT2, ids: fs.Tensor, targets: fs.Tensor, *, comm: Communicator
         ) -> fs.Tensor:
    """Mean next-token cross-entropy of the vocabulary-split logits (float32 at least)."""
    z = model(ids)
    z = z.reshape(-1, z.shape[-1])
    return vocab_parallel_cross_entropy(z if z.dtype.itemsize >= 4 else z.astype(fs.float32),
                                        targets, comm=comm)


def make_step(model: models.GPT2, opt: Any, *, comm: Communicator,
              dp: Communicator | None = None) -> Any:
    """``step(ids, targets) -> loss``: forward, backward, the dp-mean of the gradients
    (unless the optimiser is ZeRO-1, which reduce-scatters them itself), realised as one
    graph (the loss with them: else its forward would run again), then the update."""
    params = model.parameters()
    mean = dp is not None and dp.size > 1 and not isinstance(opt, optim.ZeRO1)

    def step(ids: fs.Tensor, targets: fs.Tensor) -> fs.Tensor:
        value = loss(model, ids, targets, comm=comm)
        grads = fs.grad(value, params)
        if mean:
            assert dp is not None
            grads = [dp.all_reduce(g, "avg") for g in grads]
        fs.realize(value, *grads)
        opt.step(grads)
        return value

    return step


# ---- torch: the same model and weights, eager ---------------------------------------------
def save_weights(size: Size, device: Any, path: str) -> str:
    """Write the bench's weights to ``path`` as a Hugging Face directory, from this rank
    alone (the model on a size-1 Communicator), for torch to load; return ``path``."""
    gpt2(size, comm=Communicator(SelfTransport(), device=device)).save_pretrained(path)
    return path


def torch_model(size: Size, path: str, *, tp_rank: int = 0, tp_size: int = 1,
                group: Any = None) -> Any:
    """``model(ids, targets) -> loss`` in torch from the directory ``path``: transformers'
    ``GPT2LMHeadModel`` (dropout off) when ``tp_size`` is 1; else this rank's Megatron
    shards of the same arrays (column blocks of q, k, v and the MLP's first layer, row
    blocks of the attention output and the MLP's second layer, row blocks of the tied
    table: a vocabulary-parallel embedding and head) and the conjugate pair over gloo."""
    import torch
    import torch.nn.functional as tF
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(path, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
    if tp_size == 1:
        class Whole(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.hf = hf

            def forward(self, ids: Any, targets: Any) -> Any:
                z = self.hf(input_ids=ids).logits
                return tF.cross_entropy(z.reshape(-1, z.shape[-1]), targets)
        return Whole()
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return _megatron(size, sd, tp_rank, tp_size, group)


def _megatron(size: Size, sd: dict[str, np.ndarray], rank: int, n: int, group: Any) -> Any:
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

    vp = size.vocab // n
    lo = rank * vp

    class VocabCE(torch.autograd.Function):  # Megatron's vocabulary-parallel cross-entropy
        @staticmethod
        def forward(ctx: Any, z: Any, t: Any) -> Any:
            z = z.clone()
            top = z.max(-1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            z -= top[:, None]
            outside = (t < lo) | (t >= lo + vp)
            idx = (t - lo).clamp(0, vp - 1)
            rows = torch.arange(z.shape[0])
            picked = z[rows, idx].masked_fill(outside, 0.0)
            dist.all_reduce(picked, group=group)
            e = z.exp()
            total = e.sum(-1)
            dist.all_reduce(total, group=group)
            ctx.save_for_backward(e / total[:, None], outside, idx)
            return (total.log() - picked).mean()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            soft, outside, idx = ctx.saved_tensors
            grad = soft.clone()
            grad[torch.arange(grad.shape[0]), idx] -= (~outside).to(grad.dtype)
            return grad * (g / grad.shape[0]), None

    def cols(a: np.ndarray) -> Any:
        k = a.shape[-1] // n
        return torch.nn.Parameter(torch.tensor(a[..., rank * k:(rank + 1) * k].copy()))

    def rows(a: np.ndarray) -> Any:
        k = a.shape[0] // n
        return torch.nn.Parameter(torch.tensor(a[rank * k:(rank + 1) * k].copy()))

    def full(a: np.ndarray) -> Any:
        return torch.nn.Parameter(torch.tensor(a))

    d = size.width
    heads, hd = size.heads // n, size.width // size.heads
    mask = torch.triu(torch.full((size.seq, size.seq), float("-inf")), 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = rows(sd["transformer.wte.weight"])
            self.wpe = full(sd["transformer.wpe.weight"])
            self.blocks = torch.nn.ModuleList()
            for i in range(size.layers):
                h = f"transformer.h.{i}."
                m = torch.nn.Module()
                w, b = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]
                m.ln1 = torch.nn.ParameterList([full(sd[h + "ln_1.weight"]),
                                                full(sd[h + "ln_1.bias"])])
                m.qkv = torch.nn.ParameterList(
                    [p for j in range(3) for p in (cols(w[:, j * d:(j + 1) * d]),
                                                   cols(b[j * d:(j + 1) * d]))])
                m.o = torch.nn.ParameterList([rows(sd[h + "attn.c_proj.weight"]),
                                              full(sd[h + "attn.c_proj.bias"])])
                m.ln2 = torch.nn.ParameterList([full(sd[h + "ln_2.weight"]),
                                                full(sd[h + "ln_2.bias"])])
                m.mlp = torch.nn.ParameterList([cols(sd[h + "mlp.c_fc.weight"]),
                                                cols(sd[h + "mlp.c_fc.bias"]),
                                                rows(sd[h + "mlp.c_proj.weight"]),
                                                full(sd[h + "mlp.c_proj.bias"])])
                self.blocks.append(m)
            self.lnf = torch.nn.ParameterList([full(sd["transformer.ln_f.weight"]),
                                               full(sd["transformer.ln_f.bias"])])

        def forward(self, ids: Any, targets: Any) -> Any:
            bsz, t = ids.shape
            outside = (ids < lo) | (ids >= lo + vp)
            e = self.wte[(ids - lo).clamp(0, vp - 1)].masked_fill(outside[..., None], 0.0)
            x = Reduce.apply(e) + self.wpe[:t]
            for m in self.blocks:
                h = Copy.apply(tF.layer_norm(x, (d,), m.ln1[0], m.ln1[1]))
                q, k, v = (h @ m.qkv[2 * i] + m.qkv[2 * i + 1] for i in range(3))
                q, k, v = (y.reshape(bsz, t, heads, hd).transpose(1, 2) for y in (q, k, v))
                s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(hd)) + mask[:t, :t]
                ctx = (s.softmax(-1) @ v).transpose(1, 2).reshape(bsz, t, heads * hd)
                x = x + Reduce.apply(ctx @ m.o[0]) + m.o[1]
                h = Copy.apply(tF.layer_norm(x, (d,), m.ln2[0], m.ln2[1]))
                u = tF.gelu(h @ m.mlp[0] + m.mlp[1], approximate="tanh")
                x = x + Reduce.apply(u @ m.mlp[2]) + m.mlp[3]
            h = Copy.apply(tF.layer_norm(x, (d,), self.lnf[0], self.lnf[1]))
            return VocabCE.apply((h @ self.wte.T).reshape(bsz * t, vp), targets)

    return Model()


# ---- the runs -----------------------------------------------------------------------------
def _fuelspmd(size: Size, mode: str, world: Any, compiled: bool
              ) -> Callable[[int], float]:
    """One fuelspmd candidate: ``run(i)`` takes step ``i`` (forward, backward, AdamW) and
    returns its loss."""
    solo = Communicator(SelfTransport(), device=world.device)
    comm = world.comm if mode == "tp" else solo
    dp = None
    if mode == "dp":  # the gradients' all-reduces bucketed, as DDP's are
        dp = Communicator(world.comm.transport.split(0, world.rank), device=world.device,
                          timeout=world.comm.timeout, bucket_bytes=BUCKET_BYTES)
    model = gpt2(size, comm=comm)
    step = make_step(model, optim.AdamW(model.parameters(), lr=1e-3), comm=comm, dp=dp)
    fn = fs.compile(step) if compiled else step
    replica = world.rank if mode == "dp" else 0

    def run(i: int) -> float:
        ids, targets = batch(size, 1, i, replica)
        return float(fn(fs.tensor(ids, device=world.device),
                        fs.tensor(targets, device=world.device)).numpy())
    return run


def _torch(size: Size, mode: str, world: Any) -> Callable[[int], float]:
    import torch

    rank, n = world.rank, world.size
    tp_size = n if mode == "tp" else 1
    with tempfile.TemporaryDirectory(prefix="fuelspmd-bench-train-") as path:
        model = torch_model(size, save_weights(size, world.device, path),
                            tp_rank=rank if mode == "tp" else 0, tp_size=tp_size)
    if mode == "dp" and n > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    replica = rank if mode == "dp" else 0

    def run(i: int) -> float:
        ids, targets = batch(size, 1, i, replica)
        value = model(torch.from_numpy(ids), torch.from_numpy(targets))
        opt.zero_grad()
        value.backward()
        opt.step()
        return value.item()
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
        cands["torch"] = _torch(size, mode, world)
    cands["compiled"] = _fuelspmd(size, mode, world, True)
    cands["uncompiled"] = _fuelspmd(size, mode, world, False)
    count = {k: 0 for k in cands}
    first: dict[str, float] = {}

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
            value = cands[name](count[name])
            first.setdefault(name, value)
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
    if vs_torch:  # step 0 from the same weights and batch
        row["first_loss_rel_diff"] = abs(first["compiled"] - first["torch"]) / first["torch"]
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
