"""A save killed anywhere leaves the last committed checkpoint loadable (invariant 8).

Each case is one real job (tests/checkpoint_programs.py ``kill``): it saves version 1 of a
tp x pp model and its AdamW state to ``run/ck`` (``keep=2``), then starts replacing it by
version 2 and SIGKILLs one rank at one named point of the save (the points the save's
``_hook`` is called at: before, between and inside shard writes, around each fsync, the
index, each rename, ``latest``). Then, in this process at tp 1: ``run/ck`` loads and equals
version 1 if the kill came before the commit (the rename of the new directory into place),
version 2 after it; ``checkpoint.latest(run)`` loads too; every temporary directory left
behind is refused with CheckpointIncompleteError; and a next save succeeds and clears the
leftovers. Every job has four ranks (tp 2 x pp 2), each killed rank in turn; the jobs
run two at a time in the first test.

At random moments too (issue 40): a job saves version after version (``keep=2``, sync
or async) and one rank, drawn at random, is SIGKILLed after a random delay; the newest
committed checkpoint (``checkpoint.latest``) loads at tp 1 equal to what was saved, is
at least the last version rank 0 saw committed, and the next save leaves only the run's
two newest checkpoints. CI kills one sync and one async job; the long run
(``python tests/run.py --long``) 12 of each.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_programs as cp
from budget import runs
from jobs import Job, clean_env, mpiexec, needs_mpiexec, run_job

from fuelspmd import checkpoint
from fuelspmd.comm import Communicator
from fuelspmd.errors import CheckpointIncompleteError
from fuelspmd.transport import SelfTransport

pytestmark = [needs_mpiexec, pytest.mark.timeout(600)]  # the first test runs every job

PROGRAM = str(Path(cp.__file__))
# (ranks, the rank killed, the point (a regex), whether the new checkpoint is committed)
CASES = [
    (4, 1, r"^start$", False),
    (4, 3, r"^agreed$", False),
    (4, 2, r"half written", False),
    (4, 0, r"^markers seen$", False),
    (4, 0, r"^old moved aside$", False),
    (4, 0, r"^new renamed into place$", True),
    (4, 1, r"^copied$", False),
    (4, 2, r"^tmp made$", False),
    (4, 3, r"^shard opened$", False),
    (4, 1, r"^shard header written$", False),
    (4, 3, r"fc2\.weight.* half written", False),
    (4, 0, r"norm\.bias.* half written", False),
    (4, 2, r"^shard flushed$", False),
    (4, 1, r"^shard fsynced$", False),
    (4, 3, r"^dir fsynced$", False),
    (4, 2, r"^marker temp written$", False),
    (4, 0, r"^marker renamed$", False),
    (4, 0, r"^index temp written$", False),
    (4, 0, r"^index renamed$", False),
    (4, 0, r"^leftover index removed$", True),
    (4, 0, r"^latest temp written$", True),
    (4, 0, r"^latest renamed$", True),
    (4, 0, r"^committed$", True),
]


def _comm() -> Communicator:
    return Communicator(SelfTransport(), device="cpu:0")


def _kill(where: Path, case: tuple[int, int, str, bool]) -> Job:
    n, rank, at, _ = case
    tp, pp = (2, 2) if n == 4 else (2, 1)
    (where / "run").mkdir(parents=True)
    return run_job(mpiexec(n, sys.executable, PROGRAM, "kill", "--path",
                           str(where / "run" / "ck"), "--tp", str(tp), "--pp", str(pp),
                           "--rank", str(rank), "--at", at), deadline=90)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Job]]:
    """Every case's job, two at a time (their startup dominates); case -> (dir, job)."""
    base = tmp_path_factory.mktemp("kill")
    with ThreadPoolExecutor(2) as pool:
        jobs = {k: pool.submit(_kill, base / str(k), case) for k, case in enumerate(CASES)}
        return {k: (base / str(k), f.result()) for k, f in jobs.items()}


@pytest.mark.parametrize("k", range(len(CASES)),
                         ids=[f"{n}r-rank{r}-{at.strip('^$')[:24]}" for n, r, at, _ in CASES])
