"""The exception hierarchy of fuelspmd.

Layer 0: this module imports nothing from the package. Every module above raises these.

A caller's mistake (a bad shape, a size that does not divide, a bad schedule) subclasses
``ValueError`` as well, so generic handlers catch it; a failure of communication is a
``RuntimeError``. Messages give the numbers involved and the fix.
"""

from __future__ import annotations

__all__ = [
    "CacheCapacityError",
    "CacheDivergenceError",
    "CacheError",
    "CacheUsageError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "DTypeError",
    "DeviceError",
    "FuelError",
    "IndexRangeError",
    "PeerAbortedError",
    "ScheduleError",
    "ShapeError",
    "TransportUnavailableError",
]


class FuelError(Exception):
    """Base of every error fuelspmd raises on purpose."""


class ShapeError(FuelError, ValueError):
    """Shapes that an op cannot take; raised when the node is built."""


class DTypeError(FuelError, ValueError):
    """A dtype an op or a transport cannot take."""


class DeviceError(FuelError, ValueError):
    """An unknown device, or tensors on different devices meeting in one op."""


class IndexRangeError(FuelError, ValueError):
    """An integer index outside its range: a class target or an embedding id not in
    ``[0, size)`` (and not the ``ignore_index``); found on the host before the graph runs."""


class ConfigError(FuelError, ValueError):
    """Bad sizes, meshes, partitions or launch settings."""


class CommError(FuelError, RuntimeError):
    """A failure of communication between ranks."""


class CollectiveMismatchError(CommError):
    """Ranks disagreed on a collective (op, sequence, shape, dtype, reduce op, root, group)."""


class CommTimeoutError(CommError, TimeoutError):
    """A wait passed its deadline: some rank never joined."""


class PeerAbortedError(CommError):
    """A peer finished, failed or aborted without issuing what this rank waits for."""


class TransportUnavailableError(CommError):
    """A transport was asked for that cannot run here (not installed, no device, no launcher)."""


class ScheduleError(FuelError, ValueError):
    """A pipeline schedule that is malformed or can deadlock."""


class CacheError(FuelError):
    """A KV cache bookkeeping error."""


class CacheCapacityError(CacheError, ValueError):
    """A request for more KV cache blocks than the pool holds."""


class CacheUsageError(CacheError, ValueError):
    """A KV cache call that breaks the protocol: an unknown or already allocated sequence, a
    double free, a bad token count."""


class CacheDivergenceError(CacheError, RuntimeError):
    """Ranks that must hold identical block tables do not (a broken invariant)."""


class CheckpointError(FuelError):
    """A checkpoint that cannot be saved or loaded as asked."""


class CheckpointIncompleteError(CheckpointError, RuntimeError):
    """A checkpoint that was never committed (no index, a temporary name) or lacks a file or
    a tensor its index names."""


class CheckpointCorruptError(CheckpointError, RuntimeError):
    """A shard whose bytes do not match its checksum, or a truncated or unreadable file."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The state does not fit the checkpoint (a missing name, another full shape) or the
    ranks disagree on what they save."""
