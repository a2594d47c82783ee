"""The ``host`` op: a value that Python computes from host copies of its inputs.

Its attributes (:class:`HostCall`) hold the function and the result's shape, dtype and
device. It is effectful (never merged, folded or dropped, and never reused: it may have
side effects, such as an optimiser counting its steps) and has no gradient. The kernel
copies the inputs to the host, calls the function and checks what it returned, so a
compiled step (``fs.compile``) runs the Python again on every replay instead of baking
its first result: the step's hyper-parameters, the index tables of a loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from fuelspmd.backend import Device, to_host
from fuelspmd.dtypes import DType, Shape, to_numpy

from .node import Node
from .op import Op, register

__all__ = ["HOST", "HostCall", "call_host"]


class HostCall(NamedTuple):
    """``fn(*host arrays) -> array`` of ``shape`` and ``dtype``, placed on ``device``.
    Compared by ``fn``'s equality: give a bound method or a frozen dataclass, equal from
    call to call, so the next step's graph finds its plan again."""

    fn: Callable[..., Any]
    shape: Shape
    dtype: DType
    device: Device


def call_host(attrs: HostCall, arrays: list[np.ndarray]) -> np.ndarray:
    """``attrs.fn(*arrays)`` as an array of its declared shape and dtype (RuntimeError,
    naming the function, when it returns another shape)."""
    out = np.asarray(attrs.fn(*arrays), dtype=to_numpy(attrs.dtype))
    if out.shape != attrs.shape:
        raise RuntimeError(f"host function {attrs.fn!r} returned shape {out.shape}, but its "
                           f"node was declared {attrs.shape}")
    return out


def _rule(inputs: tuple[Node, ...], attrs: HostCall) -> tuple[Shape, DType, Device]:
    return attrs.shape, attrs.dtype, attrs.device


def _kernel(be: Any, attrs: HostCall, *xs: Any) -> Any:
    return be.from_host(call_host(attrs, [to_host(x) for x in xs]), attrs.device)


HOST = register(Op("host", _rule, _kernel, None, effectful=True))
