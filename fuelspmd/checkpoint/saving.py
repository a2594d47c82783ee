"""One save, rank by rank: the setup every rank agrees on, the writing, the notes by which
a failure reaches every rank, and rank 0's commit.

Setup (on the calling thread, then one exchange). Rank 0 takes ``path``'s lock and checks
that ``path`` may be replaced; every rank makes the temporary directory, puts the marker in
it and creates its *slot*, an empty file ``slot-<rank>``. A save that cannot start (a full
disk, a second job on the same path) fails here with CheckpointError on every rank, and
what it made is removed.

Writing (on a background thread for ``async_save``; no collective from here on). Each
rank writes its shard and its ``done-<rank>`` note. A rank that fails renames its slot to
``failed-<rank>-<why>`` (``why``: ENOSPC, EIO, ...): a rename needs no free space, so a
full disk cannot stop the news, and the name alone carries the reason. Every rank watches
for such a note (between its pieces, and while it waits for the commit or the markers),
then stops, renaming its slot to ``stopped-<rank>``. A rank touches the directory no more
once its slot is renamed, so rank 0, having renamed its own, waits until no slot is left
and then removes the whole temporary directory and releases the lock: the failed save
leaves nothing, the previous checkpoint is untouched and the next save starts clean. Every
rank raises CheckpointError (``wait()`` or the next save raises it for ``async_save``).

Commit (rank 0, once every ``done-<rank>`` is there): the index (sealed) into the
temporary directory, with ``keep=`` the run's record, then the renames of
:func:`~.files.commit`. What follows the commit (``latest``, pruning, leftovers of crashed
saves) cannot undo it: a failure there is a warning, and :func:`~.files.latest` still
finds the new checkpoint from the run's record.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuelspmd.errors import CheckpointError

from . import files
from .files import INDEX, MARKER, Hook, Lock, fsync_dir, shard_name, write_json
from .index import piece_name, seal
from .state import Held

__all__ = ["Save", "SaveHandle"]

_NOTE = re.compile(r"failed-(\d+)-(\w+)")


class _Stopped(CheckpointError):
    """Another rank's failure, seen by this one: it stops."""


