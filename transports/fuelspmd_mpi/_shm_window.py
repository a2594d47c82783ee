"""The shared windows of the shm all-reduce (:mod:`fuelspmd_mpi._shm`), the check of the
call headers, and the fold: the parts that hold no state of a group.

A window per size class (powers of two, at least ``MIN_CLASS``): each rank's segment is
the data area and, unless the window is lent, two result areas. Each call's header
(count, dtype, op, call number) goes in the rank's line of the flag window;
:func:`check_headers` turns ranks that disagree into a CollectiveMismatchError on each of
them. :func:`fold` reduces one slice in rank order, so every rank gets the bitwise-same
result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuelspmd.errors import CollectiveMismatchError
from fuelspmd.transport import ReduceOp

__all__ = ["HEADER", "MIN_CLASS", "OP_CODE", "SHM_DTYPES", "UFUNC", "Window",
           "check_headers", "fold", "round_up", "size_class"]

MIN_CLASS = 1 << 16  # smallest window: bytes per rank
HEADER = 64  # a cache line: a rank's flag line, and the alignment of the result areas
# numpy dtypes reduced here; float16, bfloat16 and bool keep the MPI path (float32 staging,
# logical ops), which costs little next to their conversions
SHM_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
         ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
OP_CODE = {op: i for i, op in enumerate(ReduceOp)}
_DTYPE_NAME = {d.num: d.name for d in SHM_DTYPES}
# bytes folded per ufunc call: the partial result stays in L2 while it is written out
_CHUNK_BYTES = 1 << 18


def size_class(nbytes: int) -> int:
    """Return the window size (bytes per rank) that holds ``nbytes``: a power of two."""
    return max(MIN_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())


class Window:
    """One shared window per size class: each rank's segment is the data area (``nbytes``)
    and two result areas (``nbytes / n`` each, rounded up), mapped as numpy arrays. Calls
    alternate between the result areas (``calls % 2``). A window that is lent
    (``ShmAllReduce.shared_buffer``) has no result areas."""

    __slots__ = ("calls", "data", "nbytes", "results", "win")

    def __init__(self, MPI: Any, node: Any, nbytes: int, *, lent: bool = False) -> None:
        n = node.Get_size()
        # a slice, one more element, aligned
        part = 0 if lent else round_up(-(-nbytes // n) + 8, HEADER)
        seg = nbytes + 2 * part
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's NUMA node
        try:
            self.win = MPI.Win.Allocate_shared(seg, 1, info, comm=node)
        finally:
            info.Free()
        self.nbytes = nbytes
        self.calls = 0
        segs = [np.frombuffer(self.win.Shared_query(k)[0], np.uint8, seg) for k in range(n)]
        self.data = [s[:nbytes] for s in segs]
        self.results = [[s[nbytes + i * part:nbytes + (i + 1) * part] for s in segs]
                        for i in (0, 1)]
        if self.win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
            self.win.Free()
            raise RuntimeError("this MPI gave a shared window the separate memory model; "
                               "the shared-memory all-reduce relies on the unified one")
        self.win.Lock_all(MPI.MODE_NOCHECK)

    def free(self) -> None:
        """End the passive-target epoch and free the window (collective over the node)."""
        self.win.Unlock_all()
        self.win.Free()


def round_up(x: int, to: int) -> int:
    """``x`` rounded up to a multiple of ``to``."""
    return -(-x // to) * to


def check_headers(headers: list[list[int]], rank: int, seq: int) -> None:
    """Raise CollectiveMismatchError, naming every rank's fields, unless every header's
    (count, dtype, op, call number) equals ``headers[rank]``'s (Python ints: each rank's
    flag line is read once, with ``tolist``)."""
    mine = headers[rank][:4]
    if all(h[:4] == mine for h in headers):
        return
    names = ("count", "dtype", "op", "call number (a rank is in another size class)")
    rows = []
    for k, h in enumerate(headers):
        c, d, o, call = (int(x) for x in h[:4])
        op = list(ReduceOp)[o].value if 0 <= o < len(ReduceOp) else "?"
        rows.append(f"rank {k}: count={c} dtype={_DTYPE_NAME.get(d, d)} op={op} call={call}")
    differ = [names[i] for i in range(4) if len({int(h[i]) for h in headers}) > 1]
    raise CollectiveMismatchError(
        f"all_reduce #{seq} (shared memory) on rank {rank}: the ranks disagree on "
        f"{', '.join(differ)} ({'; '.join(rows)}); every rank must all_reduce the same "
        f"number of elements of the same dtype with the same op, in the same order")


def fold(srcs: list[np.ndarray], lo: int, hi: int, op: ReduceOp, dests: list[np.ndarray],
         also: np.ndarray) -> None:
    """Fold ``srcs[0][i] op srcs[1][i] op ...`` in rank order for ``i`` in ``[lo, hi)``.

    The result goes to ``also`` (the caller's slice ``[lo, hi)``) and to every array of
    ``dests`` (a result area where peers read it, or the peers' own segments), all indexed
    from 0. Chunks keep the partial result in cache, so each further copy costs a pass
    over cache, not over memory. ``also`` may be this rank's own input at the same
    indices, and ``dests`` the peers' inputs there (only this rank reads ``[lo, hi)`` of
    them, a chunk before it is written): with two ranks the fold writes ``also``
    elementwise (safe); with more, a later fold step would read an overwritten input, so
    the chunk is folded in a scratch buffer first.
    """
    if hi <= lo:
        return
    ufunc, n = UFUNC[op], len(srcs)
    avg = op is ReduceOp.AVG
    step = max(1, _CHUNK_BYTES // also.itemsize)
    tmp = np.empty(min(step, hi - lo), also.dtype) if n > 2 else None
    for a in range(0, hi - lo, step):
        b = min(hi - lo, a + step)
        o = also[a:b]
        t = o if tmp is None else tmp[:b - a]
        ufunc(srcs[0][lo + a:lo + b], srcs[1][lo + a:lo + b], out=t)
        for k in range(2, n):
            ufunc(t, srcs[k][lo + a:lo + b], out=t)
        if avg:
            if t.dtype.kind == "f":
                np.divide(t, n, out=t)
            else:
                np.floor_divide(t, n, out=t)
        if tmp is not None:
            o[...] = t
        for d in dests:
            d[a:b] = t
