"""Step time and memory of a GPT-style transformer under tp x pp x dp, and ranked plans.

Pure policy (layer 5): a plan is a function of the model's shape, the topology and the
stated assumptions, so it can be checked in one process against published runs.

What one training step costs, for ``t`` = tp, ``p`` = pp, ``d`` = dp, micro-batch ``b``,
``v`` model chunks per pipeline rank, ``m = B / (d b)`` micro-batches per pipeline, ``T = b s``
tokens per micro-batch (Narayanan et al., arXiv 2104.04473, whose notation this follows):

- **GEMMs** of one layer's forward on one GPU: QKV ``[T,h]x[h,3h/t]``, scores and
  attention-over-values ``b a/t`` batched ``[s,h/a]x[h/a,s]`` and ``[s,s]x[s,h/a]``, output
  projection ``[T,h/t]x[h/t,h]``, MLP ``[T,h]x[h,4h/t]`` and ``[T,4h/t]x[4h/t,h]``: 24Th^2/t +
  4Tsh/t FLOPs. Each GEMM takes the roofline time ``max(flops / (peak * matmul_efficiency),
  bytes / (HBM bandwidth * memory_efficiency))``. The backward pass runs each GEMM twice
  (input and weight gradients); activation recomputation runs the forward once more.
- **Memory-bound kernels** of one layer's forward (fused as in Megatron: layer norms, scale-
  mask-softmax, dropouts, bias-GeLU, bias-dropout-add), bytes read and written per GPU:
  ``22 T h + 16 T h / t + 9 b a s^2 / t`` (2-byte activations, 1-byte dropout masks); the
  backward moves about twice that.
- **Tensor parallelism**: two all-reduces of ``2 T h`` bytes per layer forward, two in the
  backward, two more when recomputing, over the tp group, priced by the cost model and not
  overlapped with compute (as in Megatron).
- **Pipeline**: per micro-batch and model chunk, one activation forward and one gradient
  backward between consecutive stages, each ``2 T h`` bytes (``2 T h / t`` per NIC and an
  intra-node all-gather with the scatter/gather optimisation), on the critical path. The
  step is ``m * t_slowest + (p - 1) / v * t_mean``: the steady state runs at the slowest
  stage, the fill and drain (the bubble, ``(p-1)/(v m)`` of the ideal) at the mean.
- **Data parallelism**: after the flush, an all-reduce of each GPU's gradients over dp (and
  of the tied embedding between the first and last stage), then the optimizer, a memory-
  bound pass over about 34 bytes per parameter (fp32 master, moments, gradient; fp16 copy).

Memory per GPU: parameters times ``state_bytes_per_param`` (18: fp16 weight 2, fp32
gradient accumulation 4, fp32 master 4, Adam moments 8), plus activations: with
recomputation one ``2 T h`` layer input per layer of each in-flight micro-batch, plus one
layer's full activations ``T h (10 + 24/t) + 5 b a s^2 / t`` (Korthikanti et al., 2022)
while it is recomputed. The first stage holds the most micro-batches: ``p`` for 1F1B,
``2(p-1) + (v-1) p + 1`` chunk-forwards for Megatron's interleaved schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fuelspmd.cost.collectives import CostModel
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Accelerator, Topology

__all__ = ["Assumptions", "Config", "Prediction", "Transformer", "candidates", "memory_per_gpu",
           "plan", "predict"]


@dataclass(frozen=True, kw_only=True)
class Transformer:
    """A GPT-style decoder: ``layers`` blocks of attention + 4h MLP, tied embeddings."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "global_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Transformer({name}={getattr(self, name)}): must be >= 1")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}; make "
                              "hidden a multiple of heads")

    @property
    def params(self) -> float:
        """P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))  (Megatron-LM, eq. 2)."""
        l, h = self.layers, self.hidden
        return 12 * l * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * l * h))

    def flops_per_step(self, *, recompute: bool = True) -> float:
        """GEMM FLOPs of one step: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with
        recomputation (eq. 3), 72 B s l h^2 (1 + s/(6h)) + 6 B s h V without."""
        b, s, l, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        passes = 4 if recompute else 3
        return passes * 24 * b * s * l * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """What the prediction takes as given; every number has a reason.

    ``matmul_efficiency``: share of peak FLOP/s a large fp16 GEMM reaches (cuBLAS on A100 and
    H100 runs large GEMMs at 75-85% of the datasheet peak). ``memory_efficiency``: share of
    HBM bandwidth a streaming kernel reaches. ``memory_reserve``: share of device memory kept
    for the CUDA context, workspaces and allocator fragmentation.
    """

    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    recompute: bool = True
    state_bytes_per_param: float = 18.0
    grad_bytes: float = 2.0
    scatter_gather: bool = True
    memory_reserve: float = 0.1
    microbatches: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be in (0, 1]")
        if not 0 <= self.memory_reserve < 1:
            raise ConfigError(f"memory_reserve={self.memory_reserve} must be in [0, 1)")


