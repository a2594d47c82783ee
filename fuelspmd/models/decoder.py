"""The decoder both reference models are: embeddings, pre-norm blocks, final norm, LM head.

``h = embed(ids) [+ pos(positions)]``; per block ``h += attn(norm1(h))``,
``h += mlp(norm2(h))``; ``logits = head(norm(h))``. Attention is a
:class:`~fuelspmd.tensor_parallel.ParallelAttention` (heads over the TP communicator,
grouped-query, rotary or not), the MLP a :class:`~fuelspmd.tensor_parallel.ParallelMLP`
(GELU, or SwiGLU when gated), the embedding and head vocabulary-parallel; the head
all-gathers its vocabulary blocks, so ``model(ids)`` gives the full logits on every rank.

Pipeline. Over a mesh with ``pp`` stages a rank builds only its stage: stage ``s`` holds
the blocks of :func:`stage_layers` ``[s]`` in a dict keyed by the global layer index, so
every parameter has the name it has in the whole model (``blocks.5.attn.q.weight``) on
every layout; the first stage also holds the embeddings, the last the final norm and the
head. With tied embeddings the last stage keeps its own copy of the table under the same
name (``embed.weight``), as Megatron does, marked ``spec.mirror`` (norms count the first
stage's). ``model(x)`` is the stage's forward (ids in on the first, hidden states between,
logits out of the last): :attr:`Decoder.stages` is what a
:class:`~fuelspmd.pipeline_parallel.PipelineExecutor` takes. With ``chunks=c`` (an
interleaved schedule) the layers are cut into ``pp * c`` virtual stages and rank ``s``
holds virtual stages ``s, s + pp, ...``, each a :class:`Chunk` of :attr:`Decoder.stages`;
the names stay the whole model's, so a checkpoint moves between any of these layouts.

Dropout, as transformers' models have it (the config's probabilities: GPT-2's
``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``, Llama's ``attention_dropout``), acts in
training mode on the plain forward, never through the paged cache. Every mask is keyed by
:attr:`Decoder.rng` and the global layer (:class:`Block`), so it is the same on every
layout; a training loop sets ``rng.set_step(step)`` (the pipeline sets the micro-batch).

Hugging Face layout. Each subclass maps a parameter name of ours to a :class:`Source`: the
Hugging Face tensor, whether it is stored transposed (``nn.Linear``'s ``[out, in]``
against our ``[in, out]``) and its column offset inside a fused tensor (GPT-2's
``c_attn`` is ``[Q | K | V]``). Loading reads, per parameter, only this rank's block of the
source (:meth:`Decoder.load_hf`); saving gathers one parameter at a time to rank 0, which
streams it into the file (:meth:`Decoder.save_pretrained`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.comm import Communicator
from fuelspmd.compile import compile
from fuelspmd.dtypes import DType
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError
from fuelspmd.functional import gelu, silu
from fuelspmd.nn import (
    Dropout,
    DropoutRNG,
    Embedding,
    LayerNorm,
    Module,
    RMSNorm,
    Spec,
)
from fuelspmd.tensor import Tensor, tensor
from fuelspmd.tensor_parallel import (
    ParallelAttention,
    ParallelLMHead,
    ParallelMLP,
    VocabParallelEmbedding,
)
from fuelspmd.transport import SelfTransport

from . import hf_files
from .config import Arch, check_layout
from .generate import greedy
from .safetensors_io import SafetensorsReader

__all__ = ["Chunk", "Decoder", "PagedStep", "Source", "stage_layers"]

ACTIVATIONS = {"gelu_tanh": gelu, "gelu": partial(gelu, approximate="none"), "silu": silu}


def stage_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges of ``stages`` pipeline stages, sizes differing by at most
    one (the earlier stages, which also embed, get the smaller share)."""
    base, extra = divmod(layers, stages)
    sizes = [base + (s >= stages - extra) for s in range(stages)]
    bounds = np.cumsum([0, *sizes])
    return [(int(bounds[s]), int(bounds[s + 1])) for s in range(stages)]


