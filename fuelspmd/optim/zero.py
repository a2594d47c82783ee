"""ZeRO stage 1: optimiser state sharded over the data-parallel replicas.

Layer 7. Every dp replica holds the whole (TP/PP-local) model but only ``1/dp`` of the
optimiser: the parameters are packed, in order, into flat buckets of about
``bucket_bytes`` (one dtype each, padded to a multiple of ``dp``), and rank ``r`` of dp
owns slice ``r`` of every bucket: the inner optimiser's state (AdamW's two moments) of
just that slice, and its float32 master copy when the parameters are 16-bit (otherwise
the parameters themselves hold the slice's values). A step, per bucket:

1. ``reduce_scatter(avg)`` of the replica's *unreduced* gradients: rank ``r`` receives the
   dp-mean of its slice (the all-reduce of plain data parallelism, less its all-gather);
2. clip (optionally) by the global norm, whose squares are summed over dp too (each
   element lives on one dp rank), over tp for sharded parameters and over pp;
3. the inner optimiser's :meth:`~fuelspmd.optim.Optimizer.update` on the slice: the same
   elementwise math as unsharded, so the result is the unsharded optimiser's;
4. ``all_gather`` of the updated slices (in the parameters' dtype), cut back into the
   parameters and assigned.

Each bucket is one transport call each way. Handed to the pipeline
(``PipelineExecutor(..., reduce=zero.reduce)``), a chunk's reduce-scatters go into the
graph of its last backward, where the planner starts each as soon as its bucket's last
gradient is computed, as it does the dp all-reduce buckets, so they travel while the rest
of the backward runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuelspmd.comm import Communicator
from fuelspmd.dtypes import DType
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.mesh import Mesh
from fuelspmd.optim.clip import clip_by, global_norm, spread_over, squares
from fuelspmd.optim.optimizer import (
    MASTER,
    Optimizer,
    Reader,
    State,
    applied,
    check_grads,
    master_dtype,
    per_dtype,
)
from fuelspmd.pipeline_parallel.buckets import DP_BUCKET_BYTES, check_bucket_bytes
from fuelspmd.tensor import Tensor, concat, realize, tensor, zeros

__all__ = ["ZeRO1"]


@dataclass(frozen=True)
class _Bucket:
    """Parameters ``index`` (consecutive, of one chunk), flat offsets ``offsets`` in a
    buffer of ``padded`` elements of ``dtype``; each dp rank owns ``shard`` of them."""

    chunk: int
    index: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    padded: int
    shard: int
    dtype: DType


def _buckets(params: Sequence[Tensor], chunk_of: Sequence[int], dp: int, bucket_bytes: int
             ) -> list[_Bucket]:
    out: list[_Bucket] = []
    group: list[int] = []

    def close() -> None:
        sizes = [math.prod(params[i].shape) for i in group]
        n = sum(sizes)
        shard = -(-n // dp)
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        out.append(_Bucket(chunk_of[group[0]], tuple(group), tuple(offsets), tuple(sizes),
                           shard * dp, shard, params[group[0]].dtype))
        group.clear()

    nbytes = 0
    for i, p in enumerate(params):
        if group and (p.dtype != params[group[0]].dtype or nbytes >= bucket_bytes
                      or chunk_of[i] != chunk_of[group[0]]):
            close()
            nbytes = 0
        group.append(i)
        nbytes += math.prod(p.shape) * master_dtype(p.dtype).itemsize
    close()
    return out


class ZeRO1:
    """``optimizer`` (an :class:`~fuelspmd.optim.Optimizer` that has not stepped yet) with
    its state sharded over ``dp``; see the module docs.

    :meth:`step` takes each replica's *own* gradients (not averaged over dp) and returns
    the global gradient norm when ``max_norm`` is given. To overlap the reduce-scatters
    with the backward, hand :meth:`reduce` to the pipeline
    (``PipelineExecutor(..., reduce=zero.reduce)``: each chunk's buckets go into its last
    backward's graph, each started as soon as its gradients are computed) and step on
    what it gave (``step(grads, reduced=True)``). ``chunks``: the parameter count of each
    pipeline chunk, in order (buckets never span two); one chunk by default. Collective
    over ``dp`` (and, for the norm, over the communicators of the parameters' specs and
    the mesh's ``pp``).
    """

    def __init__(self, optimizer: Optimizer, *, dp: Communicator,
                 bucket_bytes: int = DP_BUCKET_BYTES, chunks: Sequence[int] | None = None
                 ) -> None:
        check_bucket_bytes(bucket_bytes)
        if optimizer.steps or any(optimizer.state):
            raise ConfigError("ZeRO1: the optimiser has already stepped; wrap it before its "
                              "first step (its state is what ZeRO1 shards)")
        n = len(optimizer.params)
        counts = [n] if chunks is None else [int(c) for c in chunks]
        if sum(counts) != n or min(counts) < 0:
            raise ConfigError(f"ZeRO1: chunks={list(counts)} must count the optimiser's {n} "
                              "parameters, chunk by chunk, in order")
        self.inner, self.dp = optimizer, dp
        self.params = optimizer.params
        self.starts = [sum(counts[:j]) for j in range(len(counts))]  # first index per chunk
        chunk_of = [j for j, c in enumerate(counts) for _ in range(c)]
        self.buckets = _buckets(self.params, chunk_of, dp.size, bucket_bytes)
        # float32 master slices of 16-bit buckets (None: cut from the parameters)
        self.shards: list[Tensor | None] = [None] * len(self.buckets)
        self.state: list[State] = [{} for _ in self.buckets]

    @property
    def steps(self) -> int:
        return self.inner.steps

    @property
    def lr(self) -> float:
        return self.inner.lr

    def _flat(self, b: _Bucket, flats: Sequence[Tensor]) -> Tensor:
        """The padded bucket made of ``flats`` (one flat tensor per parameter)."""
        pad = b.padded - sum(b.sizes)
        parts = list(flats)
        if pad:
            parts.append(zeros((pad,), device=flats[0].device, dtype=flats[0].dtype))
        return concat(parts)

    def _pieces(self, b: _Bucket, g: Tensor) -> list[tuple[int, Tensor]]:
        """(parameter index, its part of this rank's slice ``g``) for each overlap."""
        return [(i, g[at:at + z - a]) for i, a, z, at in self._spans(b)]

    def reduce(self, chunk: int, grads: Sequence[Tensor]) -> list[Tensor]:
        """The dp-mean of this rank's slice of each bucket of chunk ``chunk``, lazily (one
        reduce-scatter per bucket), from the replica's own ``grads`` of that chunk's
        parameters. Collective over dp."""
        if not 0 <= chunk < len(self.starts):
            raise ConfigError(f"ZeRO1.reduce: chunk {chunk} of {len(self.starts)}")
        first = self.starts[chunk]
        mine = [b for b in self.buckets if b.chunk == chunk]
        count = sum(len(b.index) for b in mine)
        check_grads("ZeRO1.reduce", self.params[first:first + count], grads)
        out = []
        for b in mine:
            mdt = master_dtype(b.dtype)
            flat = self._flat(b, [grads[i - first].astype(mdt).reshape(-1) for i in b.index])
            out.append(flat if self.dp.size == 1 else self.dp.reduce_scatter(flat, 0, "avg"))
        return out

    def gather(self, reduced: Sequence[Tensor]) -> list[Tensor]:
        """Every parameter's dp-mean gradient from :meth:`reduce`'s slices (one all-gather
        per bucket: for inspection, e.g. a check against one process)."""
        self._check_reduced("ZeRO1.gather", reduced)
        out: list[Tensor | None] = [None] * len(self.params)
        for b, g in zip(self.buckets, reduced):
            full = g if self.dp.size == 1 else self.dp.all_gather(g, 0)
            for i, off, n in zip(b.index, b.offsets, b.sizes):
                out[i] = full[off:off + n].reshape(self.params[i].shape)
        return [g for g in out if g is not None]

    def _check_reduced(self, owner: str, reduced: Sequence[Tensor]) -> None:
        want = [(b.shard,) for b in self.buckets]
        got = [tuple(g.shape) for g in reduced]
        if got != want:
            raise ShapeError(f"{owner}: {len(got)} slices {got[:4]}... for {len(want)} "
                             f"buckets of slices {want[:4]}...; give ZeRO1.reduce's results, "
                             "chunk by chunk")

    def step(self, grads: Sequence[Tensor], *, reduced: bool = False,
             max_norm: float | None = None, mesh: Mesh | None = None,
             apply: Tensor | None = None) -> Tensor | None:
        """Reduce-scatter (unless ``reduced``: ``grads`` are :meth:`reduce`'s slices, chunk
        by chunk), clip, update the owned slices, all-gather; see the module docs. Returns
        the global norm before clipping (a float64 0-d tensor) when ``max_norm`` is given.
        ``apply``: as :meth:`Optimizer.step`'s (false: nothing changes)."""
        if max_norm is not None and not max_norm > 0:
            raise ConfigError(f"ZeRO1.step: max_norm={max_norm!r} must be > 0 (or None)")
        dp, params = self.dp, self.params
        if reduced:
            self._check_reduced("ZeRO1.step", grads)
            gs = list(grads)
        else:
            check_grads("ZeRO1.step", params, grads)
            ends = [*self.starts[1:], len(params)]
            gs = [g for j, (a, z) in enumerate(zip(self.starts, ends))
                  for g in self.reduce(j, grads[a:z])]
        opt = self.inner
        coefs = per_dtype(opt.next_coefficients(params[0].device, apply))
        for k, b in enumerate(self.buckets):
            if self.shards[k] is None:
                whole = self._flat(b, [Tensor(params[i].node).astype(master_dtype(b.dtype))
                                       .reshape(-1) for i in b.index])
                self.shards[k] = whole[dp.rank * b.shard:(dp.rank + 1) * b.shard]
        norm = None
        if max_norm is not None:
            parts = [(piece, spread_over(params[i], mesh))
                     for b, g in zip(self.buckets, gs) for i, piece in self._pieces(b, g)
                     if not params[i].spec.mirror]
            # every sharded parameter's communicator, so each dp rank (whatever its
            # slices hold) all-reduces the same list
            rep, sharded = squares(parts, gs[0].device,
                                   [spread_over(p, mesh) for p in params])
            norm = global_norm(rep, sharded, mesh=mesh, dp=dp)
            gs = clip_by(gs, max_norm, norm)
        outs: list[Tensor] = []
        for k, (b, g) in enumerate(zip(self.buckets, gs)):
            w = self.shards[k]
            assert w is not None
            st0 = self.state[k] or opt.init_state(w)
            w1, st = opt.update(w, g, st0, coef=coefs(w.dtype))
            if apply is not None:
                w1, st = applied(apply, w1, st, w, st0)
            w, self.state[k] = w1, st
            # a 16-bit bucket keeps its float32 slice; any other is its parameters' own
            # values after the all-gather, cut again at the next step (no second copy)
            self.shards[k] = w if w.dtype != b.dtype else None
            full = w if w.dtype == b.dtype else w.astype(b.dtype)
            outs.append(full if dp.size == 1 else dp.all_gather(full, 0))
        news = [(i, full[off:off + n].reshape(params[i].shape))
                for b, full in zip(self.buckets, outs)
                for i, off, n in zip(b.index, b.offsets, b.sizes)]
        realize(*(v for _, v in news), *(m for m in self.shards if m is not None),
                *(() if norm is None else (norm,)),
                *(v for st in self.state for v in st.values()))
        for i, v in news:
            params[i].assign(v)
        return norm

    # ---- state -----------------------------------------------------------------------
    def check_shard_state(self, steps: Any, names: Sequence[Sequence[str]], *,
                          owner: str = "load", labels: Sequence[str] | None = None) -> None:
        """As the inner optimiser's :meth:`~fuelspmd.optim.Optimizer.check_shard_state`."""
        self.inner.check_shard_state(steps, names, owner=owner, labels=labels)

    def _layout(self) -> list[tuple[list[int], int]]:
        return [(list(b.index), b.shard) for b in self.buckets]

    def state_bytes(self) -> int:
        """Bytes of optimiser state on this rank: master slices and the inner state."""
        return sum(t.size * t.dtype.itemsize for t in self._held())

    def _held(self) -> list[Tensor]:
        return [s for s in self.shards if s is not None] + \
            [v for st in self.state for v in st.values()]

    def state_dict(self) -> dict[str, Any]:
        """``steps``, this rank's master slices and state per bucket, and the layout
        (bucket parameter indices and slice length) a loader checks against."""
        return {"steps": self.steps, "dp": (self.dp.rank, self.dp.size),
                "layout": self._layout(),
                "shards": [None if s is None else s.numpy() for s in self.shards],
                "state": [{k: v.numpy() for k, v in st.items()} for st in self.state]}

    def _spans(self, b: _Bucket) -> list[tuple[int, int, int, int]]:
        """(parameter index, flat start and stop in it, start in this rank's slice) of
        each parameter overlapping this rank's slice of bucket ``b``."""
        lo = self.dp.rank * b.shard
        return [(i, a - off, z - off, a - lo) for i, off, n in zip(b.index, b.offsets, b.sizes)
                for a, z in [(max(off, lo), min(off + n, lo + b.shard))] if a < z]

    def shard_state(self) -> list[dict[str, tuple[int, Tensor]]]:
        """As :meth:`Optimizer.shard_state`: each parameter's part of this rank's slices
        (the master slice of a 16-bit bucket as ``MASTER``)."""
        out: list[dict[str, tuple[int, Tensor]]] = [{} for _ in self.params]
        for b, st, m in zip(self.buckets, self.state, self.shards):
            held = {**st, **({MASTER: m} if m is not None else {})}
            for i, a, z, at in self._spans(b):
                out[i].update({k: (a, v[at:at + z - a]) for k, v in held.items()})
        return out

    def load_shard_state(self, steps: int, names: Sequence[Sequence[str]], read: Reader
                         ) -> None:
        """As :meth:`Optimizer.load_shard_state`, reading only this rank's slices; the
        parameters of one bucket must have the same state names (ConfigError if not)."""
        self.check_shard_state(steps, names, owner="ZeRO1.load_shard_state")
        for k, b in enumerate(self.buckets):
            mdt = master_dtype(b.dtype)
            kinds = {tuple(sorted(names[i])) for i in b.index}
            if len(kinds) > 1:
                raise ConfigError(f"ZeRO1.load_shard_state: the parameters #{b.index[0]}.."
                                  f"#{b.index[-1]} of one bucket have different saved states "
                                  f"{sorted(kinds)}; save every parameter after the same steps")
            got: dict[str, Tensor] = {}
            for name in kinds.pop():
                if name == MASTER and mdt == b.dtype:
                    continue
                flat = np.zeros(b.shard, np.dtype(mdt.name))
                for i, a, z, at in self._spans(b):
                    flat[at:at + z - a] = read(i, name, a, z)
                got[name] = tensor(flat, device=self.params[0].device, dtype=mdt)
            self.shards[k] = got.pop(MASTER, None)
            self.state[k] = got
        self.inner.steps = int(steps)

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, saved by the same dp rank of the same
        layout (ShapeError otherwise, naming what differs)."""
        mine = {"dp": (self.dp.rank, self.dp.size), "layout": self._layout()}
        got = {"dp": tuple(d["dp"]), "layout": [(list(i), int(s)) for i, s in d["layout"]]}
        bad = [f"{k}: saved {got[k]}, here {mine[k]}" for k in mine if got[k] != mine[k]]
        if bad:
            raise ShapeError(f"ZeRO1.load_state_dict: the state was saved for another layout "
                             f"({'; '.join(bad)}); load it on the same dp rank with the same "
                             "parameters and bucket_bytes")
        names: list[list[str]] = [[] for _ in self.params]
        for b, st in zip(self.buckets, d["state"]):
            for i in b.index:
                names[i] = list(st)
        self.check_shard_state(d["steps"], names, owner="ZeRO1.load_state_dict")
        dev = self.params[0].device
        for k, b in enumerate(self.buckets):
            mdt = master_dtype(b.dtype)
            s = d["shards"][k]
            self.shards[k] = None if s is None else tensor(np.asarray(s), device=dev, dtype=mdt)
            self.state[k] = {n: tensor(np.asarray(v), device=dev, dtype=mdt)
                             for n, v in d["state"][k].items()}
        self.inner.steps = int(d["steps"])
