"""Graph nodes.

A :class:`Node` is one value of the lazy graph: an op applied to input nodes with static
attributes, its shape, dtype and device fixed when it is built (the op's rule runs then,
so a bad shape raises where it is written). A node holding a ``buffer`` is realised: it
has dropped its inputs (realised history costs no memory) and acts as a leaf from then on.
Building a node does nothing else: common subexpressions are merged when a graph is
planned (:func:`~fuelspmd.graph.passes.optimise`), once per structure, not per node built.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, Shape
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, DeviceError

from .op import Attrs, Fill, Op, get_op

__all__ = ["TRACE", "Node", "array_dtype", "canonical", "check_live", "const", "consume", "fill",
           "finish", "leaf", "make", "mark_realised", "post"]


class _Trace(threading.local):
    """The recorder of the compiled step being traced on this thread (``fs.compile``), or
    None: :func:`leaf` reports the leaves made during a trace (the trace's constants) and
    the executor each plan it runs. Per thread, as each device of a DeviceGroup traces its
    own step."""

    recorder: Any = None


TRACE = _Trace()


class Node:
    """One value of the graph; see the module docstring."""

    __slots__ = ("__weakref__", "attrs", "buffer", "device", "donated", "dtype", "escaped",
                 "inputs", "mark", "op", "shape")

    def __init__(self, op: Op, inputs: tuple[Node, ...], attrs: Attrs, shape: Shape,
                 dtype: DType, device: Device, buffer: Any = None) -> None:
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.buffer = buffer
        self.donated = False  # a leaf the caller gave up: the next realise may write it
        # the buffer was handed out (Tensor.numpy, a realised view of it): nothing may
        # write it, so a compiled replay puts this node's next value in a fresh buffer
        self.escaped = False
        self.mark = 0  # the last plan binding that reached it (executor)

    @property
    def realised(self) -> bool:
        return self.buffer is not None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        state = "realised" if self.buffer is not None else f"{len(self.inputs)} inputs"
        return f"Node({self.op.name}, {self.shape}, {self.dtype}, {self.device}, {state})"


def make(name: str, inputs: tuple[Node, ...] | list[Node], attrs: Attrs = ()) -> Node:
    """Build the node ``name(inputs; attrs)``, running the op's shape rule now."""
    op = get_op(name)
    inputs = tuple(inputs)
    if inputs and op.name != "to":
        dev = inputs[0].device
        for x in inputs[1:]:
            if x.device is not dev and x.device != dev:
                raise DeviceError(
                    f"{name}: inputs live on {dev} and {x.device}; move one with "
                    f".to({str(dev)!r}) first")
    shape, dt, dev = op.rule(inputs, attrs)
    return Node(op, inputs, attrs, tuple(shape), dt, dev)


_DEVICES: dict[Device, Device] = {}


def canonical(device: Device) -> Device:
    """The one Device object used for ``device`` in graphs: equal devices become the same
    object, so the hot checks are identity checks."""
    return _DEVICES.setdefault(device, device)


def leaf(buffer: Any, device: Device) -> Node:
    """Return a realised node holding ``buffer`` (an array of ``device``'s library)."""
    node = Node(get_op("leaf"), (), (), tuple(int(d) for d in buffer.shape),
                array_dtype(buffer), canonical(device), buffer)
    rec = TRACE.recorder
    if rec is not None:
        rec.made(node)
    return node


def const(value: float | int | bool, shape: Shape, dt: DType, device: Device) -> Node:
    """Return the node of an array of ``shape`` filled with ``value`` (structure, not data)."""
    if dt.is_bool:
        value = bool(value)
    elif dt.is_integer:
        value = int(value)
    else:
        value = float(value)
        return make("const", (), Fill(value, tuple(shape), dt, canonical(device),
                                      math.copysign(1.0, value) < 0))
    return make("const", (), Fill(value, tuple(shape), dt, canonical(device)))


def mark_realised(node: Node, buffer: Any) -> None:
    """Give ``node`` its buffer and drop its inputs."""
    node.buffer = buffer
    node.inputs = ()


def post(node: Node, pending: Any, data: tuple[Node, ...]) -> None:
    """Mark effectful ``node`` as issued ahead of any realise: ``pending.finish()`` gives
    its value, which :func:`finish` collects when a realise first needs it (its order
    tokens are dropped: it is issued). ``data``: the nodes whose buffers it was started
    with, which a compiled step's trace records (op, attributes and data) to issue it
    again on every replay."""
    rec = TRACE.recorder
    if rec is not None:
        rec.posted(node, data)
    node.op, node.attrs, node.inputs = get_op("posted"), pending, ()


def finish(node: Node) -> None:
    """Wait for a posted node (see :func:`post`) and make it a realised leaf."""
    rec = TRACE.recorder
    if rec is not None:
        rec.finished(node)
    value = node.attrs.finish()
    node.op, node.attrs = get_op("leaf"), ()
    mark_realised(node, value)


def fill(node: Node, value: Node) -> None:
    """Give placeholder leaf ``node`` the buffer of realised ``value``: a value that
    arrives after the graph that reads it was built (the pipeline's cotangents). A
    compiled step's trace reads ``node`` as ``value`` from then on."""
    rec = TRACE.recorder
    if rec is not None:
        rec.filled(node, value)
    node.buffer = value.buffer


def consume(node: Node) -> None:
    """Invalidate a donated leaf that a realise read: its buffer may have been written, so
    it has no value any more, and using it raises (see :func:`check_live`)."""
    node.buffer = None
    node.donated = False
    node.op = get_op("donated")


def check_live(node: Node) -> None:
    """Raise ConfigError for a donated tensor that a realise consumed."""
    if node.op.kind == "donated":
        raise ConfigError(f"a tensor of shape {node.shape} {node.dtype} was donated (its "
                          "buffer given to a realise, which may have written it) and has no "
                          "value any more; use the result of the operation it was donated to")


_ARRAY_DTYPES: dict[type, dict[Any, DType]] = {}  # per library's dtype class: no mixing


def array_dtype(arr: Any) -> DType:
    """Return the DType of an array of any supported library (array-api-strict included)."""
    dt = arr.dtype
    known = _ARRAY_DTYPES.setdefault(type(dt), {})
    found = known.get(dt)
    if found is None:
        name = getattr(dt, "name", None)
        if name is None:  # array-api-strict's dtypes print as 'array_api_strict.float32'
            name = str(dt).rpartition(".")[2]
        found = known[dt] = as_dtype(name)
    return found
