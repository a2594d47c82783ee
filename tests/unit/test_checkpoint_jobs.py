"""Checkpoints across real jobs: saved at tp 2 x pp 2 under ``mpiexec -n 4``, loaded at
tp 4, in one process, and in a DeviceGroup (every parameter and optimiser tensor equal to
the pure function it was filled from); and exact resume: a
training job that saves and is SIGKILLed, resumed by a new job, gives the losses of one
run straight through, bit for bit on the same layout and to float tolerance at tp 1."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_programs as cp
from jobs import mpiexec, needs_mpiexec, run_job

from fuelspmd.comm import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.transport import SelfTransport

pytestmark = [needs_mpiexec, pytest.mark.timeout(300)]
PROGRAM = str(Path(cp.__file__))


def _comm() -> Communicator:
    return Communicator(SelfTransport(), device="cpu:0")


def _job(n: int, *args: str) -> str:
    job = run_job(mpiexec(n, sys.executable, PROGRAM, *args), deadline=120)
    assert job.code == 0, (job.out, job.err)
    return job.out


def test_tp2_pp2_save_loads_at_tp4_tp1_and_in_a_device_group(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    _job(4, "save", "--path", path, "--tp", "2", "--pp", "2")
    out = _job(4, "load", "--path", path, "--tp", "4")
    assert sorted(re.findall(r"rank (\d) loaded version 1: 84 tensors equal", out)) == \
        ["0", "1", "2", "3"]
    assert cp.load_state(_comm(), path, 1) == (1, 84)
    assert DeviceGroup.cpu(2).run(lambda c: cp.load_state(c, path, 2)) == [(1, 84)] * 2


def _losses(out: str) -> dict[int, str]:
    return {int(k): v for k, v in re.findall(r"^loss (\d+) (\S+)$", out, re.M)}


def test_resume_after_a_kill_repeats_the_straight_run(tmp_path: Path) -> None:
    path, n, k = str(tmp_path / "ck"), 6, 3
    args = ["train", "--steps", str(n), "--tp", "2", "--dp", "2"]
    straight = _losses(_job(4, *args))
    killed = run_job(mpiexec(4, sys.executable, PROGRAM, *args, "--save-at", str(k),
                             "--path", path), deadline=120)
    assert killed.code != 0 and (tmp_path / "ck" / "index.json").exists(), killed.err
    first = _losses(killed.out)
    assert max(first) >= k - 1  # (the step overlapping the writing may be cut short)
    resumed = _losses(_job(4, *args, "--resume", path))
    assert sorted(straight) == list(range(n)) and sorted(resumed) == list(range(k, n))
    assert [first[s] for s in range(k)] + [resumed[s] for s in range(k, n)] == \
        [straight[s] for s in range(n)]
    alone = run_job([sys.executable, PROGRAM, *args[:-4], "--tp", "1", "--resume", path],
                    deadline=120)
    assert alone.code == 0, alone.err
    for s, v in _losses(alone.out).items():
        assert float.fromhex(v) == pytest.approx(float.fromhex(straight[s]), rel=1e-5)
