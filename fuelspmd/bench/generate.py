"""``fuelspmd bench generate``: greedy serving through the paged KV cache against Hugging Face.

    fuelspmd bench generate [--model gpt2] [--layers 2] [--hidden 128] [--requests 8]
                            [--prefix 64] [--suffix 8] [--new-tokens 16] [--rounds 3] [--json]
    mpiexec -n 2 fuelspmd bench generate --layers 8 --hidden 1024   # TP 2 beside TP 1

The workload: ``requests`` prompts sharing a ``prefix``-token prefix, each adding ``suffix``
tokens of its own, generated greedily for ``new_tokens`` tokens. The model is a GPT-2 or
Llama from :mod:`fuelspmd.models` with seeded random weights (float32), written with
``save_pretrained`` and loaded by transformers, so Hugging Face runs the same weights.

Candidates, interleaved round by round (hf, tp1, tpN, hf, ...):

- ``hf``: transformers' ``generate(do_sample=False)`` of the whole batch (the prompts have
  one length: no padding), torch CPU; its time to first token is a ``max_new_tokens=1``
  generate of the batch, timed in the same round;
- ``tp1``: :func:`fuelspmd.models.greedy` (prefix-cached prefill one request after
  another, then the batch decoded one token per step) on one rank;
- ``tpN`` (under ``mpiexec -n N``): the same at TP N over the world.

Under mpiexec ``hf`` and ``tp1`` run on rank 0 alone while the others wait. One BLAS
thread per rank (threadpoolctl) and one torch thread, so TP N uses N cores and the rest
one. Tokens per second count every generated token of every request over the whole call
(prefill included); time to first token is greedy's mean over the requests (from the
batch's arrival). ``plan_misses_per_token``: plan-cache misses of the first (untimed)
call over its generated tokens: a plan per prefill shape and one per decode bucket, the
decode steps of a bucket reusing its plan. ``tokens_equal``: the tokens
agree with transformers' (float32: a near tie may flip).

Pool sizes: the decode step time at pools of 1x, 4x and 16x the blocks the requests need,
each the median of a greedy call's ``Generation.decode_step_s``, interleaved in an order
reversed every round;
``pool_ratio`` = the 16x step time over the 1x one (paired by round, median).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd import models
from fuelspmd.bench import Column, interleave, median, parser, print_json, print_table
from fuelspmd.comm.communicator import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.graph import default_executor
from fuelspmd.launch import detect_launcher, init
from fuelspmd.models.config import GPT2Config, LlamaConfig
from fuelspmd.transport import SelfTransport

__all__ = ["main", "run"]

POOLS = (1, 4, 16)


def config(args: argparse.Namespace) -> Any:
    """The model's configuration from the command line."""
    if args.model == "gpt2":
        return GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers,
                          n_head=args.heads, n_positions=args.max_len)
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=args.max_len)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    g = np.random.default_rng(1)
    prefix = g.integers(0, args.vocab, args.prefix).tolist()
    return [prefix + g.integers(0, args.vocab, args.suffix).tolist()
            for _ in range(args.requests)]


