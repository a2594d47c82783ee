"""``save``, ``async_save``, ``load``: the protocol the package docstring proves safe."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fuelspmd import errors
from fuelspmd.comm import Communicator
from fuelspmd.errors import CheckpointError, CheckpointMismatchError, ConfigError
from fuelspmd.tensor import tensor

from . import files
from .files import INDEX, Hook, Shards, fsync_dir, shard_name, write_json
from .layout import Entry, plan
from .state import Held, collect, group_of, restore

__all__ = ["SaveHandle", "async_save", "latest", "load", "save"]

# per thread (a DeviceGroup runs one per device): the saves it started, not waited for yet
_local = threading.local()
_TIMEOUT = 600.0  # seconds a lone process waits for its own files (no communicator)


def _none(_: str) -> None:
    return None


def gather_json(comm: Communicator | None, value: Any) -> list[Any]:
    """Every rank's JSON ``value``, in rank order (two all_gathers: lengths, then bytes)."""
    data = json.dumps(value).encode()
    if comm is None or comm.size == 1:
        return [value]
    n = comm.all_gather(tensor(np.array([len(data)], np.int64), device=comm.device), 0)
    lengths = [int(x) for x in n.numpy()]
    width = -(-max(lengths) // 8)
    buf = np.zeros(width * 8, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    every = comm.all_gather(tensor(buf.view(np.int64), device=comm.device), 0).numpy()
    rows = every.reshape(comm.size, width).view(np.uint8)
    return [json.loads(bytes(rows[r, :lengths[r]])) for r in range(comm.size)]


def _agree_values(rows: list[dict[str, Any]]) -> None:
    """Plain values must be equal on every rank (the index holds one copy)."""
    bad = sorted({k for row in rows for k in {*row, *rows[0]}
                  if json.dumps(row.get(k)) != json.dumps(rows[0].get(k))})
    if bad:
        raise CheckpointMismatchError(
            f"checkpoint.save: the ranks give different plain values for {bad} (rank 0: "
            f"{[rows[0].get(k) for k in bad][:3]}); save one value for all ranks, or one key "
            "per rank (e.g. f'rng.{rank}')")


class SaveHandle:
    """A save in progress: its files are being written by a background thread from host
    copies; :meth:`wait` returns once the checkpoint is committed (or raises its error).

    A rank whose writing fails leaves ``failed-<rank>`` in the temporary directory, so the
    others stop waiting for it (rank 0 for its marker, the rest for the commit) at once
    rather than at the deadline."""

    def __init__(self, path: Path, tmp: Path, rank: int, nonce: str, deadline: float
                 ) -> None:
        self.path, self.tmp, self.rank, self.nonce = path, tmp, rank, nonce
        self.deadline = deadline
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._done = False

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # re-raised on the caller's thread by wait()
            self.error = e
            if self.tmp.is_dir():
                (self.tmp / f"failed-{self.rank}").write_text(f"{type(e).__name__}: {e}")

    def start(self, work: Callable[[], None], background: bool) -> None:
        if background:
            self._thread = threading.Thread(target=self._run, args=(work,),
                                            name="fuelspmd-checkpoint")
            self._thread.start()
        else:
            self._run(work)

    def done(self) -> bool:
        """Whether this rank's writing has finished (not yet whether it is committed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Wait until the checkpoint is committed; raise the save's error if it failed."""
        try:
            if self._thread is not None:
                self._thread.join(max(0.0, self.deadline - time.monotonic()))
            if self.error is not None:
                raise self.error
            if not self._done:
                files.wait_for(f"the commit of {self.path}", self._committed, self.deadline)
                self._done = True
        finally:
            if self in _pending():
                _pending().remove(self)

    def _committed(self) -> bool:
        failed(self.tmp)
        try:
            with open(self.path / INDEX) as f:
                return json.load(f).get("nonce") == self.nonce  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return False


def failed(tmp: Path) -> None:
    """Raise CheckpointError if a rank left a ``failed-<rank>`` note in ``tmp``."""
    for note in sorted(p for p in files.listing(tmp) if p.name.startswith("failed-")):
        raise CheckpointError(f"checkpoint.save: rank {note.name[7:]} failed to write its "
                              f"shard ({note.read_text()}); the previous checkpoint is intact")


def _pending() -> list[SaveHandle]:
    if not hasattr(_local, "saves"):
        _local.saves = []
    return _local.saves  # type: ignore[no-any-return]


def wait_pending() -> None:
    """Wait for every save this thread started (the next save, or a load, does first)."""
    while _pending():
        _pending()[0].wait()


def async_save(path: str | os.PathLike[str], state: Mapping[str, Any], *, mesh: Any = None,
               comm: Communicator | None = None, keep: int | None = None,
               _hook: Hook | None = None) -> SaveHandle:
    """Start saving ``state`` to ``path`` and return once its values are copied to host
    memory; the files are written by a background thread. Collective (on the calling
    thread): the ranks agree on the layout before returning. See :func:`save`."""
    return _save(Path(path), state, mesh, comm, keep, _hook or _none, background=True)


def save(path: str | os.PathLike[str], state: Mapping[str, Any], *, mesh: Any = None,
         comm: Communicator | None = None, keep: int | None = None,
         _hook: Hook | None = None) -> None:
    """Save ``state`` (names -> Modules, optimisers, JSON values) to directory ``path``,
    atomically; collective over ``mesh`` (or ``comm``, or the one communicator the state
    is sharded over). Each rank writes only the blocks no lower rank holds. ``keep=K``:
    ``path``'s parent is a run directory whose ``latest`` then names ``path`` and which
    keeps the K newest checkpoints. ``_hook(point)`` is called at each step (for tests)."""
    _save(Path(path), state, mesh, comm, keep, _hook or _none, background=False).wait()


def _save(path: Path, state: Mapping[str, Any], mesh: Any, comm: Communicator | None,
          keep: int | None, hook: Hook, *, background: bool) -> SaveHandle:
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"checkpoint.save(keep={keep!r}): give an int >= 1, or None to "
                          "keep every checkpoint")
    wait_pending()
    files.check_target(path)
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
    nonce, created = rows[0]["nonce"], rows[0]["created"]
    held.copy()
    hook("copied")
    deadline = time.monotonic() + (group.timeout if group is not None else _TIMEOUT)
    handle = SaveHandle(path, path.with_name(f"{path.name}.tmp-{nonce}"), rank, nonce,
                        deadline)
    index = {"format": files.FORMAT, "version": files.VERSION, "nonce": nonce,
             "name": path.name, "created": created, "world": size,
             "mesh": dict(mesh.shape) if mesh is not None else None,
             "values": held.values, "steps": held.steps,
             "tensors": {k: {"shape": list(s), "dtype": d, "pieces": []}
                         for k, (s, d) in the_plan.tensors.items()}, "files": {}}

    def work() -> None:
        _write(path, nonce, rank, size, held, the_plan.writes(rank), index, keep, hook,
               deadline)

    _pending().append(handle)
    handle.start(work, background)
    return handle


def _write(path: Path, nonce: str, rank: int, size: int, held: Held, writes: set[Any],
           index: dict[str, Any], keep: int | None, hook: Hook, deadline: float) -> None:
    """One rank's part: its shard and its marker; rank 0 then writes the index and
    commits once every rank's marker is there."""
    tmp = path.with_name(f"{path.name}.tmp-{nonce}")
    tmp.mkdir(parents=True, exist_ok=True)
    hook("tmp made")
    assert held.arrays is not None
    mine = [(f"{e.key}@{','.join(f'{a}:{b}' for a, b in e.box)}", arr, e.dtype, e)
            for e, arr in zip(held.entries, held.arrays) if (e.key, e.box) in writes]
    fname = shard_name(rank, size)
    done: dict[str, Any] = {"file": None, "bytes": 0, "pieces": []}
    if mine:
        recs = files.write_shard(tmp / fname, [(n, a, d) for n, a, d, _ in mine], hook)
        done = {"file": fname, "bytes": (tmp / fname).stat().st_size,
                "pieces": [[e.key, [list(b) for b in e.box], n, recs[n]["offsets"],
                            recs[n]["crc32"]] for n, _, _, e in mine]}
        fsync_dir(tmp)
        hook("dir fsynced")
    # Once its marker is in, a rank touches ``tmp`` no more: rank 0 may see the marker and
    # commit (rename ``tmp``) at once. The marker's own entry needs no fsync: the shard's is
    # durable (above), and the commit record is rank 0's index.
    write_json(tmp / f"done-{rank}", done, hook, "marker", sync_dir=rank == 0)
    if rank != 0:
        return
    markers = [tmp / f"done-{r}" for r in range(size)]

    def ready() -> bool:
        failed(tmp)
        return all(m.exists() for m in markers)

    files.wait_for("every rank's shard", ready, deadline)
    hook("markers seen")
    for m in markers:
        with open(m) as f:
            d = json.load(f)
        if d["file"] is not None:
            index["files"][d["file"]] = d["bytes"]
        for key, box, name, offsets, crc in d["pieces"]:
            index["tensors"][key]["pieces"].append(
                {"box": box, "file": d["file"], "name": name, "offsets": offsets,
                 "crc32": crc})
    write_json(tmp / INDEX, index, hook, "index")
    for m in markers:
        m.unlink()
    files.commit(tmp, path, nonce, hook)
    if keep is not None:
        files.prune(path, keep, hook)
    hook("committed")


def load(path: str | os.PathLike[str], state: Mapping[str, Any], *, mesh: Any = None,
         comm: Communicator | None = None) -> dict[str, Any]:
    """Fill the Modules and optimisers of ``state`` from the checkpoint at ``path`` in
    whatever layout they have now; return the saved plain values. Each rank reads only
    the byte ranges of the blocks it holds and checks their checksums; then the ranks of
    ``mesh`` (or ``comm``, or the group :func:`save` would take) compare outcomes in one
    exchange, so a missing file or a damaged piece that one rank read raises the same
    :class:`CheckpointError` on every rank, naming that rank. A path whose save never
    committed raises CheckpointIncompleteError; after a crash during a replacement the
    previous checkpoint there is found."""
    wait_pending()
    group = group_of(state, mesh, comm)
    error: CheckpointError | None = None
    values: dict[str, Any] = {}
    try:
        where = files.find(Path(path))
        shards = Shards(where, files.read_index(where))
        try:
            restore(shards, state)
        finally:
            shards.close()
        values = dict(shards.index["values"])
    except CheckpointError as e:
        error = e
    outcomes = gather_json(group, None if error is None else [type(error).__name__, str(error)])
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if failed:
        if error is not None and len(failed) == 1:
            raise error
        r, (kind, text) = failed[0]
        cls = getattr(errors, kind, CheckpointError)
        raise (cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else
               CheckpointError)(f"checkpoint.load failed on rank(s) "
                                f"{[q for q, _ in failed]}; rank {r}: {text}")
    return values


def latest(run: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in run directory ``run`` (None if there is none)."""
    return files.latest(Path(run))
