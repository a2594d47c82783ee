"""PagedKVStore: the key/value pages of every layer as lazy tensors on one device.

The bookkeeping (:class:`KVCacheManager`) decides *where* a token's keys and values live;
this store holds them. Per layer it keeps two pages tensors of shape
``[num_blocks, block_size, kv_heads_local, head_dim]`` (``kv_heads_local``: the heads this
tensor-parallel rank owns), seen flat as ``num_blocks * block_size`` *slots*: token ``t``
of a sequence with block table ``T`` lives in slot ``T[t // block_size] * block_size +
t % block_size``.

Every operation is a graph node, so nothing runs until the caller realises (one decode
step is one graph: projections, page writes, gathers, attention and the TP all_reduce):

* **write** ``pages' = put(pages, slots, values)``: the rows at ``slots`` replaced, the rest
  kept exactly; slots of one write are distinct (a block table never repeats a block).
  :meth:`tensors` donates the realised pages the pending writes start from
  (``Tensor.donate``), so the realise of the step's outputs with ``tensors()`` writes the
  new rows into the pages' own buffers where nothing else in that graph reads the old
  value (the graph's ownership rule; else it copies first): a write costs O(tokens
  written), not O(pool). A realise without ``tensors()`` computes the writes it needs
  functionally (copies) and donates nothing.
* **gather** ``pages.take(slots)`` reads a sequence's keys through its block table.
* **copy** carries out the manager's copy-on-write :class:`BlockCopy` instructions
  (a gather of the source slots written into the destination slots), before new tokens
  are written.
* **attend** reads only the step's sequences' blocks, batched: at a decode step (one new
  token each) each block table is padded to :func:`bucket` (a power of two) of blocks, the
  padding masked, so every decode step whose longest sequence falls in one bucket has the
  same graph and reuses its plan. A prefill step reads its longest sequence's blocks
  unpadded: its token count makes it a shape of its own anyway, and padding would make
  its t x L attention up to twice the work.

The store replaces its page tensors with the new lazy ones after each write; realise
:meth:`tensors` with the step's outputs (``fs.realize(logits, *store.tensors())``), all of
them: a donated page tensor a realise read is spent (using it raises), so one left out of
that realise could not be computed any more. The store owns its pages: what it hands out
(gathers, attention, :meth:`pages`) reads them lazily, so realise it with or before the
next realise of ``tensors()`` (after that its pages are spent, and realising it raises,
never reads the new contents).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd import graph
from fuelspmd.backend import Device
from fuelspmd.backend import device as as_device
from fuelspmd.distributed_cache.manager import BlockCopy
from fuelspmd.dtypes import DType, int64, to_numpy
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import CacheUsageError, ConfigError, ShapeError
from fuelspmd.functional import rope_tables, softmax
from fuelspmd.graph import build as B
from fuelspmd.tensor import Tensor, realize, tensor

__all__ = ["MASKED", "LayerStep", "PagedKVStore", "bucket"]

MASKED = -1e9  # additive mask: exp underflows to exactly 0 in float32 and float64


def bucket(blocks: int) -> int:
    """The padded number of blocks of a step whose longest sequence spans ``blocks``: the
    next power of two, so a sequence growing to n blocks passes log2(n) buckets (a plan
    each) and reads at most twice its own keys."""
    return 1 << max(0, int(blocks) - 1).bit_length()


class PagedKVStore:
    """Key and value pages for ``num_layers`` layers; see the module docstring."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, device: Device | str | None = None,
                 dtype: DType | str = "float32") -> None:
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim)):
            if int(value) < 1:
                raise ConfigError(f"PagedKVStore({name}={value}): give a positive count")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.device = as_device(device)
        self.dtype = as_dtype(dtype)
        self.num_slots = num_blocks * block_size
        shape = (self.num_slots, kv_heads, head_dim)
        # array-api-strict arrays cannot be donated (no integer-array assignment in the
        # standard): its writes stay functional
        self._inplace = self.device.kind != "strict"
        self._roots: list[Tensor] = []  # realised pages that pending writes start from
        # (pages read, the read) of the gathers handed out since the last tensors()
        self._reads: list[tuple[Tensor, Tensor]] = []
        self._last: tuple[Any, _Index] | None = None  # the last step's index, by its key
        self._k = [self._zeros(shape) for _ in range(num_layers)]
        self._v = [self._zeros(shape) for _ in range(num_layers)]

    # ---- views ------------------------------------------------------------------------
    def pages(self, layer: int) -> tuple[Tensor, Tensor]:
        """Copies of layer ``layer``'s (keys, values), each ``[blocks, block_size, heads,
        head_dim]`` (copies: the store writes its pages in place)."""
        self._layer(layer)
        shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        every = tensor(np.arange(self.num_slots, dtype=np.int64), device=self.device,
                       dtype=int64)
        k, v = self._read(layer, every)
        return k.reshape(shape), v.reshape(shape)

    def tensors(self) -> list[Tensor]:
        """Every page tensor (keys of each layer, then values), then the reads handed out
        since the last call of pages a later write replaced (a gather before a write), not
        yet realised: what to realise with a step's outputs. The pages the pending writes
        start from are donated to that realise, which writes them in place, so a read left
        lazy past it (an output of an earlier step never realised) has lost its pages and
        raises ConfigError when realised: realise every output with or before the next
        realise of ``tensors()``. The page tensors are the store's own buffers, which later
        steps overwrite: read the pages through :meth:`pages` or :meth:`gather` (copies),
        not their ``.numpy()``."""
        if self._inplace:
            for root in self._roots:
                if root.node.buffer is not None:
                    root.donate()
        self._roots.clear()
        now = {id(t) for t in (*self._k, *self._v)}
        stale = [r for src, r in self._reads if id(src) not in now and r.node.buffer is None]
        self._reads.clear()
        return [*self._k, *self._v, *stale]

    def state(self) -> list[Tensor]:
        """The page tensors (keys of each layer, then values), realised (pending writes run
        first) and donated: the arguments of a step that writes them in place, compiled
        (``fs.compile`` replays it on them), which gives them back through :meth:`load`."""
        if self._reads or any(p.node.buffer is None for p in (*self._k, *self._v)):
            self.realize()
        pages = [*self._k, *self._v]
        if self._inplace:
            for p in pages:
                p.donate()
        self._roots.clear()
        return pages

    def load(self, pages: Sequence[Tensor]) -> None:
        """Make ``pages`` (keys of each layer, then values, as :meth:`state` gives them)
        the store's pages; a write into one writes it in place if it is donated."""
        n = self.num_layers
        if len(pages) != 2 * n:
            raise ConfigError(f"PagedKVStore.load: {len(pages)} page tensors for {n} layers; "
                              f"give {2 * n} (keys of each layer, then values)")
        self._k, self._v = list(pages[:n]), list(pages[n:])
        self._roots.clear()
        self._reads.clear()

    def realize(self) -> None:
        """Run every pending write and read (one graph)."""
        realize(*self.tensors())

    def nbytes(self) -> int:
        """Bytes held by all pages (keys and values, every layer)."""
        return 2 * self.num_layers * self.num_slots * self.kv_heads * self.head_dim * \
            self.dtype.itemsize

    def slots(self, table: Sequence[int], start: int, stop: int) -> np.ndarray:
        """Flat slot indices of token positions ``start .. stop-1`` under block ``table``."""
        bs = self.block_size
        if not 0 <= start <= stop <= len(table) * bs:
            raise CacheUsageError(
                f"positions {start}..{stop - 1} do not fit a block table of {len(table)} "
                f"blocks x {bs} slots = {len(table) * bs} tokens; append the tokens to the "
                "manager before writing them to the store")
        pos = np.arange(start, stop, dtype=np.int64)
        blocks = np.asarray(table, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise CacheUsageError(f"block table {list(table)} names blocks outside 0.."
                                  f"{self.num_blocks - 1}; build the store with the manager's "
                                  "num_blocks")
        return blocks[pos // bs] * bs + pos % bs

    # ---- graph operations ---------------------------------------------------------------
    def write(self, layer: int, slots: np.ndarray, k: Tensor, v: Tensor) -> None:
        """Write keys ``k`` and values ``v`` (``[n, heads, head_dim]``) into ``slots``."""
        self._layer(layer)
        idx = np.asarray(slots, dtype=np.int64).reshape(-1)
        want = (idx.size, self.kv_heads, self.head_dim)
        if k.shape != want or v.shape != want:
            raise ShapeError(f"PagedKVStore.write: keys {k.shape} and values {v.shape} must "
                             f"both be {want} for {idx.size} slots")
        if np.unique(idx).size != idx.size:
            raise RuntimeError(f"PagedKVStore.write: slots {idx.tolist()} repeat one; a block "
                               "table never holds a block twice")
        if idx.size == 0:
            return
        self._write(layer, tensor(idx, device=self.device, dtype=int64), k, v)

    def gather(self, layer: int, slots: np.ndarray) -> tuple[Tensor, Tensor]:
        """Keys and values at ``slots`` (any int shape S): each ``S + [heads, head_dim]``."""
        self._layer(layer)
        idx = tensor(np.asarray(slots, dtype=np.int64), device=self.device, dtype=int64)
        return self._read(layer, idx)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Carry out copy-on-write instructions in every layer (before new tokens go in)."""
        bs = self.block_size
        for c in copies:
            src = np.arange(c.num_tokens, dtype=np.int64) + int(c.src) * bs
            dst = np.arange(c.num_tokens, dtype=np.int64) + int(c.dst) * bs
            for layer in range(self.num_layers):
                k, v = self.gather(layer, src)
                self.write(layer, dst, k, v)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *,
               tables: Sequence[Sequence[int]], starts: Sequence[int],
               scale: float | None = None) -> Tensor:
        """Write the new tokens' k/v, then causal attention of ``q`` over each sequence.

        ``k``, ``v``: ``[batch, t, kv_heads, head_dim]`` and ``q``: ``[batch, t, heads,
        head_dim]`` (``heads = g * kv_heads``: query head j reads key/value head ``j // g``,
        grouped-query attention) for the tokens at positions ``starts[i] .. starts[i]+t-1``
        of sequence i (t = 1 when decoding, the uncached part of the prompt at prefill).
        Each query at position p attends to the sequence's keys at positions 0..p, read
        through ``tables[i]``: ``softmax(scale · q K^T + M) V`` (scale 1/sqrt(head_dim) by
        default), M = ``MASKED`` past p and on the padding to ``L = block_size ·
        blocks`` keys (``bucket(blocks)`` when t = 1), blocks those of the longest
        sequence. The g query heads of a key/value head are one matrix ``(g·t, d)``
        against its keys ``(L, d)``: the keys are never repeated per query head. Returns
        ``[batch, t, heads, head_dim]``.
        """
        b, t, h, d = q.shape
        kv = self.kv_heads
        want = (b, t, kv, self.head_dim)
        if d != self.head_dim or h % kv or k.shape != want or v.shape != want:
            raise ShapeError(f"PagedKVStore.attend: q {q.shape}, k {k.shape}, v {v.shape}: k "
                             f"and v must be {want} and q (batch, t, a multiple of {kv}, "
                             f"{self.head_dim})")
        return self._attend(layer, q, k, v, self.index(tables, starts, t), scale)

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ix: dict[str, Tensor],
                scale: float | None) -> Tensor:
        b, t, h, d = q.shape
        kv = self.kv_heads
        if ix["new"].shape != (b, t):
            raise ShapeError(f"PagedKVStore.attend: an index for new tokens {ix['new'].shape} "
                             f"and q {q.shape}; build the index for ({b}, {t})")
        self._write(layer, ix["new"], k, v)
        g, length = h // kv, ix["read"].shape[1]
        keys, values = self._read(layer, ix["read"])
        # query head j = (kv head j // g, its j % g-th query): (b, kv, g·t, d), rows (g, t)
        qg = (q.reshape(b, kv, g, d) if t == 1 else  # one token: the transpose is a reshape
              q.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d))
        scores = (qg @ keys.transpose(0, 2, 3, 1)) * (
            1.0 / math.sqrt(d) if scale is None else scale)  # (b, kv, g·t, L)
        if t == 1:  # the mask (b, 1, 1, L) broadcasts over the g rows
            ctx = softmax(scores + ix["mask"], -1) @ values.transpose(0, 2, 1, 3)
            return ctx.reshape(b, 1, h, d)
        p = softmax(scores.reshape(b, kv, g, t, length) + ix["mask"], -1)
        ctx = p.reshape(b, kv, g * t, length) @ values.transpose(0, 2, 1, 3)  # (b, kv, g·t, d)
        return ctx.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)

    def view(self, layer: int, *, tables: Sequence[Sequence[int]] | None = None,
             starts: Sequence[int] | None = None, index: dict[str, Tensor] | None = None
             ) -> LayerStep:
        """One layer's cache for one step (what ``ParallelAttention(x, cache=...)`` takes):
        from the step's ``tables`` and ``starts``, or from its ``index`` (:meth:`index`,
        made before a compiled step and passed to it)."""
        self._layer(layer)
        if (index is None) == (tables is None or starts is None):
            raise ConfigError("PagedKVStore.view: give tables= and starts=, or index=")
        return LayerStep(self, layer, tables, starts, index)

    def index(self, tables: Sequence[Sequence[int]], starts: Sequence[int], t: int, *,
              rotary: tuple[int, float] | None = None) -> dict[str, Tensor]:
        """A step's host-built index tensors, shared by every layer: ``new`` (b, t) the new
        tokens' slots, ``read`` (b, L) each sequence's cached slots, ``mask``, ``positions``
        (b, t) int64 and, with ``rotary=(dim, base)``, ``cos`` and ``sin`` (b, t, 1, dim)
        in the store's dtype (see :class:`_Index`). Everything that changes per step is in
        these tensors, so a step that takes them as arguments can be compiled."""
        key = (t, tuple(int(x) for x in starts), tuple(tuple(tb) for tb in tables))
        if self._last is None or self._last[0] != key:
            self._last = (key, _Index(self, key[2], key[1], t))
        ix = self._last[1]
        if rotary is not None and ix.rotary != rotary:
            ix.add_rotary(rotary)
        return ix.tensors

    # ---- helpers ----------------------------------------------------------------------
    def _layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise CacheUsageError(f"layer {layer} is outside 0..{self.num_layers - 1}; the "
                                  f"store was built with num_layers={self.num_layers}")

    def _zeros(self, shape: tuple[int, ...]) -> Tensor:
        # written, not calloc'ed: the pool's memory is committed here, so no step pays a
        # first-touch page fault (a 2 MiB zeroing under transparent huge pages)
        arr = np.full(shape, 0, dtype=to_numpy(self.dtype))
        return tensor(arr, device=self.device, dtype=self.dtype)

    def _read(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self._k[layer].take(slots, 0), self._v[layer].take(slots, 0)
        self._reads += [(self._k[layer], k), (self._v[layer], v)]
        return k, v

    def _write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        self._k[layer] = self._put(self._k[layer], slots, k)
        self._v[layer] = self._put(self._v[layer], slots, v)

    def _put(self, pages: Tensor, slots: Tensor, values: Tensor) -> Tensor:
        if pages.node.buffer is not None:  # a chain of writes starts: donated by tensors()
            self._roots.append(pages)
        return Tensor(graph.make("put", (pages.node, slots.node,
                                         B.astype(values.node, self.dtype)), (0,)))



class _Index:
    """One step's slots as tensors: ``new`` (b, t) the new tokens' slots, ``read`` (b, L)
    every cached slot of each sequence padded with slot 0 to ``L = block_size · blocks``
    (``bucket(blocks)`` at a decode step, t = 1), ``mask`` (b, 1, 1, t, L), (b, 1, 1, L)
    when t = 1: 0 where query j of sequence i may read key p (``p <= starts[i] + j``),
    ``MASKED`` elsewhere (later keys and the padding); ``positions`` (b, t) and the rotary
    ``cos``, ``sin``."""

    def __init__(self, store: PagedKVStore, tables: tuple[tuple[int, ...], ...],
                 starts: tuple[int, ...], t: int) -> None:
        bs, b = store.block_size, len(tables)
        if len(starts) != b:
            raise ShapeError(f"PagedKVStore.attend: {b} tables and {len(starts)} starts; "
                             "give one of each per sequence")
        lens = [len(tb) for tb in tables]
        ends = [s + t for s in starts]
        longest = -(-max(ends) // bs)
        width = max(bucket(longest) if t == 1 else longest, *lens)
        padded = np.array([tb + (0,) * (width - n) for tb, n in zip(tables, lens)],
                          dtype=np.int64).reshape(b, width)
        if (min(starts) < 0 or any(e > n * bs for e, n in zip(ends, lens))
                or padded.min(initial=0) < 0 or padded.max(initial=0) >= store.num_blocks):
            for tb, s0, e in zip(tables, starts, ends):
                store.slots(tb, s0, e)  # raises the error that names it
        width = bucket(longest) if t == 1 else longest
        self.length = length = width * bs
        # slot of key p of sequence i: its block table's entry p // bs, at offset p % bs
        read = (padded[:, :width, None] * bs + np.arange(bs)).reshape(b, length)
        query = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(t)  # (b, t)
        new = read[np.arange(b)[:, None], query]  # (b, t)
        if len(set(new.ravel().tolist())) != new.size:
            raise RuntimeError(f"PagedKVStore.attend: the step writes slots {new.tolist()}, "
                               "one twice; a block table never holds a block twice and "
                               "no two sequences write one block")
        pos = np.arange(length, dtype=np.int64)
        read[pos >= np.asarray(ends, dtype=np.int64)[:, None]] = 0
        dt, dev = to_numpy(store.dtype), store.device
        mask = np.where(pos <= query[:, :, None], dt.type(0), dt.type(MASKED)).reshape(
            (b, 1, 1, length) if t == 1 else (b, 1, 1, t, length))  # (b, t, L) as below
        self.tensors = {"new": tensor(new, device=dev, dtype=int64),
                        "read": tensor(read, device=dev, dtype=int64),
                        "mask": tensor(mask, device=dev, dtype=store.dtype),
                        "positions": tensor(query, device=dev, dtype=int64)}
        self.query, self.store = query, store
        self.rotary: tuple[int, float] | None = None

    def add_rotary(self, rotary: tuple[int, float]) -> None:
        """Add (or replace) ``cos`` and ``sin`` for ``rotary = (dim, base)``."""
        cos, sin = rope_tables(self.query, rotary[0], base=rotary[1])
        dt, st = to_numpy(self.store.dtype), self.store
        for name, tab in (("cos", cos), ("sin", sin)):
            self.tensors[name] = tensor(tab[:, :, None].astype(dt), device=st.device,
                                        dtype=st.dtype)
        self.rotary = rotary


class LayerStep:
    """A store's layer at one step: the positions of the step's tokens and attention over
    the cached keys, for an attention layer that knows nothing of pages."""

    def __init__(self, store: PagedKVStore, layer: int,
                 tables: Sequence[Sequence[int]] | None, starts: Sequence[int] | None,
                 index: dict[str, Tensor] | None) -> None:
        self.store, self.layer, self._given = store, layer, index
        self.tables = None if tables is None else [list(t) for t in tables]
        self.starts = None if starts is None else [int(s) for s in starts]

    def index(self, t: int, rotary: tuple[int, float] | None = None) -> dict[str, Tensor]:
        """The step's index tensors (:meth:`PagedKVStore.index`) for ``t`` new tokens."""
        if self._given is not None:
            ix = self._given
            if ix["new"].shape[1] != t or (rotary is not None and "cos" not in ix):
                raise ConfigError(f"LayerStep: the step's index was made for "
                                  f"{ix['new'].shape[1]} new tokens"
                                  f"{'' if 'cos' in ix else ' without rotary tables'}; the "
                                  f"layer has {t}: make it with PagedKVStore.index(..., {t}"
                                  f"{'' if rotary is None else ', rotary=(dim, base)'})")
            return ix
        assert self.tables is not None and self.starts is not None
        return self.store.index(self.tables, self.starts, t, rotary=rotary)

    def rotary(self, t: int, dim: int, base: float) -> tuple[Tensor, Tensor]:
        """cos and sin (batch, t, 1, dim) at the new tokens' positions."""
        ix = self.index(t, (dim, base))
        return ix["cos"], ix["sin"]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None
               ) -> Tensor:
        return self.store._attend(self.layer, q, k, v, self.index(q.shape[1]), scale)
