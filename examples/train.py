"""Train a small transformer language model with tensor, pipeline and data parallelism.

The same program runs with ranks as processes or as devices of one process::

    python examples/train.py                          # one rank
    mpiexec -n 4 python examples/train.py             # tp 2 x pp 2
    mpiexec -n 8 python examples/train.py --dp 2      # dp 2 x pp 2 x tp 2
    python examples/train.py --devices cpu:4          # four devices of one process
    mpiexec -n 4 python examples/train.py --check     # first step == one process?
    mpiexec -n 8 python examples/train.py --dp 2 --zero --dropout 0.1   # ZeRO-1
    python examples/train.py --dtype bfloat16 --recompute   # 16-bit, recomputed blocks
    mpiexec -n 4 python examples/train.py --from DIR   # fine-tune a Hugging Face GPT-2/Llama
    python examples/train.py --no-compile             # build every step's graph anew

The model, written with :mod:`fuelspmd.nn`: a vocabulary-parallel embedding plus a learned
position embedding, ``--layers`` pre-norm blocks ``x + drop(attn(ln(x)))``,
``x + drop(mlp(ln(x)))`` (ParallelAttention and ParallelMLP, heads and hidden features
split over ``tp``), a final layer norm and a column-parallel LM head whose vocabulary-split
logits go straight into ``vocab_parallel_cross_entropy`` (the full logits are never
gathered). The blocks are cut into ``pp * chunks`` virtual stages, each a :class:`Stage`
Module, run by a :class:`~fuelspmd.pipeline_parallel.PipelineExecutor`; the first holds
the embeddings, the last the head and loss. Every rank builds its layers from the same
full weights (:func:`full_weights`, a function of ``--seed``) and keeps its shards, so the
numbers do not depend on the mesh, which is what ``--check`` verifies: each parameter's
spec cuts its shard out of the one-process gradient.

Training, with :mod:`fuelspmd.optim`: AdamW over this rank's parameters (``--zero``:
ZeRO-1, its state sharded over dp), the learning rate warmed up linearly then decayed by a
cosine, the gradient clipped by its global norm over the mesh (``--clip``); 16-bit
``--dtype`` keeps float32 master weights in the optimiser, and float16 scales the loss
dynamically (a step with an inf or nan is skipped on every rank). The summary gives rank
0's peak bytes of saved activations, of the graph's working set and of optimiser state.

The step (forward, backward, the pipeline's transfers, clip, scaler, AdamW) is one
function compiled by ``fs.compile``: traced on its first calls, then replayed without
building a graph. Every
number that changes per step stays in tensors for that (the clip coefficient, the loss
scale and its skip decision, the learning rate through ``fs.host``, the dropout masks keyed
by the step when they are made), so ``--no-compile`` gives the same losses bit for bit.

The task, generated in code: arithmetic sequences ``x_t = (s + k t) mod V`` with a random
start ``s`` and stride ``k`` in ``1..K`` per sequence. The model sees ``x_0 .. x_{T-1}`` and
predicts ``x_1 .. x_T``: the first target depends on the unknown stride (one of ``K``,
``log K`` nats at best), and every later one is determined by the two tokens before it.
So the mean next-token loss falls from about ``log V`` towards the floor ``log(K) / T``
(:func:`loss_floor`: ``log 3 / 8``, 0.137, with the defaults), which the summary line
prints beside the last loss.

``--from DIR`` fine-tunes a Hugging Face GPT-2 or Llama directory on the same task (over
the model's vocabulary) instead: :func:`fuelspmd.models.from_pretrained` over the mesh
gives each rank its stages' shards (its chunks, interleaved), the model's pipeline stages
are the executor's, its config's dropout is on, and the loss is the cross-entropy of its
full logits. With tied embeddings and pp > 1 the first
and last stages each hold the table, and their gradients are summed over those two
stages before the step, so the copies stay equal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from threadpoolctl import threadpool_limits

import fuelspmd as fs
from fuelspmd import models, nn, optim
from fuelspmd import tensor_parallel as tp
from fuelspmd.comm import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.functional import cross_entropy
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule, simulate
from fuelspmd.pipeline_parallel.render import chrome_trace

STRIDES = 3  # k in 1..STRIDES


@dataclass(frozen=True, kw_only=True)
class Config:
    """Model and task sizes (the same on every rank)."""

    vocab: int = 16
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 4
    seq: int = 8
    dtype: str = "float32"
    dropout: float = 0.0


# ---- data and weights: functions of the seed alone, so every rank agrees ----------------
def tokens(seed: int, step: int, replica: int, rows: int, cfg: Config) -> np.ndarray:
    """``rows`` sequences of ``seq + 1`` tokens ``(s + k t) mod V`` for one replica's step."""
    rng = np.random.default_rng([seed, 1, step, replica])
    s = rng.integers(0, cfg.vocab, (rows, 1))
    k = rng.integers(1, STRIDES + 1, (rows, 1))
    return ((s + k * np.arange(cfg.seq + 1)) % cfg.vocab).astype(np.int64)


