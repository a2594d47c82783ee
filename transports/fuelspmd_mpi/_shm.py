"""The shared-memory all-reduce: the ranks of one node reduce through MPI-3 shared windows.

MPICH's Allreduce within a node copies every byte into and out of its shared queues about
``4 (n-1)/n`` times and matches messages. Here every rank maps every rank's segment of an
``MPI_Win_allocate_shared`` window and works on it with loads and stores (numpy, ``out=``).
Rank ``r`` owns slice ``r`` (:func:`~fuelspmd_mpi._work.slices`). An input in the caller's
own buffer is *copied in*:

1. ``r`` copies its buffer, all but its own slice, into its segment's data area;
2. sync; ``r`` folds ``x_0 op x_1 op ... op x_{n-1}`` over its slice, left in rank order,
   in chunks that stay in cache, into its buffer and a result area of its segment;
3. sync; ``r`` copies slice ``k`` out of rank ``k``'s result area, for every ``k != r``:

about ``2 + 2/n`` passes over memory per rank, no message matching. Two syncs, not three:
calls alternate between two result areas, so a rank may start its next call while a slow
peer still copies out; an area is written again two calls later, after a sync that peer
must have passed. A *placed* input (the transport's ``lend``: an area of a lent window of
its size class) is not copied: when every rank's input starts a lent area, each rank
folds its slice into that slice of every rank's area (no other rank touches it) and one
sync later every area holds the result: ``N`` read and ``N`` written per rank. A lent area
is never the copy-in area, so a caller may hold a result there while other all_reduces of
its size run. From ``PIPE_MIN`` bytes, when every rank has a core of its own, the three
steps run per ``_CHUNK`` through two small slots per rank that stay in cache, the syncs
being flag handshakes (with more ranks than cores each would wait for a time slice).

Each call writes a header into its rank's line of the flag window (``_FLAG_WORDS`` int64),
then the ranks meet at the first sync:

====  ===================================================================================
word  meaning
====  ===================================================================================
0     phase counter, raised at every sync (:meth:`ShmAllReduce._sync`)
1, 2  the pipelined path's two handshakes: the chunk number
3-6   element count, dtype (``dtype.num``), op (index in ``ReduceOp``), call number (shm
      all-reduces of this group so far): must be equal on every rank
7-9   the caller's check words (``Check``: the ``checked`` capability)
10    the lent area of the class that holds the input: its index plus one; 0 for none
11    1: this rank found no free lent area of the class and asks for one more
12    1: this rank lost its core lately (``_SLOW_CALLS``): keep off the pipelined path
====  ===================================================================================

Every rank decides alike. After the first sync all ranks read the same lines. Where words
3-6 differ, every rank raises CollectiveMismatchError before any data area is read (none
reads past a peer's segment); otherwise each choice is a pure function of those lines: the
path (placed when every word 10 is set; pipelined when the size allows and no word 12 is
set; else copy-in), whether the copy-in window is made first, whether a lent window is
added (any word 11; up to ``LENT_MAX``). Making and freeing a window is collective and
happens only there, where every rank is in the same call of the same size. Which windows
exist, and so whether one more fits under the cap, follows from the sequence of collective
sizes, the same on every rank; the cap and whether to pipeline are agreed at creation.

Results: the left fold in rank order is bitwise the same on every rank, equal to
``functools.reduce(op, [x_0, ..., x_{n-1}])`` in numpy; against MPI floats agree to
rounding, integers bitwise. avg is sum, then division by ``n`` (floor for integers).

Memory: shared windows have MPI-3's unified model (checked), each under a ``Lock_all``
epoch for its life. A sync is ``Win.Sync`` (a full memory barrier in MPICH and Open MPI)
around a flag handshake polled against the transport's deadline (CommTimeoutError names a
missing rank), not ``MPI_Ibarrier``: a rank waiting inside MPI yields its core and may lose
it for a time slice. Windows go by size class (powers of two, at least ``MIN_CLASS``), kept
until :meth:`ShmAllReduce.free`, capped per rank (a size over the cap runs MPI's own). They
are pages of ``/dev/shm``, where a window whose pages do not fit kills its process with
SIGBUS at the first store: the cap is at most a quarter of the free space over the ranks
(a copy-in window takes up to twice its class; other jobs share the space). A group that
spans nodes has none (:mod:`fuelspmd_mpi._hier` serves those).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from fuelspmd.backend import tracked
from fuelspmd.errors import CollectiveMismatchError
from fuelspmd.transport import CHECK_WORDS, Check, Disagreement, ReduceOp
from fuelspmd_mpi._work import UFUNCS, divide, late_text, slices, spin

__all__ = ["MIN_CLASS", "PIPE_MIN", "SHM_DTYPES", "ShmAllReduce", "Window", "size_class"]

SHM_DIR = "/dev/shm"  # where MPICH and Open MPI put the pages of a shared window
MIN_CLASS = 1 << 16  # the smallest window: bytes per rank
LENT_MAX = 16  # lent windows per size class at most
# float16, bfloat16 and bool keep the MPI path (float32 staging, logical ops)
SHM_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
PIPE_MIN = 4 << 20
_CHUNK = 1 << 18  # a pipelined chunk, and the fold's: its partial result stays in cache
_FLAG_WORDS = 16  # a rank's flag line: two cache lines (the table above)
_SPIN_S = 2e-3  # a sync spins this long before it yields the core (every rank on a core)
_NEAR = 64  # polls of a sync before its deadline and watch are set up (microseconds)
_SLOW_WAIT_S, _SLOW_CALLS = 1e-3, 16  # handshakes waited this long: whole-size for a while
_OPS = list(ReduceOp)
_NO_CHECK = (0,) * CHECK_WORDS
# a header as read from word 3 of a flag line (the table): count, dtype, op and call number,
# then the check words, then these three
_PLACED, _ASKS, _SLOW = 4 + CHECK_WORDS, 5 + CHECK_WORDS, 6 + CHECK_WORDS
_HEAD = slice(3, 3 + _SLOW + 1)
_DTYPE_NAME = {d.num: d.name for d in SHM_DTYPES}


def size_class(nbytes: int) -> int:
    """The window size (bytes per rank) that holds ``nbytes``: a power of two."""
    return max(MIN_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())


def _part(nbytes: int, n: int) -> int:
    """Bytes of one result area: a slice of ``nbytes`` over ``n``, 8 more, cache-aligned."""
    return -(-(-(-nbytes // n) + 8) // 64) * 64


def _shm_free() -> int:
    """Bytes free in the file system that backs shared windows (unknown: ``1 << 62``)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


