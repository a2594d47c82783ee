"""``fuelspmd.models`` (layer 8): reference GPT-2 and Llama models with Hugging Face
directories in and out.

Both are one decoder (:mod:`.decoder`) on :mod:`fuelspmd.nn` and the TP layers, built over
a TP communicator or a tp x pp mesh. :func:`from_pretrained` reads a Hugging Face directory
straight into each rank's shards; ``model.save_pretrained(dir)`` writes one transformers
loads; ``model(ids)`` gives the full logits; :func:`greedy` (``model.generate``) decodes
through the paged KV cache.
"""

from __future__ import annotations

from .config import Arch, GPT2Config, LlamaConfig
from .decoder import Decoder, stage_layers
from .generate import Generation, greedy
from .gpt2 import GPT2
from .llama import Llama
from .pretrained import MODELS, from_pretrained

__all__ = ["GPT2", "MODELS", "Arch", "Decoder", "GPT2Config", "Generation", "Llama",
           "LlamaConfig", "from_pretrained", "greedy", "stage_layers"]
