"""Train a small transformer language model with tensor, pipeline and data parallelism.

The same program runs with ranks as processes or as devices of one process::

    python examples/train.py                          # one rank
    mpiexec -n 4 python examples/train.py             # tp 2 x pp 2
    mpiexec -n 8 python examples/train.py --dp 2      # dp 2 x pp 2 x tp 2
    python examples/train.py --devices cpu:4          # four devices of one process
    mpiexec -n 4 python examples/train.py --check     # first step == one process?

The model: a vocabulary-parallel embedding plus a learned position embedding, ``--layers``
pre-norm blocks ``x + attn(ln(x))``, ``x + mlp(ln(x))`` (ParallelAttention and ParallelMLP,
heads and hidden features split over ``tp``), a final layer norm and a column-parallel LM
head whose vocabulary-split logits go straight into ``vocab_parallel_cross_entropy`` (the
full logits are never gathered). The blocks are cut into ``pp * chunks`` virtual stages
run by a :class:`~fuelspmd.pipeline_parallel.PipelineExecutor`; the first holds the
embeddings, the last the head and loss. Every rank builds its layers from the same full
weights (:func:`full_weights`, a function of ``--seed``), so the numbers do not depend on
the mesh, which is what ``--check`` verifies.

The task, generated in code: arithmetic sequences ``x_t = (s + k t) mod V`` with a random
start ``s`` and stride ``k`` in ``1..K`` per sequence. The model sees ``x_0 .. x_{T-1}`` and
predicts ``x_1 .. x_T``: the first target depends on the unknown stride (one of ``K``,
``log K`` nats at best), and every later one is determined by the two tokens before it.
So the mean next-token loss falls from about ``log V`` towards the floor ``log(K) / T``
(:func:`loss_floor`: ``log 3 / 8``, 0.137, with the defaults), which the summary line
prints beside the last loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from threadpoolctl import threadpool_limits

import fuelspmd as fs
from fuelspmd import tensor_parallel as tp
from fuelspmd.comm import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.functional import layer_norm
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule, simulate
from fuelspmd.pipeline_parallel.render import chrome_trace
from fuelspmd.transport import SelfTransport

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


# ---- one virtual stage ------------------------------------------------------------------
class Stage:
    """Layers ``lo .. hi - 1`` of the model on one TP rank, plus the embeddings when
    ``first`` and the final norm and head when ``last``.

    ``split[k]`` says how parameter ``k`` is sharded over tp (None: replicated; else the
    axis of the full array it is a block of), so a check can slice the full gradients.
    The executor hands the current parameters to :meth:`__call__`, which installs them in
    the layers before the forward (an optimiser step replaces them each step).
    """

    def __init__(self, cfg: Config, w: dict[str, Any], lo: int, hi: int, *, first: bool,
                 last: bool, comm: Communicator) -> None:
        kw: dict[str, Any] = {"comm": comm, "dtype": cfg.dtype}
        self.cfg, self.first, self.last, self.comm = cfg, first, last, comm
        self.modules: list[Any] = []
        self.split: list[int | None] = []
        if first:
            self.emb = tp.VocabParallelEmbedding(cfg.vocab, cfg.hidden, full=w["emb"], **kw)
            self._add(self.emb, [0])
            self.pos = self._plain(w["pos"])
        self.blocks = []
        for b in w["blocks"][lo:hi]:
            blk = (self._plain(*b["ln1"]), tp.ParallelAttention(cfg.hidden, cfg.heads,
                                                                full=b["attn"], **kw),
                   self._plain(*b["ln2"]), tp.ParallelMLP(cfg.hidden, cfg.ffn,
                                                          full=b["mlp"], **kw))
            self._add(blk[1], [1, 0] * 3 + [0, None])
            self._add(blk[3], [1, 0, 0, None])
            self.blocks.append(blk)
        if last:
            self.lnf = self._plain(*w["lnf"])
            self.head = tp.ColumnParallelLinear(cfg.hidden, cfg.vocab, full=tuple(w["head"]),
                                                **kw)
            self._add(self.head, [1, 0])

    def _plain(self, *arrays: np.ndarray) -> _Plain:
        p = _Plain([fs.tensor(a.astype(self.cfg.dtype), device=self.comm.device)
                    for a in arrays])
        self._add(p, [None] * len(arrays))
        return p

    def _add(self, module: Any, split: list[int | None]) -> None:
        self.modules.append(module)
        self.split += split

    def parameters(self) -> list[fs.Tensor]:
        """Return this stage's local parameter shards, in a fixed order."""
        return [p for m in self.modules for p in m.parameters()]

    def set_parameters(self, params: list[fs.Tensor]) -> None:
        """Install ``params`` (in :meth:`parameters` order) in the layers."""
        i = 0
        for m in self.modules:
            n = len(m.parameters())
            m.set_parameters(params[i:i + n])
            i += n

    def __call__(self, params: Any, x: fs.Tensor) -> fs.Tensor:
        self.set_parameters(list(params))
        if self.first:
            x = self.emb(x) + self.pos.params[0]
        for ln1, attn, ln2, mlp in self.blocks:
            x = x + attn(layer_norm(x, *ln1.params))
            x = x + mlp(layer_norm(x, *ln2.params))
        if self.last:
            x = self.head(layer_norm(x, *self.lnf.params))
        return x

    def loss(self, logits: fs.Tensor, targets: fs.Tensor) -> fs.Tensor:
        """Mean next-token cross-entropy of this rank's vocabulary block of the logits."""
        b, t, k = logits.shape
        return tp.vocab_parallel_cross_entropy(logits.reshape(b * t, k), targets,
                                               comm=self.comm)


