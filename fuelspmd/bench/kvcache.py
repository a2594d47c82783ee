"""``fuelspmd bench kvcache``: prefill with the prefix cache on against off, interleaved.

    fuelspmd bench kvcache [--requests 16] [--prefix 512] [--suffix 16] [--batch-tokens 512]
                           [--rounds 3] [--json]

The workload: ``requests`` prompts that share a ``prefix``-token prefix and add ``suffix``
tokens each, arriving together and prefilled (first token greedy) by
:func:`fuelspmd.models.greedy`'s scheduler with a small transformer whose attention reads
keys and values through a :class:`~fuelspmd.distributed_cache.PagedKVStore` (one rank;
``layers`` pre-norm attention blocks, float32). With the cache on, a request computes only
the tokens past its longest cached prefix; off, every prompt token. A prefill step batches
requests with equal uncached lengths up to ``batch_tokens`` tokens, as a serving scheduler
does (vLLM's ``max_num_batched_tokens``): with the default, off computes one whole prompt
per step and on computes the first prompt, then every other request's suffix in one step;
``--batch-tokens 1`` gives one request per step for both. Each round builds a fresh
manager and store, and the two candidates alternate round by round (on, off, on, off, ...),
with BLAS limited to one thread (threadpoolctl), as in the other one-rank benches: a
threaded BLAS on the small matrices of this model spends its time synchronising threads.

Reported per candidate: prefill tokens computed and the mean time-to-first-token (from the
batch's arrival to a request's first token). ``expected`` is what the bookkeeping must give:
the first request computes its whole prompt, each later one its prompt less the shared
full blocks, ``prompt + (requests-1)·(prompt - block_size·floor(prefix/block_size))``.
Speedups are medians over rounds of the paired off/on ratios, of the mean
time-to-first-token (``ttft_speedup``) and of the last request's (``last_speedup``: the
whole burst prefilled). Each has its bound, the speedup were time proportional to the
tokens computed: a request's first token comes after every token computed before it
(``Generation.first_token_work``), so ``last_bound`` is the prefill tokens off / on, and
``ttft_bound`` the ratio of the mean of those counts, which is lower, because every request
waits for the shared prefix's first computation.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np

from fuelspmd.bench import Column, interleave, median, print_json, print_table
from fuelspmd.comm.communicator import Communicator
from fuelspmd.distributed_cache import PagedKVStore
from fuelspmd.dtypes import DType, float32
from fuelspmd.functional import layer_norm
from fuelspmd.models import greedy
from fuelspmd.tensor import Tensor, tensor
from fuelspmd.tensor_parallel import ParallelAttention
from fuelspmd.transport import SelfTransport

__all__ = ["main", "run"]


class _Model:
    """Embedding + positions, ``layers`` pre-norm paged-attention blocks, a vocabulary head."""

    def __init__(self, comm: Communicator, *, vocab: int, hidden: int, heads: int,
                 layers: int, max_len: int) -> None:
        g = np.random.default_rng(0)
        f32 = np.float32
        self.comm = comm
        self.embed = tensor(g.standard_normal((vocab, hidden)).astype(f32), device=comm.device)
        self.pos = tensor(g.standard_normal((max_len, hidden)).astype(f32), device=comm.device)
        self.head = tensor((g.standard_normal((hidden, vocab)) / math.sqrt(hidden)).astype(f32),
                           device=comm.device)
        self.attn = [ParallelAttention(hidden, heads, comm=comm, seed=i, device=comm.device)
                     for i in range(layers)]

    def kv_layout(self) -> tuple[int, int, int, DType]:
        """(layers, key/value heads, head_dim, dtype): the store's shape, for greedy."""
        kv, d = self.attn[0].cache_heads
        return len(self.attn), kv, d, float32

    def step(self, tokens: np.ndarray, *, starts: list[int], tables: list[list[int]],
             store: PagedKVStore, compiled: bool = True) -> Tensor:
        """Logits ``(batch, vocab)`` after ``tokens`` ``(batch, t)`` at positions
        ``starts[i]..``; keys and values into ``store``."""
        dev, t = self.comm.device, tokens.shape[1]
        pos = np.asarray(starts)[:, None] + np.arange(t)[None, :]
        x = self.embed.take(tensor(tokens, device=dev), 0) + \
            self.pos.take(tensor(pos, device=dev), 0)
        for layer, attn in enumerate(self.attn):
            x = x + attn(layer_norm(x), cache=store.view(layer, tables=tables, starts=starts))
        return layer_norm(x[:, t - 1]) @ self.head


