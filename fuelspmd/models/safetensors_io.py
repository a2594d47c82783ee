"""Hugging Face weight files: read one block of a tensor, write a file a tensor at a time.

Reading. A directory holds ``model.safetensors`` or ``model.safetensors.index.json`` (its
``weight_map`` names the shard file of every tensor). Nothing in it is trusted: the index
must be an object whose ``weight_map`` maps names to plain ``.safetensors`` file names in
the folder, every file is opened inside the folder and its header checked against its
size (:func:`fuelspmd.checkpoint.safetensors.read_header`: known dtypes, lengths that
match the shapes, tensors tiling the data) when the reader is made, before a model is
built; every tensor the index names must be in its file. Pickle files (``*.bin``,
``*.pt``) are never read: loading one can run code. A block is read at the checked
offsets with ``pread``, one contiguous run per row of the dimensions before the last one
that is cut, so a rank reads only its block, every dtype (BF16 included) on the one path.

Checksums. A file written by :class:`StreamingWriter` carries the CRC-32 of every tensor
in its ``__metadata__`` (``fuelspmd.crc32``, a JSON map of name to 8 hex digits, patched in
after the data, which transformers ignores). Where it is present, a read takes the whole
tensor, checks it and cuts the block from the same bytes; a file from elsewhere has no
checksum, and its data bytes are taken as they are (its structure is still checked).

Writing. The header is written first (every shape is known before any data), each
tensor's bytes are appended as it arrives, so the writer holds one tensor at a time, never
the model; then the checksums are patched into the header (same length), the file is
fsynced and renamed into place: a reader sees the old file or the whole new one.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.checkpoint.safetensors import (
    NAMES,
    Entry,
    crc32_of,
    header_bytes,
    open_inside,
    plain_name,
    read_header,
    read_range,
)
from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import CheckpointCorruptError, ConfigError, ShapeError

__all__ = ["INDEX", "SINGLE", "SafetensorsReader", "StreamingWriter", "atomic_write_text",
           "read_json"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
CRC = "fuelspmd.crc32"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HEX = re.compile(r"[0-9a-f]{8}")


def read_json(root: Path, name: str, what: str, limit: int = 64 << 20) -> dict[str, Any]:
    """The JSON object in file ``name`` of ``root`` (opened inside it, at most ``limit``
    bytes); ConfigError saying what is wrong with it otherwise."""
    fd = open_inside(root, name, what)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ConfigError(f"{root / name}: more than {limit} bytes, so not a {what}; give "
                          "the directory its own file")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{root / name}: not JSON ({str(e)[:80]}); give the {what} a "
                          "Hugging Face model directory has") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{root / name}: a JSON {type(d).__name__}, not an object; give the "
                          f"{what} a Hugging Face model directory has")
    return d


class SafetensorsReader:
    """The tensors of a Hugging Face directory, checked and read by block; see the module
    docstring."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        self.root = root
        self._fds: dict[str, int] = {}
        self._crcs: dict[str, dict[str, int]] = {}
        self.tensors: dict[str, tuple[str, Entry]] = {}  # name -> (file, entry)
        try:
            self._open_all(root)
        except BaseException:
            self.close()
            raise

    def _open_all(self, root: Path) -> None:
        if (root / INDEX).exists() or (root / INDEX).is_symlink():
            d = read_json(root, INDEX, "weight index")
            weight_map = d.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{root / INDEX}: 'weight_map' is {str(weight_map)[:60]!r}; "
                                  "it must be a map of tensor names to file names")
            for name, f in weight_map.items():
                if not (plain_name(f) and str(f).endswith(".safetensors")):
                    raise ConfigError(f"{root / INDEX}: tensor {name!r} is in {f!r}, which is no "
                                      ".safetensors file name in the folder (a path, '..', or "
                                      "another format); a file outside it is never read")
            wanted = weight_map
        elif (root / SINGLE).exists() or (root / SINGLE).is_symlink():
            wanted = None
        else:
            there = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
            pickles = [n for n in there if n.endswith(PICKLES)]
            raise ConfigError(
                f"from_pretrained: {root} holds neither {SINGLE} nor {INDEX}"
                + (f"; {pickles[:3]} are pickle files, which are never read (loading one "
                   "can run code): convert them to safetensors" if pickles else
                   "; give a directory written by save_pretrained"))
        files = sorted(set(wanted.values())) if wanted is not None else [SINGLE]
        headers = {}
        for f in files:
            self._fds[f] = open_inside(root, f, "the directory")
            headers[f] = read_header(self._fds[f], root / f)
            self._crcs[f] = self._checksums(root / f, headers[f].metadata, headers[f].tensors)
        for name, f in (wanted or dict.fromkeys(headers[SINGLE].tensors, SINGLE)).items():
            e = headers[f].tensors.get(name)
            if e is None:
                raise CheckpointCorruptError(f"{root / INDEX}: tensor {name!r} is in {f}, whose "
                                             "header does not hold it: the directory is damaged")
            self.tensors[name] = (f, e)

    @staticmethod
    def _checksums(where: Path, meta: dict[str, str], tensors: dict[str, Entry]
                   ) -> dict[str, int]:
        if CRC not in meta:
            return {}
        try:
            d = json.loads(meta[CRC])
        except (ValueError, RecursionError):
            d = None
        if not (isinstance(d, dict) and set(d) == set(tensors)
                and all(isinstance(v, str) and _HEX.fullmatch(v) for v in d.values())):
            raise CheckpointCorruptError(f"{where}: its {CRC} metadata is not one 8-digit hex "
                                         "CRC-32 per tensor: the file is damaged")
        return {k: int(v, 16) for k, v in d.items()}

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _get(self, name: str) -> tuple[str, Entry]:
        if name not in self.tensors:
            raise ConfigError(f"from_pretrained: the weights have no tensor {name!r} "
                              f"({len(self.tensors)} tensors found); is the directory of "
                              "this model type?")
        return self.tensors[name]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, numpy dtype name) of tensor ``name``."""
        e = self._get(name)[1]
        return e.shape, e.dtype

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Tensor ``name``'s block ``index`` (one step-1 slice per dim) as a host array."""
        f, e = self._get(name)
        where = self.root / f
        if len(index) != len(e.shape):
            raise ShapeError(f"from_pretrained: tensor {name!r} has shape {e.shape}; a "
                             f"{len(index)}-dim slice of it was asked for; fix the "
                             "directory's config.json to describe the weights in it")
        dt = to_numpy(e.dtype)
        fd = self._fds[f]
        if name in self._crcs[f]:
            raw = read_range(fd, e.lo, e.hi, where)
            if crc32_of(raw) != self._crcs[f][name]:
                raise CheckpointCorruptError(
                    f"{where}: tensor {name!r} has CRC-32 {crc32_of(raw):#010x}, the file's "
                    f"metadata says {self._crcs[f][name]:#010x}: the file is damaged; write "
                    "it again or fetch it again")
            return np.array(raw.view(dt).reshape(e.shape)[index])
        return _block(fd, e, index, dt, where)


