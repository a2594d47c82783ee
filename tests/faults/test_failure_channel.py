"""The crash handler's failure channel is private to the job (issue 41).

The first failing rank of a node prints the traceback and the others one line each; which
one is first was decided by an abstract unix socket named after the job, and any local
user could bind that name first: then every rank took itself for a follower and no rank
printed the traceback. The channel is now a file in a folder of this user's, mode 0700.
Each case runs ``squatter_job.py`` under ``mpiexec -n 2`` as root, with a child of the
failing rank dropped to uid 65534 (``nobody``) trying to take the channel first.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import clean_env, mpiexec, needs_mpiexec, run_job

JOB = Path(__file__).with_name("squatter_job.py")
TRACEBACK = "[rank 1] unhandled ValueError; aborting all 2 ranks"
pytestmark = [needs_mpiexec, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: drops a child to "
                                                               "another uid")]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary folder of the job's own that every user may create in (as /tmp), in a
    folder every user may enter (pytest's tmp_path is not)."""
    where = Path(tempfile.mkdtemp(prefix="fuelspmd-squat-"))
    where.chmod(0o1777)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize(("mode", "squatted"), [("abstract", "bound"),
                                                ("file", "PermissionError"),
                                                ("folder", "made")])
def test_another_user_cannot_silence_the_failing_rank(shared_tmp: Path, mode: str,
                                                      squatted: str) -> None:
    tmp = shared_tmp
    job = run_job(mpiexec(2, sys.executable, str(JOB), mode), deadline=60,
                  env=clean_env(TMPDIR=str(tmp)))
    out = job.out + job.err
    assert f"SQUAT {mode} {squatted} uid 65534" in out, out
    assert job.code != 0, out
    assert out.count(TRACEBACK) == 1, out
    assert "ValueError: rank 1 fails after another user squatted" in out, out
    folder = tmp / f"fuelspmd-{os.geteuid()}"
    if mode == "folder":  # not ours: nothing was written in it
        assert folder.stat().st_uid == 65534 and not list(folder.iterdir())
    else:
        assert folder.stat().st_uid == 0 and folder.stat().st_mode & 0o777 == 0o700
        assert len(list(folder.glob("failure-*"))) == 1
