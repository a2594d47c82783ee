"""``fuelspmd bench kvcache``: prefill with the prefix cache on against off, interleaved.

    fuelspmd bench kvcache [--requests 16] [--prefix 512] [--suffix 16] [--rounds 3] [--json]

The workload: ``requests`` prompts that share a ``prefix``-token prefix and add ``suffix``
tokens each, arriving together and prefilled one after another (first token greedy) by a
small transformer whose attention reads keys and values through a
:class:`~fuelspmd.distributed_cache.PagedKVStore` (one rank; ``layers`` pre-norm attention
blocks, float32). With the cache on, a request computes only the tokens past its longest
cached prefix; off, every prompt token. Each round builds a fresh manager and store, and
the two candidates alternate round by round (on, off, on, off, ...).

Reported per candidate: prefill tokens computed and the mean time-to-first-token (from the
batch's arrival to a request's first token). ``expected`` is what the bookkeeping must give:
the first request computes its whole prompt, each later one its prompt less the shared
full blocks, ``prompt + (requests-1)·(prompt - block_size·floor(prefix/block_size))``.
``ttft_speedup`` = median over rounds of the paired off/on ratios.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import numpy as np

from fuelspmd.bench import Column, interleave, median, print_json, print_table
from fuelspmd.comm.communicator import Communicator
from fuelspmd.distributed_cache import KVCacheManager, PagedKVStore
from fuelspmd.functional import layer_norm
from fuelspmd.tensor import Tensor, realize, tensor
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

    def prefill(self, tokens: list[int], start: int, table: list[int],
                store: PagedKVStore) -> Tensor:
        """Logits after ``tokens`` at positions ``start..``; keys/values into ``store``."""
        dev, t = self.comm.device, len(tokens)
        x = self.embed.take(tensor(np.asarray([tokens]), device=dev), 0) + \
            self.pos.take(tensor(np.arange(start, start + t)[None, :], device=dev), 0)
        for layer, attn in enumerate(self.attn):
            x = x + attn(layer_norm(x), cache=store.view(layer, tables=[table], starts=[start]))
        return layer_norm(x[:, t - 1]) @ self.head


def _round(model: _Model, prompts: list[list[int]], args: argparse.Namespace, *,
           cache: bool) -> dict[str, Any]:
    bs = args.block_size
    per = -(-len(prompts[0]) // bs)
    manager = KVCacheManager(len(prompts) * per, bs, enable_prefix_caching=cache)
    store = PagedKVStore(num_layers=args.layers, num_blocks=manager.pool.num_blocks,
                         block_size=bs, kv_heads=args.heads, head_dim=args.hidden // args.heads,
                         device=model.comm.device)
    computed, ttft, first = 0, [], []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        hit = manager.allocate(i, prompt)
        computed += len(prompt) - hit
        logits = model.prefill(prompt[hit:], hit, manager.block_table(i), store)
        realize(logits, *store.tensors())
        first.append(int(np.argmax(logits.numpy())))
        ttft.append(time.perf_counter() - t0)
    manager.check_invariants()
    return {"computed": computed, "ttft": float(np.mean(ttft)), "first": first,
            "hit_rate": manager.stats().hit_rate}


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
        def go() -> float:
            r = _round(model, prompts, args, cache=cache)
            name = "on" if cache else "off"
            if name in seen and (seen[name]["computed"], seen[name]["first"]) != \
                    (r["computed"], r["first"]):
                raise RuntimeError("bench kvcache: a round of the same candidate gave other "
                                   "tokens or counts; the cache is not deterministic")
            seen[name] = r
            return float(r["ttft"])
        return go

    times = interleave({"on": candidate(True), "off": candidate(False)}, count=args.rounds)
    if seen["on"]["first"] != seen["off"]["first"]:
        raise RuntimeError("bench kvcache: the first tokens differ with the cache on and off")
    shared = args.block_size * (min(args.prefix, prompt_len - 1) // args.block_size)
    expected = prompt_len + (args.requests - 1) * (prompt_len - shared)
    ratios = [off / on for on, off in zip(times["on"], times["off"])]
    rows = [{"cache": name, "computed": seen[name]["computed"],
             "expected": expected if name == "on" else args.requests * prompt_len,
             "hit_rate": seen[name]["hit_rate"], "ttft_ms": 1e3 * median(times[name])}
            for name in ("off", "on")]
    return {"requests": args.requests, "prefix": args.prefix, "suffix": args.suffix,
            "block_size": args.block_size, "rounds": args.rounds, "rows": rows,
            "computed_share": seen["on"]["computed"] / seen["off"]["computed"],
            "ttft_speedup": median(ratios)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fuelspmd bench kvcache",
                                description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    for name in ("requests", "prefix", "suffix", "block_size", "layers", "hidden", "heads",
                 "vocab", "rounds"):
        if getattr(args, name) < 1:
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
                 Column("ttft ms", "ttft_ms", "{:.1f}")], res["rows"])
    print(f"prefill tokens computed with the cache: {res['computed_share']:.3f} of without; "
          f"time-to-first-token speedup (median paired off/on): {res['ttft_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
