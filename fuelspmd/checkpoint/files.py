"""The files of a checkpoint: safetensors shards, the index, the commit by renames.

A shard is written here in the safetensors format (8-byte header length, JSON header,
tensor bytes back to back) by hand rather than by ``safetensors.numpy.save_file``, so the
bytes stream from the host copies without a second copy of the whole shard, the CRC-32 of
each tensor is computed as it is written, and a test can stop the writer between any two
steps (``hook``). bfloat16 (which numpy's safetensors reader does not know) is stored as
its 16-bit pattern ("U16"); the index keeps the real dtype. Shards are read back with
``safetensors.safe_open`` and ``get_slice``, which maps the file and copies only the
slice asked for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
)

from .layout import Box, intersect, slices, volume

__all__ = ["FORMAT", "INDEX", "Hook", "Shards", "check_target", "commit", "committed", "find",
           "fsync_dir", "latest", "prune", "read_index", "shard_name", "wait_for", "write_json",
           "write_shard"]

FORMAT, VERSION = "fuelspmd-checkpoint", 1
INDEX = "index.json"
LATEST = "latest"
Hook = Callable[[str], None]  # called at each named point of a save (tests stop there)

_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "U16",
       "int64": "I64", "int32": "I32", "bool": "BOOL"}
_CHUNK = 8 << 20  # bytes per write and per checksum read
_TEMP = re.compile(r"\.tmp-\w+$")  # a save's directory before its commit


def _none(_: str) -> None:
    return None


def shard_name(rank: int, size: int) -> str:
    return f"shard-{rank:05d}-of-{size:05d}.safetensors"


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value: Any, hook: Hook = _none, what: str = "", *,
               sync_dir: bool = True) -> None:
    """Write ``value`` to ``path`` through a temporary name, fsynced, renamed into place
    (and the rename made durable unless ``sync_dir`` is false)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        hook(f"{what} temp written")
        os.fsync(f.fileno())
    os.replace(tmp, path)
    hook(f"{what} renamed")
    if sync_dir:
        fsync_dir(path.parent)


