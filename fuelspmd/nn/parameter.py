"""``Parameter``: a Tensor an optimiser updates in place, carrying its sharding ``Spec``.

A model holds its weights as Parameters; an optimiser computes new values and calls
:meth:`Parameter.assign`, which rebinds the Parameter's node, so every module holding the
same Parameter object (tied weights) sees the update and ``fs.grad(loss, [p])``
differentiates with respect to the value the next forward reads.

A Parameter holds this rank's shard. Its :class:`Spec` says how the shards make the whole:
replicated (every rank holds all of ``full_shape``) or split into equal contiguous blocks
along ``dim`` over the communicator of a mesh axis (rank r holds block r). A Parameter can
be built from its spec alone, without data, and filled later (``assign`` or
``Module.load_state_dict``), so no rank has to hold the whole model; using it before then
raises :class:`~fuelspmd.errors.ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fuelspmd.backend import Device
from fuelspmd.backend import device as as_device
from fuelspmd.comm import Communicator
from fuelspmd.dtypes import DType, Shape, float32
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, DeviceError, DTypeError, ShapeError
from fuelspmd.graph.node import Node
from fuelspmd.tensor import Tensor, tensor

__all__ = ["Parameter", "Spec"]

_get_node = Tensor.node.__get__  # type: ignore[attr-defined]  # Tensor's own slot
_set_node = Tensor.node.__set__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Spec:
    """How a parameter is laid out: replicated, or split along ``dim`` over ``comm``.

    ``full_shape`` is the unsharded shape; ``axis`` names the mesh axis of ``comm`` ("tp",
    "dp", ...), so a caller walking parameters knows which group holds the other blocks.
    ``mirror`` marks a stage's copy of a weight another pipeline stage owns (a tied
    embedding table on the last stage): after the tied gradients are summed the copy's
    gradient is the owner's, so a norm over the stages counts the owner's alone.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    axis: str | None = None
    comm: Communicator | None = None
    mirror: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_shape", tuple(int(d) for d in self.full_shape))
        if self.dim is None:
            if self.axis is not None or self.comm is not None:
                raise ConfigError(f"Spec: axis={self.axis!r} or a comm without dim= means "
                                  "nothing; give dim= to shard, or neither to replicate")
            return
        nd = len(self.full_shape)
        if not -nd <= self.dim < nd:
            raise ConfigError(f"Spec: dim={self.dim} is out of range for full shape "
                              f"{self.full_shape}; give a dim in [0, {nd})")
        if self.axis is None or self.comm is None:
            raise ConfigError(f"Spec(dim={self.dim}): a sharded spec needs the mesh axis name "
                              "and its communicator: Spec(shape, dim, axis='tp', comm=comm)")
        object.__setattr__(self, "dim", self.dim % nd)
        n, size = self.full_shape[self.dim], self.comm.size
        if n % size:
            ok = [d for d in range(1, n + 1) if n % d == 0]
            raise ConfigError(f"Spec: dim {self.dim} of {self.full_shape} has {n} elements, "
                              f"not divisible by the {self.axis} size {size}; sizes that "
                              f"divide it: {ok}")

    @property
    def replicated(self) -> bool:
        return self.dim is None

    @property
    def local_shape(self) -> Shape:
        """The shape of one rank's shard."""
        if self.dim is None or self.comm is None:
            return self.full_shape
        s = list(self.full_shape)
        s[self.dim] //= self.comm.size
        return tuple(s)

    def local_slice(self) -> tuple[slice, ...]:
        """The index of this rank's block in the full array."""
        if self.dim is None or self.comm is None:
            return tuple(slice(None) for _ in self.full_shape)
        k = self.local_shape[self.dim]
        r = self.comm.rank
        return tuple(slice(r * k, (r + 1) * k) if i == self.dim else slice(None)
                     for i in range(len(self.full_shape)))

    def shard(self, full: Any) -> Any:
        """This rank's block of ``full`` (an array of ``full_shape``)."""
        if tuple(full.shape) != self.full_shape:
            raise ShapeError(f"Spec.shard: array of shape {tuple(full.shape)} given; give "
                             f"one of the parameter's full shape {self.full_shape}")
        return full[self.local_slice()]


