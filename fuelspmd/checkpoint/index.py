"""The index of a checkpoint: sealed by a checksum on save, checked against its schema on load.

Pure functions, no I/O. The index is the one record a load trusts to find every byte, so
every value in it is checked before it is used: :func:`seal` adds the CRC-32 of its
canonical JSON (sorted keys, no spaces), and :func:`check` refuses an index whose checksum
differs (any edit, any flipped byte) and then, because a checksum can be recomputed by hand,
checks every field's type and range:

- ``format``, ``version``; ``nonce`` 12 hex digits; ``name`` a plain file name; ``created``
  an int >= 0; ``world`` an int >= 1; ``mesh`` null or axis -> int >= 1; ``values`` an
  object; ``steps`` optimiser -> int >= 0;
- ``files``: shard file name (``shard-NNNNN-of-NNNNN.safetensors``) -> its size in bytes and
  the CRC-32 of its header (length word included);
- ``tensors``: key -> ``shape`` (ints >= 0), ``dtype`` (one this format writes) and
  ``pieces``: each a ``box`` inside the shape, a ``file`` in ``files``, the ``name`` its
  writer gives it (``<key>@<box>``, so no piece can stand for another), ``offsets`` inside
  the file whose length is the box's volume times the dtype's size, and a ``crc32``. The
  pieces of a tensor do not overlap and hold all of it; no two pieces are one entry.

Every size is bounded by the file sizes here, before a reader loops over it or allocates.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fuelspmd.errors import CheckpointCorruptError

from .layout import Box, volume
from .safetensors import crc32_of, plain_name

__all__ = ["DTYPES", "FORMAT", "VERSION", "check", "piece_name", "seal"]

FORMAT, VERSION = "fuelspmd-checkpoint", 2
CHECKSUM = "index_crc32"
# dtype -> (safetensors code in the shard, bytes per element); bfloat16 is stored as its
# 16-bit pattern, which numpy's safetensors reader can read
DTYPES = {"float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2),
          "bfloat16": ("U16", 2), "int64": ("I64", 8), "int32": ("I32", 4),
          "bool": ("BOOL", 1)}
SHARD = re.compile(r"shard-\d{5,}-of-\d{5,}\.safetensors")
_NONCE = re.compile(r"[0-9a-f]{12}")
_U32 = 1 << 32


def piece_name(key: str, box: Box) -> str:
    """The name a piece has in its shard: its tensor's key and box."""
    return f"{key}@{','.join(f'{a}:{b}' for a, b in box)}"


def _canonical(index: dict[str, Any]) -> bytes:
    body = {k: v for k, v in index.items() if k != CHECKSUM}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(index: dict[str, Any]) -> dict[str, Any]:
    """``index`` with the CRC-32 of its canonical JSON added."""
    return {**index, CHECKSUM: crc32_of(_canonical(index))}


def _int(x: object, lo: int = 0, hi: int | None = None) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool) and x >= lo
            and (hi is None or x < hi))


def check(index: object, where: Path) -> dict[str, Any]:
    """``index`` (parsed JSON) if it is sealed and fits the schema (see the module
    docstring); CheckpointCorruptError naming the first field that does not."""
    def bad(msg: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: {msg}; the index is damaged or was edited: "
                                      "load another checkpoint")

    if not isinstance(index, dict):
        raise bad(f"the index is a {type(index).__name__}, not an object")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{where}: format {index.get('format')!r} version {index.get('version')!r}; this "
            f"fuelspmd reads {FORMAT!r} version {VERSION} (load older ones with the "
            "fuelspmd that wrote them and save them again)")
    if index.get(CHECKSUM) != crc32_of(_canonical(index)):
        raise bad(f"its checksum is {index.get(CHECKSUM)!r}, its contents give "
                  f"{crc32_of(_canonical(index))}")
    for key, ok in (("nonce", isinstance(index.get("nonce"), str)
                     and _NONCE.fullmatch(index["nonce"])),
                    ("name", plain_name(index.get("name"))),
                    ("created", _int(index.get("created"))),
                    ("world", _int(index.get("world"), 1)),
                    ("mesh", index.get("mesh") is None or (
                        isinstance(index["mesh"], dict)
                        and all(isinstance(k, str) and _int(v, 1)
                                for k, v in index["mesh"].items()))),
                    ("values", isinstance(index.get("values"), dict)),
                    ("steps", isinstance(index.get("steps"), dict)
                     and all(isinstance(k, str) and _int(v) for k, v in index["steps"].items())),
                    ("files", isinstance(index.get("files"), dict)),
                    ("tensors", isinstance(index.get("tensors"), dict))):
        if not ok:
            raise bad(f"field {key!r} is {str(index.get(key))[:80]!r}, "
                      + ("optimiser steps must be ints >= 0" if key == "steps" else
                         "not of its type and range"))
    files = index["files"]
    for name, f in files.items():
        if not (SHARD.fullmatch(name) and isinstance(f, dict) and _int(f.get("bytes"), 8)
                and _int(f.get("header_crc32"), 0, _U32)):
            raise bad(f"file entry {name!r}: {str(f)[:80]} is not "
                      "{bytes: int >= 8, header_crc32: a CRC-32} of a shard name")
    seen: set[tuple[str, str]] = set()
    for key, t in index["tensors"].items():
        _tensor(key, t, files, seen, bad)
    return index