def _block(fd: int, e: Entry, index: tuple[slice, ...], dt: np.dtype, where: Path
           ) -> np.ndarray:
    """Block ``index`` of the tensor at ``e``, read one contiguous run per row of the
    dimensions before the last one that is cut."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, e.shape)]
    shape = tuple(max(0, b - a) for a, b in bounds)
    out = np.empty(shape, dt)
    if out.size == 0:
        return out
    cut = [k for k, ((a, b), n) in enumerate(zip(bounds, e.shape)) if (a, b) != (0, n)]
    k = cut[-1] if cut else 0
    inner = math.prod(e.shape[k + 1:]) * dt.itemsize
    strides = [math.prod(e.shape[j + 1:]) * dt.itemsize for j in range(len(e.shape))]
    run = shape[k] * inner if e.shape else dt.itemsize
    rows = out.reshape(-1, run // dt.itemsize) if e.shape else out.reshape(1, 1)
    for r, lead in enumerate(np.ndindex(*shape[:k])):
        at = e.lo + sum((bounds[j][0] + i) * strides[j] for j, i in enumerate(lead)) \
            + (bounds[k][0] * strides[k] if e.shape else 0)
        rows[r] = read_range(fd, at, at + run, where).view(dt)
    return out


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsynced, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class StreamingWriter:
    """One safetensors file written a tensor at a time, in the order of ``entries``
    ((name, shape, numpy dtype name)); committed by :meth:`close`. Use as a context:
    leaving it on an exception removes the temporary file and keeps the old one."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.names = [name for name, _, _ in entries]
        self.expect = [(name, tuple(shape), to_numpy(dt)) for name, shape, dt in entries]
        self.crcs: list[int] = []
        self._codes = [(name, NAMES[dt], shape) for name, shape, dt in entries]
        head = self._header(["0" * 8] * len(entries))
        self.file = open(self.tmp, "wb")
        try:
            self.file.write(head)
        except BaseException:
            self.abort()
            raise

    def _header(self, crcs: list[str]) -> bytes:
        meta = {"format": "pt", CRC: json.dumps(dict(zip(self.names, crcs)),
                                                separators=(",", ":"))}
        return header_bytes(self._codes, meta)[0]

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the temporary file; the file at ``path`` stays what it was."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the next tensor (it must be the next entry, of its shape and dtype)."""
        want, shape, dt = self.expect[len(self.crcs)]
        if name != want or tuple(array.shape) != shape:
            raise RuntimeError(f"StreamingWriter: got {name} {tuple(array.shape)}, expected "
                               f"entry {len(self.crcs)}: {want} {shape}")
        data = np.ascontiguousarray(array, dtype=dt).reshape(-1).view(np.uint8)
        self.file.write(memoryview(data))
        self.crcs.append(zlib.crc32(memoryview(data)))

    def close(self) -> None:
        if len(self.crcs) != len(self.expect):
            raise RuntimeError(f"StreamingWriter: {len(self.crcs)} of {len(self.expect)} "
                               "tensors written; the file is not committed")
        try:
            self.file.seek(0)
            self.file.write(self._header([f"{c:08x}" for c in self.crcs]))
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