@dataclass(frozen=True)
class Source:
    """Where a parameter lives in a Hugging Face file: tensor ``name``, stored as our
    array transposed or not, at column ``offset`` of a fused tensor."""

    name: str
    transpose: bool = False
    offset: int = 0

    def index(self, spec: Spec) -> tuple[slice, ...]:
        """The slice of the Hugging Face tensor that holds this rank's block of ``spec``."""
        ours = [slice(*s.indices(n)[:2]) for s, n in zip(spec.local_slice(), spec.full_shape)]
        if self.transpose:
            return tuple(reversed(ours))
        last = ours[-1]
        return (*ours[:-1], slice(last.start + self.offset, last.stop + self.offset))

    def read(self, reader: SafetensorsReader, spec: Spec) -> np.ndarray:
        """This rank's block of the parameter, in our layout."""
        arr = reader.read(self.name, self.index(spec))
        return arr.T if self.transpose else arr


@dataclass
class PagedStep:
    """One forward step through a :class:`~fuelspmd.distributed_cache.PagedKVStore`: the
    step's index tensors (:meth:`~fuelspmd.distributed_cache.PagedKVStore.index`: slots,
    masks, positions, rotary tables), every per-step value as a tensor."""

    store: Any
    index: dict[str, Tensor]

    def view(self, layer: int) -> Any:
        return self.store.view(layer, index=self.index)


def _solo(device: Device | str | None) -> Communicator:
    return Communicator(SelfTransport(), device="cpu" if device is None else device)


def _comms(comm: Any, mesh: Any, device: Device | str | None
           ) -> tuple[Communicator, Communicator, Communicator, int]:
    """(tp, pp, whole group, dp coordinate) from ``comm`` or ``mesh`` (or neither)."""
    if comm is not None and mesh is not None:
        raise ConfigError("models: give comm= (tensor parallel only) or mesh= (tp x pp), "
                          "not both")
    if mesh is not None:
        return mesh.comm("tp"), mesh.comm("pp"), mesh.comm_group, mesh.coord("dp")
    tpc = _solo(device) if comm is None else comm
    return tpc, _solo(tpc.device), tpc, 0


class Block(Module):
    """``h + drop(attn(norm1(h)))``, then ``+ drop(mlp(norm2(.)))``; heads and MLP width
    over ``comm``. Block ``index``'s dropouts are keyed ``3 index + 1..3`` (attention
    probabilities, the two residual branches; the embeddings' is 0): by the global layer,
    so a mask does not depend on the layout."""

    def __init__(self, a: Arch, *, comm: Communicator, seed: int | None, dtype: DType,
                 device: Device | str, index: int, rng: DropoutRNG) -> None:
        kw: dict[str, Any] = dict(device=device, dtype=dtype)

        def src(k: int) -> dict[str, Any]:
            return {"empty": True} if seed is None else {"seed": [seed, k]}

        norm = partial(LayerNorm, eps=a.eps) if a.norm == "layer" else partial(RMSNorm,
                                                                              eps=a.eps)
        self.norm1 = norm(a.hidden, empty=seed is None, **kw)
        self.attn = ParallelAttention(a.hidden, a.heads, comm=comm, kv_heads=a.kv_heads,
                                      head_dim=a.head_dim, bias=a.bias,
                                      rope_base=a.rope_theta, dropout=a.attn_dropout,
                                      rng=rng, layer=3 * index + 1, **src(0), **kw)
        self.norm2 = norm(a.hidden, empty=seed is None, **kw)
        self.mlp = ParallelMLP(a.hidden, a.ffn, comm=comm, bias=a.bias, gated=a.gated,
                               activation=ACTIVATIONS[a.activation], **src(1), **kw)
        self.drop1, self.drop2 = (Dropout(a.resid_dropout, rng=rng, layer=3 * index + k)
                                  for k in (2, 3))

    def forward(self, h: Tensor, *, cache: Any = None) -> Tensor:
        if cache is not None:  # generating: no dropout
            h = h + self.attn(self.norm1(h), cache=cache)
            return h + self.mlp(self.norm2(h))
        h = h + self.drop1(self.attn(self.norm1(h)))
        return h + self.drop2(self.mlp(self.norm2(h)))