class Parameter(Tensor):
    """A Tensor that is a model's weight; see the module docstring.

    ``Parameter(data)`` is replicated (its spec ``Spec(data.shape)``);
    ``Parameter(shard, spec=spec)`` holds this rank's block of a sharded one;
    ``Parameter(spec=spec, dtype=..., device=...)`` (or ``shape=`` for a replicated one) has
    no value until it is assigned. ``shape`` is always the local shape.
    """

    __slots__ = ("_meta", "spec")

    def __init__(self, data: Any = None, *, spec: Spec | None = None,
                 shape: Any = None, dtype: DType | str | None = None,
                 device: Device | str | None = None) -> None:
        if data is not None:
            t = tensor(data, device=device, dtype=dtype)
            local = t.shape
            dt, dev = t.dtype, t.device
        else:
            if spec is None and shape is None:
                raise ConfigError("Parameter: give data, or its shape (shape= or spec=) to "
                                  "fill it later")
            local = spec.local_shape if spec is not None else tuple(int(d) for d in shape)
            dt = float32 if dtype is None else as_dtype(dtype)
            dev = as_device(device if device is not None else
                            spec.comm.device if spec is not None and spec.comm is not None
                            else None)
        if shape is not None and tuple(int(d) for d in shape) != local:
            raise ShapeError(f"Parameter: shape={tuple(shape)} but the value/spec gives a "
                             f"local shape {local}; give shape= only without data, equal "
                             "to the spec's local shape")
        if spec is None:
            spec = Spec(local)
        elif spec.local_shape != local:
            raise ShapeError(f"Parameter: the local shard has shape {local}, the spec "
                             f"{spec.full_shape} split on dim {spec.dim} over "
                             f"{spec.comm.size if spec.comm else 1} ranks gives "
                             f"{spec.local_shape}")
        self.spec = spec
        self._meta = (local, dt, dev)
        _set_node(self, None if data is None else t.node)

    # the node is a property so a Parameter with no value yet fails with a typed error at
    # the first use, whatever the use is (an empty one holds None in Tensor's slot)
    @property  # type: ignore[override]
    def node(self) -> Node:
        n = _get_node(self)
        if n is None:
            raise ConfigError(f"Parameter {self.shape} ({self.dtype}) has no value yet: fill "
                              "it with assign() or Module.load_state_dict() first")
        return n  # type: ignore[no-any-return]

    @node.setter
    def node(self, value: Node) -> None:
        _set_node(self, value)

    @property
    def shape(self) -> Shape:
        return self._meta[0]

    @property
    def dtype(self) -> DType:
        return self._meta[1]

    @property
    def device(self) -> Device:
        return self._meta[2]

    @property
    def filled(self) -> bool:
        """Whether the Parameter holds a value (one built from a spec alone does not)."""
        return _get_node(self) is not None

    @property
    def full_shape(self) -> Shape:
        return self.spec.full_shape

    def __repr__(self) -> str:
        how = "replicated" if self.spec.replicated else \
            f"dim {self.spec.dim} over {self.spec.axis!r}"
        state = ("realised" if self.realised else "lazy") if self.filled else "empty"
        return (f"Parameter(shape={self.shape}, full={self.full_shape}, {how}, "
                f"dtype={self.dtype}, device='{self.device}', {state})")

    def assign(self, value: Tensor | Any) -> None:
        """Replace the value in place: every holder of this Parameter sees ``value`` next.

        A Tensor must have this Parameter's local shape, dtype and device exactly (an
        optimiser's result that differs is a bug to surface, not to cast away); a host or
        device array of the local shape is converted to the dtype and device (loading).
        A lazy ``value`` is kept lazy (realise it, e.g. with the optimiser's other updates,
        before the next forward; differentiation stops at this node either way).
        """
        shape, dt, dev = self._meta
        if isinstance(value, Tensor):
            if value.shape != shape:
                raise ShapeError(f"Parameter.assign: value of shape {value.shape} for a "
                                 f"parameter of local shape {shape}; give this rank's shard")
            if value.dtype is not dt:
                raise DTypeError(f"Parameter.assign: value of dtype {value.dtype} for a "
                                 f"{dt} parameter; cast it with .astype({dt.name!r})")
            if value.device != dev:
                raise DeviceError(f"Parameter.assign: value on {value.device} for a "
                                  f"parameter on {dev}; move it with .to({str(dev)!r})")
            self.node = value.node
            return
        if tuple(value.shape) != shape:
            raise ShapeError(f"Parameter.assign: array of shape {tuple(value.shape)} for a "
                             f"parameter of local shape {shape}; give this rank's shard")
        arr = np.ascontiguousarray(value) if type(value).__module__.startswith("numpy") \
            else value
        self.node = tensor(arr, device=dev, dtype=dt).node
