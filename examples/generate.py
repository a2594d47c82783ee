"""Greedy generation with a tensor-parallel transformer over a paged, prefix-cached KV cache.

The same program runs with ranks as processes or as devices of one process::

    python examples/generate.py                        # one rank
    mpiexec -n 2 python examples/generate.py           # two processes: heads split 2 ways
    python examples/generate.py --devices cpu:2        # two devices of one process
    python examples/generate.py --check                # also compare with a no-cache reference
    python examples/generate.py --from DIR --check     # a Hugging Face GPT-2 or Llama directory

A batch of requests shares a long prompt prefix and each adds a few tokens of its own.
Each rank runs the same :class:`KVCacheManager` (checked by a :class:`KVCacheCoordinator`)
and keeps the keys and values of its own heads in a :class:`PagedKVStore`. Prefill
computes only the part of a prompt the prefix cache does not hold; decoding runs the whole
batch one token per step, attention reading every sequence through its block table.
``--pool-blocks N`` sizes the pool (default: what the requests need). Rank 0 prints one
JSON line: prefix hit rate, blocks used, ``tokens_per_s``, ``ttft_s`` and, with
``--check``, whether the tokens EQUAL those of a plain numpy model that recomputes
attention over the whole sequence at every step, without any cache. With ``--from DIR``
the model is :func:`fuelspmd.models.from_pretrained` of that directory (each rank reading
its shards), the vocabulary the model's, and ``--check`` compares with the same model's
forward over the whole sequence at every step, without any cache. The loop is
:func:`fuelspmd.models.greedy` either way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import models
from fuelspmd import tensor_parallel as tp
from fuelspmd.distributed_cache import PagedKVStore
from fuelspmd.functional import layer_norm

DTYPE = "float64"  # greedy argmax must not flip on a rounding difference between modes


def make_weights(args: argparse.Namespace) -> dict[str, Any]:
    """The full model, seeded: the same arrays on every rank and in the reference."""
    g = np.random.default_rng(args.seed)
    h, f, v = args.hidden, args.ffn, args.vocab

    def w(*shape: int) -> np.ndarray:
        return g.standard_normal(shape) / math.sqrt(shape[0])

    layers = [{"attn": [w(h, h), 0.1 * w(h), w(h, h), 0.1 * w(h), w(h, h), 0.1 * w(h),
                        w(h, h), 0.1 * w(h)],
               "mlp": [w(h, f), 0.1 * w(f), w(f, h), 0.1 * w(h)]} for _ in range(args.layers)]
    return {"embed": g.standard_normal((v, h)), "pos": 0.5 * g.standard_normal((args.max_len, h)),
            "head": w(h, v), "layers": layers}


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``args.requests`` prompts: one shared prefix, then a few tokens of each request's own."""
    g = np.random.default_rng([args.seed, 1])
    prefix = g.integers(0, args.vocab, args.prefix).tolist()
    return [prefix + g.integers(0, args.vocab, args.suffix).tolist()
            for _ in range(args.requests)]


class PagedTransformer:
    """Pre-norm transformer: x += attn(ln x); x += mlp(ln x); logits = ln(x) @ head.

    Attention and MLP are tensor-parallel (heads and ffn features split over ``comm``);
    the embedding, positions and head are replicated. Attention keys and values go through
    ``store``, so a step computes only its new tokens.
    """

    def __init__(self, weights: dict[str, Any], *, comm: Any, heads: int) -> None:
        dev = comm.device
        self.comm, self.heads = comm, heads
        self.embed = fs.tensor(weights["embed"], device=dev, dtype=DTYPE)
        self.pos = fs.tensor(weights["pos"], device=dev, dtype=DTYPE)
        self.head = fs.tensor(weights["head"], device=dev, dtype=DTYPE)
        hidden = weights["embed"].shape[1]
        self.attn = [tp.ParallelAttention(hidden, heads, comm=comm, full=lw["attn"],
                                          device=dev, dtype=DTYPE) for lw in weights["layers"]]
        self.mlp = [tp.ParallelMLP(hidden, lw["mlp"][0].shape[1], comm=comm, full=lw["mlp"],
                                   device=dev, dtype=DTYPE) for lw in weights["layers"]]

    def kv_layout(self) -> tuple[int, int, int, fs.DType]:
        """What :func:`fuelspmd.models.greedy` sizes the store by."""
        kv_heads, head_dim = self.attn[0].cache_heads  # what this rank stores per token
        return len(self.attn), kv_heads, head_dim, fs.float64

    def step(self, tokens: np.ndarray, *, starts: list[int], tables: list[list[int]],
             store: PagedKVStore, compiled: bool = True) -> fs.Tensor:
        """Logits ``(batch, vocab)`` at the last of ``tokens`` ``(batch, t)``."""
        dev = self.comm.device
        t = tokens.shape[1]
        pos = np.asarray(starts)[:, None] + np.arange(t)[None, :]
        x = self.embed.take(fs.tensor(tokens, device=dev), 0) + \
            self.pos.take(fs.tensor(pos, device=dev), 0)
        for layer, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(layer_norm(x), cache=store.view(layer, tables=tables, starts=starts))
            x = x + mlp(layer_norm(x))
        return layer_norm(x[:, t - 1]) @ self.head


