"""Hugging Face weight files: read one slice of a tensor, write a file a tensor at a time.

Reading. A directory holds ``model.safetensors`` or ``model.safetensors.index.json`` (its
``weight_map`` names the shard file of every tensor). A slice is read with
``safe_open(..., framework="numpy").get_slice(name)[index]``, which reads only the bytes of
that slice. numpy has no bfloat16, so a BF16 tensor is read from its bytes instead: the
file's header gives the tensor's byte range, a read-only ``np.memmap`` of it as uint16
(the same 16 bits) is indexed, so again only the slice's pages are read, and the bits are
viewed as ml_dtypes' bfloat16.

Writing. The safetensors layout is an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range; ``__metadata__`` ``{"format": "pt"}``, which
transformers asks for) and the tensors' bytes in header order. Every shape is known before
any data is, so the header is written first and each tensor's bytes are appended as it
arrives: the writer holds one tensor at a time, never the model. The file is written
under a temporary name, fsynced and renamed: a reader sees the old file or the whole new
one.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from fuelspmd.dtypes import bfloat16, to_numpy
from fuelspmd.errors import ConfigError, ShapeError

__all__ = ["SafetensorsReader", "StreamingWriter", "atomic_write_text"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# safetensors dtype names <-> numpy dtype names (BF16 through ml_dtypes)
_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}
_NAMES = {v: k for k, v in _CODES.items()}


class SafetensorsReader:
    """The tensors of a Hugging Face directory, read by slice; see the module docstring."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        if (root / INDEX).exists():
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            self.files = {name: root / f for name, f in weight_map.items()}
        elif (root / SINGLE).exists():
            self.files = {}
            with safe_open(str(root / SINGLE), framework="numpy") as f:
                self.files = {name: root / SINGLE for name in f.keys()}
        else:
            raise ConfigError(f"from_pretrained: {root} holds neither {SINGLE} nor {INDEX}; "
                              "give a directory written by save_pretrained")
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise ConfigError(f"from_pretrained: the weights have no tensor {name!r} "
                              f"({len(self.files)} tensors found); is the directory of "
                              "this model type?")
        return self.files[name]

    def _header(self, path: Path) -> tuple[int, dict[str, Any]]:
        if path not in self._headers:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        return self._headers[path]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, numpy dtype name) of tensor ``name``."""
        meta = self._header(self._file(name))[1][name]
        return tuple(int(d) for d in meta["shape"]), _CODES[meta["dtype"]]

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Tensor ``name``'s block ``index`` (one slice per dim) as a host array."""
        path = self._file(name)
        shape, dt = self.info(name)
        if len(index) != len(shape):
            raise ShapeError(f"from_pretrained: tensor {name!r} has shape {shape}; a "
                             f"{len(index)}-dim slice of it was asked for; fix the "
                             "directory's config.json to describe the weights in it")
        if dt == "bfloat16":
            start, header = self._header(path)
            lo, hi = header[name]["data_offsets"]
            raw = np.memmap(path, dtype=np.uint16, mode="r", offset=start + lo, shape=shape)
            if hi - lo != raw.nbytes:
                raise ShapeError(f"from_pretrained: tensor {name!r} of {path.name} has "
                                 f"{hi - lo} bytes for shape {shape}; the file is corrupt: "
                                 "write it again (save_pretrained) or fetch it again")
            return np.array(raw[index]).view(to_numpy(bfloat16))
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), "numpy"))
        return np.asarray(self._open[path].get_slice(name)[index])


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsynced, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StreamingWriter:
    """One safetensors file written a tensor at a time, in the order of ``entries``
    ((name, shape, numpy dtype name)); committed by :meth:`close`. Use as a context:
    leaving it on an exception removes the temporary file and keeps the old one."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.expect: list[tuple[str, tuple[int, ...], np.dtype]] = []
        for name, shape, dt in entries:
            npdt = to_numpy(dt) if dt == "bfloat16" else np.dtype(dt)
            nbytes = int(np.prod(shape, dtype=np.int64)) * npdt.itemsize
            header[name] = {"dtype": _NAMES[dt], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self.expect.append((name, tuple(shape), npdt))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.done = 0

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
        want, shape, dt = self.expect[self.done]
        if name != want or tuple(array.shape) != shape:
            raise RuntimeError(f"StreamingWriter: got {name} {tuple(array.shape)}, expected "
                               f"entry {self.done}: {want} {shape}")
        self.file.write(np.ascontiguousarray(array, dtype=dt).tobytes())
        self.done += 1

    def close(self) -> None:
        if self.done != len(self.expect):
            raise RuntimeError(f"StreamingWriter: {self.done} of {len(self.expect)} tensors "
                               "written; the file is not committed")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
