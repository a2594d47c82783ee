"""``Module``: parameters and submodules found from attributes, named by their path.

A Module's parameters are the :class:`Parameter` attributes it holds, directly, in lists,
tuples or str-keyed dicts, or in submodules (``Module`` attributes, lists, tuples or dicts of
them), in the order the attributes were first set; a dict names its items by their keys, so
a pipeline stage holding blocks 4-7 of a model as ``{"4": b4, ...}`` names them as the whole
model does (``blocks.4.mlp...``); ``named_parameters`` names each by its dotted path
(``blocks.0.mlp.fc1.weight``). A Parameter reached twice (a tied weight) is listed once,
under its first name, so an optimiser updates it once with the sum of its gradients (the
gradient of a Parameter used twice already is that sum).

``state_dict`` maps each name to this rank's shard (a host array); ``shapes()`` gives the
full shapes beside it. ``load_state_dict`` takes, per name, the full array (each rank keeps
its block) or this rank's shard, and reports every missing, unexpected and mis-shaped key
in one :class:`~fuelspmd.errors.ConfigError`, before it assigns anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np

from fuelspmd.errors import ConfigError
from fuelspmd.tensor import Tensor, realize

from .parameter import Parameter
from .recompute import checkpoint
from .rng import DropoutRNG

__all__ = ["Module"]


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    """(name suffix, item) for an attribute value: itself, or the items of a list/tuple
    (by index) or of a dict (by its str keys)."""
    items = enumerate(value) if isinstance(value, (list, tuple)) else \
        value.items() if isinstance(value, dict) else None
    if items is not None:
        for key, v in items:
            if isinstance(v, (Module, Parameter)):
                yield f".{key}", v
    elif isinstance(value, (Module, Parameter)):
        yield "", value


class Module:
    """Base of every layer and model; see the module docstring. Subclasses define
    ``forward``; calling the module calls it. Set ``block.recompute = True`` to recompute
    the block's forward in the backward while training (:mod:`.recompute`)."""

    training: bool = True
    recompute: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.recompute and self.training:
            return checkpoint(self._replay(partial(self.forward, **kwargs)), *args,
                              params=self.parameters())
        return self.forward(*args, **kwargs)

    def _replay(self, fn: Any) -> Any:
        """``fn`` run under the dropout keys of now, whenever it runs (its recompute)."""
        rngs = {id(r): r for m in self.modules() for r in vars(m).values()
                if isinstance(r, DropoutRNG)}
        keys = [(r, r.step, r.micro) for r in rngs.values()]

        def run(*args: Any) -> Any:
            now = [(r, r.step, r.micro) for r, _, _ in keys]
            for r, step, micro in keys:
                r.set_step(step, micro)
            try:
                return fn(*args)
            finally:
                for r, step, micro in now:
                    r.set_step(step, micro)

        return run

    # ---- walking --------------------------------------------------------------------
    def _walk(self, prefix: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
        for attr, value in vars(self).items():
            for suffix, item in _children(value):
                if id(item) in seen:
                    continue
                seen.add(id(item))
                name = f"{prefix}{attr}{suffix}"
                yield name, item
                if isinstance(item, Module):
                    yield from item._walk(name + ".", seen)

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """Yield ``(dotted name, Parameter)`` for every parameter, each object once."""
        for name, item in self._walk("", {id(self)}):
            if isinstance(item, Parameter):
                yield name, item

    def parameters(self) -> list[Parameter]:
        """This rank's parameters (local shards) in a stable order, each object once."""
        return [p for _, p in self.named_parameters()]

    def named_modules(self) -> Iterator[tuple[str, Module]]:
        """Yield ``(dotted name, Module)`` for this module (name "") and every submodule."""
        yield "", self
        for name, item in self._walk("", {id(self)}):
            if isinstance(item, Module):
                yield name, item

    def modules(self) -> list[Module]:
        """This module and every submodule, each once, parents before children."""
        return [m for _, m in self.named_modules()]

    # ---- modes ----------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout active) on this module and every submodule."""
        for m in self.modules():
            m.training = bool(mode)
        return self

    def eval(self) -> Module:
        """Evaluation mode: ``train(False)``."""
        return self.train(False)

    # ---- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Name -> this rank's shard as a host array (realises every parameter)."""
        params = list(self.named_parameters())
        realize(*(p for _, p in params))
        return {name: p.numpy() for name, p in params}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> the full (unsharded) shape of each parameter."""
        return {name: p.full_shape for name, p in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Fill every parameter from ``state`` (name -> full array or this rank's shard).

        Checks everything first and raises one ConfigError naming each missing, unexpected
        and mis-shaped key; ``strict=False`` allows missing and unexpected keys (the
        parameters they would fill keep their values) but never a wrong shape.
        """
        params = dict(self.named_parameters())
        missing = [k for k in params if k not in state]
        unexpected = [k for k in state if k not in params]
        bad, plan = [], []
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            shape = tuple(value.shape)
            if shape == p.shape:
                plan.append((p, value))
            elif shape == p.full_shape:
                plan.append((p, p.spec.shard(value)))
            else:
                bad.append(f"{name}: {shape} is neither the full shape {p.full_shape} nor "
                           f"this rank's shard {p.shape}")
        problems = bad + ([f"missing: {missing}"] if strict and missing else []) + \
            ([f"unexpected: {unexpected}"] if strict and unexpected else [])
        if problems:
            raise ConfigError(f"{type(self).__name__}.load_state_dict: "
                              + "; ".join(problems) + ". Give one array per name in "
                              "named_parameters(), full or this rank's shard")
        for p, value in plan:  # a Tensor is converted like an array: loading casts
            p.assign(value.astype(p.dtype).to(p.device) if isinstance(value, Tensor) else value)