@dataclass(frozen=True, order=True)
class Config:
    """One parallel layout: tensor, pipeline and data parallel sizes, micro-batch, chunks."""

    tp: int
    pp: int
    dp: int
    microbatch: int = 1
    chunks: int = 1

    def __str__(self) -> str:
        return f"tp {self.tp} pp {self.pp} dp {self.dp} mb {self.microbatch} v {self.chunks}"


@dataclass(frozen=True)
class Prediction:
    """A predicted step: seconds, FLOP/s per GPU, peak memory, the time by part, and why."""

    config: Config
    step_time: float
    flops_per_gpu: float
    memory: float
    fits: bool
    parts: dict[str, float] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    chunk_times: dict[str, float] = field(default_factory=dict)
    """One micro-batch on one model chunk, for a schedule simulation: ``forward`` and
    ``backward`` (recomputation included) seconds of a chunk, ``logits_forward`` and
    ``logits_backward`` added on the last virtual stage, ``hop`` the stage-to-stage send."""


class _Gpu:
    """Roofline times on one accelerator."""

    def __init__(self, acc: Accelerator, a: Assumptions) -> None:
        self.flops = acc.peak_flops * a.matmul_efficiency
        self.bw = acc.memory_bandwidth * a.memory_efficiency

    def gemm(self, m: float, k: float, n: float, batch: float = 1) -> float:
        """max(compute, memory) of ``batch`` GEMMs [m,k]x[k,n] in 2-byte elements."""
        return batch * max(2 * m * k * n / self.flops, 2 * (m * k + k * n + m * n) / self.bw)

    def stream(self, nbytes: float) -> float:
        return nbytes / self.bw


def _accelerator(topology: Topology) -> Accelerator:
    acc = topology.nodes[0].accelerator
    if acc is None or not acc.peak_flops > 0 or not acc.memory_bandwidth > 0:
        raise ConfigError("planning needs the accelerator's peak FLOP/s, memory and memory "
                          "bandwidth: declare an 'accelerator' in the topology file")
    return acc


def _params_per_gpu(model: Transformer, c: Config) -> float:
    """Parameters on the GPU holding the most: a stage's layers, plus the tied embedding
    (first and last stage hold a copy each) and, on one stage, the position embedding."""
    h = model.hidden
    per_layer = (12 * h * h + 13 * h) / c.tp
    extra = model.vocab * h / c.tp + (model.seq * h if c.pp == 1 else 0)
    return model.layers // c.pp * per_layer + extra


def memory_per_gpu(model: Transformer, config: Config, *,
                   assumptions: Assumptions | None = None) -> float:
    """Peak bytes on the fullest GPU: the first stage (most micro-batches in flight) or the
    last (the logits); see the module docstring for the terms."""
    a = assumptions or Assumptions()
    t, p, d, b, v = config.tp, config.pp, config.dp, config.microbatch, config.chunks
    h, s, heads = model.hidden, model.seq, model.heads
    m = model.global_batch // (d * b)
    tok, per_rank = b * s, model.layers // p
    act = 2 * tok * h
    inflight = p if v == 1 else 2 * (p - 1) + (v - 1) * p + 1
    inflight = min(inflight, m * v)
    full_layer = tok * h * (10 + 24 / t) + 5 * b * heads * s * s / t
    stored = (act if a.recompute else full_layer) * inflight * per_rank / v
    state = _params_per_gpu(model, config) * a.state_bytes_per_param
    first = state + stored + (full_layer if a.recompute else 0)
    last = state + (act if a.recompute else full_layer) * per_rank + full_layer \
        + 8 * tok * model.vocab / t  # one micro-batch in flight, plus fp32 logits and grad
    return max(first, last)


