"""``from_pretrained``: a Hugging Face directory into the shards of this rank.

A directory is untrusted input, so everything is checked before anything is built:
``config.json`` is a JSON object of the documented types and ranges (the configs'
``from_hf``), the weight files' headers fit their sizes and no name leads out of the folder
(:class:`~.safetensors_io.SafetensorsReader`), and the tensors are exactly the ones the
config describes, of its shapes and a float dtype (:func:`~.hf_files.check`). Then
``model_type`` picks the class, the model is built with empty parameters (no rank ever
holds more than its shards) and each parameter reads its own block of the weights
(:func:`~.hf_files.load`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType
from fuelspmd.errors import ConfigError

from . import hf_files
from .decoder import Decoder
from .gpt2 import GPT2
from .hf_files import GENERATION
from .llama import Llama
from .safetensors_io import SafetensorsReader, read_json

__all__ = ["MODELS", "from_pretrained"]

MODELS: dict[str, type[Decoder]] = {"gpt2": GPT2, "llama": Llama}


def from_pretrained(path: str | os.PathLike[str], *, comm: Any = None, mesh: Any = None,
                    chunks: int = 1, dtype: DType | str | Any = "float32",
                    device: Device | str | None = None) -> Decoder:
    """The model in Hugging Face directory ``path``, this rank's shards of it: over ``comm``
    (a TP Communicator; None: one process) or ``mesh`` (tp x pp, this rank's stage only,
    or its ``chunks`` virtual stages). In evaluation mode, as transformers gives it
    (``model.train()`` turns the config's dropout on). Collective over the model's group:
    the ranks agree on the outcome of their reads (a damaged tensor some of them read
    raises the same error on all), and a tied ``lm_head.weight`` is checked. A directory
    that does not fit its config, or is damaged, raises a typed error before the model is
    built (see the module docstring and docs/models.md)."""
    root = Path(path)
    if not (root / "config.json").exists():
        raise ConfigError(f"from_pretrained: {root} has no config.json; give a Hugging Face "
                          "model directory")
    d = read_json(root, "config.json", "config.json")
    kind = d.get("model_type")
    if not isinstance(kind, str) or kind not in MODELS:
        raise ConfigError(f"from_pretrained: model_type {kind!r} in {root / 'config.json'} is "
                          f"not implemented; implemented: {sorted(MODELS)}: use a directory of "
                          "one of those")
    cls = MODELS[kind]
    config = cls.config_class.from_hf(d)
    generation = read_json(root, GENERATION, GENERATION) \
        if (root / GENERATION).exists() else None
    with SafetensorsReader(root) as reader:
        hf_files.check(cls, config, reader, d.get("torch_dtype", d.get("dtype")))
        model = cls(config, comm=comm, mesh=mesh, chunks=chunks, dtype=dtype, device=device)
        hf_files.load(model, reader)
    model.generation_config = generation
    model.eval()
    return model
