"""The shared-memory all-reduce: ranks of one node reduce through an MPI-3 shared window.

MPICH's Allreduce between processes of a node moves every byte through its own shared
queues: a ring or Rabenseifner all-reduce copies the data in and out of those queues about
``4 (n-1)/n`` times, each a send plus a receive copy, and reduces into a private buffer.
Here every rank maps every other rank's segment of one ``MPI_Win_allocate_shared`` window
and works on it with plain loads and stores (numpy, ``out=``):

1. copy in: rank ``r`` copies its buffer into the data area of its own segment ``S_r``,
   all but its own slice (below), which it reads from its buffer directly;
2. sync; reduce: rank ``r`` owns the slice ``[lo_r, hi_r)`` (``count/n`` elements, the
   first ``count % n`` ranks one more) and folds ``x_0[i] op x_1[i] op ... op x_{n-1}[i]``
   left in rank order, in chunks that stay in cache, writing each chunk to its own buffer
   and to this call's result area of ``S_r`` (for the peers);
3. sync; copy out: every rank copies slice ``k`` from ``S_k``'s result area, ``k != r``.

Two phase boundaries, not three: the result areas alternate between calls (two per
segment), so a rank may start the next call while a slower peer still copies out of the
previous call's results: the data areas are only read between the two syncs, and a
result area is written again two calls later, after a sync the slow peer must have passed.

Placed inputs. A second window per size class is *lent*
(:meth:`ShmAllReduce.shared_buffer`, and the transport's ``window_buffer``, through which
the lazy graph places all_reduce inputs and buckets there). A class gets more lent windows
as a program holds more results of its size at once (the buckets of one step): a rank that
asks for a free area and finds all held (or none yet: the class's first) says so in its
next call's header, and at the end of that call every rank adds one (allocating is
collective, and only inside a call do the ranks know they are all there), up to
``LENT_MAX`` and within the cap (:mod:`fuelspmd_mpi._shm_lent`).

When every rank's input starts one of its lent areas (not necessarily the same one), no
data is copied in: each rank folds its slice and writes the result into that slice of
every rank's area (only it touches that slice of any area), and the ranks sync once: every
area then holds the whole result. That is ``N`` read and ``N`` written per rank in one
pass, against the copy-in path's extra ``(n-1)/n N`` in and out; measured, 2 ranks on 2
cores, against MPICH (``fuelspmd bench shm``, column ``shm_zc``, this tree and the one
before alternately): 1.56-1.89x at 1 MiB, 1.94-2.10x at 4 MiB, 2.30-2.62x at 16 MiB,
3.99-4.15x at 64 MiB, where folding in place, copying the others' slices out after a sync
and meeting once more gave 1.36-1.51x, 1.81-1.83x, 1.69-1.71x and 3.15-3.59x. The ranks
learn from the headers, after the first sync, whether all inputs were placed; when only
some were, those ranks copy in like the others and all sync once more. The lent area is
never the copy-in area, so a caller may hold a result there while other all_reduces of
that size run through the copy-in path.

Per rank that is ``(n-1)/n N`` copied in, ``N`` read and ``2N/n`` written by the fold,
``(n-1)/n N`` copied out: about ``2 + 2/n`` passes over memory, against about
``4 (n-1)/n`` sends and copies for MPI's ring, and no message matching.

From ``PIPE_MIN`` (4 MiB), when every rank has a core of its own, the same three steps
run per chunk of 256 KiB through two small slots per rank (:meth:`ShmAllReduce._pipelined`),
the phase boundaries being flag handshakes in shared memory: the slots stay in cache
where the whole-size window does not (MPICH's own copies go through small buffers too).
Measured interleaved against the whole-size path, 2 ranks on 2 cores, 16 MiB float32:
1.19-1.34x MPI against 0.96-0.99x; at 64 MiB both about 1.8x. An earlier pipelined
variant with MPI barriers between blocks reached only 0.6-0.8x of MPI, and with more
ranks than cores a fine-grained handshake waits for a time slice per chunk (0.21x at 4
ranks on 2 cores), so oversubscribed groups keep the whole-size path.

Results: the fixed left fold in rank order means every rank gets the bitwise-same result,
equal to ``functools.reduce(op, [x_0, ..., x_{n-1}])`` in numpy; MPI may associate a float
sum differently, so against MPI floats agree to rounding, integers bitwise. avg is sum then
a division by ``n`` (floor division for integers), as on the MPI path.

Memory synchronisation follows the MPI-3 *unified* memory model (which shared windows
have on every MPI we know; :class:`ShmAllReduce` checks ``MPI.WIN_MODEL``): each window is
held under a passive-target ``Lock_all`` epoch for its life, and a phase boundary is
``Win.Sync`` (a memory barrier: my stores are visible, later loads see others'), a flag
handshake in a small window of its own (each rank raises its counter and polls the
others', against the transport's deadline: never a silent hang) and ``Win.Sync`` again.
The handshake replaced an ``MPI_Ibarrier``: a rank waiting in MPI yields its core after a
few microseconds and, on a busy machine, loses it to another job for a time slice.

Windows are allocated once per size class (powers of two, at least 64 KiB) and kept until
:meth:`ShmAllReduce.free`; their total per rank is capped (``cap_bytes``), and a call that
would need a window beyond the cap goes through MPI instead (every rank decides the same,
since all ranks see the same sequence of collective sizes). A copy-in window is made by
the first call of its class whose inputs are not all placed, after the first sync (every
rank is there), so a class whose inputs are always placed never holds one. Each call
writes a header (element count, dtype, op, call number; where its input lies, whether it
asks for a lent area, whether it lost its core lately) into the rank's line of the flag
window, which every rank checks against its peers' after the first sync: ranks that
disagree raise CollectiveMismatchError, every one of them, instead of reading past a
segment; ranks that agree all take the path the headers give (placed, pipelined or
copy-in), with no further vote.

Only ranks that share memory can do this: :meth:`ShmAllReduce.create` returns None when
the group spans several nodes (``Split_type(COMM_TYPE_SHARED)`` is smaller than the
group). A multi-node group uses MPI for the whole all-reduce; a hierarchical all-reduce
(intra-node shm, inter-node MPI) is built above the transport from ``split`` transports,
where each intra-node split can use this path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.errors import CommTimeoutError
from fuelspmd.transport import WATCH_S, Check, Disagreement, ReduceOp
from fuelspmd_mpi._shm_lent import LentAreas
from fuelspmd_mpi._shm_window import (
    HEADER,
    MIN_CLASS,
    OP_CODE,
    SHM_DTYPES,
    UFUNC,
    Window,
    check_headers,
    fold,
    round_up,
    size_class,
)

__all__ = ["MIN_CLASS", "PIPE_MIN", "SHM_DTYPES", "ShmAllReduce", "size_class"]

SHM_DIR = "/dev/shm"  # where MPICH and Open MPI put the pages of a shared window
# int64 words of a rank's flag line (two cache lines): 0 the phase counter, 1-2 the
# pipelined handshakes, 3-12 the call's header: count, dtype, op, call number (3-6,
# checked against the peers'), the caller's three check words (7-9, see Check), the lent
# area its input lies in (0: none), whether it asks for a lent area, whether it lost its
# core lately
_FLAG_WORDS = 16
# how long a phase wait spins before it yields the core (when every rank has a core)
_SPIN_S = 2e-3
# The pipelined path (every rank on a core of its own): from this size, in chunks of this
# many bytes. Measured, 2 ranks, 16 MiB float32: 256 KiB chunks 1.25x MPI, 1 MiB 1.11x,
# 4 MiB 1.01x (Python's cost per chunk against the cache); 4 ranks on 2 cores 0.21x,
# hence only without oversubscription.
PIPE_MIN = 4 << 20
_PIPE_CHUNK = 1 << 18
# A pipelined call whose handshakes waited this long past the spin (a peer lost its core)
# sends the next calls down the whole-size path (see ShmAllReduce._pipelined).
_SLOW_WAIT_S = 1e-3
_SLOW_CALLS = 16


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _shm_free(path: str = SHM_DIR) -> int:
    """Bytes free in the file system that backs shared windows (-1: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


class ShmAllReduce:
    """The shared-memory all-reduce of one single-node group (see the module docstring).

    ``timeout`` is the transport's deadline for one phase wait; ``late(seq, timeout)``
    words the CommTimeoutError (the transport names the operation and who is missing).
    ``pipelined`` says whether sizes from ``PIPE_MIN`` take the chunked path (every rank
    has a core of its own; all ranks agree).
    """

    def __init__(self, node: Any, *, MPI: Any, cap_bytes: int, timeout: float,
                 late: Callable[[int, float], str]) -> None:
        self._MPI = MPI
        self._node = node
        self.rank: int = node.Get_rank()
        self.size: int = node.Get_size()
        self.cap_bytes = int(cap_bytes)
        self.timeout = float(timeout)
        self._late = late
        self._windows: dict[int, Window] = {}  # the copy-in windows
        self._lent = LentAreas(MPI, node)  # where callers place inputs (shared_buffer)
        # shm all-reduces so far, in every call's header
        self._calls = 0
        # The phase flags and call headers: one 64-byte line per rank in a window of their
        # own, so ranks whose calls would land in different data windows still meet (and
        # then see the mismatch in the headers) instead of waiting for each other until the
        # deadline.
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self._flag_win = MPI.Win.Allocate_shared(_FLAG_WORDS * 8, 1, info, comm=node)
        finally:
            info.Free()
        self._flags = [np.frombuffer(self._flag_win.Shared_query(k)[0], np.int64, _FLAG_WORDS)
                       for k in range(self.size)]
        self._flags[self.rank][:] = 0
        self._flag_win.Lock_all(MPI.MODE_NOCHECK)
        self._syncs = 0
        # Spin while our ranks have a core each; when they outnumber the cores, a spinning
        # waiter holds the core the rank it waits for needs, so yield at once.
        # The pipelined path needs every rank on a core of its own (it meets its peers
        # twice per chunk); all ranks agree, whatever their own affinity says.
        # Shared windows are pages of a tmpfs (/dev/shm): one whose pages do not fit is
        # mapped all the same and kills its process with SIGBUS at the first store that
        # finds no page (a container's /dev/shm is 64 MiB by default). So the cap per rank
        # is at most a quarter of the free space split over the ranks (a copy-in window
        # with its result areas takes up to twice its class; other jobs share the space),
        # from the least any rank saw, so that every rank decides every window the same.
        free = _shm_free()
        agreed = np.array([1 if self.size <= _cores() else 0, free if free >= 0 else 1 << 62],
                          np.int64)
        node.Allreduce(MPI.IN_PLACE, agreed, MPI.MIN)
        self.pipelined = bool(agreed[0])
        free, self.cap_note = int(agreed[1]), ""  # free unknown: 2**62, no bound
        if free // (4 * self.size) < self.cap_bytes:
            self.cap_bytes = free // (4 * self.size)
            self.cap_note = (f"{SHM_DIR} has {free >> 20} MiB free for "
                             f"{self.size} ranks and the cap is a quarter of it per rank: "
                             f"give it more (docker run --shm-size=1g) or ask for less")
        self._spin_s = _SPIN_S if self.pipelined else 0.0
        self._pipe_win: tuple[Any, list[np.ndarray], list[np.ndarray]] | None = None
        self._pipe_bytes = 0
        self._pipe_chunks = 0
        self._waited = 0.0  # seconds this call's handshakes spent waiting past the spin
        self._slow_left = 0  # calls to run whole-size after a pipelined call lost its cores
        node.Barrier()  # every flag is 0 before anyone waits on it

    @classmethod
    def create(cls, comm: Any, *, MPI: Any, cap_bytes: int, timeout: float,
               late: Callable[[int, float], str]) -> ShmAllReduce | None:
        """Return the fast path of ``comm``, or None when its ranks do not all share memory.

        Collective over ``comm``. The node communicator keeps ``comm``'s rank order.
        ``late(seq, timeout)`` words the CommTimeoutError of a phase nobody finished.
        """
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        if node.Get_size() != comm.Get_size():
            node.Free()
            return None
        return cls(node, MPI=MPI, cap_bytes=cap_bytes, timeout=timeout, late=late)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of window this rank holds (its segments, the flag line excluded)."""
        return sum(self._windows) + self._lent.nbytes + self._pipe_bytes

    def _sync(self, win: Any, seq: int, check: Check | None = None) -> None:
        """Wait until every rank reached this phase boundary: a flag handshake in shared
        memory (each rank raises its counter, then polls everyone's), fenced by
        ``Win.Sync`` (a memory barrier) of ``win`` on both sides.

        An MPI barrier would do, but a rank that waits in one yields its core after a few
        microseconds, and on a busy machine the scheduler may then run another job's
        process for a whole time slice: measured at 16 MiB on 2 ranks, phase waits of
        3-8 ms around 2.5 ms of work.
        """
        win.Sync()
        self._syncs += 1
        self._raise_and_wait(0, self._syncs, seq, check)
        win.Sync()

    def _raise_and_wait(self, slot: int, k: int, seq: int,
                        check: Check | None = None) -> None:
        """Set this rank's flag ``slot`` to ``k``; wait until every rank's is >= ``k``,
        calling ``check.watch()`` every ``WATCH_S`` of the wait (see :meth:`all_reduce`),
        until the transport's deadline or ``check.timeout`` if that is sooner; the
        CommTimeoutError names the ranks whose flag never rose.

        ``Win.Sync`` of the flag window before raising the flag and after seeing the others'
        is the memory barrier around the phase: MPI_Win_sync is a full processor memory
        barrier in MPICH (and Open MPI), so stores to the data windows are covered too.
        """
        self._flags[self.rank][slot] = k
        self._flag_win.Sync()
        flags = self._flags
        clock = time.monotonic
        began = start = clock()  # the deadline's start; the current spin's
        watched = began + WATCH_S
        limit = self.timeout if check is None else min(self.timeout, check.timeout)
        spins = 0
        while True:
            if all(f[slot] >= k for f in flags):
                return
            spins += 1
            if spins & 63 == 0:
                now = clock()
                if now - began > limit:
                    missing = [j for j, f in enumerate(flags) if f[slot] < k]
                    raise CommTimeoutError(f"{self._late(seq, limit)} (rank(s) {missing} of "
                                           f"the group never reached it)")
                if check is not None and now > watched:
                    check.watch()
                    watched = clock() + WATCH_S
                if now - start > self._spin_s:
                    self._waited += now - start
                    start = now
                    os.sched_yield()
            self._flag_win.Sync()

    def _pipe(self) -> tuple[Any, list[np.ndarray], list[np.ndarray]] | None:
        """The pipelined path's window (collective on first use): per rank two input slots
        of ``_PIPE_CHUNK`` bytes and two result slots; None when over the cap."""
        if self._pipe_win is None:
            seg = self._pipe_seg()
            if self.allocated_bytes + seg > self.cap_bytes:
                return None
            info = self._MPI.Info.Create()
            info.Set("alloc_shared_noncontig", "true")
            try:
                win = self._MPI.Win.Allocate_shared(seg, 1, info, comm=self._node)
            finally:
                info.Free()
            segs = [np.frombuffer(win.Shared_query(k)[0], np.uint8, seg)
                    for k in range(self.size)]
            ins = [s[:2 * _PIPE_CHUNK] for s in segs]
            res = [s[2 * _PIPE_CHUNK:] for s in segs]
            win.Lock_all(self._MPI.MODE_NOCHECK)
            self._pipe_win = (win, ins, res)
            self._pipe_bytes = seg
        return self._pipe_win

    def _pipe_seg(self) -> int:
        """Bytes per rank of the pipelined path's window: two input and two result slots."""
        return 2 * _PIPE_CHUNK + 2 * round_up(-(-_PIPE_CHUNK // self.size) + 8, HEADER)

    def fits(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` can run here under the cap: its whole-size
        window fits, or it is pipelined (whose slots are small)."""
        if self.pipelined and nbytes >= PIPE_MIN and self._pipe_seg() <= self.cap_bytes:
            return True
        return size_class(nbytes) <= self.cap_bytes

    def window(self, nbytes: int) -> Window | None:
        """Return the window of ``nbytes``' class, allocating it (collective) within the cap."""
        cls = size_class(nbytes)
        w = self._windows.get(cls)
        if w is None:
            if self.allocated_bytes + cls > self.cap_bytes:
                return None
            w = self._windows[cls] = Window(self._MPI, self._node, cls)
        return w

    def shared_buffer(self, nbytes: int) -> np.ndarray:
        """Return ``nbytes`` (uint8) of a lent shared area, for a zero-copy all_reduce input.

        Collective on the first call of a size class (it allocates that class's lent
        window; every rank calls it with the same ``nbytes``), then the same memory again.
        An all_reduce of an array that starts at the returned view's first byte and has
        the same class of size reads its input where it lies and leaves the result there:
        when every rank's input is so placed, each folds its slice into every rank's
        segment (:meth:`_reduce_in_window`), one pass over memory, where copying in takes
        two. The view stays valid until the transport is finalized; the
        transport never writes it except as such an all_reduce's buffer, so its owner may
        hold a result there while other all_reduces run.
        """
        return self._lent.first(nbytes, self.allocated_bytes, self.cap_bytes, self.cap_note)

    def lends(self, nbytes: int) -> bool:
        """Whether ``nbytes``' class has a lent area already (else :meth:`shared_buffer`
        allocates one: collective)."""
        return size_class(nbytes) in self._lent.windows

    def lent_area(self, nbytes: int) -> np.ndarray | None:
        """A whole lent area of ``nbytes``' class that nobody holds any view of, else None
        (local). None also asks for one more area, or the class's first: the class's next
        all_reduce adds it on every rank after its header sync (allocating is collective),
        within the cap."""
        return self._lent.free_area(nbytes)

    def lent_holds(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` lies in one of the lent areas."""
        return self._lent.holds(buf)

    def _grow(self, cls: int, want: bool) -> None:
        """Add a lent area to ``cls`` when some rank asked (``want``, read from every rank's
        header after a sync, so all ranks agree) and the cap leaves room for it and for the
        class's copy-in window."""
        if want:
            copy_in = 0 if cls in self._windows else cls
            self._lent.grow(cls, self.cap_bytes - self.allocated_bytes - copy_in)

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, seq: int,
                   check: Check | None = None) -> bool:
        """Reduce the C-contiguous ``buf`` over the node in place; False if over the cap.

        Blocking: it returns when the result is in ``buf`` on this rank (the caller hands
        back a completed Work). Every call starts with one sync after each rank wrote its
        header (count, dtype, op, call number; where its input lies; whether it asks for a
        lent area; whether it lost its core lately) into its flag line: the ranks check
        the headers against each other and, all reading the same headers, take the same
        path: placed (every input in a lent area), pipelined, or the whole-size copy-in.

        ``check`` (:class:`~fuelspmd.transport.Check`), when given, rides on that
        header: every rank's words are handed to ``check.agrees`` after the sync, before
        any data moves (:class:`~fuelspmd.transport.Disagreement` on every rank when they
        do not agree), and ``check.watch()`` is called every ``WATCH_S`` while this rank
        waits at that sync.
        """
        flat = buf.reshape(-1)
        dt, count, n, r = flat.dtype, flat.size, self.size, self.rank
        nbytes = flat.nbytes
        cls = size_class(nbytes)
        zero_copy = self._lent.index(flat)  # which lent area holds it (0: none)
        want = self._lent.asked(cls)
        pipe = self.pipelined and nbytes >= PIPE_MIN
        slow = pipe and self._slow_left > 0
        if slow:
            self._slow_left -= 1
        base, extra = divmod(count, n)
        bounds = [k * base + min(k, extra) for k in range(n + 1)]
        lo, hi = bounds[r], bounds[r + 1]
        # the copy-in window exists on every rank or on none (allocating it is collective):
        # one that exists is filled before the first sync when this call surely takes the
        # whole-size copy-in path; otherwise once the headers say so
        w = self._windows.get(cls)
        copied = w is not None and not zero_copy and (not pipe or slow)
        if copied:  # our own slice is read from the caller's buffer, not copied in
            self._copy_in(w, flat, lo, hi)
        self._calls += 1
        words = (0, 0, 0) if check is None else check.words
        self._flags[r][3:13] = (count, dt.num, OP_CODE[op], self._calls, *words, zero_copy,
                                want, slow)
        self._sync(self._flag_win, seq, check)
        heads = [f[3:13].tolist() for f in self._flags]  # each line read once, as ints
        if check is not None and not check.agrees([h[4:7] for h in heads]):
            raise Disagreement(f"all_reduce #{seq} (shared memory)", [h[4:7] for h in heads])
        mine = heads[r][:4]
        for h in heads:
            if h[:4] != mine:
                check_headers(heads, r, seq)
        placed = [h[7] for h in heads]
        want = any(h[8] for h in heads)
        if all(placed):  # each rank's input in one of its lent areas (not always the same)
            segs, win = self._lent.segments(placed, nbytes, dt)
            self._reduce_in_window(segs, bounds, op, win, seq)
        elif pipe and not any(h[9] for h in heads) and self._pipe() is not None:
            self._pipelined(flat, op, seq)
        else:
            # every rank copied in before the sync when the window existed and none was
            # placed or stayed ready for the pipelined path; otherwise those that did not
            # copy in now, and all sync once more
            ready = w is not None and not any(h[7] or (pipe and not h[9]) for h in heads)
            if w is None:
                w = self.window(nbytes)
                if w is None:  # beyond the cap: every rank decides the same, MPI reduces it
                    return False
            if not ready:
                if not copied:
                    self._copy_in(w, flat, lo, hi)
                self._sync(w.win, seq)
            segs = [d[:nbytes].view(dt) for d in w.data]
            # this call's result areas: the previous call's are still read by a slower peer
            area = w.results[w.calls % 2]
            w.calls += 1
            res = [a[:(bounds[k + 1] - bounds[k]) * dt.itemsize].view(dt)
                   for k, a in enumerate(area)]
            fold([flat if k == r else s for k, s in enumerate(segs)], lo, hi, op, [res[r]],
                 flat[lo:hi])
            self._sync(w.win, seq)
            for k in range(n):
                if k != r:
                    flat[bounds[k]:bounds[k + 1]] = res[k]
        self._grow(cls, want)
        return True
    def _copy_in(self, w: Window, flat: np.ndarray, lo: int, hi: int) -> None:
        """Copy ``flat`` into this rank's data area of ``w``, all but its own slice."""
        mine = w.data[self.rank][:flat.nbytes].view(flat.dtype)
        mine[:lo] = flat[:lo]
        mine[hi:] = flat[hi:]

    def _pipelined(self, flat: np.ndarray, op: ReduceOp, seq: int) -> None:
        """The all-reduce in chunks of ``_PIPE_CHUNK`` bytes through two small slots.

        Per chunk ``c`` (slot ``c % 2``): copy in the chunk but this rank's slice; flag 1;
        fold this rank's slice from the slots and its own buffer, into its buffer and its
        result slot; flag 2; copy every peer's result slice out. The slots stay in cache
        (MPICH's own copies go through small buffers for the same reason), where the bulk
        path's whole-size window does not: at 16 MiB on 2 ranks the bulk path's working
        set, buffers plus window, is 80 MiB against a 48 MiB cache. A slot is written again
        two chunks later, after a flag every peer raised once done reading it.

        It runs when every rank's header (read after the call's first sync) says it has
        not lost its core lately: on a machine where other jobs take the cores, every
        handshake may wait for a descheduled peer's time slice, 128 of them at 16 MiB
        (measured: 270 ms against MPI's 12 ms), where the whole-size path waits at most
        twice. A rank says so for ``_SLOW_CALLS`` calls after one whose handshakes waited
        past the spin for more than a millisecond.
        """
        _, ins, res = self._pipe_win  # type: ignore[misc]
        dt, count, n, r = flat.dtype, flat.size, self.size, self.rank
        self._waited = 0.0
        step = _PIPE_CHUNK // dt.itemsize
        slots = [[a[i * _PIPE_CHUNK:(i + 1) * _PIPE_CHUNK].view(dt) for a in ins]
                 for i in (0, 1)]
        half = len(res[0]) // 2
        results = [[a[i * half:(i + 1) * half].view(dt) for a in res] for i in (0, 1)]
        ufunc, avg = UFUNC[op], op is ReduceOp.AVG
        tmp = np.empty(-(-step // n) + 1, dt) if n > 2 else None
        for c0 in range(0, count, step):
            chunk = flat[c0:c0 + step]
            size = chunk.size
            base, extra = divmod(size, n)
            b = [k * base + min(k, extra) for k in range(n + 1)]
            lo, hi = b[r], b[r + 1]
            self._pipe_chunks += 1
            k = self._pipe_chunks
            slot, out = slots[k % 2], results[k % 2]
            slot[r][:lo] = chunk[:lo]
            slot[r][hi:size] = chunk[hi:]
            self._raise_and_wait(1, k, seq)
            mine = chunk[lo:hi]
            srcs = [mine if j == r else slot[j][lo:hi] for j in range(n)]
            t = mine if tmp is None else tmp[:hi - lo]
            ufunc(srcs[0], srcs[1], out=t)
            for j in range(2, n):
                ufunc(t, srcs[j], out=t)
            if avg:
                if dt.kind == "f":
                    np.divide(t, n, out=t)
                else:
                    np.floor_divide(t, n, out=t)
            if tmp is not None:
                mine[...] = t
            out[r][:hi - lo] = t
            self._raise_and_wait(2, k, seq)
            for j in range(n):
                if j != r:
                    chunk[b[j]:b[j + 1]] = out[j][:b[j + 1] - b[j]]
        if self._waited > _SLOW_WAIT_S:
            self._slow_left = _SLOW_CALLS

    def _reduce_in_window(self, segs: list[np.ndarray], bounds: list[int], op: ReduceOp,
                          win: Any, seq: int) -> None:
        """The all-reduce when every rank's input is its own segment's data area.

        Each rank folds its slice ``[lo, hi)`` and writes the result there in every
        segment, its own and its peers' (only this rank reads or writes that slice of any
        segment, each chunk read before it is written), then meets the others once: every
        segment then holds the whole result, and no rank touches a peer's segment after
        it, so each may write its own again (its next call, or its caller refilling the
        buffer) at once. Per rank that is ``N`` read and ``N`` written, in one pass, and
        two phase boundaries (the header's and this one). Measured, a 4 MiB bucket of 256
        arrays on 2 ranks, concatenation included: 0.76x the time of folding in place and
        then copying the peers' slices out (``N/n`` more read, a third boundary).
        """
        r = self.rank
        lo, hi = bounds[r], bounds[r + 1]
        fold(segs, lo, hi, op, [s[lo:hi] for k, s in enumerate(segs) if k != r],
             segs[r][lo:hi])
        self._sync(win, seq)

    def free(self) -> list[Window]:
        """Free the windows and the node communicator (collective over the group).

        A lent area some rank still holds a view of (a graph result may live there) is not
        unmapped under it: when any rank holds one, every rank keeps its lent windows and
        returns them (the ranks agree first, freeing a window being collective); the
        caller keeps them referenced until the process exits.
        """
        held = np.array([self._lent.held()], np.int8)
        self._node.Allreduce(self._MPI.IN_PLACE, held, self._MPI.MAX)
        for w in self._windows.values():
            w.free()
        self._windows.clear()
        kept = self._lent.free(keep=bool(held[0]))
        if self._pipe_win is not None:
            self._pipe_win[0].Unlock_all()
            self._pipe_win[0].Free()
            self._pipe_win = None
            self._pipe_bytes = 0
        self._flag_win.Unlock_all()
        self._flag_win.Free()
        self._node.Free()
        return kept
