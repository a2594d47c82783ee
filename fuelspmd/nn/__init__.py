"""``fuelspmd.nn`` (layer 5): :class:`Module`, :class:`Parameter` with its sharding
:class:`Spec`, the plain (unsharded) layers and activation recomputation. The
tensor-parallel layers (:mod:`fuelspmd.tensor_parallel`) are Modules built on these."""

from __future__ import annotations

from .layers import (
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    RMSNorm,
    full_arrays,
    make_parameter,
    seeded_weight,
    weight_source,
)
from .module import Module
from .parameter import Parameter, Spec
from .recompute import checkpoint
from .rng import DropoutRNG

__all__ = ["Dropout", "DropoutRNG", "Embedding", "LayerNorm", "Linear", "Module", "Parameter",
           "RMSNorm", "Spec", "checkpoint", "full_arrays", "make_parameter", "seeded_weight",
           "weight_source"]
