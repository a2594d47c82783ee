"""Every rank's outcome of a step that reads or writes files, agreed in one exchange.

Only the ranks that hold a block read its bytes, so only they can find it damaged; a rank
that raised alone would leave the others running into their next collective. Each rank
therefore catches its error, the ranks all-gather what they found, and every rank raises
the same error (the class and message of the lowest failing rank) or none.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fuelspmd import errors
from fuelspmd.comm import Communicator
from fuelspmd.errors import FuelError
from fuelspmd.tensor import tensor

__all__ = ["agree", "gather_json"]


def gather_json(comm: Communicator | None, value: Any) -> list[Any]:
    """Every rank's JSON ``value``, in rank order (two all_gathers: lengths, then bytes)."""
    data = json.dumps(value).encode()
    if comm is None or comm.size == 1:
        return [value]
    n = comm.all_gather(tensor(np.array([len(data)], np.int64), device=comm.device), 0)
    lengths = [int(x) for x in n.numpy()]
    width = -(-max(lengths) // 8)
    buf = np.zeros(width * 8, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    every = comm.all_gather(tensor(buf.view(np.int64), device=comm.device), 0).numpy()
    rows = every.reshape(comm.size, width).view(np.uint8)
    return [json.loads(bytes(rows[r, :lengths[r]])) for r in range(comm.size)]


def agree(comm: Communicator | None, error: BaseException | None, what: str) -> None:
    """Raise on every rank of ``comm`` the error of the lowest rank that had one (None:
    this rank had none). A fuelspmd error keeps its class on every rank and its message
    names the rank; another exception is re-raised as it is on its own rank (a bug to see,
    not to rename) and is a RuntimeError naming it on the others."""
    if error is not None and not isinstance(error, FuelError):
        gather_json(comm, [type(error).__name__, str(error), False])
        raise error
    rows = gather_json(comm, None if error is None else [type(error).__name__, str(error),
                                                          True])
    failed = [(r, row) for r, row in enumerate(rows) if row is not None]
    if not failed:
        return
    if len(rows) == 1 and error is not None:
        raise error
    r, (kind, text, typed) = failed[0]
    message = f"{what} failed on rank(s) {[q for q, _ in failed]}; rank {r}: {text}"
    cls = getattr(errors, kind, None) if typed else None
    if not (isinstance(cls, type) and issubclass(cls, FuelError)):
        raise RuntimeError(f"{message} ({kind}, not a fuelspmd error: a bug)")
    raise cls(message) from error
