"""fuelspmd: a Python SPMD runtime for model-parallel machine learning.

``import fuelspmd as fs``. Importing does nothing but define names: no MPI, no GPU
library and no thread is touched until :func:`init` or the first tensor needs it.
Public names are resolved from their modules on first access.
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any

from fuelspmd import errors
from fuelspmd.backend import Device, device
from fuelspmd.dtypes import (
    DType,
    bfloat16,
    bool_,
    float16,
    float32,
    float64,
    int32,
    int64,
)
from fuelspmd.errors import (
    CacheCapacityError,
    CacheError,
    CacheUsageError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    ConfigError,
    DeviceError,
    DTypeError,
    FuelError,
    IndexRangeError,
    PeerAbortedError,
    ScheduleError,
    ShapeError,
    TransportUnavailableError,
)
from fuelspmd.transport import ReduceOp

__version__ = "0.1.0"

# name -> module that defines it; imported when the name is first used.
_LAZY = {
    "init": "fuelspmd.launch",
    "World": "fuelspmd.launch",
    "rank_print": "fuelspmd.launch.output",
    "Tensor": "fuelspmd.tensor",
    "tensor": "fuelspmd.tensor",
    "zeros": "fuelspmd.tensor",
    "ones": "fuelspmd.tensor",
    "arange": "fuelspmd.tensor",
    "randn": "fuelspmd.tensor",
    "concat": "fuelspmd.tensor",
    "split": "fuelspmd.tensor",
    "where": "fuelspmd.tensor",
    "realize": "fuelspmd.tensor",
    "host": "fuelspmd.tensor",
    "compile": "fuelspmd.compile",
    "grad": "fuelspmd.autograd",
    "vjp": "fuelspmd.autograd",
    "Communicator": "fuelspmd.comm",
    "DeviceGroup": "fuelspmd.device_group",
    "Mesh": "fuelspmd.mesh",
}

__all__ = [
    "CacheCapacityError",
    "CacheError",
    "CacheUsageError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "DType",
    "DTypeError",
    "Device",
    "DeviceError",
    "FuelError",
    "IndexRangeError",
    "PeerAbortedError",
    "ReduceOp",
    "ScheduleError",
    "ShapeError",
    "TransportUnavailableError",
    "bfloat16",
    "bool_",
    "device",
    "errors",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fuelspmd' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


class _Package(types.ModuleType):
    """Keeps ``fs.tensor`` the function: importing the submodule ``fuelspmd.tensor`` makes
    the import system set the package attribute ``tensor`` to the module, which would hide
    the constructor of the same name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