@dataclass
class Save:
    """What one rank needs to write its part of a save."""

    path: Path
    nonce: str
    created: int
    rank: int
    size: int
    keep: int | None
    deadline: float
    hook: Hook
    held: Held | None = None
    writes: set[Any] = field(default_factory=set)
    index: dict[str, Any] = field(default_factory=dict)
    lock: Lock | None = None

    @property
    def tmp(self) -> Path:
        return self.path.with_name(f"{self.path.name}.tmp-{self.nonce}")

    @property
    def slot(self) -> Path:
        return self.tmp / f"slot-{self.rank}"

    # ---- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        """This rank's part of the setup (see the module docstring)."""
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            files.check_target(self.path)
            self.lock = Lock(self.path, self.nonce)
            self.lock.acquire()
        self.tmp.mkdir(parents=True, exist_ok=True)
        files.write_marker(self.tmp, self.path.name, self.nonce, self.created, self.rank)
        self.slot.touch()

    def undo_setup(self, barrier: Callable[[], None]) -> None:
        """After a failed setup: every rank's slot, then (rank 0) the directory and lock."""
        self.slot.unlink(missing_ok=True)
        barrier()
        if self.rank == 0:
            self._clear()

    def _clear(self) -> None:
        if files.ours(self.tmp, self.path.name):
            files.remove(self.tmp)
        else:
            try:
                self.tmp.rmdir()
            except OSError:
                pass
        if self.lock is not None:
            self.lock.release()

    # ---- writing -------------------------------------------------------------------------
    def failures(self) -> None:
        """Raise _Stopped if a rank left a ``failed-<rank>-<why>`` note."""
        for p in sorted(files.listing(self.tmp)):
            m = _NOTE.fullmatch(p.name)
            if m:
                try:
                    text = p.read_text()[:500]
                except OSError:
                    text = ""
                raise _Stopped(f"checkpoint.save: rank {m[1]} failed to write ({text or m[2]}"
                               "); the save is abandoned "
                               f"and removed, the previous checkpoint at {self.path} is "
                               "intact")

    def run(self) -> None:
        """This rank's writing and, on rank 0, the commit; raises CheckpointError."""
        committed = False
        try:
            self._write()
            if self.rank != 0:
                files.wait_for(f"the commit of {self.path}", self._committed, self.deadline)
                return
            files.wait_for("every rank's shard", self._markers, self.deadline)
            self.hook("markers seen")
            self._index()
            if self.keep is not None:
                files.record(self.path, self.hook)
            for r in range(self.size):
                (self.tmp / f"done-{r}").unlink()
            files.commit(self.tmp, self.path, self.nonce, self.hook)
            committed = True
        except BaseException as e:
            if committed or self._committed_here():
                warnings.warn(f"checkpoint.save: {self.path} is committed, then: {e}",
                              stacklevel=2)
            else:
                raise self._fail(e) from e
        finally:
            if self.rank == 0 and (committed or self._committed_here()):
                self._after_commit()

    def _write(self) -> None:
        assert self.held is not None and self.held.arrays is not None
        mine = [(e.key, e.box, arr, e.dtype) for e, arr in zip(self.held.entries,
                                                               self.held.arrays)
                if (e.key, e.box) in self.writes]
        fname = shard_name(self.rank, self.size)
        done: dict[str, Any] = {"file": None, "pieces": []}
        if mine:
            recs, head = files.write_shard(self.tmp / fname, mine, self.hook, self.failures)
            done = {"file": fname, "bytes": (self.tmp / fname).stat().st_size,
                    "header_crc32": head,
                    "pieces": [[k, [list(b) for b in box], piece_name(k, box),
                                *recs[piece_name(k, box)]] for k, box, _, _ in mine]}
            fsync_dir(self.tmp)
            self.hook("dir fsynced")
        self.failures()
        # Once its note is in, a rank touches ``tmp`` no more but for its slot: rank 0 may
        # see the note and commit (rename ``tmp``) at once. The note's own entry needs no
        # fsync: the shard's is durable (above), and the commit record is rank 0's index.
        write_json(self.tmp / f"done-{self.rank}", done, self.hook, "marker",
                   sync_dir=self.rank == 0)

    def _committed(self) -> bool:
        self.failures()
        return self._committed_here()

    def _committed_here(self) -> bool:
        """Whether ``path`` is this save, committed: its index is there, and its marker
        has this save's nonce."""
        try:
            with open(self.path / MARKER) as f:
                ok = json.load(f).get("nonce") == self.nonce
        except (OSError, ValueError, AttributeError):
            return False
        return ok and (self.path / INDEX).is_file()

    def _markers(self) -> bool:
        self.failures()
        return all((self.tmp / f"done-{r}").exists() for r in range(self.size))

    def _index(self) -> None:
        index = self.index
        for r in range(self.size):
            with open(self.tmp / f"done-{r}") as f:
                d = json.load(f)
            if d["file"] is not None:
                index["files"][d["file"]] = {"bytes": d["bytes"],
                                             "header_crc32": d["header_crc32"]}
            for key, box, name, offsets, crc in d["pieces"]:
                index["tensors"][key]["pieces"].append(
                    {"box": box, "file": d["file"], "name": name, "offsets": offsets,
                     "crc32": crc})
        write_json(self.tmp / INDEX, seal(index), self.hook, "index")

    # ---- failure and after the commit -----------------------------------------------------
    def _fail(self, e: BaseException) -> CheckpointError:
        """This rank's end of a failed save (see the module docstring); the error to raise."""
        if isinstance(e, _Stopped):
            note, err = f"stopped-{self.rank}", CheckpointError(str(e))
        else:
            note = f"failed-{self.rank}-{files.errno_name(e)}"
            err = CheckpointError(
                f"checkpoint.save: rank {self.rank} could not write its part of {self.path} "
                f"({type(e).__name__}: {e}); the save is abandoned and removed, the previous "
                "checkpoint is intact" + ("; free some space and save again"
                                          if files.errno_name(e) == "ENOSPC" else ""))
        for name in (shard_name(self.rank, self.size), f"done-{self.rank}.tmp"):
            try:
                (self.tmp / name).unlink(missing_ok=True)
            except OSError:
                pass
        try:  # the reason into the slot first (a full disk may refuse it: the name says why)
            self.slot.write_text(f"{type(e).__name__}: {e}"[:500])
        except OSError:
            pass
        try:
            os.replace(self.slot, self.tmp / note)
        except OSError:
            pass
        if self.rank == 0:
            try:
                files.wait_for("every rank's stop", self._slots_gone, self.deadline)
            except CheckpointError:
                pass
            self._clear()
        return err

    def _slots_gone(self) -> bool:
        return not any(p.name.startswith("slot-") for p in files.listing(self.tmp))

    def _after_commit(self) -> None:
        """Rank 0 after the commit: the slots out of the checkpoint, ``latest`` and
        pruning with keep=, the leftovers of crashed saves, the lock released."""
        try:
            for r in range(self.size):
                (self.path / f"slot-{r}").unlink(missing_ok=True)
            if self.keep is not None:
                files.prune(self.path, self.keep, self.hook)
            files.tidy(self.path.parent, self.path, self.hook)
            self.hook("committed")
        except OSError as e:
            warnings.warn(f"checkpoint.save: {self.path} is committed, but tidying after it "
                          f"failed ({e}); the next save tidies again", stacklevel=3)
        finally:
            if self.lock is not None:
                self.lock.release()


class SaveHandle:
    """A save in progress: its files are being written by a background thread from host
    copies; :meth:`wait` returns once the checkpoint is committed (or raises its error, a
    CheckpointError on every rank)."""

    def __init__(self, save: Save) -> None:
        self.save = save
        self.path = save.path
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.on_wait: Callable[[SaveHandle], None] = lambda _: None

    def _run(self) -> None:
        try:
            self.save.run()
        except BaseException as e:  # re-raised on the caller's thread by wait()
            self.error = e

    def start(self, background: bool) -> None:
        if background:
            self._thread = threading.Thread(target=self._run, name="fuelspmd-checkpoint")
            self._thread.start()
        else:
            self._run()

    def done(self) -> bool:
        """Whether this rank's part has finished (committed, or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Wait until the checkpoint is committed; raise the save's error if it failed."""
        try:
            if self._thread is not None:
                self._thread.join(max(0.0, self.save.deadline - time.monotonic()) + 5.0)
                if self._thread.is_alive():
                    raise CheckpointError(f"checkpoint.save: the writing of {self.path} did "
                                          "not end before the deadline (a disk stalled)")
            if self.error is not None:
                raise self.error
        finally:
            self.on_wait(self)
