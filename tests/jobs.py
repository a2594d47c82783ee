"""Real jobs launched from tests: the mpiexec beside this Python, an environment without
the launcher variables of any job the test itself runs in, and a deadline after which the
job's whole process group is killed (mpiexec's ranks included), so no test can hang.

Test modules put ``tests/`` on ``sys.path`` and ``from jobs import ...``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
_LAUNCHER_VARS = ("PMI_", "PMIX_", "MPI_", "OMPI_", "SLURM_", "HYDRA", "FUELSPMD_")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher (and fuelspmd) variables, plus ``extra``:
    a job started from inside an mpiexec or Slurm step must not think it is part of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    return {**env, **extra}


@dataclass(frozen=True)
class Job:
    """How a finished job ended."""

    code: int
    out: str
    err: str
    seconds: float


def run_job(cmd: list[str], *, deadline: float, env: dict[str, str] | None = None,
            cwd: Path | str | None = None) -> Job:
    """Run ``cmd`` (in ``cwd``) in its own process group; fail the test if it outlives
    ``deadline`` s."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env() if env is None else env, start_new_session=True,
                            cwd=cwd)
    try:
        out, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} outlived its {deadline} s deadline:\n{out}\n{err}")
    return Job(proc.returncode, out, err, time.monotonic() - start)


def mpiexec(n: int, *args: str) -> list[str]:
    """The command line running ``args`` (a program and its arguments) on ``n`` ranks."""
    if MPIEXEC is None:
        raise RuntimeError("no mpiexec: mark the test with jobs.needs_mpiexec")
    return [MPIEXEC, "-n", str(n), *args]


SEGMENTS = ("mpich_shm_", "sm_segment.")  # MPICH's and Open MPI's shared-memory files


def remove_segments(since: float) -> int:
    """Remove MPI shared-memory files of dead jobs created after ``since``; return how many.

    MPICH (``/dev/shm/mpich_shm_*``) and Open MPI (``/dev/shm/sm_segment.*``) unlink their
    segment in MPI_Finalize, so every aborted or killed job leaves 2-16 MiB of memory
    behind. A file is removed only if it was created after its job started, is more than
    0.2 s old (MPI creates and maps a segment within milliseconds) and no live process
    maps it: a running job's segment, ours or another test's, is never touched.
    """
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return 0
    now = time.time()
    candidates = []
    for path in shm.iterdir():
        if not path.name.startswith(SEGMENTS):
            continue
        try:
            created = path.stat().st_mtime
        except OSError:
            continue
        if since - 1.0 <= created <= now - 0.2:
            candidates.append(path)
    if not candidates:
        return 0
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped.update(line.rsplit("/", 1)[-1] for line in text.splitlines()
                      if "/dev/shm/" in line)
    removed = 0
    for path in candidates:
        if path.name not in mapped:
            path.unlink(missing_ok=True)
            removed += 1
    return removed
