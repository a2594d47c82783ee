"""How fuelspmd dtypes and reduce ops map onto MPI, and the Work over an MPI request.

Moving bytes never looks at the values: float16 and bfloat16 travel as ``MPI_UINT16_T``
bit patterns (numpy cannot export bfloat16, so it is viewed as uint16), the others as
their own MPI type. Reducing:

- float32, float64, int32, int64: MPI's own SUM, PROD, MIN, MAX, in the caller's buffer.
- float16, bfloat16: MPI has no portable 16-bit float, so a float32 copy is reduced and
  rounded back once (to nearest even): one 16-bit rounding instead of one per step, the
  same on every rank since MPI hands every rank the same float32 result.
- bool: MPI's logical ops on ``MPI_C_BOOL``: sum and max are OR, prod and min are AND.
- avg: SUM, then division by the group size on every rank (in float32 for the 16-bit
  types, before rounding; floor division for integers); refused for bool (DTypeError).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from fuelspmd.errors import CollectiveMismatchError, CommError, CommTimeoutError, DTypeError
from fuelspmd.transport import WATCH_S, ReduceOp

__all__ = ["UFUNCS", "YIELD_AFTER_S", "MPIWork", "ReducePlan", "Types", "divide", "late_text",
           "local_reduce", "slices", "spin"]

_BURST = 8  # polls between two reads of the clock (and, past the spin, two yields)
YIELD_AFTER_S = 1e-5  # a wait spins this long before it yields the core, as MPI's own do
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


class ReducePlan(NamedTuple):
    """How one (dtype, op) pair is reduced: MPI type and op, and an optional float32 stage."""

    datatype: Any
    mpi_op: Any
    stage: np.dtype | None
    avg: bool


class Types:
    """The MPI datatypes and reduce plans (the module docstring) of one MPI library: ``move``
    and ``reduce_as`` by dtype, ``ops`` by ReduceOp for numbers and for bool."""

    def __init__(self, MPI: Any) -> None:
        u16, f32 = MPI.UINT16_T, np.dtype(np.float32)
        # bfloat16 joins the tables at its first buffer (:meth:`know`): its numpy dtype
        # comes from ml_dtypes, whose import takes most of a second, in every process
        self.bf16: np.dtype | None = None
        self._bf16_entries = (u16, (MPI.FLOAT, f32))
        self.move: dict[np.dtype, Any] = {
            np.dtype(np.float16): u16,
            f32: MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
            np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T,
            np.dtype(np.bool_): MPI.C_BOOL,
        }
        self.reduce_as = {dt: (MPI.FLOAT, f32) if dt.itemsize == 2 else (mt, None)
                          for dt, mt in self.move.items()}
        self.ops = {False: {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD,
                            ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                            ReduceOp.AVG: MPI.SUM},
                    True: {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR,
                           ReduceOp.PROD: MPI.LAND, ReduceOp.MIN: MPI.LAND}}
        # by op name, then dtype: hashing a (dtype, op) tuple, or an Enum member (its
        # __hash__ is Python code), costs more than the rest of a small call's bookkeeping
        self.plans: dict[str, dict[np.dtype, ReducePlan]] = {op.value: {} for op in ReduceOp}

    def know(self, dt: np.dtype) -> None:
        """Add ``dt`` to the tables if it is bfloat16 (the first buffer of it; an array of
        it exists, so ml_dtypes is imported already)."""
        if self.bf16 is None and dt.name == "bfloat16":
            self.bf16 = dt
            self.move[dt], self.reduce_as[dt] = self._bf16_entries

    def spec(self, buf: Any) -> list[Any]:
        """``buf`` as MPI moves it, unreduced: [buffer, MPI type], bfloat16 as uint16 bits."""
        dt = buf.dtype
        if dt not in self.move:
            self.know(dt)
        return [buf.view(np.uint16) if dt == self.bf16 else buf, self.move[dt]]

    def plan(self, dt: np.dtype, op: ReduceOp, where: str) -> ReducePlan:
        """Return the reduce plan of ``dt`` and ``op``; DTypeError for avg over bool."""
        found = self.plans[op.value].get(dt)
        if found is None:
            logical = dt == np.bool_
            if logical and op is ReduceOp.AVG:
                raise DTypeError(f"{where}: avg is not defined for bool buffers; use 'sum' "
                                 f"(logical or) or 'prod' (logical and), or cast to a number")
            self.know(dt)
            datatype, stage = self.reduce_as[dt]
            found = self.plans[op.value][dt] = ReducePlan(
                datatype, self.ops[logical][op], stage, op is ReduceOp.AVG)
        return found


def slices(count: int, n: int) -> list[int]:
    """The bounds of ``n`` slices of ``count`` elements: ``count // n`` each, the first
    ``count % n`` one more; slice ``k`` is ``[b[k], b[k + 1])``."""
    base, extra = divmod(count, n)
    return [k * base + min(k, extra) for k in range(n + 1)]


def divide(buf: np.ndarray, size: int) -> None:
    """Finish an avg in place: true division for floats, floor division for integers."""
    if buf.dtype.kind == "f":
        buf /= size
    else:
        np.floor_divide(buf, size, out=buf)


def local_reduce(parts: np.ndarray, op: ReduceOp, plan: ReducePlan, out: np.ndarray) -> None:
    """Reduce the rows of ``parts`` (one per rank) into ``out`` as MPI would for ``plan``,
    in rank order: every rank that reduces the same rows gets the same bits."""
    if parts.dtype == np.bool_:
        ufunc = np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and
        ufunc.reduce(parts, axis=0, out=out)
    elif plan.stage is None:
        UFUNCS[op].reduce(parts, axis=0, out=out)  # into out: a 0-d result stays an array
        if plan.avg:
            divide(out, parts.shape[0])
    else:
        wide = np.empty(out.shape, plan.stage)  # an array: a 0-d reduce returns a scalar,
        UFUNCS[op].reduce(parts.astype(plan.stage), axis=0, out=wide)  # which divide rebinds
        if plan.avg:
            divide(wide, parts.shape[0])
        out[...] = wide


def spin(done: Callable[[], bool], limit: float, late: Callable[[float], str],
         watch: Callable[[], None] | None = None, spin_s: float = YIELD_AFTER_S) -> float:
    """Poll ``done()`` until it holds; return the seconds waited when past ``spin_s``, else 0.

    The one wait of this package. It never sleeps (MPI progresses a non-blocking collective
    only inside MPI calls, so a rank asleep between two polls stalls its peers too) and
    reads the clock once per ``_BURST`` polls; past ``spin_s`` it yields the core between
    bursts (a spinning rank keeps the core its peer, or another job, needs); it calls
    ``watch()`` every ``WATCH_S``, and raises CommTimeoutError(``late(limit)``) after
    ``limit`` seconds.
    """
    clock = time.monotonic
    start = clock()
    deadline, watched = start + limit, start + WATCH_S
    while True:
        for _ in range(_BURST):
            if done():
                now = clock()
                return now - start if now - start > spin_s else 0.0
        now = clock()
        if now > deadline:
            raise CommTimeoutError(late(limit))
        if watch is not None and now > watched:
            watch()
            watched = clock() + WATCH_S
        if now - start > spin_s:
            os.sched_yield()


def late_text(owner: Any, op: str | tuple[str, int, int], seq: int, limit: float) -> str:
    """The CommTimeoutError text of ``owner``'s operation ``seq`` that did not complete
    within ``limit`` s (``owner.explain`` names it and who failed to join)."""
    what, hint = owner.explain(op, seq)
    return (f"{what} did not complete within {limit:g} s: {hint}; if it is only slow, "
            f"raise the timeout (fs.init(timeout=...) or wait(timeout))")


class MPIWork:
    """A started MPI operation: ``test`` polls it, ``wait`` spins on it (:func:`spin`).

    ``finish`` runs once, on the rank's own thread, when the request completes (a float32
    stage copied back, the division of avg); ``keep`` holds the buffers MPI uses until then
    (a caller may pass a temporary). ``owner.explain(op, seq)`` words errors, on the slow
    path only. After a timeout the request is still posted: the Work can be waited on
    again, or a receive cancelled.
    """

    __slots__ = ("_finish", "_keep", "_op", "_owner", "_req", "_seq")

    def __init__(self, req: Any, owner: Any, op: str | tuple[str, int, int], seq: int,
                 finish: Callable[[], None] | None = None, keep: Any = None) -> None:
        self._req = req  # None once complete
        self._owner = owner
        self._op = op  # a name, or (name, peer, tag) for send and recv
        self._seq = seq
        self._finish = finish
        self._keep = keep

    def __del__(self) -> None:
        # Dropped before MPI finished (a wait that timed out, a failing job): MPI may
        # still write these buffers, so they must never be freed. The process is failing;
        # a deliberate leak is what keeps its memory sound until it ends.
        if self._req is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object((self._req, self._keep)))

    def _late(self, limit: float) -> str:
        return late_text(self._owner, self._op, self._seq, limit)

    def _complete(self) -> bool:
        self._req = None
        self._keep = None
        finish = self._finish
        if finish is not None:
            self._finish = None
            finish()
        return True

    def error(self, e: Exception) -> CommError:
        """mpi4py's MPI.Exception as a CommError; its last line is MPI's own reason."""
        what, _ = self._owner.explain(self._op, self._seq)
        text = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
        if "truncat" in str(e).lower():
            return CollectiveMismatchError(
                f"{what}: the message sent is longer than the receive buffer ({text}); "
                f"size the recv buffer to the number of elements the peer sends")
        return CommError(f"{what}: MPI reported an error: {text}")

    def test(self) -> bool:
        """Return whether the operation completed (never blocks)."""
        req = self._req
        if req is None:
            return True
        try:
            return req.Test() and self._complete()
        except self._owner.mpi_error as e:  # truncation, a failed peer, ...
            raise self.error(e) from e

    def wait(self, timeout: float | None = None,
             watch: Callable[[], None] | None = None) -> None:
        """Block until complete; CommTimeoutError after ``timeout`` s (None: the transport's),
        calling ``watch`` every ``WATCH_S`` (a check's, inside a transport call)."""
        req = self._req
        if req is None:
            return
        try:
            if not req.Test():  # a small operation usually ends here
                spin(req.Test, self._owner.timeout if timeout is None else timeout,
                     self._late, watch, self._owner.spin_s)
            self._complete()
        except self._owner.mpi_error as e:
            raise self.error(e) from e

    def cancel(self, timeout: float = 5.0) -> bool:
        """Withdraw a pending receive; return False if it had already completed. (MPI
        cancels only point-to-point requests: after a collective's timeout, ``abort``.)"""
        req = self._req
        if req is None:
            return False
        req.Cancel()
        spin(req.Test, timeout, lambda limit: f"cancelling: {self._late(limit)}",
             spin_s=self._owner.spin_s)
        self._finish = None
        return self._complete()