def write_shard(path: Path, tensors: Sequence[tuple[str, np.ndarray, str]],
                hook: Hook = _none) -> dict[str, dict[str, Any]]:
    """Write ``(name, host array, dtype name)`` tensors to ``path`` and fsync it; return
    per name its byte range in the file and CRC-32."""
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    at, out = 0, {}
    for name, arr, dt in tensors:
        n = arr.nbytes
        header[name] = {"dtype": _ST[dt], "shape": list(arr.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    with open(path, "wb") as f:
        hook("shard opened")
        f.write(struct.pack("<Q", len(text)) + text)
        hook("shard header written")
        for name, arr, _ in tensors:
            data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            crc, half = 0, len(data) // 2
            for a, b in ((0, half), (half, len(data))):
                for k in range(a, b, _CHUNK):
                    piece = data[k:min(b, k + _CHUNK)]
                    f.write(piece)
                    crc = zlib.crc32(piece, crc)
                if a == 0:
                    hook(f"tensor {name} half written")
            lo = base + header[name]["data_offsets"][0]
            out[name] = {"offsets": [lo, lo + len(data)], "crc32": crc}
        f.flush()
        hook("shard flushed")
        os.fsync(f.fileno())
    hook("shard fsynced")
    return out


def read_index(path: Path) -> dict[str, Any]:
    """The index of the committed checkpoint at ``path`` (see :func:`find`)."""
    try:
        with open(path / INDEX) as f:
            index = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointCorruptError(f"{path / INDEX}: not a readable index ({e})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{path / INDEX}: format {index.get('format')!r} version {index.get('version')!r}; "
            f"this fuelspmd reads {FORMAT!r} version {VERSION}")
    m = re.fullmatch(rf"{re.escape(str(index['name']))}\.tmp-(\w+)", path.name)
    if m and m[1] == index["nonce"]:
        raise CheckpointIncompleteError(
            f"{path}: a checkpoint for {index['name']!r} whose save stopped before its "
            f"commit (it is still under its temporary name); load {path.parent / index['name']} "
            "(the last committed one) instead")
    return index  # type: ignore[no-any-return]


def committed(path: Path) -> bool:
    return (path / INDEX).is_file()


def listing(path: Path) -> list[Path]:
    """The entries of directory ``path``; none when it is not one. Asked, not looked at
    first: another rank may rename or remove it between two looks (a commit renames the
    save's temporary directory while the other ranks poll it)."""
    try:
        return list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _aside(path: Path) -> list[Path]:
    """``path``'s siblings named ``<name>.old-*`` (moved aside) and ``.tmp-*`` (unfinished)."""
    pat = re.compile(rf"{re.escape(path.name)}\.(old|tmp)-\w+")
    return [p for p in listing(path.parent) if pat.fullmatch(p.name)]


def find(path: Path) -> Path:
    """The committed checkpoint that ``path`` names: ``path`` itself, or, after a crash
    between the two renames of a replacement, the previous one moved aside; otherwise
    CheckpointIncompleteError naming what is there."""
    if committed(path):
        return path
    old = [p for p in _aside(path) if ".old-" in p.name and _created(p) >= 0]
    if old:
        return max(old, key=_created)
    found = sorted(p.name for p in _aside(path))
    there = sorted(q.name for q in listing(path))
    what = (f"{path} has no {INDEX}: its save never committed (files there: {there[:6]})"
            if there or path.is_dir() else f"no checkpoint at {path}")
    raise CheckpointIncompleteError(
        what + (f"; uncommitted saves beside it: {found}" if found else "")
        + ". Load the last committed checkpoint (checkpoint.latest(run_dir) finds it)")


def _created(path: Path) -> int:
    """When the checkpoint at ``path`` was saved (ns); -1 if it is none of ours."""
    try:
        with open(path / INDEX) as f:
            index = json.load(f)
        return int(index["created"]) if index.get("format") == FORMAT else -1
    except (OSError, ValueError, KeyError, AttributeError):
        return -1


def _checkpoints(run: Path) -> list[Path]:
    """The committed checkpoints of ours directly in ``run``, newest first."""
    found = [p for p in listing(run) if not _TEMP.search(p.name) and _created(p) >= 0]
    return sorted(found, key=_created, reverse=True)


def _remove(path: Path, hook: Hook, what: str) -> None:
    """Delete a checkpoint directory, its index first, so a kill midway leaves a directory
    that is refused as uncommitted rather than one whose index names deleted shards."""
    if (path / INDEX).exists():
        (path / INDEX).unlink()
        fsync_dir(path)
        hook(f"{what} index removed")
    shutil.rmtree(path, ignore_errors=True)
    hook(f"{what} removed")


_OURS = re.compile(rf"shard-\d+-of-\d+\.safetensors|done-\d+(\.tmp)?|{INDEX}(\.tmp)?")


def check_target(path: Path) -> None:
    """Refuse to replace ``path`` unless it is a checkpoint (or what is left of one): a
    save moves what is there aside and deletes it."""
    if not path.exists() or _created(path) >= 0:
        return
    other = ([n for n in sorted(p.name for p in listing(path)) if not _OURS.fullmatch(n)]
             if path.is_dir() else [path.name])
    if other:
        raise CheckpointError(f"checkpoint.save: {path} exists and is not a checkpoint (it "
                              f"holds {other[:4]}); a save would replace it. Choose another "
                              "path, or remove it first")


def commit(tmp: Path, path: Path, nonce: str, hook: Hook) -> None:
    """Move the finished ``tmp`` (its index written) to ``path``, replacing a committed
    checkpoint there: old -> ``<path>.old-<nonce>``, new -> path, then delete the old one
    and leftovers of earlier crashed saves."""
    if path.exists():
        os.replace(path, path.with_name(f"{path.name}.old-{nonce}"))
        fsync_dir(path.parent)
        hook("old moved aside")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    hook("new renamed into place")
    for p in sorted(_aside(path)):
        _remove(p, hook, "leftover")


def prune(path: Path, keep: int, hook: Hook) -> None:
    """Point the run directory's ``latest`` at ``path``, then keep only the ``keep``
    newest committed checkpoints there (``path`` always one of them)."""
    run = path.parent
    write_json(run / LATEST, {"latest": path.name}, hook, "latest")
    for p in [p for p in _checkpoints(run) if p != path][keep - 1:]:
        _remove(p, hook, f"pruned {p.name}")


def latest(run: Path) -> Path | None:
    """The newest committed checkpoint of run directory ``run``: the one ``latest`` names
    (moved only after a commit), else the newest by commit time; None if there is none."""
    try:
        with open(run / LATEST) as f:
            name = json.load(f)["latest"]
        if _created(run / name) >= 0:
            return run / name
    except (OSError, ValueError, KeyError):
        pass
    found = _checkpoints(run)
    return found[0] if found else None


def wait_for(what: str, ready: Callable[[], bool], deadline: float) -> None:
    """Poll ``ready`` until it holds; CheckpointError once ``deadline`` (monotonic) passes."""
    pause = 0.001
    while not ready():
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint.save: {what} did not happen before the "
                                  "deadline (a rank died or its disk stalled); the previous "
                                  "checkpoint is intact")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class Shards:
    """Reads boxes of a committed checkpoint's tensors, each saved tensor's checksum
    verified (streamed in chunks) before the first of its values is used."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = path, index
        self._open: dict[str, Any] = {}
        self._checked: set[tuple[str, str]] = set()

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()

    def _file(self, name: str) -> Any:
        if name not in self._open:
            p = self.path / name
            if not p.is_file():
                raise CheckpointIncompleteError(f"{self.path}: shard file {name} is missing "
                                                "(the index names it); restore it or load "
                                                "another checkpoint")
            want = self.index["files"][name]
            if p.stat().st_size != want:
                raise CheckpointCorruptError(f"{p}: {p.stat().st_size} bytes, the index "
                                             f"says {want} (truncated or overwritten)")
            try:
                self._open[name] = safe_open(str(p), framework="numpy").__enter__()
            except Exception as e:  # the reader's own error type is not exported
                raise CheckpointCorruptError(f"{p}: not a readable safetensors file "
                                             f"({e})") from None
        return self._open[name]

    def _verify(self, piece: dict[str, Any]) -> None:
        name, tensor = piece["file"], piece["name"]
        if (name, tensor) in self._checked:
            return
        lo, hi = piece["offsets"]
        crc = 0
        with open(self.path / name, "rb") as f:
            f.seek(lo)
            for at in range(lo, hi, _CHUNK):
                crc = zlib.crc32(f.read(min(_CHUNK, hi - at)), crc)
        if crc != piece["crc32"]:
            raise CheckpointCorruptError(
                f"{self.path / name}: tensor {tensor!r} has CRC-32 {crc:#010x}, the index "
                f"says {piece['crc32']:#010x}: the shard is corrupt; load another checkpoint")
        self._checked.add((name, tensor))

    def read(self, key: str, box: Box) -> np.ndarray:
        """The values of ``box`` of tensor ``key``, from every saved piece meeting it."""
        meta = self.index["tensors"][key]
        dt = to_numpy(meta["dtype"])
        out = np.empty(tuple(b - a for a, b in box), dt)
        got = 0
        for piece in meta["pieces"]:
            pbox: Box = tuple((int(a), int(b)) for a, b in piece["box"])
            part = intersect(pbox, box)
            if part is None:
                continue
            f = self._file(piece["file"])
            self._verify(piece)
            values = f.get_slice(piece["name"])[slices(part, pbox)]
            out[slices(part, box)] = np.asarray(values).view(dt)
            got += volume(part)
        if got != out.size:
            raise CheckpointIncompleteError(f"{self.path}: tensor {key!r}: the saved pieces "
                                            f"hold {got} of the {out.size} elements of block "
                                            f"{list(box)}; the index is incomplete")
        return out
