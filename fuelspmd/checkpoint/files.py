"""The files of a checkpoint on the writing side: shards, notes, the commit, and what a save
may remove.

A shard is written here in the safetensors format by hand rather than by
``safetensors.numpy.save_file``, so the bytes stream from the host copies without a second
copy of the whole shard, the CRC-32 of each tensor is computed as it is written, and a test
can stop the writer between any two steps (``hook``).

Ownership. A save removes only what this format made and can prove it made. Every
directory a save creates holds :data:`MARKER` (the format and the checkpoint's name) from
before any other file of ours goes in; a committed one also holds its index. Inside such
a directory only the files named by this format (:data:`OURS`) are ever removed, the
marker last, and then the directory only if it is empty. Beside ``path``, only
``<name>.tmp-<nonce>`` and ``<name>.old-<nonce>`` directories whose marker proves them
saves of ours for ``name`` are cleared (what crashed saves left; an old one only once
``name`` is committed again, as until then it is the copy a load finds), each only while
no save to ``name`` runs (its lock is free). ``keep=`` prunes only checkpoints its own run
recorded: ``latest`` in the run directory lists the names that saves with ``keep=``
committed there, and a checkpoint saved by hand beside them (``best-model``) is never on
it.

The lock. Two jobs saving to one path would take each other's directories away; rank 0
holds an exclusive ``flock`` on ``.<name>.lock`` beside ``path`` for the whole save (the
kernel drops it if the process dies), so a second job's save fails at once with
CheckpointError on every rank.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd.errors import CheckpointCorruptError, CheckpointError, CheckpointIncompleteError

from .index import DTYPES, FORMAT, check, piece_name
from .layout import Box
from .safetensors import header_bytes, open_inside, plain_name

__all__ = ["INDEX", "LATEST", "MARKER", "Hook", "Lock", "check_target", "commit", "find",
           "fsync_dir", "latest", "listing", "prune", "read_index", "record", "remove",
           "shard_name", "tidy", "wait_for", "write_json", "write_shard"]

INDEX = "index.json"
LATEST = "latest"
MARKER = "fuelspmd-checkpoint.json"
Hook = Callable[[str], None]  # called at each named point of a save (tests stop there)

_CHUNK = 8 << 20  # bytes per write
_ASIDE = r"\.(old|tmp)-[0-9a-f]{12}"  # a save's directory before its commit, or the old one
# every file name a save writes inside a checkpoint directory
OURS = re.compile(rf"shard-\d+-of-\d+\.safetensors|done-\d+(\.tmp)?|slot-\d+|failed-\d+(-\w+)?"
                  rf"|stopped-\d+|{INDEX}(\.tmp)?|{MARKER}(\.tmp-\d+)?")


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
               sync_dir: bool = True, temp: str = ".tmp") -> None:
    """Write ``value`` to ``path`` through the name ``path + temp``, fsynced, renamed into
    place (and the rename made durable unless ``sync_dir`` is false); a failure leaves
    ``path`` as it was and no temporary file."""
    tmp = path.with_name(path.name + temp)
    try:
        with open(tmp, "w") as f:
            json.dump(value, f)
            f.flush()
            hook(f"{what} temp written")
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    hook(f"{what} renamed")
    if sync_dir:
        fsync_dir(path.parent)


def write_shard(path: Path, tensors: Sequence[tuple[str, Box, np.ndarray, str]],
                hook: Hook = _none, stop: Callable[[], None] = lambda: None
                ) -> tuple[dict[str, tuple[list[int], int]], int]:
    """Write ``(key, box, host array, dtype name)`` pieces to ``path`` and fsync it; return
    per piece name its byte range in the file and CRC-32, and the header's CRC-32.
    ``stop()`` is called before each piece (it raises when the save is abandoned)."""
    entries = [(piece_name(k, b), DTYPES[dt][0], arr.shape) for k, b, arr, dt in tensors]
    head, spans = header_bytes(entries, {"format": FORMAT})
    out = {}
    with open(path, "wb") as f:
        hook("shard opened")
        f.write(head)
        hook("shard header written")
        for (name, _, _), (_, _, arr, _), (lo, hi) in zip(entries, tensors, spans):
            stop()
            data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            crc, half = 0, len(data) // 2
            for a, b in ((0, half), (half, len(data))):
                for k in range(a, b, _CHUNK):
                    piece = data[k:min(b, k + _CHUNK)]
                    f.write(piece)
                    crc = zlib.crc32(piece, crc)
                if a == 0:
                    hook(f"tensor {name} half written")
            out[name] = ([lo, hi], crc)
        f.flush()
        hook("shard flushed")
        os.fsync(f.fileno())
    hook("shard fsynced")
    return out, zlib.crc32(head)


def write_marker(folder: Path, name: str, nonce: str, created: int, rank: int) -> None:
    """Put the marker proving ``folder`` is a save of ours for ``name`` (every rank writes
    the same bytes, each through its own temporary name)."""
    if not (folder / MARKER).exists():
        write_json(folder / MARKER, {"format": FORMAT, "name": name, "nonce": nonce,
                                     "created": created}, sync_dir=False, temp=f".tmp-{rank}")


def _read_json(path: Path, limit: int = 1 << 16) -> Any:
    """The JSON in file ``path`` if it is one of at most ``limit`` bytes; else None."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
        return None if len(raw) > limit else json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None