class _Plain:
    """Replicated parameters (layer norm, position embedding) with the layers' interface."""

    def __init__(self, params: list[fs.Tensor]) -> None:
        self.params = params

    def parameters(self) -> list[fs.Tensor]:
        return list(self.params)

    def set_parameters(self, params: list[fs.Tensor]) -> None:
        self.params = list(params)


def stage_layers(cfg: Config, stages: int) -> list[tuple[int, int]]:
    """Contiguous, equal layer ranges of the ``stages`` virtual stages."""
    if cfg.layers % stages:
        ok = [n for n in range(1, cfg.layers + 1) if cfg.layers % n == 0]
        raise ConfigError(f"train: {cfg.layers} layers cannot be cut into pp x chunks = "
                          f"{stages} equal virtual stages; use --layers a multiple of "
                          f"{stages}, or pp x chunks in {ok}")
    n = cfg.layers // stages
    return [(v * n, (v + 1) * n) for v in range(stages)]


# ---- Adam -------------------------------------------------------------------------------
class Adam:
    """Adam on lazy tensors: the update of every parameter is one realised graph."""

    def __init__(self, lr: float, *, b1: float = 0.9, b2: float = 0.99,
                 eps: float = 1e-8) -> None:
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.t = 0
        self.m: list[fs.Tensor] | None = None
        self.v: list[fs.Tensor] | None = None

    def step(self, params: list[fs.Tensor], grads: list[fs.Tensor]) -> list[fs.Tensor]:
        """Return the updated parameters (realised), keeping the moments."""
        self.t += 1
        if self.m is None or self.v is None:
            self.m = [g * 0.0 for g in grads]
            self.v = [g * 0.0 for g in grads]
        b1, b2 = self.b1, self.b2
        self.m = [m * b1 + g * (1 - b1) for m, g in zip(self.m, grads)]
        self.v = [v * b2 + g * g * (1 - b2) for v, g in zip(self.v, grads)]
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        new = [p - (m * (self.lr / c1)) / ((v * (1 / c2)).sqrt() + self.eps)
               for p, m, v in zip(params, self.m, self.v)]
        fs.realize(*new, *self.m, *self.v)
        return new


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
    """One rank's program; returns its losses, step times, bubbles and check result."""
    world = comm.comm if hasattr(comm, "comm") else comm
    cfg = config(args)
    tp_, pp_, dp_ = plan(world.size, args)
    mesh = fs.Mesh(comm, tp=tp_, pp=pp_, dp=dp_)
    tpc, ppc = mesh.comm("tp"), mesh.comm("pp")
    chunks = args.chunks or (2 if args.schedule == "interleaved" else 1)
    sched = schedule(args.schedule, pp_, args.microbatches, chunks)
    ranges = stage_layers(cfg, pp_ * chunks)
    w = full_weights(cfg, args.seed)
    vs = [j * pp_ + mesh.coord("pp") for j in range(chunks)]
    stages = [Stage(cfg, w, *ranges[v], first=v == 0, last=v == len(ranges) - 1, comm=tpc)
              for v in vs]
    ex = PipelineExecutor(sched, comm=ppc, stages=stages,
                          params=[s.parameters() for s in stages], loss=stages[-1].loss,
                          dp=mesh.comm("dp"), recompute=tp_ > 1)
    opt = [Adam(args.lr) for _ in stages]
    first, lastv = vs[0] == 0, vs[-1] == len(ranges) - 1
    out: dict[str, Any] = {"losses": [], "times": [], "bubbles": [], "check": None,
                           "mesh": {"tp": tp_, "pp": pp_, "dp": dp_}}
    # the schedule's own bubble with uniform action times (backward = 2 x forward), no
    # transfer cost: (p-1)/(m+p-1) for GPipe and 1F1B, divided by the chunks when interleaved
    out["ideal_bubble"] = simulate(sched, 1.0, 2.0).bubble
    out["floor"] = loss_floor(cfg)
    bar = Progress(args.steps) if world.rank == 0 else None
    fs.rank_print(world, f"mesh dp={dp_} pp={pp_} tp={tp_} ({world.size} ranks on "
                  f"{world.device.kind}), schedule {args.schedule} x{chunks}, "
                  f"{args.microbatches} micro-batches of {args.batch}, {cfg.layers} layers, "
                  f"hidden {cfg.hidden}")
    for step in range(args.steps):
        xs, ys = microbatches(args.seed, step, mesh.coord("dp"), args.microbatches,
                              args.batch, cfg)
        t0 = time.perf_counter()
        res = ex.step(xs if first else None, ys if lastv else None)
        if step == 0 and args.check:
            out["check"] = check(world, mesh, stages, vs, res.grads, res.loss, cfg, args)
        for j, o in enumerate(opt):
            ex.params[j] = o.step(ex.params[j], res.grads[j])
        dt = time.perf_counter() - t0
        timeline = ex.timeline()
        out["losses"].append(res.loss)
        out["times"].append(dt)
        out["bubbles"].append(timeline.bubble)
        if bar is not None:
            bar.update(step, res.loss, dt, timeline.bubble)
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
        if out["check"] is not None:
            print(out["check"]["line"], flush=True)


