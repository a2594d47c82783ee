"""GPT-2 (``GPT2LMHeadModel``) on the shared decoder: learned positions, LayerNorm, GELU.

Hugging Face stores GPT-2's projections as ``Conv1D``, already ``[in, out]`` like ours, and
the attention's Q, K and V fused as ``c_attn`` ``[hidden, 3 * hidden]`` (``[Q | K | V]``
columns): our q, k and v read and write their column blocks of it. The head is the
embedding table (``lm_head.weight`` is not stored) unless ``tie_word_embeddings`` is false.
"""

from __future__ import annotations

from .config import GPT2Config
from .decoder import Decoder, Source

__all__ = ["GPT2"]

_TOP = {"embed.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
        "head.weight": "lm_head.weight"}
_BLOCK = {"norm1": "ln_1", "norm2": "ln_2", "attn.out": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
          "mlp.fc2": "mlp.c_proj"}
_QKV = {"attn.q": 0, "attn.k": 1, "attn.v": 2}


class GPT2(Decoder):
    """GPT-2 over a TP communicator or a tp x pp mesh; see :mod:`.decoder`."""

    config_class = GPT2Config

    def hf_source(self, name: str) -> Source:
        if name in _TOP:
            return Source(_TOP[name])
        _, i, rest = name.split(".", 2)
        part, leaf = rest.rsplit(".", 1)
        prefix = f"transformer.h.{i}."
        if part in _QKV:
            width = self.arch.heads * self.arch.head_dim
            return Source(f"{prefix}attn.c_attn.{leaf}", offset=_QKV[part] * width)
        return Source(f"{prefix}{_BLOCK[part]}.{leaf}")