def generate(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy tokens of every request (:func:`fuelspmd.models.greedy`) and what the cache
    did; sequence ``i * samples + s`` is sample ``s`` of request ``i``."""
    model: Any = (models.from_pretrained(args.from_dir, comm=comm, dtype=DTYPE)
                  if args.from_dir else PagedTransformer(make_weights(args), comm=comm,
                                                         heads=args.heads))
    out = models.greedy(model, make_prompts(args), args.new_tokens,
                        block_size=args.block_size, samples=args.samples,
                        prefix_caching=not args.no_prefix_cache,
                        check_every=args.check_every, coordinate=args.coordinate,
                        num_blocks=args.pool_blocks)
    return {"tp": comm.size, "requests": args.requests, "samples": args.samples,
            "prefix": args.prefix, "prefix_cache": not args.no_prefix_cache,
            "hit_rate": round(out.hit_rate, 4),
            "prefill_tokens_computed": out.prefill_tokens_computed,
            "blocks_used": out.blocks_used, "blocks_total": out.blocks_total,
            "copies": out.copies, "ttft_s": round(out.ttft_s, 4),
            "tokens_per_s": round(out.tokens_per_s, 1), "tokens": out.tokens}


# ---- the reference: plain numpy, whole sequence, no cache --------------------------------
def _ln(x: np.ndarray) -> np.ndarray:
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(weights: dict[str, Any], tokens: list[int], heads: int) -> np.ndarray:
    """Logits at the last position, attention recomputed over every position."""
    n = len(tokens)
    x = weights["embed"][tokens] + weights["pos"][:n]
    hidden = x.shape[1]
    d = hidden // heads
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for lw in weights["layers"]:
        wq, bq, wk, bk, wv, bv, wo, bo = lw["attn"]
        h = _ln(x)
        q, k, v = ((h @ w + b).reshape(n, heads, d).transpose(1, 0, 2)
                   for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + (p @ v).transpose(1, 0, 2).reshape(n, hidden) @ wo + bo
        a, ab, b2, bb = lw["mlp"]
        x = x + _gelu(_ln(x) @ a + ab) @ b2 + bb
    return _ln(x[-1]) @ weights["head"]


def reference_tokens(args: argparse.Namespace) -> list[list[int]]:
    """Greedy tokens of every sequence (each request's samples alike) from
    :func:`reference_logits`, or with ``--from`` from the model's whole-sequence forward
    in one process."""
    if args.from_dir:
        model = models.from_pretrained(args.from_dir, dtype=DTYPE)

        def last(seq: list[int]) -> np.ndarray:
            return model(np.asarray([seq])).numpy()[0, -1]
    else:
        weights = make_weights(args)

        def last(seq: list[int]) -> np.ndarray:
            return reference_logits(weights, seq, args.heads)

    out = []
    for prompt in make_prompts(args):
        seq = list(prompt)
        for _ in range(args.new_tokens):
            seq.append(int(np.argmax(last(seq))))
        out += [seq[len(prompt):]] * args.samples
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--devices", default=None,
                   help="run as a DeviceGroup in this process: 'cpu:2' (a count: cpu:0 "
                        "and cpu:1) or a list 'cpu:0,strict:0'")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefix", type=int, default=128, help="shared prompt tokens")
    p.add_argument("--suffix", type=int, default=8, help="each request's own prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--samples", type=int, default=1,
                   help="sequences per request, forked after prefill (copy-on-write)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                   help="a Hugging Face GPT-2 or Llama directory (config.json and "
                        "safetensors): its model and vocabulary instead of the seeded one")
    p.add_argument("--check-every", type=int, default=4,
                   help="digest check of the block tables every N decode steps (1: debug)")
    p.add_argument("--coordinate", choices=("check", "leader"), default="check",
                   help="check: same calls on every rank, digests compared; leader: rank 0's "
                        "calls broadcast and replayed")
    p.add_argument("--pool-blocks", type=int, default=None, metavar="N",
                   help="blocks in the KV pool (default: what the requests need); a larger "
                        "pool must not slow a step: writes and reads touch only the "
                        "step's blocks")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="compare the tokens with a no-cache numpy reference (must be EQUAL)")
    args = p.parse_args(argv)
    for name in ("requests", "prefix", "suffix", "new_tokens", "block_size", "samples",
                 "layers", "hidden", "heads", "ffn", "vocab", "check_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pool_blocks is not None and args.pool_blocks < 1:
        p.error(f"--pool-blocks must be >= 1, got {args.pool_blocks}")
    args.max_len = args.prefix + args.suffix + args.new_tokens
    if args.from_dir:  # the prompts are drawn from the model's vocabulary
        cfg = json.loads((Path(args.from_dir) / "config.json").read_text())
        args.vocab = int(cfg["vocab_size"])
        most = cfg.get("n_positions", cfg.get("max_position_embeddings"))
        if most is not None and args.max_len > most:
            p.error(f"--prefix + --suffix + --new-tokens = {args.max_len} positions, but the "
                    f"model has {most}; give shorter prompts or fewer new tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.devices is not None:
        group = fs.DeviceGroup.parse(args.devices, timeout=60.0)
        print(f"{group} from --devices {args.devices}", file=sys.stderr)
        result = group.run(generate, [args] * group.size)[0]
    else:
        world = fs.init(timeout=60.0)
        result = generate(world.comm, args)
        if world.rank != 0:
            return 0
    ok = True
    if args.check:
        ok = result["tokens"] == reference_tokens(args)
        result["check"] = "EQUAL" if ok else "DIFFERENT"
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