def _tensor(key: str, t: object, files: dict[str, Any], seen: set[tuple[str, str]],
            bad: Any) -> None:
    if not (isinstance(t, dict) and isinstance(t.get("shape"), list)
            and all(_int(n) for n in t["shape"]) and isinstance(t.get("dtype"), str)
            and t["dtype"] in DTYPES
            and isinstance(t.get("pieces"), list)):
        raise bad(f"tensor {key!r}: {str(t)[:80]} is not {{shape: [ints >= 0], dtype: one "
                  f"of {sorted(DTYPES)}, pieces: [...]}}")
    shape: list[int] = t["shape"]
    size = DTYPES[t["dtype"]][1]
    boxes: list[Box] = []
    for p in t["pieces"]:
        if not (isinstance(p, dict) and isinstance(p.get("box"), list)
                and len(p["box"]) == len(shape)
                and all(isinstance(b, list) and len(b) == 2 and _int(b[0]) and _int(b[1])
                        and b[0] <= b[1] <= n for b, n in zip(p["box"], shape))):
            raise bad(f"tensor {key!r}: piece {str(p)[:80]} has no box inside shape {shape}")
        box: Box = tuple((int(a), int(b)) for a, b in p["box"])
        f, offsets = p.get("file"), p.get("offsets")
        if not (isinstance(f, str) and f in files and isinstance(offsets, list)
                and len(offsets) == 2 and _int(offsets[0]) and _int(offsets[1])
                and offsets[0] <= offsets[1] <= files[f]["bytes"]
                and offsets[1] - offsets[0] == volume(box) * size
                and _int(p.get("crc32"), 0, _U32) and p.get("name") == piece_name(key, box)):
            raise bad(f"tensor {key!r}: piece {str(p)[:160]} is not {{file: a listed shard, "
                      "offsets: a range inside it as long as the box, crc32, name: "
                      f"{piece_name(key, box)!r}}}")
        if (f, p["name"]) in seen:
            raise bad(f"tensor {key!r}: two pieces are entry {p['name']!r} of {f}")
        seen.add((f, p["name"]))
        boxes.append(box)
    clash = _overlap(boxes)
    if clash is not None:
        raise bad(f"tensor {key!r}: pieces {list(clash[0])} and {list(clash[1])} overlap")
    held = sum(map(volume, boxes))
    if held != math.prod(shape):
        raise bad(f"tensor {key!r}: its pieces hold {held} of its {math.prod(shape)} "
                  "elements")


def _overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two boxes that overlap, if any: a sweep along the dimension the boxes are split
    along compares only boxes whose ranges there meet (linear for the blocks a save
    writes: row blocks, column blocks, the flat runs of ZeRO-1)."""
    if len(boxes) < 2:
        return None
    if not boxes[0]:
        return boxes[0], boxes[1]
    d = max(range(len(boxes[0])), key=lambda k: len({b[k][0] for b in boxes}))
    order = sorted(boxes, key=lambda b: b[d])
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if b[d][0] >= a[d][1]:
                break
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                return a, b
    return None
