"""Llama (``LlamaForCausalLM``) on the shared decoder: RMSNorm, rotary positions,
grouped-query attention, SwiGLU, no biases.

Hugging Face's projections are ``nn.Linear``, stored ``[out, in]``: each is read and
written transposed into our ``[in, out]``. Our gated MLP is ``fc2(silu(gate x) * fc1 x)``,
so ``fc1`` is ``up_proj``, ``gate`` is ``gate_proj`` and ``fc2`` is ``down_proj``.
"""

from __future__ import annotations

from .config import LlamaConfig
from .decoder import Decoder, Source

__all__ = ["Llama"]

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_BLOCK = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm",
          "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
          "attn.v": "self_attn.v_proj", "attn.out": "self_attn.o_proj",
          "mlp.fc1": "mlp.up_proj", "mlp.gate": "mlp.gate_proj", "mlp.fc2": "mlp.down_proj"}


class Llama(Decoder):
    """Llama over a TP communicator or a tp x pp mesh; see :mod:`.decoder`."""

    config_class = LlamaConfig

    def hf_source(self, name: str) -> Source:
        if name in _TOP:
            return Source(_TOP[name])
        _, i, rest = name.split(".", 2)
        part, leaf = rest.rsplit(".", 1)
        return Source(f"model.layers.{i}.{_BLOCK[part]}.{leaf}",
                      transpose=not part.startswith("norm"))
