"""``save``, ``async_save``, ``load``: the protocol the package docstring proves safe."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fuelspmd.comm import Communicator
from fuelspmd.errors import (
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    ConfigError,
)

from . import files
from .files import Hook
from .index import FORMAT, VERSION
from .layout import Entry, plan
from .outcome import agree, gather_json
from .saving import Save, SaveHandle
from .shards import Shards
from .state import Loading, collect, group_of

__all__ = ["SaveHandle", "async_save", "latest", "load", "save"]

# per thread (a DeviceGroup runs one per device): the saves it started, not waited for yet
_local = threading.local()
_TIMEOUT = 600.0  # seconds a lone process waits for its own files (no communicator)


def _none(_: str) -> None:
    return None


def _agree_values(rows: list[dict[str, Any]]) -> None:
    """Plain values must be equal on every rank (the index holds one copy)."""
    bad = sorted({k for row in rows for k in {*row, *rows[0]}
                  if json.dumps(row.get(k)) != json.dumps(rows[0].get(k))})
    if bad:
        raise CheckpointMismatchError(
            f"checkpoint.save: the ranks give different plain values for {bad} (rank 0: "
            f"{[rows[0].get(k) for k in bad][:3]}); save one value for all ranks, or one key "
            "per rank (e.g. f'rng.{rank}')")


def _pending() -> list[SaveHandle]:
    if not hasattr(_local, "saves"):
        _local.saves = []
    return _local.saves  # type: ignore[no-any-return]


def _forget(handle: SaveHandle) -> None:
    if handle in _pending():
        _pending().remove(handle)


def wait_pending() -> None:
    """Wait for every save this thread started (the next save, or a load, does first)."""
    while _pending():
        _pending()[0].wait()


def async_save(path: str | os.PathLike[str], state: Mapping[str, Any], *, mesh: Any = None,
               comm: Communicator | None = None, keep: int | None = None,
               _hook: Hook | None = None) -> SaveHandle:
    """Start saving ``state`` to ``path`` and return once its values are copied to host
    memory; the files are written by a background thread. Collective (on the calling
    thread): the ranks agree on the layout and set the save up before returning; a
    failure of the writing is raised by ``wait()`` or the next save. See :func:`save`."""
    return _save(Path(path), state, mesh, comm, keep, _hook or _none, background=True)


def save(path: str | os.PathLike[str], state: Mapping[str, Any], *, mesh: Any = None,
         comm: Communicator | None = None, keep: int | None = None,
         _hook: Hook | None = None) -> None:
    """Save ``state`` (names -> Modules, optimisers, JSON values) to directory ``path``,
    atomically; collective over ``mesh`` (or ``comm``, or the one communicator the state
    is sharded over). Each rank writes only the blocks no lower rank holds. ``keep=K``:
    ``path``'s parent is a run directory whose ``latest`` then names ``path`` and which
    keeps the K newest of the checkpoints saved there with ``keep=``. A failure (a full
    disk, an I/O error, another job saving to ``path``) raises CheckpointError on every
    rank and leaves the previous checkpoint as it was. ``_hook(point)`` is called at each
    step (for tests)."""
    _save(Path(path), state, mesh, comm, keep, _hook or _none, background=False).wait()


def _save(path: Path, state: Mapping[str, Any], mesh: Any, comm: Communicator | None,
          keep: int | None, hook: Hook, *, background: bool) -> SaveHandle:
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ConfigError(f"checkpoint.save(keep={keep!r}): give an int >= 1, or None to "
                          "keep every checkpoint")
    wait_pending()
    group = group_of(state, mesh, comm)
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    hook("start")
    held = collect(state)
    mine = {"entries": [e.as_json() for e in held.entries], "values": held.values,
            "nonce": secrets.token_hex(6), "created": time.time_ns()}
    rows = gather_json(group, mine)
    hook("agreed")
    the_plan = plan([[Entry.from_json(r) for r in row["entries"]] for row in rows])
    _agree_values([row["values"] for row in rows])
    held.copy()
    hook("copied")
    job = Save(path, rows[0]["nonce"], rows[0]["created"], rank, size, keep,
               time.monotonic() + (group.timeout if group is not None else _TIMEOUT), hook,
               held, the_plan.writes(rank))
    error: BaseException | None = None
    try:
        job.setup()
    except Exception as e:  # agreed below: a save that cannot start fails on every rank
        error = e if isinstance(e, CheckpointError) else CheckpointError(
            f"checkpoint.save: rank {rank} could not set up {job.tmp} ({type(e).__name__}: "
            f"{e}); nothing was written, the previous checkpoint is intact")
    try:
        agree(group, error, "checkpoint.save")
    except BaseException:
        job.undo_setup(lambda: gather_json(group, None) and None)
        raise
    hook("tmp made")
    job.index = {"format": FORMAT, "version": VERSION, "nonce": job.nonce,
                 "name": path.name, "created": job.created, "world": size,
                 "mesh": dict(mesh.shape) if mesh is not None else None,
                 "values": held.values, "steps": held.steps,
                 "tensors": {k: {"shape": list(s), "dtype": d, "pieces": []}
                             for k, (s, d) in the_plan.tensors.items()}, "files": {}}
    handle = SaveHandle(job)
    handle.on_wait = _forget
    _pending().append(handle)
    handle.start(background)
    return handle


def load(path: str | os.PathLike[str] | None, state: Mapping[str, Any], *,
         mesh: Any = None, comm: Communicator | None = None) -> dict[str, Any]:
    """Fill the Modules and optimisers of ``state`` from the checkpoint at ``path`` in
    whatever layout they have now; return the saved plain values. All or nothing: every
    rank first reads and checks everything it will assign (the index against its schema
    and checksum, names, full shapes, dtypes, every byte's checksum), then the ranks of
    ``mesh`` (or ``comm``, or the group :func:`save` would take) compare outcomes in one
    exchange, and only then is anything assigned; any failure raises the same
    CheckpointError on every rank, naming the rank that found it, and leaves every rank's
    model and optimiser as they were. A path whose save never committed raises
    CheckpointIncompleteError; after a crash during a replacement the previous checkpoint
    there is found."""
    wait_pending()
    group = group_of(state, mesh, comm)
    error: BaseException | None = None
    values: dict[str, Any] = {}
    loading = Loading()
    try:
        if path is None:
            raise CheckpointIncompleteError(
                "checkpoint.load(None): no checkpoint to load (checkpoint.latest(run_dir) is "
                "None when the run directory holds none): start from scratch then")
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"checkpoint.load: path is a {type(path).__name__}; give a "
                              "str or a pathlib.Path")
        where = files.find(Path(path))
        shards = Shards(where, files.read_index(where))
        try:
            loading.prepare(shards, state)
        finally:
            shards.close()
        values = json.loads(json.dumps(shards.index["values"]))
    except Exception as e:  # agreed below: every rank raises the same, nothing assigned
        error = e
    try:
        agree(group, error, "checkpoint.load")
    except BaseException:
        loading.rollback()
        raise
    loading.apply()
    return values


def latest(run: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in run directory ``run`` (None if there is none)."""
    return files.latest(Path(run))
