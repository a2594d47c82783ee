"""Hugging Face directories in and out of a decoder model: what the model expects of the
files, checked before anything is built; each rank's blocks read; the directory written.

The expected tensors come from the model itself: a skeleton of the whole model (every
parameter empty, so nothing is allocated) gives every parameter's name and full shape,
and :meth:`~fuelspmd.models.decoder.Decoder.hf_source` where each lives in Hugging Face's
layout (transposed, a column block of a fused tensor). :func:`check` compares that with
the files' checked headers: a tensor missing or left over (a config with fewer layers
than the file), a shape that differs (a ``head_dim`` that is not the file's), a dtype that
is not a float or not the one ``config.json`` declares, each is a ConfigError naming them
all, raised before the model is built. The layer count is bounded by the number of
tensors first, so not even the skeleton grows with a config's numbers alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.checkpoint.outcome import agree
from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import ConfigError, FuelError
from fuelspmd.nn import Parameter
from fuelspmd.optim import Optimizer, ZeRO1
from fuelspmd.optim.optimizer import MASTER, master_dtype
from fuelspmd.tensor import Tensor, tensor

from .safetensors_io import SINGLE, SafetensorsReader, StreamingWriter, atomic_write_text

__all__ = ["GENERATION", "check", "layout", "load", "save"]

GENERATION = "generation_config.json"
HEAD = "lm_head.weight"
FLOATS = ("float64", "float32", "float16", "bfloat16")
# buffers that files from older transformers hold and no parameter reads
BUFFERS = re.compile(r".*\.attn\.(masked_)?bias|.*rotary_emb\.inv_freq")


def layout(skeleton: Any) -> dict[str, tuple[tuple[int, ...], list[tuple[str, Any]]]]:
    """Per Hugging Face tensor of a whole model (``skeleton``): its shape, and the
    parameters of ours it holds (name, Source), in column order."""
    full = {n: p.full_shape for n, p in skeleton.named_parameters()}
    parts: dict[str, list[tuple[str, Any]]] = {}
    for name in full:
        src = skeleton.hf_source(name)
        parts.setdefault(src.name, []).append((name, src))
    out = {}
    for hf, ps in parts.items():
        shapes = [full[n][::-1] if s.transpose else full[n] for n, s in ps]
        out[hf] = ((*shapes[0][:-1], sum(s[-1] for s in shapes)), ps)
    return out


def check(cls: Any, config: Any, reader: SafetensorsReader, declared: Any) -> None:
    """Raise ConfigError unless the files hold exactly the tensors ``config`` describes,
    of those shapes, in a float dtype (``declared``, config.json's ``torch_dtype`` or
    ``dtype``, when it names one); see the module docstring."""
    owner = f"from_pretrained({reader.root})"
    layers = config.arch.layers
    if layers > len(reader):
        raise ConfigError(f"{owner}: config.json says {layers} layers, but the weights hold "
                          f"only {len(reader)} tensors; fix config.json")
    skeleton = cls(config, device="cpu")
    want = {hf: shape for hf, (shape, _) in layout(skeleton).items()}
    if config.arch.tie and HEAD in reader:
        want[HEAD] = want[skeleton.hf_source("embed.weight").name]
    missing = [n for n in want if n not in reader]
    extra = [n for n in reader.tensors if n not in want and not BUFFERS.fullmatch(n)]
    shapes = [f"{n} is {reader.info(n)[0]}, config.json gives {want[n]}" for n in want
              if n in reader and reader.info(n)[0] != tuple(want[n])]
    kinds = sorted({reader.info(n)[1] for n in want if n in reader})
    problems = ([f"missing {missing[:4]} ({len(missing)})"] if missing else []) + \
        ([f"not in the model {extra[:4]} ({len(extra)})"] if extra else []) + \
        ([f"shapes: {'; '.join(shapes[:4])} ({len(shapes)})"] if shapes else []) + \
        ([f"dtypes {kinds}, not float"] if any(k not in FLOATS for k in kinds) else []) + \
        ([f"dtypes {kinds}, config.json says {declared}"]
         if declared in FLOATS and kinds and kinds != [declared] else [])
    if problems:
        raise ConfigError(f"{owner}: config.json does not describe the weights in the "
                          f"directory: {', '.join(problems)}; fix config.json, or use the "
                          "files it was written with")


def load(model: Any, reader: SafetensorsReader) -> None:
    """Fill every parameter of ``model`` with this rank's block of the weights, reading
    only that block; the ranks of its group agree first, so a damaged tensor that some
    ranks read raises the same error on all and nothing is assigned. Tied embeddings: an
    ``lm_head.weight`` in the file must equal the embedding (checked on this rank's rows)."""
    np_dtype = to_numpy(model.dtype)
    values: list[tuple[Parameter, np.ndarray]] = []
    error: BaseException | None = None
    differs = 0.0
    try:
        for name, p in model.named_parameters():
            values.append((p, model.hf_source(name).read(reader, p.spec).astype(np_dtype)))
        if model.arch.tie and HEAD in reader and hasattr(model, "embed"):
            spec, emb = model.embed.weight.spec, model.hf_source("embed.weight")
            head = type(emb)(HEAD)
            differs = float(not np.array_equal(head.read(reader, spec), emb.read(reader, spec)))
    except FuelError as e:
        error = e
    agree(model.group, error, "from_pretrained")
    if model.arch.tie and HEAD in reader:
        flag = tensor(np.array([differs]), device=model.group.device)
        if float(model.group.all_reduce(flag, "max").numpy()[0]):
            raise ConfigError(f"{type(model).__name__}: tie_word_embeddings is true but "
                              f"{HEAD} differs from the embedding in {reader.root}; set "
                              "tie_word_embeddings to false to load both")
    for p, v in values:
        p.assign(v)


def _masters(model: Any, masters: Any) -> Callable[[Parameter], Tensor]:
    """Parameter -> its local values in the optimiser's update dtype: the float32 master
    copy of a 16-bit parameter (ZeRO-1's slices summed over dp), else the parameter."""
    if not isinstance(masters, (Optimizer, ZeRO1)):
        raise ConfigError(f"save_pretrained(masters=...): give the optimiser that trains the "
                          f"model (an Optimizer or ZeRO1), not a {type(masters).__name__}")
    index = {id(p): i for i, p in enumerate(masters.params)}
    lost = [n for n, p in model.named_parameters() if id(p) not in index]
    if lost:
        raise ConfigError(f"save_pretrained(masters=...): the optimiser does not update "
                          f"{lost[:4]} ({len(lost)} parameters); give the one over this model")
    dt = master_dtype(model.dtype)
    state = masters.shard_state() if isinstance(masters, ZeRO1) else []

    def value(p: Parameter) -> Tensor:
        i = index[id(p)]
        if isinstance(masters, ZeRO1):
            held = state[i].get(MASTER)
            flat = np.zeros(int(np.prod(p.shape)), to_numpy(dt))
            if held is not None:
                lo, piece = held
                flat[lo:lo + piece.shape[0]] = piece.numpy()
            if masters.dp.size > 1:
                flat = masters.dp.all_reduce(tensor(flat, device=p.device), "sum").numpy()
            m: Tensor | None = tensor(flat.reshape(p.shape), device=p.device) \
                if held is not None or masters.dp.size > 1 else None
        else:
            m = masters.master[i]
        return m if m is not None and dt != model.dtype else p.astype(dt.name)

    return value


def _generation(model: Any) -> dict[str, Any]:
    """``generation_config.json``: the one the model was loaded with, else transformers'
    default made from the config (its token ids)."""
    kept = getattr(model, "generation_config", None)
    if isinstance(kept, dict):
        return kept
    extra = getattr(model.config, "extra", {})
    return {"_from_model_config": True,
            **{k: extra[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if extra.get(k) is not None}}


def save(model: Any, path: str | os.PathLike[str], masters: Any = None) -> None:
    """:meth:`~fuelspmd.models.decoder.Decoder.save_pretrained`."""
    root = Path(path)
    writer = model.group.rank == 0
    value = _masters(model, masters) if masters is not None else None
    dt = (master_dtype(model.dtype) if masters is not None else model.dtype).name
    tensors = layout(model._skeleton())
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        out = StreamingWriter(root / SINGLE, [(hf, shape, dt) for hf, (shape, _) in
                                              tensors.items()])
    mine = dict(model.named_parameters())
    full = {n: p.full_shape for n, p in model._skeleton().named_parameters()}
    try:
        for hf, (_, parts) in tensors.items():
            arrays = [_gather_to_root(model, n, mine.get(n), full[n], dt, value)
                      for n, _ in parts]
            if writer:
                arrays = [a.T if s.transpose else a for a, (_, s) in zip(arrays, parts)]
                out.write(hf, np.concatenate(arrays, -1) if len(arrays) > 1 else arrays[0])
        if writer:  # the weights first: a save failing midway leaves the old directory
            out.close()
            cfg = model.config.to_hf()
            cfg["dtype"] = dt
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = dt
            atomic_write_text(root / "config.json", json.dumps(cfg, indent=2) + "\n")
            atomic_write_text(root / GENERATION, json.dumps(_generation(model), indent=2) + "\n")
    except BaseException:
        if writer:
            out.abort()
        raise
    model.group.barrier()


def _gather_to_root(model: Any, name: str, p: Parameter | None, shape: tuple[int, ...],
                    dt: str, value: Callable[[Parameter], Tensor] | None
                    ) -> np.ndarray | None:
    """Parameter ``name``'s full array on rank 0 of the group (None elsewhere): gathered
    over tp on its stage, then broadcast over pp from that stage (its bits, a collective
    every stage enters, so none runs ahead of rank 0)."""
    owner = model._owner(name)
    t: Tensor | None = None
    if model.stage == owner:
        assert p is not None
        t = p if value is None else value(p)  # every dp rank: ZeRO-1 sums masters over dp
    if model.dp_coord != 0:
        return None
    arr = None
    if t is not None:
        assert p is not None
        arr = (t if p.spec.replicated else model.comm.all_gather(t, axis=p.spec.dim)).numpy()
    if model.comm.rank != 0:
        return None
    if model.pp_comm.size > 1:
        mine = np.empty(shape, to_numpy(dt)) if arr is None else arr
        arr = model.pp_comm.broadcast(tensor(mine, device=model.comm.device),
                                      root=owner).numpy()
    return arr if model.group.rank == 0 else None