def test_kill_during_save_leaves_the_committed_checkpoint(
        killed: dict[int, tuple[Path, Job]], k: int) -> None:
    _, rank, _, after = CASES[k]
    where, job = killed[k]
    run = where / "run"
    assert job.code != 0 and f"rank {rank} killed at" in job.out, (job.code, job.out, job.err)
    assert "saved without a kill" not in job.out
    want = 2 if after else 1
    assert cp.load_state(_comm(), str(run / "ck"), 1) == (want, 84)
    found = checkpoint.latest(run)
    assert found is not None and cp.load_state(_comm(), str(found), 1)[0] == want
    left = sorted(run.glob("ck.tmp-*"))
    for partial in left:
        with pytest.raises(CheckpointIncompleteError, match=r"never committed|temporary name"):
            cp.load_state(_comm(), str(partial), 1)
    cp.save_state(_comm(), str(run / "ck"), 1, 1, False, 3, keep=2)
    assert sorted(p.name for p in run.iterdir()) == ["ck", "latest"]
    assert cp.load_state(_comm(), str(run / "ck"), 1)[0] == 3


def test_a_partial_checkpoint_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    cp.save_state(_comm(), str(tmp_path / "ck"), 1, 1, False)
    (tmp_path / "ck" / "index.json").unlink()
    with pytest.raises(CheckpointIncompleteError, match=r"no index\.json.*shard-00000"):
        cp.load_state(_comm(), str(tmp_path / "ck"), 1)
    with pytest.raises(CheckpointIncompleteError, match="no checkpoint at"):
        cp.load_state(_comm(), str(tmp_path / "nothing"), 1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("seed", range(runs(1, 12)))
def test_a_kill_at_a_random_moment_loses_nothing(tmp_path: Path, mode: str, seed: int) -> None:
    rng = random.Random(f"{mode}-{seed}")
    rank, delay = rng.randrange(4), rng.uniform(0.0, 2.5)
    run, pids = tmp_path / "run", tmp_path / "pids"
    cmd = mpiexec(4, sys.executable, PROGRAM, "loop", "--path", str(run), "--tp", "2",
                  "--pp", "2", "--steps", "100000", "--pids", str(pids),
                  *(["--async"] if mode == "async" else []))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=clean_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.glob("*"))) < 4 or not all(p.read_text() for p in pids.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.05)
        time.sleep(delay)
        os.kill(int((pids / str(rank)).read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    seen = [int(v) for v in re.findall(r"^committed (\d+)$", out, re.M)]
    found = checkpoint.latest(run)
    if not seen and found is None:
        print(f"\nkill {mode} rank {rank} at {delay:.2f} s: before the first commit")
        return  # nothing to lose
    assert found is not None, (mode, rank, delay, seen)
    version, n = cp.load_state(_comm(), str(found), 1)
    assert n == 84 and version >= max(seen, default=1), (mode, rank, delay, seen, version)
    print(f"\nkill {mode} rank {rank} at {delay:.2f} s: {len(seen)} saves seen committed, "
          f"{found.name} loads at tp 1 equal to version {version}")
    cp.save_state(_comm(), str(run / "step-next"), 1, 1, False, version, keep=2)
    assert len([p for p in run.iterdir() if p.name.startswith("step-")]) == 2
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("step-")) == \
        ["latest"]


@pytest.mark.timeout(120)
def test_a_second_job_saving_to_one_path_fails_on_every_rank_at_once(tmp_path: Path) -> None:
    """Two real jobs: A holds before its commit; B saves to the same path and each of its
    ranks raises CheckpointError within seconds (before: a raw FileNotFoundError on one
    rank while the other waited out the whole timeout); A commits."""
    path = str(tmp_path / "ck")
    a = subprocess.Popen(mpiexec(2, sys.executable, PROGRAM, "save", "--path", path,
                                 "--tp", "2", "--hold", str(tmp_path / "go")),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=clean_env(), start_new_session=True)
    try:
        assert a.stdout is not None and a.stdout.readline().strip() == "holding"
        started = time.monotonic()
        b = run_job(mpiexec(2, sys.executable, PROGRAM, "save", "--path", path, "--tp", "2",
                            "--version", "2"), deadline=60)
        took = time.monotonic() - started
        (tmp_path / "go").touch()
        out_a, _ = a.communicate(timeout=60)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
    lines = sorted(re.findall(r"^rank (\d): (\w+)", b.out, re.M))
    assert lines == [("0", "CheckpointError"), ("1", "CheckpointError")], b.out
    assert "another save" in b.out and took < 15, (took, b.out)
    assert sorted(re.findall(r"^rank (\d): saved", out_a, re.M)) == ["0", "1"], out_a
    assert cp.load_state(_comm(), path, 1) == (1, 84)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "go"]
