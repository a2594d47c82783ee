"""What a ``state`` dict holds, as global tensors: names, full shapes, boxes, values.

A parameter's global identity is ``<state key>/<its dotted name>`` and its Spec: a rank
holds block ``spec.comm.rank`` of ``spec.comm.size`` along ``spec.dim`` (all of it when
replicated). An optimiser's state follows its parameter, found by object identity among the
modules of the same ``state``: ``<optimiser key>/<parameter key>/<state name>``, with the
parameter's full shape; what the optimiser holds of it (all of the local shard, or a ZeRO-1
flat slice) comes from ``shard_state`` as a flat range, cut into boxes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuelspmd.comm import Communicator
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import CheckpointMismatchError, ConfigError
from fuelspmd.launch import current
from fuelspmd.nn import Module, Parameter
from fuelspmd.optim import Optimizer, ZeRO1
from fuelspmd.tensor import Tensor, realize

from .layout import Box, Entry, block_box, flat_boxes, shift
from .shards import Shards

__all__ = ["Held", "Loading", "collect", "group_of"]

Optimiser = Optimizer | ZeRO1


def param_box(p: Parameter) -> Box:
    s = p.spec
    return block_box(s.full_shape, s.dim, s.comm.rank if s.comm else 0,
                     s.comm.size if s.comm else 1)


@dataclass
class Held:
    """What this rank holds of a state: its entries, their values (host copies after
    :meth:`copy`), the plain values and each optimiser's step count."""

    entries: list[Entry]
    tensors: list[Tensor]
    cuts: list[tuple[int, int] | None]  # flat range of the tensor an entry takes, or all
    values: dict[str, Any]
    steps: dict[str, int]
    arrays: list[np.ndarray] | None = None

    def copy(self) -> None:
        """Realise every tensor and copy its values to host memory (the only part of an
        asynchronous save the caller waits for)."""
        realize(*self.tensors)
        whole: dict[int, np.ndarray] = {}
        out = []
        for e, t, cut in zip(self.entries, self.tensors, self.cuts):
            if id(t) not in whole:
                whole[id(t)] = np.array(t.numpy(), copy=True).reshape(-1)
            flat = whole[id(t)]
            piece = flat if cut is None else flat[cut[0]:cut[1]]
            out.append(piece.reshape(tuple(b - a for a, b in e.box)))
        self.arrays = out


def _modules(state: Mapping[str, Any]) -> dict[int, str]:
    """id(parameter) -> its global key, over every module of ``state``."""
    names: dict[int, str] = {}
    for k, v in state.items():
        if isinstance(v, Module):
            for name, p in v.named_parameters():
                names.setdefault(id(p), f"{k}/{name}")
    return names


def _optimiser_keys(owner: str, k: str, opt: Optimiser, names: dict[int, str]) -> list[str]:
    keys, lost = [], []
    for i, p in enumerate(opt.params):
        if id(p) in names:
            keys.append(names[id(p)])
        else:
            lost.append(f"#{i} {p!r}")
    if lost:
        raise CheckpointMismatchError(
            f"{owner}: optimiser {k!r} updates parameters that are in no module of the state "
            f"({', '.join(lost[:4])}); put the module holding them in the state dict")
    return keys


def collect(state: Mapping[str, Any]) -> Held:
    """This rank's entries of ``state`` (see the module docstring)."""
    names = _modules(state)
    held = Held([], [], [], {}, {})

    def add(key: str, p: Parameter, t: Tensor, box: Box, cut: tuple[int, int] | None) -> None:
        held.entries.append(Entry(key, p.full_shape, t.dtype.name, box))
        held.tensors.append(t)
        held.cuts.append(cut)

    for k, v in state.items():
        if not isinstance(k, str) or "/" in k:
            raise ConfigError(f"checkpoint: state key {k!r} must be a str without '/'")
        if isinstance(v, Module):
            for name, p in v.named_parameters():
                add(f"{k}/{name}", p, p, param_box(p), None)
        elif isinstance(v, (Optimizer, ZeRO1)):
            keys = _optimiser_keys("checkpoint.save", k, v, names)
            held.steps[k] = v.steps
            for p, key, st in zip(v.params, keys, v.shard_state()):
                origin = param_box(p)
                for sname, (lo, flat) in st.items():
                    at = 0
                    for b in flat_boxes(p.shape, lo, lo + flat.size):
                        n = math.prod(e - s for s, e in b)
                        add(f"{k}/{key}/{sname}", p, flat, shift(b, origin), (at, at + n))
                        at += n
        else:
            try:  # a copy: the caller may change the value while the save writes
                v = json.loads(json.dumps(v))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"checkpoint.save: state[{k!r}] is a {type(v).__name__}, "
                                  f"neither a Module, an optimiser nor a JSON value ({e}); "
                                  "pass a JSON value instead (a numpy Generator: "
                                  "rng.bit_generator.state)"
                                  ) from None
            held.values[k] = v
    return held