def _marker(folder: Path, name: str) -> dict[str, Any] | None:
    """The marker of directory ``folder`` if it is a save of ours for ``name``."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    d = _read_json(folder / MARKER)
    ok = isinstance(d, dict) and d.get("format") == FORMAT and d.get("name") == name
    return d if ok else None  # type: ignore[return-value]


def ours(folder: Path, name: str) -> bool:
    """Whether directory ``folder`` proves to be a checkpoint (or a save) of ours for
    ``name``: its marker says so."""
    return _marker(folder, name) is not None


def listing(path: Path) -> list[Path]:
    """The entries of directory ``path``; none when it is not one. Asked, not looked at
    first: another rank may rename or remove it between two looks (a commit renames the
    save's temporary directory while the other ranks poll it)."""
    try:
        return list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove(folder: Path, hook: Hook = _none, what: str = "") -> None:
    """Delete a directory of ours: its index first (so a kill midway leaves a directory
    that is refused as uncommitted, never a committed one missing shards), then every file
    this format names, the marker last, then the directory if nothing else is in it."""
    if (folder / INDEX).is_file():
        (folder / INDEX).unlink()
        fsync_dir(folder)
        hook(f"{what} index removed")
    for p in listing(folder):
        if OURS.fullmatch(p.name) and p.name != MARKER and not p.is_dir():
            p.unlink(missing_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # not empty: what is left is not ours
        pass
    hook(f"{what} removed")


def check_target(path: Path) -> None:
    """Refuse to replace ``path`` unless it is a checkpoint of ours (or an empty
    directory): a save moves what is there aside and deletes it."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink() and (ours(path, path.name)
                                                    or not listing(path)):
        return
    other = (sorted(p.name for p in listing(path))
             if path.is_dir() and not path.is_symlink() else [path.name])
    raise CheckpointError(f"checkpoint.save: {path} exists and is not a checkpoint this "
                          f"fuelspmd wrote (it holds {other[:4]}); a save would replace it. "
                          "Choose another path, or remove it first")


class Lock:
    """``path``'s save lock (see the module docstring), held by rank 0 during a save."""

    def __init__(self, path: Path, nonce: str) -> None:
        self.file = path.with_name(f".{path.name}.lock")
        self.nonce = nonce
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise CheckpointError naming the job that holds it."""
        for _ in range(10):
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
                os.close(fd)
                raise CheckpointError(
                    f"checkpoint.save: another save to {self.file.with_name(self.file.name[1:-5])}"
                    f" is running ({holder or 'its holder'} holds {self.file}); two jobs must "
                    "not save to one path: give each job its own") from None
            try:  # the holder before may have removed the file between our open and lock
                same = os.stat(self.file).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                try:  # who holds it, for the message of a second job (a full disk: none)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} save "
                                  f"{self.nonce}\n".encode(), 0)
                except OSError:
                    pass
                return
            os.close(fd)
        raise CheckpointError(f"checkpoint.save: could not take {self.file}: it keeps being "
                              "replaced; is another job saving to this path?")

    def release(self) -> None:
        if self.fd is not None:
            try:
                self.file.unlink(missing_ok=True)
            finally:
                os.close(self.fd)
                self.fd = None


def commit(tmp: Path, path: Path, nonce: str, hook: Hook) -> None:
    """Move the finished ``tmp`` (its index written) to ``path``, replacing a committed
    checkpoint there: old -> ``<path>.old-<nonce>``, new -> path. A failure before the
    second rename puts the old one back."""
    old = path.with_name(f"{path.name}.old-{nonce}")
    moved = path.exists()
    try:
        if moved:
            os.replace(path, old)
            fsync_dir(path.parent)
            hook("old moved aside")
        os.replace(tmp, path)
    except BaseException:
        if moved and tmp.exists() and not path.exists():
            os.replace(old, path)
        raise
    fsync_dir(path.parent)
    hook("new renamed into place")


_LOCK_TEXT = re.compile(r"host \S+ pid \d+ save [0-9a-f]{12}\n")


def tidy(folder: Path, mine: Path, hook: Hook) -> None:
    """Remove what crashed saves left in ``folder``: the ``<name>.tmp-<nonce>``
    directories whose marker proves them saves of ours for ``name``, the
    ``<name>.old-<nonce>`` ones once ``name`` itself is committed again (before, an old one
    is the last committed copy, which a load of ``name`` finds), and the stale locks we
    wrote; each only when no save to ``name`` runs (its lock is free; ``mine`` is the path
    whose lock this save holds)."""
    aside = re.compile(r"(.+)" + _ASIDE)
    names: dict[str, list[Path]] = {}
    for p in listing(folder):
        m = aside.fullmatch(p.name)
        if m and not p.is_symlink() and p.is_dir():
            names.setdefault(m[1], []).append(p)
        elif p.name.startswith(".") and p.name.endswith(".lock") and p.is_file():
            names.setdefault(p.name[1:-5], [])
    for name, dirs in sorted(names.items()):
        lock = None
        if folder / name != mine:
            stale = folder / f".{name}.lock"
            if stale.exists() and not _LOCK_TEXT.fullmatch(_read_text(stale)):
                continue  # a lock file we cannot prove ours, or a save that could not say
            lock = Lock(folder / name, "0" * 12)
            try:
                lock.acquire()
            except CheckpointError:
                continue  # a save to ``name`` is running
        try:
            committed = _created(folder / name) >= 0  # an .old- is the last copy otherwise
            for p in sorted(dirs):
                if ".old-" in p.name[len(name):] and not committed:
                    continue
                if ours(p, name):
                    remove(p, hook, "leftover")
                else:
                    try:  # an empty one (a save killed before its marker) holds nothing
                        p.rmdir()
                    except OSError:
                        pass
        finally:
            if lock is not None:
                lock.release()


def _read_text(path: Path) -> str:
    try:
        return path.read_text()[:200]
    except (OSError, ValueError):
        return ""


# ---- the run directory: ``latest`` and what keep= may prune --------------------------------
def _journal(run: Path) -> tuple[str | None, list[str]]:
    """(the name ``latest`` points at, the names keep= saves recorded); plain names only."""
    d = _read_json(run / LATEST, 1 << 24)
    if not isinstance(d, dict):
        return None, []
    name = d.get("latest") if plain_name(d.get("latest")) else None
    saved = d.get("saved")
    return name, [n for n in saved if plain_name(n)] if isinstance(saved, list) else []


def record(path: Path, hook: Hook) -> None:
    """Before the commit of a save with keep=: add ``path``'s name to its run's record."""
    name, saved = _journal(path.parent)
    if path.name not in saved:
        write_json(path.parent / LATEST, {"latest": name, "saved": [*saved, path.name]},
                   hook, "record")


def prune(path: Path, keep: int, hook: Hook) -> None:
    """After the commit: point ``latest`` at ``path``, then keep only the ``keep`` newest
    of the checkpoints the run recorded (``path`` always one of them). What a killed
    prune left of a recorded one (no index, or not even the marker: then an empty
    directory) is removed, and a name of which nothing of ours is left is forgotten."""
    run = path.parent
    _, saved = _journal(run)
    write_json(run / LATEST, {"latest": path.name, "saved": saved}, hook, "latest")
    found: list[tuple[int, Path]] = []
    gone: set[str] = set()
    for name in saved:
        p = run / name
        if p == path:
            continue
        when = _resolved(p)
        if when >= 0:
            found.append((when, p))
            continue
        if ours(p, name):
            remove(p, hook, f"pruned {name}")  # a prune killed between index and marker
        elif p.is_dir() and not p.is_symlink():
            try:  # a prune killed after the marker: nothing of ours is left in it
                p.rmdir()
            except OSError:
                pass
        if not ours(p, name):
            gone.add(name)
    for _, p in sorted(found, reverse=True)[keep - 1:]:
        remove(find(p), hook, f"pruned {p.name}")
        gone.add(p.name)
    if gone:
        write_json(run / LATEST, {"latest": path.name,
                                  "saved": [n for n in saved if n not in gone]}, hook, "record")


def _created(path: Path, name: str | None = None) -> int:
    """When the committed checkpoint of ours for ``name`` (``path``'s own name by default)
    at ``path`` was saved (ns, from its marker); -1 if there is none."""
    d = _marker(path, path.name if name is None else name)
    c = None if d is None or not (path / INDEX).is_file() else d.get("created")
    return c if isinstance(c, int) and not isinstance(c, bool) and c >= 0 else -1


def latest(run: Path) -> Path | None:
    """The newest committed checkpoint of run directory ``run``: the newest of the one
    ``latest`` names and those the run recorded; without that file, the newest of ours
    in ``run``; None if there is none. A name counts while a replacement is between its
    two renames (a load of it finds the old one)."""
    name, saved = _journal(run)
    names = ([name] if name else []) + saved
    if not names:
        names = [p.name for p in listing(run) if not re.search(_ASIDE + "$", p.name)]
    found = {n: _resolved(run / n) for n in dict.fromkeys(names)}
    best = max(found, key=lambda n: found[n], default=None)
    return None if best is None or found[best] < 0 else run / best


def _resolved(path: Path) -> int:
    """When the checkpoint a load of ``path`` finds was saved (ns); -1 if it finds none."""
    try:
        where = find(path)
    except CheckpointIncompleteError:
        return -1
    return _created(where, path.name)


# ---- finding and reading what is committed -----------------------------------------------
def find(path: Path) -> Path:
    """The committed checkpoint that ``path`` names: ``path`` itself, or, after a crash
    between the two renames of a replacement, the previous one moved aside; otherwise
    CheckpointIncompleteError naming what is there."""
    if (path / INDEX).is_file():
        return path
    pat = re.compile(re.escape(path.name) + r"\.old-[0-9a-f]{12}")
    old = [p for p in listing(path.parent) if pat.fullmatch(p.name)
           and _created(p, path.name) >= 0]
    if old:
        return max(old, key=lambda p: _created(p, path.name))
    aside = re.compile(re.escape(path.name) + _ASIDE)
    found = sorted(p.name for p in listing(path.parent) if aside.fullmatch(p.name))
    there = sorted(q.name for q in listing(path))
    what = (f"{path} has no {INDEX}: its save never committed (files there: {there[:6]})"
            if there or path.is_dir() else f"no checkpoint at {path}")
    raise CheckpointIncompleteError(
        what + (f"; uncommitted saves beside it: {found}" if found else "")
        + ". Load the last committed checkpoint (checkpoint.latest(run_dir) finds it)")


def read_index(path: Path) -> dict[str, Any]:
    """The checked index of the committed checkpoint at ``path`` (see :mod:`.index`)."""
    fd = open_inside(path, INDEX, "the checkpoint")
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointCorruptError(f"{path / INDEX}: cannot be read ({e})") from None
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path / INDEX}: not a readable index "
                                     f"({str(e)[:80]})") from None
    index = check(parsed, path / INDEX)
    m = re.fullmatch(rf"{re.escape(index['name'])}\.tmp-(\w+)", path.name)
    if m and m[1] == index["nonce"]:
        raise CheckpointIncompleteError(
            f"{path}: a checkpoint for {index['name']!r} whose save stopped before its "
            f"commit (it is still under its temporary name); load {path.parent / index['name']} "
            "(the last committed one) instead")
    return index


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


def errno_name(e: BaseException) -> str:
    """A short word for why a write failed: ENOSPC, EIO, ... or the exception's class."""
    if isinstance(e, OSError) and e.errno in errno.errorcode:
        return errno.errorcode[e.errno]
    return type(e).__name__