class Chunk(Module):
    """Virtual stage ``v`` of a :class:`Decoder` whose rank holds several (an interleaved
    pipeline): its blocks, and the embeddings when it is the first, the final norm and
    head when it is the last; the modules are the decoder's own."""

    def __init__(self, model: Decoder, v: int) -> None:
        self.v, self._run = v, model.run  # a method, not the module: its parameters
        lo, hi = model.ranges[v]           # are not all this chunk's
        self.blocks = {str(i): model.blocks[str(i)] for i in range(lo, hi)}
        self.first, self.last = v == 0, v == len(model.ranges) - 1
        for name in (("embed", "pos", "drop") if self.first else ()) + \
                ("norm", "head") * self.last:
            if hasattr(model, name):
                setattr(self, name, getattr(model, name))

    def forward(self, x: Any) -> Tensor:
        return self._run(x, first=self.first, last=self.last, blocks=self.blocks)


class Decoder(Module):
    """A decoder-only language model over a TP communicator or a tp x pp mesh; see the
    module docstring. ``seed=None`` builds empty parameters (filled by
    :func:`~fuelspmd.models.from_pretrained` or ``load_state_dict``), an int random ones."""

    config_class: Any = None

    def __init__(self, config: Any, *, comm: Any = None, mesh: Any = None,
                 chunks: int = 1, dtype: DType | str | Any = "float32",
                 device: Device | str | None = None, seed: int | None = None) -> None:
        if not isinstance(config, self.config_class):
            raise ConfigError(f"{type(self).__name__}: config must be a "
                              f"{self.config_class.__name__}, got {type(config).__name__}")
        a = config.arch
        tpc, ppc, group, dp_coord = _comms(comm, mesh, device)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"{type(self).__name__}: chunks={chunks!r} must be an int >= 1 "
                              "(model chunks per pipeline rank)")
        check_layout(type(self).__name__, a, tpc.size, ppc.size * chunks)
        self.config, self.arch = config, a
        self._decode: Any = None  # the compiled decode step, made at the first
        self._store: Any = None
        self._ends: Communicator | None = None  # see param_grads
        self.comm, self.pp_comm, self.group, self.dp_coord = tpc, ppc, group, dp_coord
        self.dtype = as_dtype(dtype)
        dev = tpc.device if device is None else device
        self.stage, n = ppc.rank, ppc.size
        self.chunks = chunks
        # virtual stage j * pp + stage is this rank's chunk j (the interleaved schedules')
        self.ranges = stage_layers(a.layers, n * chunks)
        self.virtual = [j * n + self.stage for j in range(chunks)]
        self.first, self.last = self.stage == 0, self.stage == n - 1
        self.layer_range = self.ranges[self.stage] if chunks == 1 else None
        self.rng = DropoutRNG()  # every dropout mask's key (see Block)
        kw: dict[str, Any] = dict(device=dev, dtype=self.dtype)

        def src(*k: int) -> dict[str, Any]:
            return {"empty": True} if seed is None else {"seed": [seed, *k]}

        if self.first or (self.last and a.tie):
            self.embed = VocabParallelEmbedding(a.vocab, a.hidden, comm=tpc, **src(0), **kw)
        if self.first and a.rope_theta is None:
            self.pos = Embedding(a.max_positions, a.hidden, **src(1), **kw)
        if self.first:
            self.drop = Dropout(a.embed_dropout, rng=self.rng, layer=0)
        mine = [i for v in self.virtual for i in range(*self.ranges[v])]
        self.blocks = {str(i): Block(a, comm=tpc, seed=None if seed is None else seed + 1 + i,
                                     index=i, rng=self.rng, **kw) for i in mine}
        if self.last:
            empty = seed is None
            self.norm = (LayerNorm(a.hidden, eps=a.eps, empty=empty, **kw) if a.norm == "layer"
                         else RMSNorm(a.hidden, eps=a.eps, empty=empty, **kw))
            self.head = ParallelLMHead(a.hidden, a.vocab, comm=tpc, gather_output=True,
                                       tie=self.embed if a.tie else None,
                                       **({} if a.tie else src(2)), **kw)
            if a.tie and not self.first:  # the first stage owns the table
                w = self.embed.weight
                w.spec = replace(w.spec, mirror=True)

    # ---- forward --------------------------------------------------------------------
    @property
    def stages(self) -> list[Module]:
        """This rank's pipeline stages, one per chunk, for a PipelineExecutor: the model
        itself with one chunk, else a :class:`Chunk` per virtual stage it holds."""
        return [self] if self.chunks == 1 else [Chunk(self, v) for v in self.virtual]

    def forward(self, x: Any, *, kv: PagedStep | None = None, last_token: bool = False
                ) -> Tensor:
        """The stage's forward: ids ``(batch, seq)`` (an int array or Tensor) on the first
        stage, hidden states ``(batch, seq, hidden)`` on the others; the last returns the
        logits ``(batch, seq, vocab)`` (``last_token``: at the last position only,
        ``(batch, 1, vocab)``). ``kv``: keys and values through a paged store. A rank of
        several chunks runs each (:attr:`stages`), not this."""
        if self.chunks > 1:
            raise ConfigError(f"{type(self).__name__}: this rank holds {self.chunks} model "
                              "chunks (virtual stages); run each of model.stages, as a "
                              "PipelineExecutor does")
        return self.run(x, first=self.first, last=self.last, blocks=self.blocks, kv=kv,
                        last_token=last_token)

    def run(self, x: Any, *, first: bool, last: bool, blocks: dict[str, Block],
            kv: PagedStep | None = None, last_token: bool = False) -> Tensor:
        """The forward of ``blocks``, after the embeddings when ``first`` and into the
        head when ``last`` (see :meth:`forward`)."""
        h = x
        if first:
            ids = x if isinstance(x, Tensor) else tensor(np.asarray(x, dtype=np.int64),
                                                         device=self.comm.device)
            t = ids.shape[1]
            h = self.embed(ids)
            if self.arch.rope_theta is None:
                h = h + self.pos(tensor(np.arange(t), device=ids.device) if kv is None else
                                 kv.index["positions"])
            if kv is None:
                h = self.drop(h)
        for key, block in blocks.items():
            h = block(h, cache=None if kv is None else kv.view(int(key)))
        if last:
            if last_token:
                h = h[:, h.shape[1] - 1:]
            h = self.head(self.norm(h))
        return h

    def param_grads(self, per_chunk: list[list[Tensor]]) -> list[Tensor]:
        """The gradient of each of :meth:`parameters`, from a pipeline's gradients of each
        of :attr:`stages`' parameters: a parameter two chunks of this rank use (a tied
        table, first and last on one rank) gets the sum, and a table tied across the first
        and last pipeline stages the sum over those two (each holds a copy, which stay
        equal). Collective over the pipeline group (every stage calls it, every step)."""
        params, grads, at = [], [], {}
        for st, gs in zip(self.stages, per_chunk):
            mine = st.parameters()
            if len(gs) != len(mine):
                raise ConfigError(f"{type(self).__name__}.param_grads: {len(gs)} gradients "
                                  f"for a chunk of {len(mine)} parameters; give the "
                                  "executor's result.grads")
            for p, g in zip(mine, gs):
                k = at.get(id(p))
                if k is None:
                    at[id(p)] = len(params)
                    params.append(p)
                    grads.append(g)
                else:
                    grads[k] = grads[k] + g
        n = self.pp_comm.size
        if self.arch.tie and n > 1:
            if self._ends is None:  # the first and last stages, made by every stage once
                self._ends = self.pp_comm.split(0 if self.first or self.last else 1,
                                                self.pp_comm.rank)
            if self.first or self.last:
                k = at[id(self.embed.weight)]
                grads[k] = self._ends.all_reduce(grads[k])
        order = {id(p): i for i, p in enumerate(params)}
        return [grads[order[id(p)]] for p in self.parameters()]

    # ---- generation (the protocol of fuelspmd.models.generate) ------------------------
    def kv_layout(self) -> tuple[int, int, int, DType]:
        """(layers, key/value heads this rank stores, head_dim, dtype): the store's shape."""
        if self.pp_comm.size > 1:
            raise ConfigError(f"{type(self).__name__}: generation runs on a TP communicator "
                              f"(pp=1), this model has pp={self.pp_comm.size}; load it "
                              "with comm= for generation")
        kv, d = next(iter(self.blocks.values())).attn.cache_heads
        return self.arch.layers, kv, d, self.dtype

    def step(self, tokens: np.ndarray, *, starts: list[int], tables: list[list[int]],
             store: Any, compiled: bool = True) -> Tensor:
        """Logits ``(batch, vocab)`` at the last of ``tokens`` ``(batch, t)``, the tokens
        at positions ``starts[i]..`` of each sequence, keys and values through ``store``;
        a decode step (``t`` = 1) replays its compiled step unless not ``compiled``."""
        t = tokens.shape[1]
        a = self.arch
        rotary = None if a.rope_theta is None else (self.kv_layout()[2], a.rope_theta)
        index = store.index(tables, starts, t, rotary=rotary)
        ids = tensor(np.asarray(tokens, dtype=np.int64), device=self.comm.device)
        if self._decode is None:
            self._decode = compile(self._paged)
        # a decode step (t = 1) repeats its shapes within a bucket: replayed; a prefill's
        # shapes rarely repeat, so it runs uncompiled (the same function)
        run = self._decode if t == 1 and compiled else self._paged
        self._store = store  # read while tracing only: every call passes its pages
        try:
            logits, pages = run(ids, index, store.state())
        finally:
            self._store = None
        store.load(pages)
        return logits

    def _paged(self, ids: Tensor, index: dict[str, Tensor], pages: list[Tensor]
               ) -> tuple[Tensor, list[Tensor]]:
        """The logits ``(batch, vocab)`` at the last of ``ids`` and the pages written: the
        step as a function of tensors only, so that it compiles (its Python, the store's
        included, runs when tracing only; the cache's bookkeeping stays in the caller)."""
        store = self._store
        store.load(pages)
        out = self(ids, kv=PagedStep(store, index), last_token=True)
        return out.reshape(ids.shape[0], self.arch.vocab), store.tensors()

    def generate(self, prompts: list[list[int]], new_tokens: int, **kw: Any) -> list[list[int]]:
        """Greedy tokens of every prompt through a paged KV cache
        (:func:`fuelspmd.models.greedy`, which takes ``kw``). Collective over ``comm``."""
        return greedy(self, prompts, new_tokens, **kw).tokens

    # ---- Hugging Face layout --------------------------------------------------------
    def hf_source(self, name: str) -> Source:
        """The Hugging Face tensor a parameter name of ours comes from."""
        raise NotImplementedError

    def _skeleton(self) -> Decoder:
        """The whole model on one rank, empty: every name and full shape, no data."""
        return type(self)(self.config, dtype=self.dtype, device=self.comm.device)

    def _owner(self, name: str) -> int:
        """The pipeline stage that holds parameter ``name``."""
        if name.startswith("blocks."):
            i = int(name.split(".")[1])
            v = next(v for v, (lo, hi) in enumerate(self.ranges) if lo <= i < hi)
            return v % self.pp_comm.size
        return 0 if name.split(".")[0] in ("embed", "pos") else self.pp_comm.size - 1

    def load_hf(self, path: str | os.PathLike[str]) -> None:
        """Fill every parameter with this rank's block of the Hugging Face weights in
        ``path`` (:func:`~fuelspmd.models.hf_files.load`); :func:`~fuelspmd.models.
        from_pretrained` checks the directory against the config first."""
        with SafetensorsReader(path) as reader:
            hf_files.load(self, reader)

    def save_pretrained(self, path: str | os.PathLike[str], *, masters: Any = None) -> None:
        """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` in
        Hugging Face's names and layouts, which transformers loads. ``masters``: the
        optimiser training this model, whose float32 master copies of 16-bit parameters
        are written instead (float32 files from bfloat16 training). Collective over the
        model's group: each parameter is gathered over tp (and sent from its pipeline
        stage) to rank 0 one at a time, and rank 0 streams it into the file (each tensor's
        CRC-32 in its metadata); every rank returns once it is committed."""
        hf_files.save(self, path, masters)
