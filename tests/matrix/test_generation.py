"""Generation in the equivalence matrix: greedy tokens through the paged cache equal
transformers' ``generate`` for {GPT-2, Llama} x {float32, bfloat16} x {tp 1, 2, 4} x
{compiled decode on, off} x {prefix hits in a roomy pool, preemption forced by a small
one}. CI runs the all-pairs covering set of those axes, ``FUELSPMD_MATRIX=full`` all 48.

The models are small transformers models trained for a few seconds on arithmetic
sequences (``x_t = s + k t mod V``), so greedy decoding is confident: every next token's
float32 logit margin (top-1 minus top-2) along the compared paths is checked to be far
above what bfloat16 rounding moves a logit by (measured below 0.2 on these models), which
is what makes a token-for-token comparison in bfloat16 mean something. On an untrained
model a margin is often 0.01, where transformers' own bfloat16 and float32 runs disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from matrix_cases import covering, missing

import fuelspmd as fs
from fuelspmd import models

pytestmark = pytest.mark.timeout(300)

V, NEW, BS = 96, 8, 4
SMALL = 10  # blocks: the four sequences need 14 at once, the longest alone 5
MARGIN = 0.5  # the smallest float32 margin a compared token may have


def _seq(s: int, k: int, n: int) -> list[int]:
    return [(s + k * t) % V for t in range(n)]


# two pairs of prompts sharing their first blocks (prefix hits), of different lengths
PROMPTS = [_seq(10, 2, 9), _seq(10, 2, 13), _seq(40, 3, 6), _seq(40, 3, 10)]


@dataclass(frozen=True)
class Gen:
    model: str
    dtype: str
    tp: int
    compiled: bool
    pool: str  # "roomy": prefix hits only; "small": preemption too


AXES = {"model": ("gpt2", "llama"), "dtype": ("float32", "bfloat16"), "tp": (1, 2, 4),
        "compiled": (True, False), "pool": ("roomy", "small")}
FULL = [Gen(m, d, t, c, p) for m in AXES["model"] for d in AXES["dtype"]
        for t in AXES["tp"] for c in AXES["compiled"] for p in AXES["pool"]]
CASES = FULL if os.environ.get("FUELSPMD_MATRIX") == "full" else covering(FULL, list(AXES))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """(model, dtype) -> (directory, transformers' greedy tokens of every prompt)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    root = tmp_path_factory.mktemp("trained")
    torch.set_num_threads(1)
    out = {}
    for name in AXES["model"]:
        cfg = (GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                          initializer_range=0.2) if name == "gpt2" else
               LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                           initializer_range=0.2))
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg)
        opt = torch.optim.AdamW(hf.parameters(), lr=3e-3)
        rng = np.random.default_rng(0)
        for _ in range(150):
            x = torch.tensor(np.stack([_seq(int(s), int(k), 24) for s, k in
                                       zip(rng.integers(0, V, 32), rng.integers(1, 4, 32))]))
            loss = hf(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        hf.eval()
        hf.generation_config.eos_token_id = None  # every token compared
        for dt in AXES["dtype"]:
            m = hf.to(getattr(torch, dt))
            path = root / f"{name}-{dt}"
            m.save_pretrained(path)
            want, margins = [], []
            for p in PROMPTS:
                with torch.no_grad():
                    g = m.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW,
                                   pad_token_id=0, output_scores=True,
                                   return_dict_in_generate=True)
                want.append([int(t) for t in g.sequences[0, len(p):]])
                margins += [float(np.diff(np.sort(s[0].float().numpy())[-2:])[0])
                            for s in g.scores]
            if dt == "float32":
                assert min(margins) > MARGIN, (name, min(margins))
            out[(name, dt)] = (path, want)
        assert out[(name, "bfloat16")][1] == out[(name, "float32")][1]
    return out


def test_the_covering_set_covers_every_pair() -> None:
    assert missing(CASES, FULL, list(AXES)) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.model}-{c.dtype}-tp{c.tp}-"
                         f"{'compiled' if c.compiled else 'eager'}-{c.pool}")
def test_greedy_tokens_equal_transformers(trained: dict[tuple[str, str], Any], case: Gen
                                          ) -> None:
    path, want = trained[(case.model, case.dtype)]

    def gen(comm: Any) -> Any:
        model = models.from_pretrained(path, comm=comm, dtype=case.dtype)
        return models.greedy(model, PROMPTS, NEW, block_size=BS, check_every=1,
                             num_blocks=SMALL if case.pool == "small" else None,
                             compiled=case.compiled)

    outs = fs.DeviceGroup.cpu(case.tp, timeout=60).run(gen)
    for out in outs:
        assert out.tokens == want
        assert out.hit_rate > 0
        assert (out.preemptions > 0) == (case.pool == "small")
