"""A checkpoint directory is untrusted (DESIGN.md invariant 11), each finding of issue 40 in
turn: a save removes only what it made; a failed load leaves every rank's model and
optimiser as they were and raises the same typed error on each; the index, every header
and every byte read are checked (swapped offsets, an edited dtype, offsets past the file,
names out of the folder, a schema broken by hand, negative steps); two jobs saving to one
path; ``latest`` of an empty run and ``load(None)``. Ranks are devices of a DeviceGroup
(the same protocol as processes, in one process); tests/mpi/test_checkpoint.py runs the
all-or-nothing load under mpiexec."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_damage as dmg
import checkpoint_programs as cp

import fuelspmd as fs
from fuelspmd import checkpoint, nn, optim
from fuelspmd.comm import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    FuelError,
)
from fuelspmd.transport import SelfTransport

pytestmark = pytest.mark.timeout(60)
SHARD0, SHARD1 = "shard-00000-of-00001.safetensors", "shard-00001-of-00002.safetensors"


def _comm() -> Communicator:
    return Communicator(SelfTransport(), device="cpu:0")


def _saved(tmp_path: Path) -> Path:
    cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False)
    return tmp_path / "ck"


def _outcome(comm: Any, path: Path, tp: int, before: int = 7) -> str:
    """Load ``path`` into a model holding version ``before``: "loaded v<N>", or the error
    and whether the model and optimiser still hold ``before`` ("untouched")."""
    mesh, net, opt = cp.build(comm, tp)
    cp.fill(net, opt, before)
    try:
        values = checkpoint.load(path, {"model": net, "optim": opt}, mesh=mesh)
    except FuelError as e:
        try:
            cp.check(net, opt, before)
            kept = "untouched"
        except AssertionError:
            kept = "CHANGED"
        return f"{type(e).__name__} {kept}: {e}"
    cp.check(net, opt, values["version"])
    return f"loaded v{values['version']}"


# ---- a save removes only what it made ---------------------------------------------------
def test_a_save_keeps_what_it_did_not_write_beside_it(tmp_path: Path) -> None:
    backup = tmp_path / "ck.old-backup"
    backup.mkdir()
    (backup / "README").write_text("my notes")
    (tmp_path / "ck.tmp-mine").mkdir()
    (tmp_path / "ck.tmp-mine" / "shard-00000-of-00001.safetensors").write_text("mine")
    for version in (1, 2):
        cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False, version)
    assert (backup / "README").read_text() == "my notes"
    assert (tmp_path / "ck.tmp-mine" / SHARD0).read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.old-backup", "ck.tmp-mine"]
    assert cp.load_state(_comm(), str(tmp_path / "ck"), 1) == (2, 84)


def test_keep_prunes_only_the_runs_own_checkpoints(tmp_path: Path) -> None:
    cp.save_state(_comm(), str(tmp_path / "best-model"), 1, 1, False, 5)  # saved by hand
    (tmp_path / "notes").mkdir()
    for step in range(4):
        cp.save_state(_comm(), str(tmp_path / f"step-{step}"), 1, 1, False, step + 1, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-model", "latest", "notes",
                                                          "step-2", "step-3"]
    assert cp.load_state(_comm(), str(tmp_path / "best-model"), 1) == (5, 84)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-3"


def test_a_crashed_saves_leftovers_are_cleared_and_foreign_files_kept(tmp_path: Path) -> None:
    """A save killed before its commit leaves its temporary directory: the next save
    clears it, its marker proving it ours, but not a look-alike without one."""
    cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False, 1)
    shutil.copytree(tmp_path / "ck", tmp_path / "ck.tmp-abcdef012345")  # as a kill leaves it
    (tmp_path / "ck.tmp-0123456789ab").mkdir()  # named like ours, no marker: not ours
    (tmp_path / "ck.tmp-0123456789ab" / "mine.txt").write_text("x")
    cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.tmp-0123456789ab"]
    assert cp.load_state(_comm(), str(tmp_path / "ck"), 1) == (2, 84)


def test_what_a_killed_save_or_prune_left_is_finished_and_the_last_copy_kept(
        tmp_path: Path) -> None:
    """A prune killed after a checkpoint's index went leaves a directory of ours without
    one: the next keep= save finishes it. A replacement killed between its renames leaves
    only ``<name>.old-*``: a save to another name keeps it (it is the copy a load of
    ``name`` finds) until ``name`` is committed again."""
    for step in range(3):
        cp.save_state(_comm(), str(tmp_path / f"step-{step}"), 1, 1, False, step + 1, keep=3)
    (tmp_path / "step-0" / "index.json").unlink()  # as a kill in the middle of a prune
    (tmp_path / "step-1").rename(tmp_path / "step-1.old-0123456789ab")  # between renames
    cp.save_state(_comm(), str(tmp_path / "step-3"), 1, 1, False, 4, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-1.old-0123456789ab", "step-2", "step-3"]
    shutil.rmtree(tmp_path / "step-2")  # a kill after the marker went: an empty directory
    (tmp_path / "step-2").mkdir()
    cp.save_state(_comm(), str(tmp_path / "step-4"), 1, 1, False, 5, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-1.old-0123456789ab", "step-3", "step-4"]
    assert cp.load_state(_comm(), str(tmp_path / "step-1"), 1) == (2, 84)
    cp.save_state(_comm(), str(tmp_path / "step-1"), 1, 1, False, 6, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1", "step-3",
                                                          "step-4"]


# ---- a failed load is all or nothing -----------------------------------------------------
def test_a_failed_load_leaves_every_rank_untouched_with_one_error(tmp_path: Path) -> None:
    """A piece only rank 1 reads is damaged: before, rank 0 had its model replaced and
    rank 1 part of it; now both raise the same CheckpointCorruptError, nothing assigned."""
    path = tmp_path / "ck"
    DeviceGroup.cpu(2).run(lambda c: cp.save_state(c, str(path), 2, 1, False, 1))
    dmg.flip(path / SHARD1, -1)
    got = DeviceGroup.cpu(2).run(lambda c: _outcome(c, path, 2))
    assert got[0] == got[1], got
    assert got[0].startswith("CheckpointCorruptError untouched: checkpoint.load failed on "
                             "rank(s) [1]"), got[0]
    assert "CRC-32" in got[0]
    assert _outcome(_comm(), path, 1).startswith("CheckpointCorruptError untouched")


def test_a_mismatched_optimiser_leaves_the_model_untouched(tmp_path: Path) -> None:
    """The optimiser refuses the saved state (SGD's into AdamW): the parameters, read
    and checked before, are not assigned either."""
    lin = nn.Linear(3, 4, seed=0)
    sgd = optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    sgd.step([fs.ones(p.shape) for p in sgd.params])
    checkpoint.save(tmp_path / "ck", {"lin": lin, "opt": sgd})
    other = nn.Linear(3, 4, seed=1)
    before = other.weight.numpy().copy()
    with pytest.raises(CheckpointError):
        checkpoint.load(tmp_path / "ck", {"lin": other,
                                          "opt": optim.AdamW(other.parameters(), lr=0.1)})
    assert np.array_equal(other.weight.numpy(), before)


# ---- what is trusted is checked ----------------------------------------------------------
def test_swapped_header_offsets_are_found(tmp_path: Path) -> None:
    """Before: the CRC covered the index's byte range but values were read at the header's
    offsets, so two swapped tensors loaded (exchanged)."""
    path = _saved(tmp_path)
    _, header = dmg.read_header(path / SHARD0)
    same = [n for n in header if n.startswith("model/blocks.0.fc1.weight")
            or n.startswith("model/blocks.1.fc1.weight")]
    dmg.swap_offsets(path / SHARD0, *same[:2])
    assert _outcome(_comm(), path, 1).startswith("CheckpointCorruptError untouched")


@pytest.mark.parametrize("sealed", [False, True])
def test_an_edited_dtype_is_refused(tmp_path: Path, sealed: bool) -> None:
    """Before: an index dtype of int32 over float32 bytes loaded them reinterpreted."""
    path = _saved(tmp_path)

    def to_int(index: dict[str, Any]) -> None:
        index["tensors"]["model/inp.weight"]["dtype"] = "int32"

    dmg.edit_index(path, to_int, sealed=sealed)
    got = _outcome(_comm(), path, 1)
    assert got.startswith(("CheckpointCorruptError untouched", "CheckpointMismatchError "
                           "untouched")), got


@pytest.mark.timeout(30)
def test_offsets_past_the_file_are_refused_before_any_loop(tmp_path: Path) -> None:
    """Before: offsets [lo, 10**18] made the checksum loop run for hours."""
    path = _saved(tmp_path)

    def huge(index: dict[str, Any]) -> None:
        index["tensors"]["model/inp.weight"]["pieces"][0]["offsets"][1] = 10 ** 18

    dmg.edit_index(path, huge)
    started = time.monotonic()
    assert _outcome(_comm(), path, 1).startswith("CheckpointCorruptError untouched")
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/shadow", "..", ""])
def test_a_shard_name_out_of_the_folder_is_never_opened(tmp_path: Path, name: str) -> None:
    path = _saved(tmp_path)

    def move(index: dict[str, Any]) -> None:
        index["files"] = dict.fromkeys([name], *index["files"].values())
        for t in index["tensors"].values():
            for p in t["pieces"]:
                p["file"] = name

    dmg.edit_index(path, move)
    got = _outcome(_comm(), path, 1)
    assert got.startswith("CheckpointCorruptError untouched"), got
    assert "of a shard name" in got, got  # refused by its name, never opened
    if Path(name).is_file():  # its size (what the old message showed) is never read
        assert f"{Path(name).stat().st_size} bytes" not in got


def test_a_shard_linked_out_of_the_folder_is_never_read(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    (path / SHARD0).rename(outside)
    (path / SHARD0).symlink_to(outside)
    got = _outcome(_comm(), path, 1)
    assert got.startswith("CheckpointCorruptError untouched") and "link out" in got, got


@pytest.mark.parametrize("edit", [
    lambda ix: ix.pop("tensors"),
    lambda ix: ix.__setitem__("files", []),
    lambda ix: ix["tensors"]["model/inp.weight"]["pieces"][0].pop("box"),
    lambda ix: ix["tensors"]["model/inp.weight"].__setitem__("shape", "4x8"),
    lambda ix: ix["tensors"]["model/inp.weight"]["pieces"].append(
        ix["tensors"]["model/inp.weight"]["pieces"][0]),
    lambda ix: ix["steps"].__setitem__("optim", -3),
    lambda ix: ix.__setitem__("values", None),
    lambda ix: ix["tensors"]["model/inp.weight"].__setitem__("dtype", []),
], ids=["no-tensors", "files-list", "no-box", "shape-str", "piece-twice", "steps-3",
        "values-null", "dtype-list"])
@pytest.mark.parametrize("sealed", [False, True])
def test_an_index_edited_by_hand_is_refused_with_a_typed_error(tmp_path: Path, edit: Any,
                                                                sealed: bool) -> None:
    """Before: KeyError, AttributeError, TypeError; steps = -3 loaded and failed at the
    next step with 'math domain error'."""
    path = _saved(tmp_path)
    dmg.edit_index(path, edit, sealed=sealed)
    got = _outcome(_comm(), path, 1)
    assert got.startswith("CheckpointCorruptError untouched"), got


# ---- two jobs, and nothing to load ----------------------------------------------------------
def test_a_second_job_saving_to_the_same_path_fails_at_once_on_every_rank(
        tmp_path: Path) -> None:
    """Job A is held between its shards and its commit; job B saves to the same path: B
    raises CheckpointError on both ranks within seconds, A commits."""
    path = str(tmp_path / "ck")
    held, go = threading.Event(), threading.Event()

    def hold(point: str) -> None:
        if point == "markers seen":
            held.set()
            go.wait(30)

    def job_a(c: Communicator) -> None:
        cp.save_state(c, path, 2, 1, False, 1, _hook=hold if c.rank == 0 else None)

    def job_b(c: Communicator) -> str:
        try:
            cp.save_state(c, path, 2, 1, False, 2)
        except FuelError as e:
            return f"{type(e).__name__}: {e}"
        return "saved"

    a = threading.Thread(target=lambda: DeviceGroup.cpu(2).run(job_a))
    a.start()
    assert held.wait(30)
    started = time.monotonic()
    got = DeviceGroup.cpu(2).run(job_b)
    took = time.monotonic() - started
    go.set()
    a.join(30)
    assert took < 10, took
    assert all(g.startswith("CheckpointError: checkpoint.save failed on rank(s) [0]")
               and "another save" in g for g in got), got
    assert cp.load_state(_comm(), path, 1) == (1, 84)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_latest_of_an_empty_run_and_load_of_none(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(CheckpointIncompleteError, match="no checkpoint to load"):
        cp.load_state(_comm(), checkpoint.latest(tmp_path), 1)  # type: ignore[arg-type]


def test_a_checkpoint_written_by_hand_looks_like_no_checkpoint(tmp_path: Path) -> None:
    """A directory holding a committed-looking index of another format is not ours: load
    refuses it by its format, and a save does not replace it."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "index.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointCorruptError, match="format 'other'"):
        cp.load_state(_comm(), str(tmp_path / "ck"), 1)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["index.json"]