def needed_blocks(args: argparse.Namespace) -> int:
    """What :func:`fuelspmd.models.greedy` sizes its pool by (one block spare)."""
    per = -(-(args.prefix + args.suffix + args.new_tokens) // args.block_size)
    return args.requests * per + 1


class _Greedy:
    """One candidate's greedy call on ``model``; keeps the tokens of its last call."""

    def __init__(self, model: Any, args: argparse.Namespace) -> None:
        self.model, self.args, self.tokens = model, args, None
        self.misses_per_token = 0.0

    def __call__(self, new_tokens: int | None = None, num_blocks: int | None = None
                 ) -> models.Generation:
        a, cache = self.args, default_executor().cache
        new = a.new_tokens if new_tokens is None else new_tokens
        before = cache.misses
        out = models.greedy(self.model, prompts(a), new, block_size=a.block_size,
                            num_blocks=num_blocks)
        if new_tokens is None:
            if self.tokens is None:  # the first call: every plan is made in it
                self.misses_per_token = (cache.misses - before) / (a.requests * new)
            self.tokens = out.tokens
        return out


def _hf_model(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no early stop: every token generated
    return model


def _hf_generate(model: Any, ids: np.ndarray, new: int) -> list[list[int]]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def run(args: argparse.Namespace, world: Any = None) -> dict[str, Any]:
    """Interleave ``args.rounds`` rounds of every candidate; return the report (rank 0's)."""
    from threadpoolctl import threadpool_limits

    comm = world.comm if world is not None else None
    lead = comm is None or comm.rank == 0
    fence = comm.barrier if comm is not None and comm.size > 1 else (lambda: None)
    cfg = config(args)
    ps = prompts(args)
    ids = np.asarray(ps)
    root = Path(tempfile.mkdtemp(prefix="fuelspmd-bench-generate-")) if lead else None
    with threadpool_limits(limits=1, user_api="blas"):
        try:
            cls = models.GPT2 if args.model == "gpt2" else models.Llama
            solo = Communicator(SelfTransport(), device="cpu")
            one = cls(cfg, comm=solo, seed=0) if lead else None
            many = cls(cfg, comm=comm, seed=0) if comm is not None and comm.size > 1 else None
            hf = None
            if lead:
                assert one is not None and root is not None
                one.save_pretrained(root / "model")
                hf = _hf_model(root / "model")
            g1 = _Greedy(one, args) if one is not None else None
            gn = _Greedy(many, args) if many is not None else None
            seen: dict[str, Any] = {}

            def fenced(fn: Callable[[], dict[str, float]], name: str) -> Callable[[], float]:
                def once() -> float:
                    fence()
                    seen.setdefault(name, []).append(fn())
                    fence()
                    return seen[name][-1]["tokens_per_s"]
                return once

            def hf_round() -> dict[str, float]:
                if hf is None:
                    return {"tokens_per_s": 0.0, "ttft_s": 0.0}
                t0 = time.perf_counter()
                _hf_generate(hf, ids, 1)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                seen["hf_tokens"] = _hf_generate(hf, ids, args.new_tokens)
                elapsed = time.perf_counter() - t0
                return {"tokens_per_s": args.requests * args.new_tokens / elapsed,
                        "ttft_s": ttft}

            def ours(gen: _Greedy | None) -> Callable[[], dict[str, float]]:
                def go() -> dict[str, float]:
                    if gen is None:
                        return {"tokens_per_s": 0.0, "ttft_s": 0.0}
                    out = gen()
                    return {"tokens_per_s": out.tokens_per_s, "ttft_s": out.ttft_s}
                return go

            cand = {"hf": fenced(hf_round, "hf"), "tp1": fenced(ours(g1), "tp1")}
            if gn is not None:
                cand[f"tp{comm.size}"] = fenced(ours(gn), f"tp{comm.size}")
            for fn in cand.values():  # warm: plans cached, torch's first call done
                fn()
            seen.clear()
            interleave(cand, count=args.rounds)
            pools = _pools(gn or g1, args, fence)  # type: ignore[arg-type]
        finally:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
    if not lead:
        return {}
    names = list(cand)
    rows = [{"candidate": n, "tokens_per_s": median([r["tokens_per_s"] for r in seen[n]]),
             "ttft_ms": 1e3 * median([r["ttft_s"] for r in seen[n]])} for n in names]
    for row in rows:
        gen = {"tp1": g1, **({names[-1]: gn} if gn is not None else {})}.get(
            row["candidate"])
        if gen is not None:
            row["plan_misses_per_token"] = gen.misses_per_token
            row["tokens_equal"] = gen.tokens == seen["hf_tokens"]

    def ratio(a: str, b: str) -> float:
        return median([x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(seen[a], seen[b])])

    res: dict[str, Any] = {
        "model": args.model, "layers": args.layers, "hidden": args.hidden,
        "requests": args.requests, "prefix": args.prefix, "suffix": args.suffix,
        "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows,
        "tp1_over_hf": ratio("tp1", "hf"), "pools": pools["rows"],
        "pool_ratio": pools["ratio"]}
    if len(names) > 2:
        res[f"{names[-1]}_over_tp1"] = ratio(names[-1], "tp1")
    return res


def _pools(gen: _Greedy, args: argparse.Namespace, fence: Callable[[], object]
           ) -> dict[str, Any]:
    """Decode step time at pools of 1x, 4x, 16x the needed blocks (see the module)."""
    need = needed_blocks(args)

    def step_time(factor: int) -> Callable[[], float]:
        def once() -> float:
            fence()
            steps = gen(args.new_tokens, need * factor).decode_step_s
            fence()
            return median(steps)  # the first steps of a bucket trace its plan: not the median
        return once

    cand = {f"{f}x": step_time(f) for f in POOLS}
    for fn in cand.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cand}
    for r in range(args.rounds):  # A B C, C B A, ...: no candidate always runs last
        names = list(cand)[::-1] if r % 2 else list(cand)
        for name, got in interleave({n: cand[n] for n in names}, count=1).items():
            times[name] += got
    rows = [{"pool": name, "blocks": need * f, "step_ms": 1e3 * median(times[name])}
            for name, f in zip(cand, POOLS)]
    last, first = f"{POOLS[-1]}x", f"{POOLS[0]}x"
    ratio = median([a / b for a, b in zip(times[last], times[first])])
    return {"rows": rows, "ratio": ratio}


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table (or JSON). Returns the exit code."""
    p = parser("fuelspmd bench generate", __doc__)
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="llama's key/value heads (2)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefix", type=int, default=64)
    p.add_argument("--suffix", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per candidate (3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    world = init(timeout=600.0) if detect_launcher().size > 1 else None
    for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "requests", "prefix",
                 "suffix", "block_size", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be >= 2 (a decode step), got {args.new_tokens}")
    args.max_len = args.prefix + args.suffix + args.new_tokens
    try:
        res = run(args, world)
    except ConfigError as e:
        print(f"fuelspmd bench generate: {e}", file=sys.stderr, flush=True)
        return 2
    if world is not None and world.rank != 0:
        return 0
    if args.json:
        print_json({"bench": "generate", **res})
        return 0
    print_table(f"generate: {args.model} {args.layers} layers x {args.hidden}, "
                f"{args.requests} requests, {args.prefix}-token shared prefix + "
                f"{args.suffix} each, {args.new_tokens} new tokens, float32, 1 thread per "
                f"rank (median of {args.rounds} interleaved rounds)",
                [Column("candidate", "candidate"),
                 Column("tokens/s", "tokens_per_s", "{:.1f}"),
                 Column("ttft ms", "ttft_ms", "{:.1f}"),
                 Column("plan misses/token", "plan_misses_per_token", "{:.3f}"),
                 Column("tokens = hf", "tokens_equal")], res["rows"])
    print_table("decode step time by pool size",
                [Column("pool", "pool"), Column("blocks", "blocks"),
                 Column("step ms", "step_ms", "{:.2f}")], res["pools"])
    extra = "".join(f"; {k.removesuffix('_over_tp1')}/tp1 tokens/s: {v:.2f}x"
                    for k, v in res.items() if k.endswith("_over_tp1"))
    print(f"tp1/hf tokens/s: {res['tp1_over_hf']:.2f}x{extra}; decode step 16x/1x pool: "
          f"{res['pool_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
