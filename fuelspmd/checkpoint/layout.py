"""Boxes: the regions of a global tensor that shards hold, and the plan of who writes what.

Pure functions, no I/O and no communication, so every rank computes the same plan from the
same gathered manifests and a test checks them in one process.

A *box* is a tuple of ``(start, stop)`` per dimension in the global (unsharded) tensor. A
tensor-parallel shard is the box of block ``r`` of ``n`` along its split dimension; a ZeRO-1
slice is a flat range of such a block, which :func:`flat_boxes` cuts into at most
``2 * ndim - 1`` boxes, each a contiguous run of the row-major order (the dimensions after
the one that varies are whole, those before it fixed). Every saved piece is therefore a
box, and loading any layout is box intersection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fuelspmd.errors import CheckpointMismatchError

__all__ = ["Box", "Entry", "Plan", "block_box", "flat_boxes", "intersect", "plan", "shift",
           "slices", "volume"]

Box = tuple[tuple[int, int], ...]


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def shape_of(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def block_box(shape: Sequence[int], dim: int | None, rank: int, size: int) -> Box:
    """Block ``rank`` of ``size`` equal blocks along ``dim`` (the whole when ``dim`` is None)."""
    box = list(full_box(shape))
    if dim is not None:
        k = box[dim][1] // size
        box[dim] = (rank * k, (rank + 1) * k)
    return tuple(box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x < y for x, y in out) else None


def shift(box: Box, origin: Box) -> Box:
    """``box`` given relative to ``origin``'s start, in ``origin``'s coordinates' frame."""
    return tuple((a + o, b + o) for (a, b), (o, _) in zip(box, origin))


def slices(box: Box, within: Box) -> tuple[slice, ...]:
    """The index of ``box`` inside an array holding ``within``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, within))


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The boxes covering flat range ``[lo, hi)`` of an array of ``shape`` in row-major
    order, in that order; each is contiguous in it, so the flat values cut in order fit."""
    if hi <= lo:
        return []
    if not shape:
        return [()]
    n0, rest = int(shape[0]), tuple(shape[1:])
    s = math.prod(rest)
    i0, r0, i1, r1 = lo // s, lo % s, hi // s, hi % s
    if i0 == i1:
        return [((i0, i0 + 1), *b) for b in flat_boxes(rest, r0, r1)]
    out: list[Box] = []
    if r0:
        out += [((i0, i0 + 1), *b) for b in flat_boxes(rest, r0, s)]
        i0 += 1
    if i0 < i1:
        out.append(((i0, i1), *full_box(rest)))
    if r1 and i1 < n0:
        out += [((i1, i1 + 1), *b) for b in flat_boxes(rest, 0, r1)]
    return out


@dataclass(frozen=True)
class Entry:
    """One region a rank holds: the tensor's global key, full shape and dtype, the box."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    box: Box

    def as_json(self) -> list[object]:
        return [self.key, list(self.shape), self.dtype, [list(b) for b in self.box]]

    @staticmethod
    def from_json(row: Sequence[object]) -> Entry:
        key, shape, dt, box = row
        return Entry(str(key), tuple(int(n) for n in shape),  # type: ignore[attr-defined]
                     str(dt), tuple((int(a), int(b)) for a, b in box))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Plan:
    """Per key: full shape and dtype; per distinct box, the rank that writes it."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    writers: dict[tuple[str, Box], int]

    def writes(self, rank: int) -> set[tuple[str, Box]]:
        return {k for k, r in self.writers.items() if r == rank}


def plan(manifests: Sequence[Sequence[Entry]]) -> Plan:
    """Who writes what: each distinct (key, box) once, by the lowest rank holding it.

    Raises CheckpointMismatchError, the same on every rank given the same manifests, when
    ranks give one key different full shapes or dtypes, or its boxes overlap without being
    equal or leave part of the tensor unheld.
    """
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    first: dict[str, int] = {}
    writers: dict[tuple[str, Box], int] = {}
    bad: list[str] = []
    for rank, entries in enumerate(manifests):
        for e in entries:
            got = (e.shape, e.dtype)
            if e.key not in tensors:
                tensors[e.key], first[e.key] = got, rank
            elif tensors[e.key] != got:
                bad.append(f"{e.key}: rank {first[e.key]} has shape {tensors[e.key][0]} "
                           f"{tensors[e.key][1]}, rank {rank} has {e.shape} {e.dtype}")
                continue
            writers.setdefault((e.key, e.box), rank)
    boxes: dict[str, list[Box]] = {}
    for key, box in writers:
        boxes.setdefault(key, []).append(box)
    for key, held in boxes.items():
        shape = tensors[key][0]
        clash = next(((a, b) for i, a in enumerate(held) for b in held[i + 1:]
                      if intersect(a, b) is not None), None)
        if clash is not None:
            bad.append(f"{key}: ranks hold overlapping but different blocks {clash[0]} and "
                       f"{clash[1]}")
        elif sum(map(volume, held)) != math.prod(shape):
            bad.append(f"{key}: the ranks' blocks hold {sum(map(volume, held))} of its "
                       f"{math.prod(shape)} elements")
    if bad:
        raise CheckpointMismatchError(
            "checkpoint.save: the ranks' layouts do not make whole tensors (" + "; ".join(bad[:8])
            + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "") + "); every rank must "
            "save the same model built with the same sizes, each parameter's Spec saying "
            "which block the rank holds")
    return Plan(tensors, writers)
