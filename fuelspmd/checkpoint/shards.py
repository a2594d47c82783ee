"""Reading a committed checkpoint's tensors: every byte that is used is a byte that was checked.

A shard file is opened inside the checkpoint's folder (:func:`~.safetensors.open_inside`);
its size must be the one the index records, its header must parse and tile the file
(:func:`~.safetensors.read_header`) and its bytes must have the CRC-32 the index records;
a piece's header entry must be the piece's own (dtype, shape and byte range). A piece's
bytes are then read once, at the offsets the index gives, checked against its CRC-32, and
its values are cut from those same bytes, so nothing read after the check is trusted on
its word. A read asks for several boxes of one tensor at once (ZeRO-1 reads a flat run as
up to ``2 * ndim - 1`` boxes), so each piece is read once for all of them, and none is
kept after: a rank holds its own blocks plus one piece.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import CheckpointCorruptError, CheckpointIncompleteError

from .index import DTYPES
from .layout import Box, intersect, shape_of, slices, volume
from .safetensors import Header, crc32_of, open_inside, read_header, read_range

__all__ = ["Shards"]


class Shards:
    """The verified pieces of the committed checkpoint at ``path`` (its checked index)."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = path, index
        self._open: dict[str, tuple[int, Header]] = {}

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()

    def _file(self, name: str) -> tuple[int, Header]:
        if name not in self._open:
            where = self.path / name
            fd = open_inside(self.path, name, "the index")
            try:
                size, want = os.fstat(fd).st_size, self.index["files"][name]
                if size != want["bytes"]:
                    raise CheckpointCorruptError(f"{where}: {size} bytes, the index says "
                                                 f"{want['bytes']} (truncated or overwritten)")
                header = read_header(fd, where)
                if crc32_of(header.raw) != want["header_crc32"]:
                    raise CheckpointCorruptError(
                        f"{where}: its header has CRC-32 {crc32_of(header.raw):#010x}, the "
                        f"index says {want['header_crc32']:#010x}: the shard is corrupt; load "
                        "another checkpoint")
            except BaseException:
                os.close(fd)
                raise
            self._open[name] = (fd, header)
        return self._open[name]

    def piece(self, key: str, piece: dict[str, Any]) -> np.ndarray:
        """The values of one saved piece (its box's shape), from bytes whose CRC-32 was
        checked."""
        fd, header = self._file(piece["file"])
        where = self.path / piece["file"]
        dt = self.index["tensors"][key]["dtype"]
        box: Box = tuple((a, b) for a, b in piece["box"])
        lo, hi = piece["offsets"]
        e = header.tensors.get(piece["name"])
        if e is None or (e.code, e.shape, e.lo, e.hi) != (DTYPES[dt][0], shape_of(box), lo, hi):
            raise CheckpointCorruptError(
                f"{where}: its header holds {piece['name']!r} as {e}, the index as "
                f"{DTYPES[dt][0]} {list(shape_of(box))} at bytes {lo}..{hi}: the shard does "
                "not belong to this index; load another checkpoint")
        raw = read_range(fd, lo, hi, where)
        crc = crc32_of(raw)
        if crc != piece["crc32"]:
            raise CheckpointCorruptError(
                f"{where}: tensor {piece['name']!r} has CRC-32 {crc:#010x}, the index says "
                f"{piece['crc32']:#010x}: the shard is corrupt; load another checkpoint")
        return raw.view(to_numpy(dt)).reshape(shape_of(box))

    def read(self, key: str, boxes: list[Box]) -> list[np.ndarray]:
        """The values of each of ``boxes`` of tensor ``key``, from every saved piece
        meeting them (the checked index's pieces tile the tensor: they fill each exactly)."""
        meta = self.index["tensors"][key]
        outs = [np.empty(shape_of(box), to_numpy(meta["dtype"])) for box in boxes]
        got = [0] * len(boxes)
        for piece in meta["pieces"]:
            pbox: Box = tuple((a, b) for a, b in piece["box"])
            parts = [intersect(pbox, box) for box in boxes]
            if all(part is None for part in parts):
                continue
            values = self.piece(key, piece)
            for k, (part, box) in enumerate(zip(parts, boxes)):
                if part is not None:
                    outs[k][slices(part, box)] = values[slices(part, pbox)]
                    got[k] += volume(part)
            del values
        for out, n, box in zip(outs, got, boxes):
            if n != out.size:
                raise CheckpointIncompleteError(
                    f"{self.path}: tensor {key!r}: the saved pieces hold {n} of the "
                    f"{out.size} elements of block {list(box)}; the index is incomplete")
        return outs