class Window:
    """One shared window: ``nbytes`` per rank, every rank's segment mapped (``segs``, uint8).
    ``uses`` counts the copy-in calls through it (their result areas alternate). ``held``:
    of a lent window, a weak reference to the one array its area was handed out as (every
    view of the area derives from that array, so it is alive while any view is)."""

    __slots__ = ("held", "nbytes", "segs", "uses", "win")

    def __init__(self, MPI: Any, node: Any, nbytes: int) -> None:
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's NUMA node
        try:
            self.win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=node)
        finally:
            info.Free()
        if self.win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
            self.win.Free()
            raise RuntimeError("this MPI gave a shared window the separate memory model; "
                               "the shared-memory all-reduce relies on the unified one")
        self.nbytes, self.uses = nbytes, 0
        self.held: weakref.ref[np.ndarray] | None = None
        self.segs = [np.frombuffer(self.win.Shared_query(k)[0], np.uint8, nbytes)
                     for k in range(node.Get_size())]
        self.win.Lock_all(MPI.MODE_NOCHECK)

    def free(self) -> None:
        """End the epoch and free the window (collective over the node)."""
        self.win.Unlock_all()
        self.win.Free()


def fold_piece(srcs: Sequence[np.ndarray], ufunc: Any, avg: bool, out: np.ndarray,
               tmp: np.ndarray | None) -> np.ndarray:
    """Fold ``srcs[0] op srcs[1] op ...`` (equal pieces, in rank order) into ``out`` and
    return the array that holds the result. ``out`` may be one of ``srcs``: with two the
    fold writes it elementwise (each element is read before it is written); with more,
    ``tmp`` (``out``'s size) takes the partial result, or a later step would read an
    overwritten input, and is copied into ``out`` at the end."""
    t = out if tmp is None else tmp
    ufunc(srcs[0], srcs[1], out=t)
    for s in srcs[2:]:
        ufunc(t, s, out=t)
    if avg:
        divide(t, len(srcs))
    if tmp is not None:
        out[...] = t
    return t


