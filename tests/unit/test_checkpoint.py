"""``fuelspmd.checkpoint`` in one process: the box arithmetic and the write plan, round
trips (AdamW, SGD momentum, bfloat16 masters, plain values), ZeRO-1 resharded over
DeviceGroups of other dp sizes and against plain AdamW, async saves, ``keep``, and every
damaged or mismatched checkpoint refused with its typed error."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_programs as cp

import fuelspmd as fs
from fuelspmd import checkpoint, nn, optim
from fuelspmd.checkpoint.layout import Entry, flat_boxes, plan, volume
from fuelspmd.comm import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    ConfigError,
)
from fuelspmd.transport import SelfTransport

pytestmark = pytest.mark.timeout(120)


def _comm() -> Communicator:
    return Communicator(SelfTransport(), device="cpu:0")


# ---- layout ---------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_boxes_cover_the_range_in_order(shape: list[int], data: st.DataObject) -> None:
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    a = np.arange(n).reshape(shape)
    boxes = flat_boxes(shape, lo, hi)
    got = [a[tuple(slice(x, y) for x, y in b)].reshape(-1) for b in boxes]
    assert np.array_equal(np.concatenate(got) if got else np.zeros(0, int), np.arange(lo, hi))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_plan_writes_each_block_once_by_the_lowest_rank() -> None:
    rep = Entry("m/norm", (4,), "float32", ((0, 4),))
    halves = [Entry("m/w", (4, 2), "float32", ((0, 2), (0, 2))),
              Entry("m/w", (4, 2), "float32", ((2, 4), (0, 2)))]
    p = plan([[rep, halves[0]], [rep, halves[1]], [rep, halves[0]]])
    assert p.writes(0) == {("m/norm", rep.box), ("m/w", halves[0].box)}
    assert p.writes(1) == {("m/w", halves[1].box)} and p.writes(2) == set()


@pytest.mark.parametrize(("rows", "match"), [
    ([[Entry("w", (4,), "float32", ((0, 4),))], [Entry("w", (6,), "float32", ((0, 6),))]],
     r"w: rank 0 has shape \(4,\) float32, rank 1 has \(6,\)"),
    ([[Entry("w", (4,), "float32", ((0, 3),))], [Entry("w", (4,), "float32", ((2, 4),))]],
     "overlapping"),
    ([[Entry("w", (4,), "float32", ((0, 2),))]], "hold 2 of its 4 elements"),
])
def test_plan_refuses_layouts_that_do_not_make_whole_tensors(rows: list[list[Entry]],
                                                             match: str) -> None:
    with pytest.raises(CheckpointMismatchError, match=match):
        plan(rows)


# ---- round trips ----------------------------------------------------------------------
def _train(model: nn.Module, opt: optim.Optimizer | optim.ZeRO1, steps: int, seed: int) -> None:
    for k in range(steps):
        grads = [fs.tensor(np.random.default_rng([seed, k, i]).standard_normal(p.shape)
                           .astype(np.float32), device=p.device, dtype=p.dtype)
                 for i, p in enumerate(opt.params)]
        opt.step(grads)


def test_round_trip_restores_parameters_state_and_values(tmp_path: Path) -> None:
    _, net, opt = cp.build(_comm(), 1)
    cp.fill(net, opt, 1)
    rng = np.random.default_rng(5)
    rng.standard_normal(3)
    checkpoint.save(tmp_path / "ck", {"model": net, "optim": opt, "step": 7,
                                      "rng": rng.bit_generator.state})
    _, net2, opt2 = cp.build(_comm(), 1)
    values = checkpoint.load(tmp_path / "ck", {"model": net2, "optim": opt2})
    assert values["step"] == 7 and cp.check(net2, opt2, 1) == 84
    shard = load_file(str(tmp_path / "ck" / "shard-00000-of-00001.safetensors"))
    assert np.array_equal(shard["model/inp.weight@0:4,0:8"], net.inp.weight.numpy())
    again = np.random.default_rng(0)
    again.bit_generator.state = values["rng"]
    assert np.array_equal(again.standard_normal(4), rng.standard_normal(4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sgd_momentum_and_bf16_masters_round_trip(tmp_path: Path, dtype: str) -> None:
    def make() -> tuple[nn.Linear, optim.Optimizer]:
        lin = nn.Linear(3, 4, seed=1, dtype=dtype)
        return lin, (optim.SGD(lin.parameters(), lr=0.1, momentum=0.9) if dtype == "float32"
                     else optim.AdamW(lin.parameters(), lr=0.1))
    a, oa = make()
    _train(a, oa, 2, 0)
    checkpoint.save(tmp_path / "ck", {"lin": a, "opt": oa})
    b, ob = make()
    checkpoint.load(tmp_path / "ck", {"lin": b, "opt": ob})
    _train(a, oa, 1, 9)
    _train(b, ob, 1, 9)
    for p, q in zip(a.parameters(), b.parameters()):
        assert np.array_equal(p.numpy(), q.numpy())
    if dtype == "bfloat16":
        assert all(m is not None for m in ob.master)


def _zero_run(comm: Communicator, dp_path: str, save: bool, shapes: list[tuple[int, ...]],
              steps: int) -> list[np.ndarray]:
    """A replicated model under ZeRO-1 over the group: ``steps`` steps then save, or load
    and one step; returns the parameters."""
    params = [nn.Parameter(np.zeros(s, np.float32) + 0.5, device=comm.device) for s in shapes]
    model = nn.Module()
    model.ps = params  # type: ignore[attr-defined]
    z = optim.ZeRO1(optim.AdamW(params, lr=1e-2), dp=comm, bucket_bytes=64)
    if save:
        _train(model, z, steps, 0)
        checkpoint.save(dp_path, {"model": model, "optim": z}, comm=comm)
    else:
        checkpoint.load(dp_path, {"model": model, "optim": z}, comm=comm)
        _train(model, z, 1, 1)
    return [p.numpy() for p in params]


SHAPES = [(3, 5), (7,), (2, 2, 3), (1,)]


def test_zero1_state_reshards_to_other_dp_sizes_and_to_adamw(tmp_path: Path) -> None:
    """Saved by ZeRO-1 at dp 2, loaded at dp 1, 4 and by plain AdamW: one more step gives
    plain AdamW's parameters (ZeRO-1's math is the unsharded one's); and the reverse."""
    path = str(tmp_path / "z2")
    DeviceGroup.cpu(2).run(lambda c: _zero_run(c, path, True, SHAPES, 2))
    ref_params = [nn.Parameter(np.zeros(s, np.float32) + 0.5) for s in SHAPES]
    ref = nn.Module()
    ref.ps = ref_params  # type: ignore[attr-defined]
    ref_opt = optim.AdamW(ref_params, lr=1e-2)
    _train(ref, ref_opt, 2, 0)
    checkpoint.save(tmp_path / "adamw", {"model": ref, "optim": ref_opt})
    _train(ref, ref_opt, 1, 1)
    want = [p.numpy() for p in ref_params]
    for dp in (1, 4):
        for got in DeviceGroup.cpu(dp).run(lambda c: _zero_run(c, path, False, SHAPES, 0)):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
    plain = [nn.Parameter(np.zeros(s, np.float32)) for s in SHAPES]
    m = nn.Module()
    m.ps = plain  # type: ignore[attr-defined]
    o = optim.AdamW(plain, lr=1e-2)
    checkpoint.load(path, {"model": m, "optim": o})
    _train(m, o, 1, 1)
    for p, w in zip(plain, want):
        np.testing.assert_array_equal(p.numpy(), w)
    adamw = str(tmp_path / "adamw")
    for got in DeviceGroup.cpu(2).run(lambda c: _zero_run(c, adamw, False, SHAPES, 0)):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_zero1_at_tp2_dp2_loads_at_dp1_dp2_dp4_and_into_adamw(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    DeviceGroup.cpu(4).run(lambda c: cp.save_state(c, path, 2, 1, True))
    assert cp.load_state(_comm(), path, 1, zero=False) == (1, 84)
    assert cp.load_state(_comm(), path, 1, zero=True)[0] == 1
    for tp in (1, 2):  # dp 4 and dp 2 over four devices
        got = DeviceGroup.cpu(4).run(lambda c, tp=tp: cp.load_state(c, path, tp, zero=True))
        assert [v for v, _ in got] == [1] * 4


def test_replicas_write_each_block_once(tmp_path: Path) -> None:
    """dp 3 replicas of one model: only rank 0 writes a shard."""
    path = str(tmp_path / "ck")
    DeviceGroup.cpu(3).run(lambda c: cp.save_state(c, path, 1, 1, False))
    index = json.loads((tmp_path / "ck" / "index.json").read_text())
    assert list(index["files"]) == ["shard-00000-of-00003.safetensors"]
    assert cp.load_state(_comm(), path, 1) == (1, 84)


def test_tp2_save_loads_in_a_device_group_and_one_process(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    DeviceGroup.cpu(2).run(lambda c: cp.save_state(c, path, 2, 1, False))
    assert DeviceGroup.cpu(4).run(lambda c: cp.load_state(c, path, 4)) == [(1, 84)] * 4
    assert cp.load_state(_comm(), path, 1) == (1, 84)


def test_async_save_holds_the_values_of_when_it_was_called(tmp_path: Path) -> None:
    _, net, opt = cp.build(_comm(), 1)
    cp.fill(net, opt, 1)
    h = checkpoint.async_save(tmp_path / "ck", {"model": net, "optim": opt, "version": 1})
    cp.fill(net, opt, 2)  # the caller goes on changing the model while the files are written
    h.wait()
    assert h.done() and cp.load_state(_comm(), str(tmp_path / "ck"), 1) == (1, 84)
    h2 = checkpoint.async_save(tmp_path / "ck", {"model": net, "optim": opt, "version": 2})
    h3 = checkpoint.async_save(tmp_path / "ck2", {"model": net, "optim": opt, "version": 2})
    h3.wait()  # the second save waited for the first
    assert h2.done() and cp.load_state(_comm(), str(tmp_path / "ck"), 1) == (2, 84)


def test_keep_leaves_the_newest_and_latest_names_it(tmp_path: Path) -> None:
    for step in range(4):
        cp.save_state(_comm(), str(tmp_path / f"step-{step}"), 1, 1, False, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-3"
    assert checkpoint.latest(tmp_path / "none") is None


# ---- refused ----------------------------------------------------------------------------
def _saved(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False)
    return tmp_path / "ck", json.loads((tmp_path / "ck" / "index.json").read_text())


def test_a_flipped_byte_is_found_by_its_checksum(tmp_path: Path) -> None:
    path, index = _saved(tmp_path)
    piece = index["tensors"]["model/blocks.1.fc1.weight"]["pieces"][0]  # type: ignore[index]
    shard = path / piece["file"]
    data = bytearray(shard.read_bytes())
    data[piece["offsets"][0] + 5] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"shard-00000.*'model/blocks\.1\.fc1"
                                                     r"\.weight@.*CRC-32"):
        cp.load_state(_comm(), str(path), 1)


def test_a_truncated_or_missing_shard_is_refused(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    shard = path / "shard-00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-9])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        cp.load_state(_comm(), str(path), 1)
    shard.unlink()
    with pytest.raises(CheckpointIncompleteError, match=r"file shard-00000.* is missing"):
        cp.load_state(_comm(), str(path), 1)


def test_another_model_is_refused_before_anything_is_assigned(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    other = nn.Linear(4, 9, seed=0)
    model = nn.Module()
    model.inp = other  # type: ignore[attr-defined]
    before = other.weight.numpy()
    with pytest.raises(CheckpointMismatchError, match=r"model/inp\.weight: saved \(4, 8\), "
                                                      r"here \(4, 9\)"):
        checkpoint.load(path, {"model": model})
    assert np.array_equal(other.weight.numpy(), before)
    with pytest.raises(CheckpointMismatchError, match=r"not in the checkpoint: \['extra/"):
        checkpoint.load(path, {"extra": other})


def test_bad_state_is_refused_with_the_fix(tmp_path: Path) -> None:
    lin = nn.Linear(2, 2, seed=0)
    with pytest.raises(ConfigError, match=r"neither a Module.*pass a JSON value"):
        checkpoint.save(tmp_path / "ck", {"lin": lin, "rng": np.random.default_rng(0)})
    with pytest.raises(CheckpointMismatchError, match="in no module of the state"):
        checkpoint.save(tmp_path / "ck", {"opt": optim.AdamW(lin.parameters())})
    with pytest.raises(ConfigError, match="keep=0"):
        checkpoint.save(tmp_path / "ck", {"lin": lin}, keep=0)
    assert not (tmp_path / "ck").exists() and volume(((0, 2), (1, 3))) == 4


def test_a_directory_that_is_no_checkpoint_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint.*notes\.txt"):
        checkpoint.save(tmp_path / "ck", {"lin": nn.Linear(2, 2, seed=0)})
    assert (tmp_path / "ck" / "notes.txt").read_text() == "mine"


def test_an_async_save_left_at_exit_is_finished(tmp_path: Path) -> None:
    code = ("import fuelspmd as fs; from fuelspmd import checkpoint, nn; "
            f"checkpoint.async_save({str(tmp_path / 'ck')!r}, "
            "{'lin': nn.Linear(64, 64, seed=0), 'step': 1})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lin = nn.Linear(64, 64, seed=1)
    assert checkpoint.load(tmp_path / "ck", {"lin": lin}) == {"step": 1}
    assert np.array_equal(lin.weight.numpy(), nn.Linear(64, 64, seed=0).weight.numpy())


def test_a_rank_that_fails_to_write_ends_the_save_on_every_rank_at_once(
        tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    DeviceGroup.cpu(2).run(lambda c: cp.save_state(c, path, 2, 1, False, 1))

    def hook(point: str) -> None:
        if point == "shard opened":
            raise OSError("disk full")

    def save(c: Communicator) -> str:
        try:
            cp.save_state(c, path, 2, 1, False, 2, _hook=hook if c.rank == 1 else None)
        except Exception as e:  # each device's error is its result here
            return f"{type(e).__name__}: {e}"
        return "saved"

    started = time.monotonic()
    got = DeviceGroup.cpu(2).run(save)
    assert time.monotonic() - started < 60  # not the 600 s deadline
    assert re.match(r"CheckpointError: checkpoint.save: rank 1 could not write its part of "
                    r".*\(OSError: disk full\)", got[1])
    assert re.match(r"CheckpointError: checkpoint.save: rank 1 failed to write \(OSError: "
                    r"disk full\)", got[0])
    assert cp.load_state(_comm(), path, 1) == (1, 84)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the failed save removed


def test_a_rank_polling_while_the_commit_renames_the_directory_sees_no_error(
        tmp_path: Path) -> None:
    """The ranks that wait for a commit poll the save's temporary directory for a failed
    rank's note while rank 0 renames it into place: a directory that goes between two looks
    is one with no note, never an error (a save that succeeded raised on a waiting rank)."""
    import threading

    from fuelspmd.checkpoint.saving import Save

    job = Save(tmp_path / "ck", "0" * 12, 0, 1, 2, None, time.monotonic() + 60, print)
    a, b = job.tmp, tmp_path / "ck"
    a.mkdir()
    stop = threading.Event()

    def commit_again_and_again() -> None:
        while not stop.is_set():
            os.replace(a, b)
            os.replace(b, a)

    mover = threading.Thread(target=commit_again_and_again)
    mover.start()
    try:
        for _ in range(20000):
            job.failures()
    finally:
        stop.set()
        mover.join()
