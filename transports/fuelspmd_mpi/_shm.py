"""The shared-memory all-reduce: ranks of one node reduce through an MPI-3 shared window.

MPICH's Allreduce between processes of a node moves every byte through its own shared
queues: a ring or Rabenseifner all-reduce copies the data in and out of those queues about
``4 (n-1)/n`` times, each a send plus a receive copy, and reduces into a private buffer.
Here every rank maps every other rank's segment of one ``MPI_Win_allocate_shared`` window
and works on it with plain loads and stores (numpy, ``out=``):

1. copy in: rank ``r`` copies its buffer into its own segment ``S_r`` (skipped when the
   buffer already *is* the start of ``S_r``: :meth:`ShmAllReduce.shared_buffer`);
2. sync; reduce: rank ``r`` owns the slice ``[lo_r, hi_r)`` (``count/n`` elements, the
   first ``count % n`` ranks one more) and writes ``S_0[i] op S_1[i] op ... op S_{n-1}[i]``,
   folded left in rank order, into ``S_r[lo_r:hi_r]``, in cache-sized chunks;
3. sync; copy out: every rank copies slice ``k`` from ``S_k`` for every ``k``;
4. sync, so no rank writes its segment again (the next call, or a caller filling a
   :meth:`~ShmAllReduce.shared_buffer`) while a peer still reads it.

The data crosses memory about ``2 + 2/n`` times per rank (copy in: read + write; reduce:
read ``n`` slices of ``N/n``, write one; copy out: read + write ``N``), against about
``4 (n-1)/n`` sends and copies for MPI's ring, and there is no message matching.

Results: the fixed left fold in rank order means every rank gets the bitwise-same result,
equal to ``functools.reduce(op, [x_0, ..., x_{n-1}])`` in numpy; MPI may associate a float
sum differently, so against MPI floats agree to rounding, integers bitwise. avg is sum then
a division by ``n`` (floor division for integers), as on the MPI path.

Memory synchronisation follows the MPI-3 *unified* memory model (which shared windows
have on every MPI we know; :class:`ShmAllReduce` checks ``MPI.WIN_MODEL``): each window is
held under a passive-target ``Lock_all`` epoch for its life, and a phase boundary is
``Win.Sync`` (a memory barrier: my stores are visible, later loads see others'), an
``MPI_Ibarrier`` (so everyone's stores are done; polled against the transport's deadline,
never a silent hang) and ``Win.Sync`` again.

Windows are allocated once per size class (powers of two, at least 64 KiB) and kept until
:meth:`ShmAllReduce.free`; their total per rank is capped (``cap_bytes``), and a call that
would need a window beyond the cap goes through MPI instead (every rank decides the same,
since all ranks see the same sequence of collective sizes). Each segment starts with a
64-byte header (element count, dtype, op) that every rank checks against its peers' after
the first sync: ranks that disagree raise CollectiveMismatchError, every one of them,
instead of reading past a segment.

Only ranks that share memory can do this: :meth:`ShmAllReduce.create` returns None when
the group spans several nodes (``Split_type(COMM_TYPE_SHARED)`` is smaller than the
group). A multi-node group uses MPI for the whole all-reduce; a hierarchical all-reduce
(intra-node shm, inter-node MPI) is built above the transport from ``split`` transports,
where each intra-node split can use this path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuelspmd.errors import CollectiveMismatchError, ConfigError
from fuelspmd.transport import ReduceOp

__all__ = ["MIN_CLASS", "SHM_DTYPES", "ShmAllReduce", "size_class"]

MIN_CLASS = 1 << 16  # smallest window: bytes per rank
HEADER = 64  # bytes before each segment's data: keeps the data 64-byte aligned
# numpy dtypes reduced here; float16, bfloat16 and bool keep the MPI path (float32 staging,
# logical ops), which costs little next to their conversions
SHM_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
_OP_CODE = {op: i for i, op in enumerate(ReduceOp)}
_DTYPE_NAME = {d.num: d.name for d in SHM_DTYPES}
# elements folded per ufunc call when n > 2: the partial result stays in L2 (measured
# float32, 2 ranks: 64 KiB..1 MiB chunks within 5%, 16 KiB 20% slower from call overhead)
_CHUNK_BYTES = 1 << 18


def size_class(nbytes: int) -> int:
    """Return the window size (bytes per rank) that holds ``nbytes``: a power of two."""
    return max(MIN_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class _Window:
    """One shared window of ``nbytes`` (+ header) per rank, mapped as numpy arrays."""

    __slots__ = ("data", "headers", "nbytes", "win")

    def __init__(self, MPI: Any, node: Any, nbytes: int) -> None:
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's NUMA node
        try:
            self.win = MPI.Win.Allocate_shared(HEADER + nbytes, 1, info, comm=node)
        finally:
            info.Free()
        self.nbytes = nbytes
        segs = [np.frombuffer(self.win.Shared_query(k)[0], np.uint8, HEADER + nbytes)
                for k in range(node.Get_size())]
        self.headers = [s[:HEADER].view(np.int64) for s in segs]
        self.data = [s[HEADER:] for s in segs]
        if self.win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
            self.win.Free()
            raise RuntimeError("this MPI gave a shared window the separate memory model; "
                               "the shared-memory all-reduce relies on the unified one")
        self.win.Lock_all(MPI.MODE_NOCHECK)

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


class ShmAllReduce:
    """The shared-memory all-reduce of one single-node group (see the module docstring).

    ``owner`` is the MPITransport: it supplies the deadline and names the operation in a
    CommTimeoutError (``MPIWork``); ``sync`` starts an Ibarrier on the node communicator
    and waits for it under that deadline.
    """

    def __init__(self, node: Any, *, MPI: Any, cap_bytes: int, sync: Any) -> None:
        self._MPI = MPI
        self._node = node
        self.rank: int = node.Get_rank()
        self.size: int = node.Get_size()
        self.cap_bytes = int(cap_bytes)
        self._sync_barrier = sync
        self._windows: dict[int, _Window] = {}

    @classmethod
    def create(cls, comm: Any, *, MPI: Any, cap_bytes: int, sync: Any) -> ShmAllReduce | None:
        """Return the fast path of ``comm``, or None when its ranks do not all share memory.

        Collective over ``comm``. The node communicator keeps ``comm``'s rank order.
        """
        if cap_bytes < MIN_CLASS:
            raise ConfigError(f"cap_bytes={cap_bytes} is below the smallest shared window "
                              f"({MIN_CLASS} bytes per rank); pass at least {MIN_CLASS}")
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        if node.Get_size() != comm.Get_size():
            node.Free()
            return None
        return cls(node, MPI=MPI, cap_bytes=cap_bytes, sync=sync)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of window this rank holds (its segments, headers excluded)."""
        return sum(self._windows)

    def _sync(self, w: _Window, seq: int) -> None:
        w.win.Sync()
        self._sync_barrier(self._node, seq)
        w.win.Sync()

    def window(self, nbytes: int) -> _Window | None:
        """Return the window of ``nbytes``' class, allocating it (collective) within the cap."""
        cls = size_class(nbytes)
        w = self._windows.get(cls)
        if w is None:
            if self.allocated_bytes + cls > self.cap_bytes:
                return None
            w = self._windows[cls] = _Window(self._MPI, self._node, cls)
        return w

    def shared_buffer(self, nbytes: int) -> np.ndarray:
        """Return ``nbytes`` of this rank's segment (uint8) for a zero-copy all_reduce input.

        Collective (it may allocate the window): every rank calls it with the same
        ``nbytes``. An all_reduce of an array that starts at the returned view's first
        byte and has the same class of size skips the copy in. The view stays valid until
        the transport is finalized; its contents after an all_reduce are the result.
        """
        w = self.window(nbytes)
        if w is None:
            raise ConfigError(
                f"shared_buffer({nbytes}): a window of {size_class(nbytes)} bytes would take "
                f"this rank's shared memory to {self.allocated_bytes + size_class(nbytes)} "
                f"bytes, above cap_bytes={self.cap_bytes}; raise cap_bytes in "
                f"set_all_reduce_policy or ask for less")
        return w.data[self.rank][:nbytes]

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """Reduce the C-contiguous ``buf`` over the node in place; False if over the cap.

        Blocking: it returns when the result is in ``buf`` on this rank (the caller hands
        back a completed Work).
        """
        w = self.window(buf.nbytes)
        if w is None:
            return False
        flat = buf.reshape(-1)
        dt, count, n, r = flat.dtype, flat.size, self.size, self.rank
        mine = w.data[r]
        zero_copy = _address(flat) == _address(mine)
        # a buffer inside the window but not at its start: copy in as usual, but copy out
        # to a private array, since writing our segment in phase 3 would clobber the slice
        # a peer is still reading
        inside = not zero_copy and np.shares_memory(flat, w.data[r])
        if not zero_copy:
            mine[:flat.nbytes].view(dt)[...] = flat
        w.headers[r][:3] = (count, dt.num, _OP_CODE[op])
        self._sync(w, seq)
        self._check_headers(w, seq)
        segs = [d[:flat.nbytes].view(dt) for d in w.data]
        base, extra = divmod(count, n)
        bounds = [k * base + min(k, extra) for k in range(n + 1)]
        lo, hi = bounds[r], bounds[r + 1]
        self._reduce(segs, lo, hi, op)
        self._sync(w, seq)
        out = np.empty_like(flat) if inside else flat
        if not zero_copy:
            for k in range(n):
                out[bounds[k]:bounds[k + 1]] = segs[k][bounds[k]:bounds[k + 1]]
        else:
            for k in range(n):
                if k != r:
                    out[bounds[k]:bounds[k + 1]] = segs[k][bounds[k]:bounds[k + 1]]
        self._sync(w, seq)
        if inside:
            flat[...] = out
        return True

    def _check_headers(self, w: _Window, seq: int) -> None:
        mine = w.headers[self.rank][:3]
        if all((h[:3] == mine).all() for h in w.headers):
            return
        names = ("count", "dtype", "op")
        rows = []
        for k, h in enumerate(w.headers):
            c, d, o = (int(x) for x in h[:3])
            op = list(ReduceOp)[o].value if 0 <= o < len(ReduceOp) else "?"
            rows.append(f"rank {k}: count={c} dtype={_DTYPE_NAME.get(d, d)}"
                        f" op={op}")
        differ = [names[i] for i in range(3) if len({int(h[i]) for h in w.headers}) > 1]
        raise CollectiveMismatchError(
            f"all_reduce #{seq} (shared memory) on rank {self.rank}: the ranks disagree on "
            f"{', '.join(differ)} ({'; '.join(rows)}); every rank must all_reduce the same "
            f"number of elements of the same dtype with the same op")

    def _reduce(self, segs: list[np.ndarray], lo: int, hi: int, op: ReduceOp) -> None:
        """Fold slice ``[lo, hi)`` of every segment in rank order into this rank's segment."""
        if hi <= lo:
            return
        ufunc, n = _UFUNC[op], len(segs)
        dest = segs[self.rank]
        if n == 2:  # one pass, streaming: dest is read at the same index it is written
            ufunc(segs[0][lo:hi], segs[1][lo:hi], out=dest[lo:hi])
        else:
            step = max(1, _CHUNK_BYTES // dest.itemsize)
            tmp = np.empty(min(step, hi - lo), dest.dtype)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                t = tmp[:b - a]
                ufunc(segs[0][a:b], segs[1][a:b], out=t)
                for k in range(2, n - 1):
                    ufunc(t, segs[k][a:b], out=t)
                ufunc(t, segs[n - 1][a:b], out=dest[a:b])
        if op is ReduceOp.AVG:
            part = dest[lo:hi]
            if part.dtype.kind == "f":
                np.divide(part, n, out=part)
            else:
                np.floor_divide(part, n, out=part)

    def free(self) -> None:
        """Free every window and the node communicator (collective over the group)."""
        for w in self._windows.values():
            w.free()
        self._windows.clear()
        self._node.Free()
