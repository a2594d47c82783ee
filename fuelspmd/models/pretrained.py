"""``from_pretrained``: a Hugging Face directory into the shards of this rank.

``config.json``'s ``model_type`` picks the class; the model is built with empty parameters
(no rank ever holds more than its shards) and each parameter reads its own block of the
weights (:meth:`~fuelspmd.models.decoder.Decoder.load_hf`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType
from fuelspmd.errors import ConfigError

from .decoder import Decoder
from .gpt2 import GPT2
from .llama import Llama

__all__ = ["MODELS", "from_pretrained"]

MODELS: dict[str, type[Decoder]] = {"gpt2": GPT2, "llama": Llama}


def from_pretrained(path: str | os.PathLike[str], *, comm: Any = None, mesh: Any = None,
                    chunks: int = 1, dtype: DType | str | Any = "float32",
                    device: Device | str | None = None) -> Decoder:
    """The model in Hugging Face directory ``path``, this rank's shards of it: over ``comm``
    (a TP Communicator; None: one process) or ``mesh`` (tp x pp, this rank's stage only,
    or its ``chunks`` virtual stages). In evaluation mode, as transformers gives it
    (``model.train()`` turns the config's dropout on). Collective over the model's group
    only where a tied ``lm_head.weight`` is checked."""
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise ConfigError(f"from_pretrained: {root} has no config.json; give a Hugging Face "
                          "model directory")
    d = json.loads(cfg_path.read_text())
    kind = d.get("model_type")
    if kind not in MODELS:
        raise ConfigError(f"from_pretrained: model_type {kind!r} in {cfg_path} is not "
                          f"implemented; implemented: {sorted(MODELS)}: use a directory of "
                          "one of those")
    cls = MODELS[kind]
    model = cls(cls.config_class.from_hf(d), comm=comm, mesh=mesh, chunks=chunks,
                dtype=dtype, device=device)
    model.load_hf(root)
    model.eval()
    return model
