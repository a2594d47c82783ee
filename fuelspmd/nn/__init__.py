"""``fuelspmd.nn`` (layer 5): :class:`Module`, :class:`Parameter` with its sharding
:class:`Spec`, and the plain (unsharded) layers. The tensor-parallel layers
(:mod:`fuelspmd.tensor_parallel`) are Modules too, built on these."""

from __future__ import annotations

from .module import Module
from .parameter import Parameter, Spec

__all__ = ["Module", "Parameter", "Spec"]