def predict(model: Transformer, config: Config, topology: Topology, *,
            assumptions: Assumptions | None = None, cost: CostModel | None = None) -> Prediction:
    """Predict one step of ``model`` laid out as ``config`` on ``topology`` (``cost``: a
    CostModel of the same topology to reuse, so repeated collectives are priced once)."""
    a = assumptions or Assumptions()
    t, p, d, b, v = config.tp, config.pp, config.dp, config.microbatch, config.chunks
    n = t * p * d
    if n > topology.size:
        raise ConfigError(f"{config} needs {n} GPUs; the topology has {topology.size}")
    if model.layers % (p * v) or model.heads % t or model.global_batch % (d * b):
        raise ConfigError(f"{config} does not divide {model}: layers % (pp*v), heads % tp and "
                          "global_batch % (dp*microbatch) must be 0")
    acc = _accelerator(topology)
    gpu = _Gpu(acc, a)
    cost = cost if cost is not None else CostModel(topology)
    h, s, heads, l, voc = model.hidden, model.seq, model.heads, model.layers, model.vocab
    m = model.global_batch // (d * b)
    tok = b * s
    r = 1 if a.recompute else 0
    per_node = topology.nodes[0].devices

    # Rank order as Megatron: tp fastest, then dp, then pp.
    tp_group = list(range(t))
    dp_group = [i * t for i in range(d)]
    fwd_gemm = (gpu.gemm(tok, h, 3 * h / t) + gpu.gemm(s, h / heads, s, b * heads / t)
                + gpu.gemm(s, s, h / heads, b * heads / t) + gpu.gemm(tok, h / t, h)
                + gpu.gemm(tok, h, 4 * h / t) + gpu.gemm(tok, 4 * h / t, h))
    fwd_mem = gpu.stream(22 * tok * h + 16 * tok * h / t + 9 * b * heads * s * s / t)
    act = 2 * tok * h
    ar = cost.predict("all_reduce", act, tp_group, concurrent=max(1, per_node // t)) \
        if t > 1 else 0.0
    layer = (fwd_gemm + fwd_mem) * (3 + r) + ar * (4 + 2 * r)
    p2p = 0.0
    if p > 1:
        nxt = t * d  # first device of the next stage
        if a.scatter_gather and t > 1:
            p2p = cost.predict("send_recv", act / t, [0, nxt], concurrent=per_node) + \
                cost.predict("all_gather", act, tp_group, concurrent=max(1, per_node // t))
        else:
            p2p = cost.predict("send_recv", act, [0, nxt], concurrent=per_node)
    per_rank = l // p
    body = per_rank * layer + 2 * v * p2p
    logits = 3 * gpu.gemm(tok, h, voc / t)
    stage_times = [body + (logits if i == p - 1 else 0.0) for i in range(p)]
    t_max, t_mean = max(stage_times), sum(stage_times) / p
    pipe = m * t_max + (p - 1) / v * t_mean
    bubble = (p - 1) / v * t_mean

    params_rank = _params_per_gpu(model, config)
    per_dp_node = max(len(x) for x in topology.by_node(dp_group).values())
    dp_time = cost.predict("all_reduce", params_rank * a.grad_bytes, dp_group,
                           concurrent=max(1, per_node // per_dp_node)) if d > 1 else 0.0
    emb = cost.predict("all_reduce", voc * h / t * a.grad_bytes, [0, (p - 1) * t * d],
                       concurrent=per_node) if p > 1 else 0.0
    optim = gpu.stream(34 * params_rank)
    step = pipe + dp_time + emb + optim

    memory = memory_per_gpu(model, config, assumptions=a)
    fits = memory <= acc.memory * (1 - a.memory_reserve)

    flops = model.flops_per_step(recompute=a.recompute) / (step * n)
    comp = m * per_rank * (fwd_gemm + fwd_mem) * (3 + r)
    parts = {"compute": comp, "tp_comm": m * per_rank * ar * (4 + 2 * r),
             "pp_comm": m * 2 * v * p2p, "bubble": bubble, "imbalance": m * (t_max - body),
             "dp_comm": dp_time + emb, "optimizer": optim}
    reasons = _reasons(config, topology, cost, parts, step, memory, acc, a, m, ar, tp_group)
    per_chunk = per_rank / v
    chunk_times = {"forward": per_chunk * ((fwd_gemm + fwd_mem) + 2 * ar),
                   "backward": per_chunk * ((fwd_gemm + fwd_mem) * (2 + r) + ar * (2 + 2 * r)),
                   "logits_forward": logits / 3, "logits_backward": 2 * logits / 3, "hop": p2p}
    return Prediction(config, step, flops, memory, fits, parts, reasons, chunk_times)


def _reasons(c: Config, topo: Topology, cost: CostModel, parts: dict[str, float], step: float,
             memory: float, acc: Accelerator, a: Assumptions, m: int, ar: float,
             tp_group: list[int]) -> tuple[str, ...]:
    """The decisive facts of a prediction, in words."""
    nodes_tp = len(topo.by_node(tp_group))
    where = "inside one node" if nodes_tp == 1 else f"across {nodes_tp} nodes"
    share = {k: v / step for k, v in parts.items()}
    out = [f"tp {c.tp}: tensor-parallel all-reduces run {where}, {ar * 1e3:.2f} ms each, "
           f"{share['tp_comm']:.1%} of the step" if c.tp > 1 else
           "tp 1: no tensor parallelism, so no all-reduce inside a layer",
           f"pp {c.pp} x {c.chunks} chunk(s), {m} micro-batches of {c.microbatch}: bubble "
           f"{share['bubble']:.1%} of the step ((p-1)/(v m) = "
           f"{(c.pp - 1) / (c.chunks * m):.1%} of the work), stage-to-stage traffic "
           f"{share['pp_comm']:.1%}" if c.pp > 1 else
           f"pp 1: no pipeline and no bubble; {m} micro-batches of {c.microbatch} accumulate",
           f"dp {c.dp}: gradient all-reduce after the flush {share['dp_comm']:.1%}"
           if c.dp > 1 else "dp 1: no gradient all-reduce",
           f"memory {memory / 2**30:.1f} GiB of {acc.memory / 2**30:.0f} GiB "
           f"({'fits' if memory <= acc.memory * (1 - a.memory_reserve) else 'does NOT fit'}"
           f" with {a.memory_reserve:.0%} reserved)"]
    return tuple(out)


def _divisors(x: int) -> list[int]:
    return [i for i in range(1, x + 1) if x % i == 0]


def candidates(model: Transformer, gpus: int, *,
               microbatches: Sequence[int] = (1, 2, 4, 8)) -> list[Config]:
    """Every (tp, pp, dp, micro-batch, chunks) the shapes allow on ``gpus`` GPUs.

    tp divides the heads, pp x chunks divides the layers, dp x micro-batch divides the
    global batch, and the interleaved schedule (chunks > 1) needs the micro-batch count to
    be a multiple of pp, as Megatron's does.
    """
    out = []
    for t in _divisors(model.heads):
        for p in _divisors(model.layers):
            if gpus % (t * p):
                continue
            d = gpus // (t * p)
            for b in microbatches:
                if model.global_batch % (d * b):
                    continue
                m = model.global_batch // (d * b)
                for v in _divisors(model.layers // p):
                    if v == 1 or (p > 1 and m % p == 0):
                        out.append(Config(t, p, d, b, v))
    return out


def plan(model: Transformer, gpus: int, topology: Topology, *,
         assumptions: Assumptions | None = None) -> list[Prediction]:
    """Predictions for every layout that fits in memory, fastest first; for each
    (tp, pp, dp) only its best micro-batch and chunk count."""
    a = assumptions or Assumptions()
    if gpus < 1 or gpus > topology.size:
        raise ConfigError(f"gpus={gpus}: the topology has {topology.size} devices; load it "
                          f"with nodes={-(-gpus // topology.nodes[0].devices)}")
    best: dict[tuple[int, int, int], Prediction] = {}
    cost = CostModel(topology)
    limit = _accelerator(topology).memory * (1 - a.memory_reserve)
    for c in candidates(model, gpus, microbatches=a.microbatches):
        if memory_per_gpu(model, c, assumptions=a) > limit:
            continue  # priced only when it fits: the big data-parallel groups are slow to walk
        pred = predict(model, c, topology, assumptions=a, cost=cost)
        key = (c.tp, c.pp, c.dp)
        if pred.fits and (key not in best or pred.step_time < best[key].step_time):
            best[key] = pred
    return sorted(best.values(), key=lambda x: x.step_time)