def loss_floor(cfg: Config) -> float:
    """The lowest mean next-token loss the task allows: ``log K`` nats for the first target
    (the stride is unknown), 0 for the other ``T - 1``."""
    return math.log(STRIDES) / cfg.seq


def microbatches(seed: int, step: int, replica: int, m: int, rows: int, cfg: Config
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Inputs ``(rows, seq)`` and flat next-token targets ``(rows * seq,)``, m of each."""
    t = tokens(seed, step, replica, m * rows, cfg)
    xs = [t[i * rows:(i + 1) * rows, :-1] for i in range(m)]
    ys = [t[i * rows:(i + 1) * rows, 1:].reshape(-1) for i in range(m)]
    return xs, ys


def full_weights(cfg: Config, seed: int) -> dict[str, Any]:
    """The unsharded float64 weights of the whole model: what every layer keeps a shard of."""
    rng = np.random.default_rng([seed, 0])
    d = cfg.hidden

    def lin(n_in: int, n_out: int) -> list[np.ndarray]:
        return [rng.standard_normal((n_in, n_out)) / math.sqrt(n_in), np.zeros(n_out)]

    def ln() -> list[np.ndarray]:
        return [np.ones(d), np.zeros(d)]

    blocks = []
    for _ in range(cfg.layers):
        attn = lin(d, d) + lin(d, d) + lin(d, d) + lin(d, d)
        blocks.append({"ln1": ln(), "attn": attn, "ln2": ln(), "mlp": lin(d, cfg.ffn)
                       + lin(cfg.ffn, d)})
    return {"emb": rng.standard_normal((cfg.vocab, d)), "pos": rng.standard_normal((cfg.seq, d))
            * 0.1, "blocks": blocks, "lnf": ln(), "head": lin(d, cfg.vocab)}


# ---- the model: nn Modules -------------------------------------------------------------
class Block(nn.Module):
    """``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``: heads and hidden features
    split over ``comm`` (tp). The dropouts act on replicated activations (after the
    attention's and the MLP's all-reduce), so every TP rank draws the same mask.
    ``recompute``: the block's forward runs again in the backward instead of its
    intermediates being kept (``Module.recompute``)."""

    def __init__(self, cfg: Config, w: dict[str, Any], *, index: int, comm: Communicator,
                 rng: nn.DropoutRNG, recompute: bool) -> None:
        kw: dict[str, Any] = {"device": comm.device, "dtype": cfg.dtype}
        self.ln1 = nn.LayerNorm(cfg.hidden, full=w["ln1"], **kw)
        self.attn = tp.ParallelAttention(cfg.hidden, cfg.heads, full=w["attn"], comm=comm,
                                         dtype=cfg.dtype)
        self.ln2 = nn.LayerNorm(cfg.hidden, full=w["ln2"], **kw)
        self.mlp = tp.ParallelMLP(cfg.hidden, cfg.ffn, full=w["mlp"], comm=comm,
                                  dtype=cfg.dtype)
        self.drop1 = nn.Dropout(cfg.dropout, rng=rng, layer=2 * index)
        self.drop2 = nn.Dropout(cfg.dropout, rng=rng, layer=2 * index + 1)
        self.recompute = recompute

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class Stage(nn.Module):
    """Blocks ``lo .. hi - 1`` of the model on one TP rank, plus the embeddings (a
    vocabulary-parallel token embedding and a replicated position embedding) when
    ``first`` and the final norm and column-parallel head when ``last``. Every layer is
    built from the full weights (``w``, the same on every rank) and keeps its shard; each
    Parameter's spec says how, so nothing else needs to know."""

    def __init__(self, cfg: Config, w: dict[str, Any], lo: int, hi: int, *, first: bool,
                 last: bool, comm: Communicator, rng: nn.DropoutRNG | None = None,
                 recompute: bool = False) -> None:
        self.cfg, self.first, self.last, self.comm = cfg, first, last, comm
        rng = nn.DropoutRNG() if rng is None else rng
        if first:
            self.emb = tp.VocabParallelEmbedding(cfg.vocab, cfg.hidden, full=w["emb"],
                                                 comm=comm, dtype=cfg.dtype)
            self.pos = nn.Parameter(fs.tensor(w["pos"], device=comm.device, dtype=cfg.dtype))
        self.blocks = [Block(cfg, w["blocks"][i], index=i, comm=comm, rng=rng,
                             recompute=recompute) for i in range(lo, hi)]
        if last:
            self.lnf = nn.LayerNorm(cfg.hidden, full=w["lnf"], device=comm.device,
                                    dtype=cfg.dtype)
            self.head = tp.ColumnParallelLinear(cfg.hidden, cfg.vocab, full=tuple(w["head"]),
                                                comm=comm, dtype=cfg.dtype)

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        if self.first:
            x = self.emb(x) + self.pos
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.lnf(x))
        return x

    def loss(self, logits: fs.Tensor, targets: fs.Tensor) -> fs.Tensor:
        """Mean next-token cross-entropy of this rank's vocabulary block of the logits, in
        float32 at least (a 16-bit softmax over the vocabulary loses the small terms)."""
        b, t, k = logits.shape
        z = logits.reshape(b * t, k)
        if z.dtype.itemsize < 4:
            z = z.astype(fs.float32)
        return tp.vocab_parallel_cross_entropy(z, targets, comm=self.comm)