def _round(model: _Model, prompts: list[list[int]], args: argparse.Namespace, *,
           cache: bool) -> dict[str, Any]:
    out = greedy(model, prompts, 1, block_size=args.block_size, prefix_caching=cache,
                 max_batch_tokens=args.batch_tokens, num_blocks=args.pool_blocks)
    return {"computed": out.prefill_tokens_computed, "ttft": out.ttft_s,
            "last": max(out.first_token_s), "work": out.first_token_work,
            "first": [t[0] for t in out.tokens], "hit_rate": out.hit_rate}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Interleave ``args.rounds`` rounds of cache on and off; return the report."""
    comm = Communicator(SelfTransport(), device="cpu:0")
    prompt_len = args.prefix + args.suffix
    model = _Model(comm, vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                   layers=args.layers, max_len=prompt_len)
    g = np.random.default_rng(1)
    prefix = g.integers(0, args.vocab, args.prefix).tolist()
    prompts = [prefix + g.integers(0, args.vocab, args.suffix).tolist()
               for _ in range(args.requests)]
    seen: dict[str, dict[str, Any]] = {}

    def candidate(cache: bool) -> Any:
        def go() -> tuple[float, float]:
            r = _round(model, prompts, args, cache=cache)
            name = "on" if cache else "off"
            if name in seen and (seen[name]["computed"], seen[name]["first"]) != \
                    (r["computed"], r["first"]):
                raise RuntimeError("bench kvcache: a round of the same candidate gave other "
                                   "tokens or counts; the cache is not deterministic")
            seen[name] = r
            return float(r["ttft"]), float(r["last"])
        return go

    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        times = interleave({"on": candidate(True), "off": candidate(False)}, count=args.rounds)
    if seen["on"]["first"] != seen["off"]["first"]:
        raise RuntimeError("bench kvcache: the first tokens differ with the cache on and off")
    shared = args.block_size * (min(args.prefix, prompt_len - 1) // args.block_size)
    expected = prompt_len + (args.requests - 1) * (prompt_len - shared)
    on, off = times["on"], times["off"]
    mean_ratios = [b[0] / a[0] for a, b in zip(on, off)]
    last_ratios = [b[1] / a[1] for a, b in zip(on, off)]
    work = {name: seen[name]["work"] for name in ("on", "off")}
    rows = [{"cache": name, "computed": seen[name]["computed"],
             "expected": expected if name == "on" else args.requests * prompt_len,
             "hit_rate": seen[name]["hit_rate"],
             "ttft_ms": 1e3 * median([t[0] for t in times[name]]),
             "last_ms": 1e3 * median([t[1] for t in times[name]])}
            for name in ("off", "on")]
    return {"requests": args.requests, "prefix": args.prefix, "suffix": args.suffix,
            "block_size": args.block_size, "batch_tokens": args.batch_tokens,
            "pool_blocks": args.pool_blocks,
            "rounds": args.rounds, "rows": rows,
            "computed_share": seen["on"]["computed"] / seen["off"]["computed"],
            "ttft_speedup": median(mean_ratios),
            "ttft_bound": float(np.mean(work["off"]) / np.mean(work["on"])),
            "last_speedup": median(last_ratios),
            "last_bound": max(work["off"]) / max(work["on"])}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fuelspmd bench kvcache",
                                description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=512,
                   help="most tokens a prefill step batches (1: one request per step)")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="KV cache blocks (default: every request's blocks at once)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    for name in ("requests", "prefix", "suffix", "block_size", "batch_tokens", "layers",
                 "hidden", "heads", "vocab", "rounds", "pool_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    res = run(args)
    if args.json:
        print_json({"bench": "kvcache", **res})
        return 0
    print_table(f"kvcache: {args.requests} requests, {args.prefix}-token shared prefix + "
                f"{args.suffix} each, block {args.block_size}, interleaved x{args.rounds}",
                [Column("cache", "cache"), Column("prefill tokens", "computed"),
                 Column("expected", "expected"), Column("hit rate", "hit_rate", "{:.3f}"),
                 Column("ttft ms", "ttft_ms", "{:.1f}"), Column("last ms", "last_ms", "{:.1f}")],
                res["rows"])
    print(f"prefill tokens computed with the cache: {res['computed_share']:.3f} of without; "
          "time-to-first-token speedup (median paired off/on), against its bound by tokens: "
          f"mean {res['ttft_speedup']:.2f}x of {res['ttft_bound']:.2f}x, last "
          f"{res['last_speedup']:.2f}x of {res['last_bound']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
