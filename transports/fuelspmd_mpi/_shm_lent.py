"""The lent windows of the shm all-reduce (:mod:`fuelspmd_mpi._shm`): where a caller, or the
lazy graph, puts an all_reduce input so that it is reduced where it lies.

Per size class a list of windows without result areas. A lent area is never the copy-in
area of the class, which a call with a private buffer overwrites while the caller may still
hold a lent one (a graph result lives there). Each window's area is handed out as one array
of its own, over a memoryview, and tracked by a weak reference to that array: every view
handed out derives from it, so it is alive exactly while someone holds part of the area.

A class starts with one window and grows by one when a rank asks for a free area and finds
them all held (the buckets of one step hold several results of one size at once): the ask
goes into that rank's next call header, and at the end of that call every rank adds one
(allocating a window is collective), up to ``LENT_MAX`` and within the group's cap.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from fuelspmd.backend import tracked
from fuelspmd.errors import ConfigError
from fuelspmd_mpi._shm_window import Window, size_class

__all__ = ["LENT_MAX", "LentAreas"]

LENT_MAX = 16  # lent windows per size class at most (each costs a window of the class)


class LentAreas:
    """The lent windows of one node group, per size class (see the module docstring)."""

    def __init__(self, MPI: Any, node: Any) -> None:
        self._MPI, self._node = MPI, node
        self.rank: int = node.Get_rank()
        self.windows: dict[int, list[Window]] = {}
        self._holds: dict[int, list[weakref.ref[np.ndarray] | None]] = {}
        self._asked: set[int] = set()  # classes whose areas were all held when asked

    @property
    def nbytes(self) -> int:
        """Bytes of lent window this rank holds."""
        return sum(c * len(ws) for c, ws in self.windows.items())

    def first(self, nbytes: int, allocated: int, cap: int, why: str = "") -> np.ndarray:
        """The first area of ``nbytes``' class, its window made (collective) on first use
        when it fits under ``cap`` beside the ``allocated`` bytes; the same memory after.
        ``why`` says what set the cap, and the fix, when it is not the policy's
        ``cap_bytes``."""
        cls = size_class(nbytes)
        if cls not in self.windows:
            if allocated + cls > cap:
                fix = why or ("raise cap_bytes in set_all_reduce_policy or ask for less")
                raise ConfigError(
                    f"shared_buffer({nbytes}): a window of {cls} bytes would take this "
                    f"rank's shared memory to {allocated + cls} bytes, above its cap of "
                    f"{cap} bytes; {fix}")
            self.windows[cls] = [Window(self._MPI, self._node, cls, lent=True)]
            self._holds[cls] = [None]
        ref = self._holds[cls][0]
        area = ref() if ref is not None else None
        return (self._hold(cls, 0) if area is None else area)[:nbytes]

    def free_area(self, nbytes: int) -> np.ndarray | None:
        """A whole area of ``nbytes``' class that nobody holds a view of, else None, which
        also asks for one more (see :meth:`asked`; the class's first, where it has none)."""
        cls = size_class(nbytes)
        for i, ref in enumerate(self._holds.get(cls, ())):
            if ref is None or ref() is None:
                return self._hold(cls, i)
        self._asked.add(cls)
        return None

    def _hold(self, cls: int, i: int) -> np.ndarray:
        area = tracked(self.windows[cls][i].data[self.rank])
        self._holds[cls][i] = weakref.ref(area)
        return area

    def index(self, flat: np.ndarray) -> int:
        """Which area of its class ``flat`` starts: its index plus one, or 0 for none.

        A view of an area has the area's array as its base (numpy collapses the bases of
        views), so the areas are told apart by identity; a view of one starts it when its
        first element overlaps the area's first byte (``shares_memory`` of the two:
        0.6 us, where an address from ``__array_interface__`` builds a dict, 2 us warm
        and tens of microseconds right after a large reduction).
        """
        base = flat.base
        if base is None or not flat.size:
            return 0
        for i, ref in enumerate(self._holds.get(size_class(flat.nbytes), ())):
            if ref is not None and ref() is base:
                return i + 1 if np.shares_memory(flat[:1], base[:1]) else 0
        return 0

    def holds(self, buf: np.ndarray) -> bool:
        """Whether ``buf`` is a view of one of the areas (at any offset)."""
        base = buf.base
        return base is not None and any(ref is not None and ref() is base
                                        for refs in self._holds.values() for ref in refs)

    def asked(self, cls: int, *, consume: bool = True) -> bool:
        """Whether this rank asked for one more area of ``cls`` since the last call that
        carried the ask (``consume``: this call carries it)."""
        if cls not in self._asked:
            return False
        if consume:
            self._asked.discard(cls)
        return True

    def segments(self, placed: list[int], nbytes: int, dt: np.dtype) -> tuple[
            list[np.ndarray], Any]:
        """Every rank's input, as ``placed`` (from the headers: each rank's area index plus
        one) says where it lies, and the MPI window of this rank's (for ``Win.Sync``)."""
        ws = self.windows[size_class(nbytes)]
        segs = [ws[i - 1].data[k][:nbytes].view(dt) for k, i in enumerate(placed)]
        return segs, ws[placed[self.rank] - 1].win

    def grow(self, cls: int, room: int) -> None:
        """Add an area to ``cls``, its first or one more (collective: every rank at the
        same point of the same call, once a sync showed them all the same asks) when
        ``room`` bytes are left."""
        ws = self.windows.setdefault(cls, [])
        holds = self._holds.setdefault(cls, [])
        if len(ws) < LENT_MAX and cls <= room:
            ws.append(Window(self._MPI, self._node, cls, lent=True))
            holds.append(None)
        elif not ws:  # nothing fits: the class stays unlent
            del self.windows[cls], self._holds[cls]

    def held(self) -> bool:
        """Whether this rank holds a view of any area."""
        return any(h is not None and h() is not None
                   for hs in self._holds.values() for h in hs)

    def free(self, keep: bool) -> list[Window]:
        """Free every window (collective), or with ``keep`` free none and return them all
        (a view of one is still held somewhere: the caller keeps them mapped)."""
        every = [w for ws in self.windows.values() for w in ws]
        if not keep:
            for w in every:
                w.free()
        self.windows.clear()
        self._holds.clear()
        self._asked.clear()
        return every if keep else []