# ---- --check: the first step against one process ----------------------------------------
def reference(cfg: Config, args: argparse.Namespace, dp: int, device: Any
              ) -> tuple[float, list[list[np.ndarray]]]:
    """Loss and full gradients of the first step in one process: the whole model as one
    stage on a size-1 Communicator, every replica's micro-batches, mean of their losses."""
    comm = Communicator(SelfTransport(), device=device)
    whole = Stage(cfg, full_weights(cfg, args.seed), 0, cfg.layers, first=True, last=True,
                  comm=comm)
    losses = []
    for r in range(dp):
        xs, ys = microbatches(args.seed, 0, r, args.microbatches, args.batch, cfg)
        params = whole.parameters()
        for x, y in zip(xs, ys):
            logits = whole(params, fs.tensor(x, device=device))
            losses.append(whole.loss(logits, fs.tensor(y, device=device)))
    loss = losses[0]
    for t in losses[1:]:
        loss = loss + t
    loss = loss * (1.0 / len(losses))
    grads = fs.grad(loss, whole.parameters())
    fs.realize(loss, *grads)
    # regroup the flat gradients by layer ranges, as the stages hold them
    return float(loss.numpy()), _by_stage(cfg, [g.numpy() for g in grads])


def _by_stage(cfg: Config, flat: list[np.ndarray]) -> list[list[np.ndarray]]:
    """[embeddings (2), per block (16), final (4)] of the whole model."""
    per = 16
    return [flat[:2]] + [flat[2 + i * per: 2 + (i + 1) * per] for i in range(cfg.layers)] + \
        [flat[2 + cfg.layers * per:]]


def check(world: Any, mesh: Any, stages: list[Stage], vs: list[int],
          grads: list[list[fs.Tensor]], loss: float, cfg: Config,
          args: argparse.Namespace) -> dict[str, Any]:
    """Compare this rank's first-step loss and gradient shards with :func:`reference`;
    agree over all ranks (one all_reduce) so every rank reports the same verdict."""
    ref_loss, ref = reference(cfg, args, mesh.shape["dp"], world.device)
    ranges = stage_layers(cfg, len(stages) * mesh.shape["pp"])
    r, n = mesh.coord("tp"), mesh.shape["tp"]
    tol = 1e-9 if cfg.dtype == "float64" else 2e-4
    worst = abs(loss - ref_loss) / max(1.0, abs(ref_loss))
    for v, s, gs in zip(vs, stages, grads):
        lo, hi = ranges[v]
        want = ([*ref[0]] if s.first else []) + [g for b in ref[1 + lo:1 + hi] for g in b] + \
            ([*ref[-1]] if s.last else [])
        if len(want) != len(gs):
            raise RuntimeError(f"check: stage {v} has {len(gs)} gradients, reference "
                               f"{len(want)}")
        for g, full, axis in zip(gs, want, s.split):
            part = full if axis is None else np.split(full, n, axis=axis)[r]
            err = np.abs(g.numpy() - part).max() / max(1e-3, np.abs(part).max())
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
                  layers=args.layers, seq=args.seq, dtype=args.dtype)


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
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--devices", default=None, help="run as a DeviceGroup in this process: "
                   "'cpu:4' (a count: cpu:0 .. cpu:3) or a list 'cpu:0,cpu:1'")
    p.add_argument("--check", action="store_true", help="compare the first step's loss and "
                   "gradients with one process; exit 1 when they disagree")
    p.add_argument("--trace", default=None, help="write the last step's measured timeline "
                   "as a Chrome trace (JSON) to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    for name, default in (("vocab", 16), ("hidden", 32), ("heads", 4), ("ffn", 64),
                          ("layers", 4), ("seq", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = p.parse_args(argv)
    for name in ("steps", "microbatches", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
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