def group_of(state: Mapping[str, Any], mesh: Any, comm: Communicator | None
             ) -> Communicator | None:
    """The communicator of every rank taking part: the mesh's, ``comm``, the one
    communicator the state is sharded over, or the world of ``fs.init()`` (None: this
    process alone)."""
    if mesh is not None:
        return mesh.comm_group  # type: ignore[no-any-return]
    if comm is not None:
        return comm
    found: dict[int, Communicator] = {}
    for v in state.values():
        if isinstance(v, Module):
            found.update({id(p.spec.comm): p.spec.comm for p in v.parameters()
                          if p.spec.comm is not None and p.spec.comm.size > 1})
        elif isinstance(v, ZeRO1) and v.dp.size > 1:
            found[id(v.dp)] = v.dp
    world = current()  # every rank of the job: replicated state (pp stages, dp replicas),
    # or state sharded over several communicators (tp and dp)
    if len(found) == 1:
        return next(iter(found.values()))
    if world is not None and world.size > 1:
        return world.comm
    if found:
        raise ConfigError(f"checkpoint: the state is sharded over {len(found)} communicators "
                          "(tp and dp?); pass mesh= (or comm=, the group of every rank)")
    return None


class Loading:
    """A load in two phases, so that it is all or nothing. :meth:`prepare` reads and checks
    everything (names, full shapes, dtypes, every byte's checksum) into host memory and
    loads the optimisers, each after a snapshot of what it held; then the ranks agree, and
    :meth:`apply` assigns the parameters, or :meth:`rollback` restores the optimisers from
    their snapshots (through their own ``shard_state``/``load_shard_state``), so a failure
    anywhere leaves every rank's model and optimiser as they were."""

    def __init__(self) -> None:
        self.params: list[tuple[Parameter, np.ndarray]] = []
        self._undo: list[Any] = []

    def prepare(self, shards: Shards, state: Mapping[str, Any]) -> None:
        index = shards.index
        tensors = index["tensors"]
        plan, bad, missing = [], [], []
        for k, v in state.items():
            if isinstance(v, Module):
                for name, p in v.named_parameters():
                    key = f"{k}/{name}"
                    saved = tensors.get(key)
                    if saved is None:
                        missing.append(key)
                    elif tuple(saved["shape"]) != p.full_shape:
                        bad.append(f"{key}: saved {tuple(saved['shape'])}, here {p.full_shape}")
                    elif saved["dtype"] != p.dtype.name and not (
                            as_dtype(saved["dtype"]).is_floating and p.dtype.is_floating):
                        bad.append(f"{key}: saved as {saved['dtype']}, here {p.dtype}")
                    else:
                        plan.append((p, key))
            elif isinstance(v, (Optimizer, ZeRO1)) and k not in index["steps"]:
                missing.append(f"{k} (an optimiser)")
        if missing or bad:
            raise CheckpointMismatchError(
                f"checkpoint.load({shards.path}): " + "; ".join(
                    ([f"not in the checkpoint: {missing[:6]}"] if missing else []) +
                    ([f"other full shapes or dtypes: {bad[:6]}"] if bad else []))
                + f" ({len(tensors)} tensors saved, e.g. {sorted(tensors)[:3]}); build the "
                "model with the sizes and dtype it was saved with, under the same state keys")
        self.params = [(p, shards.read(key, [param_box(p)])[0]) for p, key in plan]
        names = _modules(state)
        states: dict[str, list[str]] = {}  # "<optimiser>/<parameter key>" -> its state names
        for t in tensors:
            owner, _, sname = t.rpartition("/")
            states.setdefault(owner, []).append(sname)
        for k, v in state.items():
            if isinstance(v, (Optimizer, ZeRO1)):
                keys = _optimiser_keys("checkpoint.load", k, v, names)
                saved = [sorted(states.get(f"{k}/{key}", [])) for key in keys]

                def read(i: int, name: str, lo: int, hi: int, k: str = k,
                         keys: list[str] = keys, params: list[Parameter] = v.params,
                         saved: list[list[str]] = saved) -> np.ndarray:
                    key = f"{k}/{keys[i]}/{name}"
                    if key not in tensors:
                        raise CheckpointMismatchError(
                            f"checkpoint.load({shards.path}): {key} is not in the checkpoint "
                            f"(saved for it: {saved[i]}); load into the optimiser it was "
                            "saved with")
                    origin = param_box(params[i])
                    parts = [v.reshape(-1) for v in shards.read(
                        key, [shift(b, origin) for b in flat_boxes(params[i].shape, lo, hi)])]
                    return np.concatenate(parts) if parts else np.zeros(0, np.float32)

                self._undo.append(_snapshot(v))
                v.load_shard_state(index["steps"][k], saved, read)

    def apply(self) -> None:
        """Assign every parameter its values (each host copy let go once assigned)."""
        self.params.reverse()
        while self.params:
            p, values = self.params.pop()
            p.assign(values)
            del values

    def rollback(self) -> None:
        self.params = []
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def _snapshot(opt: Optimiser) -> Any:
    """A function that puts back what ``opt`` holds now (its steps and every state entry
    of every parameter, as :meth:`shard_state` gives them) with ``load_shard_state``."""
    steps, held = opt.steps, opt.shard_state()
    names = [sorted(d) for d in held]
    cache: dict[tuple[int, str], np.ndarray] = {}

    def read(i: int, name: str, lo: int, hi: int) -> np.ndarray:
        at, flat = held[i][name]
        if (i, name) not in cache:
            cache[i, name] = np.asarray(flat.numpy()).reshape(-1)
        return cache[i, name][lo - at:hi - at]

    def undo() -> None:
        opt.load_shard_state(steps, names, read)

    return undo
