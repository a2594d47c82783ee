"""Small Hugging Face models for the fuelspmd.models tests, built by transformers from
configs with random weights (nothing downloaded), in float64, and transformers' own
logits and greedy ``generate`` as the oracle.

transformers' Llama computes RMSNorm and the rotary tables in float32 even in a float64
model (``hidden_states.to(torch.float32)``, ``inv_freq`` in float32). :func:`float64_llama`
swaps those two forwards for the same formulas in float64 while it is active, so the
oracle is float64 throughout and the comparison is to float64 rounding; the plain
transformers forward is compared too, at float32's rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 96  # divisible by the TP sizes 1..4

CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(kind="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                 n_positions=64),
    "llama": dict(kind="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  tie_word_embeddings=False),
    "llama_tied": dict(kind="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=VOCAB, tie_word_embeddings=True),
    # an explicit head_dim wider than hidden / heads, and 3 layers (stages of 1 and 2)
    "llama_head_dim": dict(kind="llama", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, vocab_size=VOCAB, rope_theta=500.0),
}


def build(name: str, path: Path, *, seed: int = 0, dtype: str = "float64",
          max_shard_size: str | None = None) -> Any:
    """transformers' model ``name`` with seeded random weights, saved to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    kw = dict(CONFIGS[name])
    kind = kw.pop("kind")
    if kind == "llama" and "rope_theta" in kw:
        kw["rope_parameters"] = {"rope_theta": kw.pop("rope_theta"), "rope_type": "default"}
    # wider weights than the default 0.02, so logits spread and greedy margins are wide
    cfg = (GPT2Config if kind == "gpt2" else LlamaConfig)(initializer_range=0.2, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).eval()
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **extra)
    return model


@contextlib.contextmanager
def float64_llama() -> Iterator[None]:
    """transformers' Llama RMSNorm and rotary embedding computed in the model's dtype."""
    import torch
    from transformers.models.llama import modeling_llama as ml

    def rms(self: Any, h: Any) -> Any:
        var = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.variance_epsilon))

    def rope(self: Any, x: Any, position_ids: Any) -> Any:
        cfg = self.config
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        base = cfg.rope_parameters["rope_theta"]
        inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        ang = position_ids[..., None].double() * inv
        emb = torch.cat((ang, ang), -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    saved = ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward
    ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward = rms, rope
    try:
        yield
    finally:
        ml.LlamaRMSNorm.forward, ml.LlamaRotaryEmbedding.forward = saved


def hf_logits(model: Any, ids: np.ndarray, *, exact: bool = True) -> np.ndarray:
    """transformers' logits (batch, seq, vocab); ``exact``: float64 throughout."""
    import torch

    ctx = float64_llama() if exact else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        return model(torch.tensor(ids)).logits.numpy()


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` tokens after ``prompt``."""
    import torch

    model.generation_config.eos_token_id = None  # no early stop: every token compared
    with torch.no_grad(), float64_llama():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def prompts(seed: int = 1) -> list[list[int]]:
    """Two prompts of different lengths sharing a prefix of 5 tokens."""
    g = np.random.default_rng(seed)
    prefix = g.integers(0, VOCAB, 5).tolist()
    return [prefix + g.integers(0, VOCAB, 4).tolist(), prefix + g.integers(0, VOCAB, 7).tolist()]


def margins(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 of each row: a greedy comparison means something only where the
    margin is far above the two sides' rounding differences."""
    top = np.sort(logits, -1)
    return top[..., -1] - top[..., -2]