def fold(srcs: list[np.ndarray], lo: int, hi: int, op: ReduceOp, dests: list[np.ndarray],
         also: np.ndarray) -> None:
    """Fold ``srcs[0][i] op srcs[1][i] op ...`` in rank order for ``i`` in ``[lo, hi)`` into
    ``also`` (the caller's slice ``[lo, hi)``, which may be this rank's own input) and every
    array of ``dests`` (indexed from 0), a cache-sized piece at a time (:func:`fold_piece`)."""
    if hi <= lo:
        return
    ufunc, avg, n = UFUNCS[op], op is ReduceOp.AVG, len(srcs)
    step = max(1, _CHUNK // also.itemsize)
    tmp = np.empty(min(step, hi - lo), also.dtype) if n > 2 else None
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        t = fold_piece([x[a:b] for x in srcs], ufunc, avg, also[a - lo:b - lo],
                       None if tmp is None else tmp[:b - a])
        for d in dests:
            d[a - lo:b - lo] = t


def _mismatch(heads: list[list[int]], rank: int, seq: int) -> NoReturn:
    """Raise CollectiveMismatchError naming every rank's header words 3-6."""
    names = ("count", "dtype", "op", "call number (a rank is in another size class)")
    rows = [f"rank {k}: count={c} dtype={_DTYPE_NAME.get(d, d)} "
            f"op={_OPS[o].value if 0 <= o < len(_OPS) else '?'} call={call}"
            for k, (c, d, o, call) in enumerate(h[:4] for h in heads)]
    differ = [names[i] for i in range(4) if len({h[i] for h in heads}) > 1]
    raise CollectiveMismatchError(
        f"all_reduce #{seq} (shared memory) on rank {rank}: the ranks disagree on "
        f"{', '.join(differ)} ({'; '.join(rows)}); every rank must all_reduce the same "
        f"number of elements of the same dtype with the same op, in the same order")


class ShmAllReduce:
    """The shared-memory all-reduce of one single-node group (the module docstring); the
    transport ``owner``'s timeout bounds one sync, and ``owner`` names it in a timeout."""

    def __init__(self, node: Any, *, MPI: Any, cap_bytes: int, owner: Any) -> None:
        self._MPI, self._node, self._owner = MPI, node, owner
        self.rank: int = node.Get_rank()
        self.size: int = node.Get_size()
        self.timeout: float = owner.timeout
        self._copy: dict[int, Window] = {}  # size class -> its copy-in window
        self._lent: dict[int, list[Window]] = {}  # size class -> its lent windows
        self._asked: set[int] = set()  # classes whose areas were all held when asked
        self._pipe_win: Window | None = None
        self._calls = self._syncs = self._pipe_chunks = self._slow_left = 0
        self._waited = 0.0  # seconds this call's handshakes waited past the spin
        # the flags and headers in a window of their own: ranks whose calls would use
        # different data windows still meet, and see the mismatch in the headers
        self._flag = Window(MPI, node, _FLAG_WORDS * 8)
        self._flags = [s.view(np.int64) for s in self._flag.segs]
        self._flags[self.rank][:] = 0
        # agreed by all ranks: a core each to pipeline (else a sync yields at once), and a
        # cap of a quarter of the least free /dev/shm any rank saw, over the ranks
        agreed = np.array([1 if owner.core_each else 0, _shm_free()], np.int64)
        node.Allreduce(MPI.IN_PLACE, agreed, MPI.MIN)
        self.pipelined = bool(agreed[0])
        self._pipe_bytes = 2 * _CHUNK + 2 * _part(_CHUNK, self.size)  # two slots, two results
        self._spin_s = _SPIN_S if self.pipelined else 0.0
        self._near = _NEAR if self.pipelined else 0  # sharing cores: yield at once
        self.cap_bytes, self.cap_note = min(int(cap_bytes), int(agreed[1]) // (4 * self.size)), ""
        if self.cap_bytes < int(cap_bytes):
            self.cap_note = (f"{SHM_DIR} has {int(agreed[1]) >> 20} MiB free for "
                             f"{self.size} ranks and the cap is a quarter of it per rank: "
                             f"give it more (docker run --shm-size=1g) or ask for less")
        node.Barrier()  # every flag is 0 before anyone waits on it

    @classmethod
    def create(cls, comm: Any, *, MPI: Any, cap_bytes: int, owner: Any) -> ShmAllReduce | None:
        """The shm all-reduce of ``comm`` (in its rank order), or None when its ranks do not
        all share memory. Collective over ``comm``."""
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        if node.Get_size() != comm.Get_size():
            node.Free()
            return None
        return cls(node, MPI=MPI, cap_bytes=cap_bytes, owner=owner)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of window this rank holds: its classes, lent and copy-in, and the slots."""
        return (sum(self._copy) + sum(c * len(ws) for c, ws in self._lent.items())
                + (0 if self._pipe_win is None else self._pipe_win.nbytes))

    def fits(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` can run here under the cap: its class fits, or
        it is pipelined (whose slots are small)."""
        return size_class(nbytes) <= self.cap_bytes or (
            self.pipelined and nbytes >= PIPE_MIN and self._pipe_bytes <= self.cap_bytes)

    # -- lent areas ----------------------------------------------------------------------

    def lend(self, nbytes: int) -> np.ndarray | None:
        """A whole lent area (uint8) of ``nbytes``' class that nobody holds a view of; or None,
        asking the class's next all_reduce to add one on every rank. Local."""
        cls = size_class(nbytes)
        for w in self._lent.get(cls, ()):
            if w.held is None or w.held() is None:
                area = tracked(w.segs[self.rank])
                w.held = weakref.ref(area)
                return area
        self._asked.add(cls)
        return None

    def _placed(self, flat: np.ndarray) -> int:
        """Which lent area of its class ``flat`` starts: its index plus one, or 0. A view of
        an area has the area's array as its base (told apart by identity), and starts it
        when its first element overlaps the area's first byte."""
        base = flat.base
        if base is None or not flat.size:
            return 0
        for i, w in enumerate(self._lent.get(size_class(flat.nbytes), ())):
            if w.held is not None and w.held() is base:
                return i + 1 if np.shares_memory(flat[:1], base[:1]) else 0
        return 0

    def lent(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` is a view of a lent area (at any offset)."""
        base = buf.base
        return base is not None and any(w.held is not None and w.held() is base
                                        for ws in self._lent.values() for w in ws)

    def _grow(self, cls: int) -> None:
        """Add a lent window to ``cls`` (some rank asked: every rank read it in the headers)
        when the cap leaves room for it and for the class's copy-in window."""
        ws = self._lent.setdefault(cls, [])
        room = self.cap_bytes - self.allocated_bytes - (0 if cls in self._copy else cls)
        if len(ws) < LENT_MAX and cls <= room:
            ws.append(Window(self._MPI, self._node, cls))
        elif not ws:  # nothing fits: the class stays unlent
            del self._lent[cls]

    # -- syncs ---------------------------------------------------------------------------

    def _sync(self, seq: int, check: Check | None = None) -> None:
        """Wait until every rank reached this phase boundary (flag 0, raised at each)."""
        self._syncs += 1
        self._raise_and_wait(0, self._syncs, seq, check)

    def _raise_and_wait(self, slot: int, k: int, seq: int,
                        check: Check | None = None) -> None:
        """Set this rank's flag ``slot`` to ``k``; spin until every rank's is >= ``k``, within
        the deadline, calling ``check.watch``. ``Win.Sync`` (a memory barrier, whichever
        window it names) puts this rank's data stores before its flag, and the peers' flags
        before their data. With a core each, the first ``_NEAR`` polls run before the wait
        is set up: ranks that work alike arrive close together, and a sync's latency is paid
        by every call (twice per chunk on the pipelined path)."""
        flags, fence = self._flags, self._flag.win.Sync
        fence()
        flags[self.rank][slot] = k
        fence()
        for _ in range(self._near):
            if all(f[slot] >= k for f in flags):
                fence()
                return

        def late(limit: float) -> str:
            missing = [j for j, f in enumerate(flags) if f[slot] < k]
            return (f"{late_text(self._owner, 'all_reduce (shared memory)', seq, limit)} "
                    f"(rank(s) {missing} of the group never reached it)")

        self._waited += spin(lambda: all(f[slot] >= k for f in flags),
                             self.timeout if check is None else min(self.timeout, check.timeout),
                             late, None if check is None else check.watch, self._spin_s)
        fence()

    # -- the all-reduce ------------------------------------------------------------------

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, seq: int,
                   check: Check | None = None) -> bool:
        """Reduce the C-contiguous ``buf`` over the node in place, blocking; False if over
        the cap. ``check`` rides in header words 7-10 (:class:`Disagreement` on every rank
        unless ``check.agrees``), and ``check.watch()`` runs while this rank waits."""
        flat = buf.reshape(-1)
        dt, count, n, r = flat.dtype, flat.size, self.size, self.rank
        nbytes = flat.nbytes
        cls = size_class(nbytes)
        placed = self._placed(flat)
        want = cls in self._asked
        self._asked.discard(cls)
        pipe = self.pipelined and nbytes >= PIPE_MIN
        slow = pipe and self._slow_left > 0
        self._slow_left -= slow
        bounds = slices(count, n)
        lo, hi = bounds[r], bounds[r + 1]
        # the copy-in window exists on every rank or on none; one that exists is filled
        # before the first sync when this call surely takes the copy-in path
        w = self._copy.get(cls)
        copied = w is not None and not placed and (not pipe or slow)
        if copied:
            self._copy_in(w, flat, lo, hi)
        self._calls += 1
        words = _NO_CHECK if check is None else check.words
        self._flags[r][_HEAD] = (count, dt.num, _OPS.index(op), self._calls, *words, placed,
                                want, slow)
        self._sync(seq, check)
        heads = [f[_HEAD].tolist() for f in self._flags]  # each line read once, as ints
        if check is not None and not check.agrees(rows := [h[4:_PLACED] for h in heads]):
            raise Disagreement(f"all_reduce #{seq} (shared memory)", rows)
        if any(h[:4] != heads[r][:4] for h in heads):
            _mismatch(heads, r, seq)
        if all(h[_PLACED] for h in heads):  # every input in a lent area (not always the same)
            ws = self._lent[cls]
            segs = [ws[h[_PLACED] - 1].segs[k][:nbytes].view(dt) for k, h in enumerate(heads)]
            fold(segs, lo, hi, op, [s[lo:hi] for k, s in enumerate(segs) if k != r],
                 segs[r][lo:hi])
            self._sync(seq)
        elif pipe and not any(h[_SLOW] for h in heads) and self._pipe() is not None:
            self._pipelined(flat, op, seq)
        else:
            # every rank copied in before the sync when the window existed and no rank's
            # input was placed or meant for the pipelined path; else the others copy now
            ready = w is not None and not any(h[_PLACED] or (pipe and not h[_SLOW]) for h in heads)
            if w is None:
                if self.allocated_bytes + cls > self.cap_bytes:
                    return False  # beyond the cap: every rank decides the same
                w = self._copy[cls] = Window(self._MPI, self._node, cls + 2 * _part(cls, n))
            if not ready:
                if not copied:
                    self._copy_in(w, flat, lo, hi)
                self._sync(seq)
            part = _part(cls, n)
            at = cls + (w.uses % 2) * part  # this call's result areas
            w.uses += 1
            res = [s[at:at + (bounds[k + 1] - bounds[k]) * dt.itemsize].view(dt)
                   for k, s in enumerate(w.segs)]
            fold([flat if k == r else s[:nbytes].view(dt) for k, s in enumerate(w.segs)],
                 lo, hi, op, [res[r]], flat[lo:hi])
            self._sync(seq)
            for k in range(n):
                if k != r:
                    flat[bounds[k]:bounds[k + 1]] = res[k]
        if any(h[_ASKS] for h in heads):
            self._grow(cls)
        return True

    def _copy_in(self, w: Window, flat: np.ndarray, lo: int, hi: int) -> None:
        """Copy ``flat`` into this rank's data area of ``w``, all but its own slice."""
        mine = w.segs[self.rank][:flat.nbytes].view(flat.dtype)
        mine[:lo] = flat[:lo]
        mine[hi:] = flat[hi:]

    def _pipe(self) -> Window | None:
        """The pipelined path's window (made on first use, collective): per rank two input
        slots of ``_CHUNK`` bytes and two result slots; None when over the cap."""
        if self._pipe_win is None and self.allocated_bytes + self._pipe_bytes <= self.cap_bytes:
            self._pipe_win = Window(self._MPI, self._node, self._pipe_bytes)
        return self._pipe_win

    def _pipelined(self, flat: np.ndarray, op: ReduceOp, seq: int) -> None:
        """The three steps per chunk ``c`` of ``_CHUNK`` bytes through slot ``c % 2``, the
        syncs being flags 1 and 2; a slot is written again two chunks later, after a flag
        every peer raised once done reading it."""
        segs = self._pipe_win.segs  # type: ignore[union-attr]
        dt, count, n, r = flat.dtype, flat.size, self.size, self.rank
        self._waited = 0.0
        step, part = _CHUNK // dt.itemsize, _part(_CHUNK, n)
        slots = [[s[i * _CHUNK:(i + 1) * _CHUNK].view(dt) for s in segs] for i in (0, 1)]
        results = [[s[2 * _CHUNK + i * part:2 * _CHUNK + (i + 1) * part].view(dt)
                    for s in segs] for i in (0, 1)]
        ufunc, avg = UFUNCS[op], op is ReduceOp.AVG
        tmp = np.empty(-(-step // n) + 1, dt) if n > 2 else None  # fold_piece's scratch
        for c0 in range(0, count, step):
            chunk = flat[c0:c0 + step]
            b = slices(chunk.size, n)
            lo, hi = b[r], b[r + 1]
            self._pipe_chunks += 1
            k = self._pipe_chunks
            slot, out = slots[k % 2], results[k % 2]
            slot[r][:lo] = chunk[:lo]
            slot[r][hi:chunk.size] = chunk[hi:]
            self._raise_and_wait(1, k, seq)
            mine = chunk[lo:hi]  # a chunk is cache-sized: folded as one piece
            out[r][:hi - lo] = fold_piece([mine if j == r else slot[j][lo:hi]
                                           for j in range(n)], ufunc, avg, mine,
                                          None if tmp is None else tmp[:hi - lo])
            self._raise_and_wait(2, k, seq)
            for j in range(n):
                if j != r:
                    chunk[b[j]:b[j + 1]] = out[j][:b[j + 1] - b[j]]
        if self._waited > _SLOW_WAIT_S:
            self._slow_left = _SLOW_CALLS

    def free(self) -> list[Window]:
        """Free the windows and the node communicator (collective). While some rank holds a
        view of a lent area (a graph result may live there), every rank keeps its lent
        windows (agreed first) and returns them, for the caller to keep referenced."""
        lent = [w for ws in self._lent.values() for w in ws]
        held = np.array([any(w.held is not None and w.held() is not None for w in lent)],
                        np.int8)
        self._node.Allreduce(self._MPI.IN_PLACE, held, self._MPI.MAX)
        pipe = [] if self._pipe_win is None else [self._pipe_win]
        for w in [*self._copy.values(), *([] if held[0] else lent), *pipe, self._flag]:
            w.free()
        self._copy, self._lent, self._pipe_win = {}, {}, None
        self._node.Free()
        return lent if held[0] else []
