"""The safetensors format, as checkpoints and Hugging Face directories both write and read it.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON header (each
tensor's ``dtype`` code, ``shape`` and ``data_offsets`` ``[begin, end)`` from the start of
the data; ``__metadata__`` a map of strings) and the tensors' bytes. Nothing in a file is
trusted, so :func:`read_header` checks, before any loop over a size it names or any
allocation, that ``8 + n`` fits in the file, that the header is a JSON object of these
types, that every tensor's byte length is its shape's volume times its dtype's size, and
that the tensors tile the data exactly (sorted by ``begin``, each starts where the last
ended, the last ends at the end of the file: safetensors' own rule, so a file accepted
here is one safetensors accepts). Every reader of tensor bytes (the checkpoint's shards,
Hugging Face weights of every dtype) goes through it, and reads the bytes at the offsets
it checked (:func:`read_range`).

A file is opened by :func:`open_inside`: a plain name that resolves inside its folder (no
``..``, no absolute path, no symlink out of it), a regular file (never a FIFO or a device,
whose open or read could block or never end).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.errors import CheckpointCorruptError, CheckpointIncompleteError

__all__ = ["CODES", "NAMES", "Entry", "Header", "crc32_of", "header_bytes", "open_inside",
           "plain_name", "read_header", "read_range"]

# safetensors dtype codes -> numpy dtype names (BF16 through ml_dtypes), and back
CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
         "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
         "U16": "uint16", "BOOL": "bool"}
NAMES = {v: k for k, v in CODES.items()}
_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
         "U8": 1, "U16": 2, "BOOL": 1}
MAX_HEADER = 100 << 20  # safetensors' own limit on the header's length
_CHUNK = 8 << 20  # bytes per read


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype code, shape and absolute byte range in the file."""

    code: str
    shape: tuple[int, ...]
    lo: int
    hi: int

    @property
    def dtype(self) -> str:
        return CODES[self.code]


@dataclass(frozen=True)
class Header:
    """A checked header: its raw bytes (the length word included), the tensors, metadata."""

    raw: bytes
    tensors: dict[str, Entry]
    metadata: dict[str, str]


def plain_name(name: object) -> bool:
    """Whether ``name`` is one path component: no separator, not ``.``/``..``, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and os.sep not in name and "\0" not in name)


def open_inside(folder: Path, name: object, what: str) -> int:
    """A read-only descriptor of regular file ``name`` in ``folder``; the typed error says
    why not (an unsafe name, a link out of the folder, missing, not a regular file)."""
    if not plain_name(name):
        raise CheckpointCorruptError(f"{folder}: {what} names the file {name!r}, which is no "
                                     "plain file name in the folder (a path, '..' or empty); "
                                     "a file outside the folder is never read")
    where = folder / str(name)
    real = Path(os.path.realpath(where))
    if real.parent != Path(os.path.realpath(folder)):
        raise CheckpointCorruptError(f"{where}: a link out of the folder (to {real}); a file "
                                     "outside the folder is never read: copy it in")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointIncompleteError(f"{folder}: file {name} is missing ({what} names "
                                        "it); restore it or load another copy") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{where}: cannot be opened ({e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"{where}: not a regular file; {what} names a file")
    return fd


def read_range(fd: int, lo: int, hi: int, where: object) -> np.ndarray:
    """Bytes ``[lo, hi)`` of the file as a uint8 array (``hi`` checked against the file's
    size by the caller); a short read or an I/O error is CheckpointCorruptError."""
    out = np.empty(hi - lo, np.uint8)
    view = memoryview(out)
    at = 0
    while at < len(out):
        try:
            got = os.preadv(fd, [view[at:at + _CHUNK]], lo + at)
        except OSError as e:
            raise CheckpointCorruptError(f"{where}: reading bytes {lo + at}.. failed ({e})"
                                         ) from None
        if got == 0:
            raise CheckpointCorruptError(f"{where}: the file ends at byte {lo + at}, before "
                                         f"{hi} (truncated while read)")
        at += got
    return out


def crc32_of(data: Any) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _fail(where: object, msg: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where}: {msg}: not a valid safetensors file (truncated or "
                                  "damaged); write it again or fetch it again")


def _nonneg_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(fd: int, where: object) -> Header:
    """The checked header of the file open at ``fd`` (see the module docstring)."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise _fail(where, f"{size} bytes, less than the 8 of the header's length")
    (n,) = struct.unpack("<Q", bytes(read_range(fd, 0, 8, where)))
    if n > min(size - 8, MAX_HEADER):
        raise _fail(where, f"a header of {n} bytes in a file of {size}")
    raw = bytes(read_range(fd, 0, 8 + n, where))
    try:
        header = json.loads(raw[8:])
    except (ValueError, RecursionError) as e:
        raise _fail(where, f"the header is not JSON ({str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise _fail(where, f"the header is a {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise _fail(where, "__metadata__ is not a map of strings")
    start, tensors = 8 + n, {}
    for name, e in header.items():
        if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] in _SIZE
                and isinstance(e.get("shape"), list) and all(map(_nonneg_int, e["shape"]))
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(map(_nonneg_int, e["data_offsets"]))):
            raise _fail(where, f"tensor {name!r}: {str(e)[:120]} is not "
                               "{dtype: a known code, shape: [ints], data_offsets: [2 ints]}")
        lo, hi = e["data_offsets"]
        if hi - lo != math.prod(e["shape"]) * _SIZE[e["dtype"]]:
            raise _fail(where, f"tensor {name!r}: {hi - lo} bytes for shape {e['shape']} of "
                               f"{e['dtype']}")
        tensors[name] = Entry(e["dtype"], tuple(e["shape"]), start + lo, start + hi)
    at = start
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].lo, kv[1].hi)):
        if e.lo != at:
            raise _fail(where, f"tensor {name!r} starts at byte {e.lo}, the data before it "
                               f"ends at {at} (a gap or an overlap)")
        at = e.hi
    if at != size:
        raise _fail(where, f"the tensors end at byte {at}, the file at {size}")
    return Header(raw, tensors, meta)


def header_bytes(entries: Sequence[tuple[str, str, Sequence[int]]],
                 metadata: dict[str, str]) -> tuple[bytes, list[tuple[int, int]]]:
    """The length word and header of a file holding ``(name, dtype code, shape)`` tensors
    back to back in this order, padded so the data starts 8-byte aligned; and each
    tensor's absolute byte range in the file."""
    header: dict[str, Any] = {"__metadata__": metadata}
    at, spans = 0, []
    for name, code, shape in entries:
        n = math.prod(shape) * _SIZE[code]
        header[name] = {"dtype": code, "shape": [int(d) for d in shape],
                        "data_offsets": [at, at + n]}
        spans.append((at, at + n))
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [(base + a, base + b) for a, b in spans]
