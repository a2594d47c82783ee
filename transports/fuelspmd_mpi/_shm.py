"""The shared-memory all-reduce: ranks of one node reduce through an MPI-3 shared window.

MPICH's Allreduce between processes of a node moves every byte through its own shared
queues: a ring or Rabenseifner all-reduce copies the data in and out of those queues about
``4 (n-1)/n`` times, each a send plus a receive copy, and reduces into a private buffer.
Here every rank maps every other rank's segment of one ``MPI_Win_allocate_shared`` window
and works on it with plain loads and stores (numpy, ``out=``):

1. copy in: rank ``r`` copies its buffer into its own segment ``S_r``, all but its own
   slice (below), which it reads from its buffer directly; skipped when the buffer already
   *is* the start of ``S_r`` (:meth:`ShmAllReduce.shared_buffer`);
2. sync; reduce: rank ``r`` owns the slice ``[lo_r, hi_r)`` (``count/n`` elements, the
   first ``count % n`` ranks one more) and folds ``x_0[i] op x_1[i] op ... op x_{n-1}[i]``
   left in rank order, in chunks that stay in cache, writing each chunk to ``S_r`` (for
   the peers) and to its own buffer;
3. sync; copy out: every rank copies slice ``k`` from ``S_k`` for every ``k != r``;
4. sync, so no rank writes its segment again (the next call, or a caller filling a
   :meth:`~ShmAllReduce.shared_buffer`) while a peer still reads it.

Per rank that is ``(n-1)/n N`` copied in, ``N`` read and ``2N/n`` written by the fold,
``(n-1)/n N`` copied out: about ``2 + 2/n`` passes over memory, against about
``4 (n-1)/n`` sends and copies for MPI's ring, and no message matching.

A pipelined variant (blocks of 1-4 MiB through a small double-buffered window, two
barriers per block) was measured and dropped: 0.6-0.8x of MPI at 16 MiB and 64 MiB on 2
ranks on 2 busy cores, since every barrier waits for the last-scheduled rank.

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
64-byte header (element count, dtype, op, call number) that every rank checks against its
peers' after the first sync: ranks that disagree raise CollectiveMismatchError, every one
of them, instead of reading past a segment.

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
# bytes folded per ufunc call: the partial result stays in L2 while it is written out
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
        # shm all-reduces so far, in every segment header: a rank whose call landed in
        # another window (a different size) leaves a stale header here, which this exposes
        self._calls = 0

    @classmethod
    def create(cls, comm: Any, *, MPI: Any, cap_bytes: int, sync: Any) -> ShmAllReduce | None:
        """Return the fast path of ``comm``, or None when its ranks do not all share memory.

        Collective over ``comm``. The node communicator keeps ``comm``'s rank order.
        """
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
        base, extra = divmod(count, n)
        bounds = [k * base + min(k, extra) for k in range(n + 1)]
        lo, hi = bounds[r], bounds[r + 1]
        mine = w.data[r][:flat.nbytes].view(dt)
        zero_copy = _address(flat) == _address(mine)
        # A buffer inside the window but not at its start is copied in whole and its result
        # copied out to a private array first: writing our segment in the copy-out phase
        # would clobber the slice a peer is still reading.
        inside = not zero_copy and np.may_share_memory(flat, w.data[r])
        if zero_copy or inside:
            if inside:
                mine[...] = flat
            src = mine
        else:  # our own slice is read from the caller's buffer: no need to copy it in
            mine[:lo] = flat[:lo]
            mine[hi:] = flat[hi:]
            src = flat
        self._calls += 1
        w.headers[r][:4] = (count, dt.num, _OP_CODE[op], self._calls)
        self._sync(w, seq)
        self._check_headers(w, seq)
        segs = [d[:flat.nbytes].view(dt) for d in w.data]
        self._reduce([src if k == r else s for k, s in enumerate(segs)], lo, hi, op, mine,
                     None if src is mine else flat)
        self._sync(w, seq)
        out = np.empty_like(flat) if inside else flat
        for k in range(n):
            if k != r or inside:
                out[bounds[k]:bounds[k + 1]] = segs[k][bounds[k]:bounds[k + 1]]
        self._sync(w, seq)
        if inside:
            flat[...] = out
        return True

    def _check_headers(self, w: _Window, seq: int) -> None:
        mine = w.headers[self.rank][:4]
        if all((h[:4] == mine).all() for h in w.headers):
            return
        names = ("count", "dtype", "op", "call number (a rank is in another size class)")
        rows = []
        for k, h in enumerate(w.headers):
            c, d, o, call = (int(x) for x in h[:4])
            op = list(ReduceOp)[o].value if 0 <= o < len(ReduceOp) else "?"
            rows.append(f"rank {k}: count={c} dtype={_DTYPE_NAME.get(d, d)}"
                        f" op={op} call={call}")
        differ = [names[i] for i in range(4) if len({int(h[i]) for h in w.headers}) > 1]
        raise CollectiveMismatchError(
            f"all_reduce #{seq} (shared memory) on rank {self.rank}: the ranks disagree on "
            f"{', '.join(differ)} ({'; '.join(rows)}); every rank must all_reduce the same "
            f"number of elements of the same dtype with the same op")

    def _reduce(self, srcs: list[np.ndarray], lo: int, hi: int, op: ReduceOp,
                dest: np.ndarray, also: np.ndarray | None) -> None:
        """Fold ``srcs[0][i] op srcs[1][i] op ...`` in rank order for ``i`` in ``[lo, hi)``.

        The result goes to ``dest`` (this rank's segment, where peers read it) and to
        ``also`` (the caller's buffer) when given. Chunks keep the partial result in cache,
        so writing it twice costs one extra pass over cache, not over memory.
        """
        if hi <= lo:
            return
        ufunc, n = _UFUNC[op], len(srcs)
        avg = op is ReduceOp.AVG
        step = max(1, _CHUNK_BYTES // dest.itemsize)
        tmp = np.empty(min(step, hi - lo), dest.dtype)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            # with one destination the last fold writes it directly (it may be an input at
            # the same index: elementwise, so safe); with two, a cached chunk is copied twice
            t = tmp[:b - a] if also is not None or n > 2 else dest[a:b]
            ufunc(srcs[0][a:b], srcs[1][a:b], out=t)
            for k in range(2, n):
                last = k == n - 1 and also is None
                ufunc(t, srcs[k][a:b], out=dest[a:b] if last else t)
                if last:
                    t = dest[a:b]
            if avg:
                if t.dtype.kind == "f":
                    np.divide(t, n, out=t)
                else:
                    np.floor_divide(t, n, out=t)
            if also is not None:
                dest[a:b] = t
                also[a:b] = t

    def free(self) -> None:
        """Free every window and the node communicator (collective over the group)."""
        for w in self._windows.values():
            w.free()
        self._windows.clear()
        self._node.Free()