def stage_layers(cfg: Config, stages: int) -> list[tuple[int, int]]:
    """Contiguous, equal layer ranges of the ``stages`` virtual stages."""
    if cfg.layers % stages:
        ok = [n for n in range(1, cfg.layers + 1) if cfg.layers % n == 0]
        raise ConfigError(f"train: {cfg.layers} layers cannot be cut into pp x chunks = "
                          f"{stages} equal virtual stages; use --layers a multiple of "
                          f"{stages}, or pp x chunks in {ok}")
    n = cfg.layers // stages
    return [(v * n, (v + 1) * n) for v in range(stages)]


def dropout_seed(seed: int, replica: int) -> int:
    """The Dropout seed of data-parallel replica ``replica``: each its own masks."""
    return seed * 65536 + replica


# ---- the mesh, the executor, the loop ---------------------------------------------------
def plan(size: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """(tp, pp, dp): given ones as given; tp and pp default to 2 where the size allows."""
    tp_ = args.tp or (2 if size % 2 == 0 else 1)
    pp_ = args.pp or (2 if size % (tp_ * 2) == 0 and args.dp in (None, size // tp_ // 2)
                      else 1)
    dp_ = args.dp or max(1, size // (tp_ * pp_))
    if tp_ * pp_ * dp_ != size:
        raise ConfigError(f"train: tp={tp_} x pp={pp_} x dp={dp_} = {tp_ * pp_ * dp_} ranks, "
                          f"but there are {size}; make the product {size}")
    return tp_, pp_, dp_


def train(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's program; returns its losses, step times, bubbles, memory and check."""
    cfg = config(args)
    size = comm.size
    tp_, pp_, dp_ = plan(size, args)
    mesh = fs.Mesh(comm, tp=tp_, pp=pp_, dp=dp_)
    world = mesh.comm_group
    tpc, ppc, dpc = mesh.comm("tp"), mesh.comm("pp"), mesh.comm("dp")
    chunks = args.chunks or (2 if args.schedule == "interleaved" else 1)
    sched = schedule(args.schedule, pp_, args.microbatches, chunks)
    rng = nn.DropoutRNG(dropout_seed(args.seed, mesh.coord("dp")))
    vs = [j * pp_ + mesh.coord("pp") for j in range(chunks)]
    pretrained = None
    if args.from_dir:
        pretrained = models.from_pretrained(args.from_dir, mesh=mesh, chunks=chunks,
                                            dtype=cfg.dtype)
        pretrained.train()  # the config's dropout, keyed per replica as the built-in's
        pretrained.rng.seed = rng.seed
        rng = pretrained.rng
        ranges = pretrained.ranges
        stages: list[Any] = pretrained.stages
    else:
        ranges = stage_layers(cfg, pp_ * chunks)
        w = full_weights(cfg, args.seed)
        stages = [Stage(cfg, w, *ranges[v], first=v == 0, last=v == len(ranges) - 1,
                        comm=tpc, rng=rng, recompute=args.recompute) for v in vs]
    scaler = optim.LossScaler() if cfg.dtype == "float16" else None
    last_stage = stages[-1]

    def loss(y: fs.Tensor, t: fs.Tensor) -> fs.Tensor:
        if pretrained is None:
            value = last_stage.loss(y, t)
        else:  # the full logits, in float32 at least
            z = y.reshape(-1, y.shape[-1])
            value = cross_entropy(z if z.dtype.itemsize >= 4 else z.astype(fs.float32), t)
        return value if scaler is None else scaler.scale(value)

    params = (pretrained.parameters() if pretrained is not None else
              [p for st in stages for p in st.parameters()])
    lr = optim.cosine(args.lr, args.steps, warmup=args.warmup, min_lr=args.lr / 10)
    adam = optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    # ZeRO-1: the pipeline reduce-scatters each chunk's gradient buckets inside its last
    # backward (instead of all-reducing them), and the optimiser steps on those slices
    opt = (optim.ZeRO1(adam, dp=dpc, chunks=[len(st.parameters()) for st in stages])
           if args.zero else adam)
    ex = PipelineExecutor(sched, comm=ppc, stages=stages, loss=loss, dp=dpc,
                          recompute=tp_ > 1, dropout=rng,
                          reduce=opt.reduce if isinstance(opt, optim.ZeRO1) else None)
    first, lastv = vs[0] == 0, vs[-1] == len(ranges) - 1
    if pretrained is not None:
        first, lastv = pretrained.first, pretrained.last
    out: dict[str, Any] = {"losses": [], "times": [], "bubbles": [], "norms": [],
                           "check": None, "skipped": 0, "peak_saved": 0, "peak_run": 0,
                           "mesh": {"tp": tp_, "pp": pp_, "dp": dp_}}
    # the schedule's own bubble with uniform action times (backward = 2 x forward), no
    # transfer cost: (p-1)/(m+p-1) for GPipe and 1F1B, divided by the chunks when interleaved
    out["ideal_bubble"] = simulate(sched, 1.0, 2.0).bubble
    out["floor"] = loss_floor(cfg)
    bar = Progress(args.steps) if world.rank == 0 else None
    compiled = not args.no_compile
    fs.rank_print(world, f"mesh dp={dp_} pp={pp_} tp={tp_} ({world.size} ranks on "
                  f"{world.device.kind}), schedule {args.schedule} x{chunks}, "
                  f"{args.microbatches} micro-batches of {args.batch}, {cfg.layers} layers, "
                  f"hidden {cfg.hidden}, {cfg.dtype}{', ZeRO-1' if args.zero else ''}"
                  f"{', recompute' if args.recompute else ''}, "
                  f"{'compiled' if compiled else 'uncompiled'}")
    last: dict[str, Any] = {}

    def one_step(xs: list[fs.Tensor] | None, ys: list[fs.Tensor] | None, keep: bool
                 ) -> tuple[fs.Tensor, fs.Tensor | None, fs.Tensor, list[fs.Tensor]]:
        """Forward, backward, clip and AdamW of one step, every number left in tensors so
        that ``fs.compile`` can replay it: (mean loss, global norm, whether the step was
        applied (float16: the scaler's finiteness check), the gradients when ``keep``)."""
        res = last["res"] = ex.step(xs, ys)  # kept from the traced calls
        # a loaded model's tied table: its uses summed over chunks and stages
        grads = (pretrained.param_grads(res.grads) if pretrained is not None else
                 [g for gs in res.grads for g in gs])
        loss = res.loss
        finite = None
        if scaler is not None:  # unscale first: it places the scale on a stage with no loss
            grads, finite = scaler.unscale(grads, comm=world)
            loss = loss / scaler.factor
        if isinstance(opt, optim.ZeRO1):
            norm = opt.step(grads, reduced=True, max_norm=args.clip, mesh=mesh, apply=finite)
        else:
            clipped, norm = optim.clip_grad_norm(params, grads, args.clip, mesh=mesh)
            opt.step(clipped, apply=finite)
        if scaler is not None:
            scaler.update(finite)
        ok = fs.tensor(True, device=world.device) if finite is None else finite
        return loss, norm, ok, grads if keep else []

    step_fn = fs.compile(one_step) if compiled else one_step
    for step in range(args.steps):
        xs, ys = microbatches(args.seed, step, mesh.coord("dp"), args.microbatches,
                              args.batch, cfg)
        rng.set_step(step)
        t0 = time.perf_counter()
        replays = step_fn.replays if compiled else 0
        loss, norm, ok, grads = step_fn(
            [fs.tensor(x, device=world.device) for x in xs] if first else None,
            [fs.tensor(y, device=world.device) for y in ys] if lastv else None,
            step == 0 and args.check)
        dt = time.perf_counter() - t0
        loss_f = float(loss)
        if step == 0 and args.check:
            full = opt.gather(grads) if isinstance(opt, optim.ZeRO1) else grads
            out["check"] = check(mesh, stages, vs, full, loss_f, cfg, args)
        if not bool(ok):
            out["skipped"] += 1
        else:
            out["norms"].append(float(norm))
        res = last["res"]
        if not compiled or step_fn.replays == replays:  # a replay runs no executor code
            timeline = ex.timeline()
            out["bubbles"].append(timeline.bubble)
        out["losses"].append(loss_f)
        out["times"].append(dt)
        out["peak_saved"] = max(out["peak_saved"], res.peak_saved_bytes)
        out["peak_run"] = max(out["peak_run"], res.peak_run_bytes)
        if bar is not None:
            bar.update(step, loss_f, dt, out["bubbles"][-1])
    out["optimizer_bytes"] = opt.state_bytes()
    out["replays"] = step_fn.replays if compiled else 0
    if args.trace and world.rank == 0:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(timeline), f)
    if bar is not None:
        bar.done(out)
    return out


class Progress:
    """Rank 0's view of the run: on a terminal a live bar (rich's), with a kept line every
    tenth of the run so the loss curve stays on screen; into a file or a pipe (a log,
    ``| tee``, an sbatch job's output) the kept lines alone, plain, with no ``\\r`` redraws."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.keep = max(1, steps // 10)
        console = Console()
        self.bar: RichProgress | None = None
        if console.is_terminal:
            self.bar = RichProgress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                    TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                    console=console, transient=True)
            self.task = self.bar.add_task("train", total=steps, status="")
            self.bar.start()

    def update(self, step: int, loss: float, dt: float, bubble: float) -> None:
        n = step + 1
        line = (f"step {n}/{self.steps} loss {loss:.4f} {dt * 1e3:7.1f} ms/step "
                f"bubble {bubble:.2f}")
        kept = n % self.keep == 0 or n == self.steps or n == 1
        if self.bar is not None:
            self.bar.update(self.task, completed=n, status=f"loss {loss:.4f}")
            if kept:
                self.bar.console.print(line, highlight=False, soft_wrap=True)
        elif kept:
            print(line, flush=True)

    def done(self, out: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.stop()
        ls, ts, bs = out["losses"], out["times"], out["bubbles"]
        rest = ts[1:] or ts  # the first step also builds plans and finds shapes
        print(f"loss {ls[0]:.4f} -> {ls[-1]:.4f} in {len(ls)} steps; "
              f"{np.median(rest) * 1e3:.1f} ms/step (median after the first), "
              f"measured bubble {np.median(bs[1:] or bs):.2f} (schedule's own "
              f"{out['ideal_bubble']:.2f}); the task's loss floor is {out['floor']:.3f}",
              flush=True)
        skipped = f", {out['skipped']} steps skipped (inf/nan)" if out["skipped"] else ""
        print(f"rank 0 peak bytes: saved activations {out['peak_saved']}, graph working "
              f"set {out['peak_run']}, optimiser state {out['optimizer_bytes']}{skipped}",
              flush=True)
        if out["check"] is not None:
            print(out["check"]["line"], flush=True)


# ---- --check: the first step against one process ----------------------------------------
def reference(cfg: Config, args: argparse.Namespace, ranges: list[tuple[int, int]], dp: int,
              solo: Communicator) -> tuple[float, list[dict[str, np.ndarray]]]:
    """Loss and full gradients of the first step in one process: the virtual stages
    ``ranges`` of the model on ``solo`` (a size-1 Communicator), chained, over every
    replica's micro-batches (each with its dropout masks), the mean of their losses; the
    gradients by virtual stage and parameter name."""
    w = full_weights(cfg, args.seed)
    rng = nn.DropoutRNG()
    n = len(ranges)
    stages = [Stage(cfg, w, lo, hi, first=v == 0, last=v == n - 1, comm=solo, rng=rng)
              for v, (lo, hi) in enumerate(ranges)]
    losses = []
    for r in range(dp):
        rng.seed = dropout_seed(args.seed, r)
        xs, ys = microbatches(args.seed, 0, r, args.microbatches, args.batch, cfg)
        for i, (x, y) in enumerate(zip(xs, ys)):
            rng.set_step(0, i)
            h = fs.tensor(x, device=solo.device)
            for st in stages:
                h = st(h)
            losses.append(stages[-1].loss(h, fs.tensor(y, device=solo.device)))
    loss = losses[0]
    for t in losses[1:]:
        loss = loss + t
    loss = loss * (1.0 / len(losses))
    named = [dict(st.named_parameters()) for st in stages]
    grads = iter(fs.grad(loss, [p for ps in named for p in ps.values()]))
    by_stage = [{name: next(grads) for name in ps} for ps in named]
    fs.realize(loss, *(g for gs in by_stage for g in gs.values()))
    return float(loss.numpy()), [{k: g.numpy() for k, g in gs.items()} for gs in by_stage]


def check(mesh: fs.Mesh, stages: list[Stage], vs: list[int], grads: list[fs.Tensor],
          loss: float, cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Compare this rank's first-step loss and gradient shards (``grads``, in the order of
    its stages' parameters) with :func:`reference`: each parameter's shard of the full
    gradient is ``p.spec.shard(full)``. Agreed over all ranks (one all_reduce), so every
    rank reports the same verdict. Collective over the mesh."""
    world = mesh.comm_group
    solo = world.split(world.rank)  # collective: a size-1 Communicator per rank
    ranges = stage_layers(cfg, len(stages) * mesh.shape["pp"])
    ref_loss, ref = reference(cfg, args, ranges, mesh.shape["dp"], solo)
    # 16 bits: sums in another order (TP partial sums all-reduced in the storage dtype)
    # differ by tens of roundoffs of their largest term (bfloat16 keeps 8 bits); a wrong
    # shard or a missing reduction is still an error of order 1
    tol = {"float64": 1e-9, "float32": 2e-4, "float16": 5e-2, "bfloat16": 0.2}[cfg.dtype]
    worst = abs(loss - ref_loss) / max(1.0, abs(ref_loss))
    mine = iter(grads)
    for v, st in zip(vs, stages):
        for name, p in st.named_parameters():
            part = p.spec.shard(ref[v][name])
            g = next(mine).numpy().astype(np.float64)
            err = np.abs(g - part).max() / max(1e-3, np.abs(part).max())
            worst = max(worst, float(err))
    agreed = world.all_reduce(fs.tensor(np.array([worst]), device=world.device), "max")
    worst = float(agreed.numpy()[0])
    ok = worst <= tol
    line = (f"check {'OK' if ok else 'FAILED'}: first-step loss {loss:.6f} vs one process "
            f"{ref_loss:.6f}; largest relative error over loss and gradients {worst:.2e} "
            f"(tolerance {tol:.0e})")
    return {"ok": ok, "worst": worst, "line": line, "ref_loss": ref_loss}


# ---- command line -----------------------------------------------------------------------
def config(args: argparse.Namespace) -> Config:
    return Config(vocab=args.vocab, hidden=args.hidden, heads=args.heads, ffn=args.ffn,
                  layers=args.layers, seq=args.seq, dtype=args.dtype, dropout=args.dropout)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2 "
                   "when the rank count is even)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default 2 when "
                   "the rest is even)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: "
                   "the ranks left over)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    p.add_argument("--chunks", type=int, default=None, help="model chunks per rank "
                   "(interleaved: default 2)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of AdamW: "
                   "linear warm-up, then cosine down to a tenth of it")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: a "
                   "tenth of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradient's global norm "
                   "(over tp, pp and dp) to this")
    p.add_argument("--zero", action="store_true", help="ZeRO-1: shard the optimiser state "
                   "over dp (gradients reduce-scattered, parameters all-gathered)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout after attention "
                   "and MLP (masks a function of seed, step, micro-batch, layer, replica)")
    p.add_argument("--recompute", action="store_true", help="recompute each block's "
                   "forward in the backward instead of keeping its activations")
    p.add_argument("--devices", default=None, help="run as a DeviceGroup in this process: "
                   "'cpu:4' (a count: cpu:0 .. cpu:3) or a list 'cpu:0,cpu:1'")
    p.add_argument("--check", action="store_true", help="compare the first step's loss and "
                   "gradients with one process; exit 1 when they disagree")
    p.add_argument("--trace", default=None, help="write the last step's measured timeline "
                   "as a Chrome trace (JSON) to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="build every step's graph "
                   "anew instead of replaying the step compiled by fs.compile (the same "
                   "losses, bit for bit)")
    p.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                   help="fine-tune this Hugging Face GPT-2 or Llama directory on the task "
                        "(its vocabulary and layer count replace --vocab and --layers)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    for name, default in (("vocab", 16), ("hidden", 32), ("heads", 4), ("ffn", 64),
                          ("layers", 4), ("seq", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   default="float32", help="parameters and activations; 16-bit ones train "
                   "with float32 master weights (float16 with dynamic loss scaling)")
    args = p.parse_args(argv)
    for name in ("steps", "microbatches", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup is None:
        args.warmup = args.steps // 10
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    if args.from_dir:
        if args.check or args.zero or args.dropout:
            p.error("--from fine-tunes the loaded model as it is: --check, --zero and "
                    "--dropout apply to the built-in model only")
        cfg = json.loads((Path(args.from_dir) / "config.json").read_text())
        args.vocab = int(cfg["vocab_size"])
        args.layers = int(cfg.get("n_layer", cfg.get("num_hidden_layers", 0)))
        most = cfg.get("n_positions", cfg.get("max_position_embeddings"))
        if most is not None and args.seq > most:
            p.error(f"--seq {args.seq} is longer than the model's {most} positions")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the training; exit status 1 when ``--check`` finds a disagreement."""
    args = parse(argv)
    if args.devices is not None:
        group = fs.DeviceGroup.parse(args.devices, timeout=args.timeout)
        print(f"{group} from --devices {args.devices}", file=sys.stderr)
        with threadpool_limits(limits=1, user_api="blas"):
            out = group.run(train, [args] * group.size)[0]
    else:
        world = fs.init(timeout=args.timeout)
        # one BLAS thread per rank when the ranks fill the cores: oversubscribed BLAS
        # threads spin against each other and make the step many times slower
        with threadpool_limits(limits=1 if world.local_size > 1 else None, user_api="blas"):
            out = train(world, args)
    return 0 if out["check"] is None or out["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
