"""Fixtures of the fault matrix: the job runner, the three launchers, a Slurm for srun.

The machinery (cells, jobs, the tag scan, the launchers) is in ``faultjobs.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from faultjobs import (
    KINDS,
    MOMENTS,
    RESULTS,
    Jobs,
    Launcher,
    Matrix,
    clean_env,
    mpich_launcher,
    openmpi_launcher,
    results,
    slurm_cluster_function,
    wanted,
)


@pytest.fixture(scope="session")
def fault_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """The job runner; at the end any job still running is killed."""
    jobs = Jobs(tmp_path_factory.mktemp("faults"))
    try:
        yield jobs
    finally:
        jobs.kill_all()


# The cluster of tests/slurm, started for this module only: a session fixture of its own
# would hold the machine-wide Slurm lock until the session ends, and tests/slurm's would
# then wait for it in vain.
_start_slurm = slurm_cluster_function()


@pytest.fixture(scope="module")
def fault_slurm(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A one-node Slurm for this module's srun cells (tests/slurm/conftest.py's cluster)."""
    yield from _start_slurm(request, tmp_path_factory)


@pytest.fixture(scope="module")
def mpich_matrix(request: pytest.FixtureRequest, fault_jobs: Jobs) -> Matrix:
    """The MPICH cells selected in this session."""
    return Matrix(mpich_launcher(), fault_jobs, wanted(request, "mpich"),
                  results(request.config))


@pytest.fixture(scope="module")
def openmpi_matrix(request: pytest.FixtureRequest, fault_jobs: Jobs) -> Matrix:
    """The Open MPI cells selected in this session."""
    return Matrix(openmpi_launcher(), fault_jobs, wanted(request, "openmpi"),
                  results(request.config))


@pytest.fixture(scope="module")
def srun_matrix(request: pytest.FixtureRequest, fault_jobs: Jobs,
                fault_slurm: object) -> Matrix:
    """The srun cells: ``srun --mpi=pmi2 --kill-on-bad-exit=1``, as slurm/*.sbatch run."""
    env = {**clean_env(), "PATH": fault_slurm.env["PATH"]}  # type: ignore[attr-defined]
    launcher = Launcher("srun", ("srun", "-n", "{n}", "--mpi=pmi2", "--kill-on-bad-exit=1"),
                        env, parallel=2)
    return Matrix(launcher, fault_jobs, wanted(request, "srun"), results(request.config))


@pytest.fixture(scope="module")
def srun_plain_matrix(request: pytest.FixtureRequest, fault_jobs: Jobs,
                      fault_slurm: object) -> Matrix:
    """Cells under a plain ``srun --mpi=pmi2``: Slurm's default leaves the ranks running."""
    env = {**clean_env(), "PATH": fault_slurm.env["PATH"]}  # type: ignore[attr-defined]
    launcher = Launcher("srun-plain", ("srun", "-n", "{n}", "--mpi=pmi2"), env, parallel=2)
    return Matrix(launcher, fault_jobs, wanted(request, "srun-plain"),
                  results(request.config))


# issue 41's faults: (fault, launcher) -> seconds each run took (test_silent_end.py,
# test_hung_job.py), for docs/reliability.md's table of faults
FAULT_TIMES = pytest.StashKey[dict[tuple[str, str], list[float]]]()


@pytest.fixture
def fault_time(request: pytest.FixtureRequest) -> Callable[[str, str, float], None]:
    """Record how long a fault took to end the job (or to be answered), for the summary."""
    stash = request.config.stash
    if FAULT_TIMES not in stash:
        stash[FAULT_TIMES] = {}
    times = stash[FAULT_TIMES]

    def record(fault: str, launcher: str, seconds: float) -> None:
        times.setdefault((fault, launcher), []).append(seconds)

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    """Print the matrix: seconds from the failure to the end of every rank, per cell; and
    the seconds each of issue 41's faults took."""
    faults = config.stash.get(FAULT_TIMES, {})
    if faults:
        terminalreporter.section("faults: seconds from the fault to the job's end (or answer)")
        for (fault, launcher), times in sorted(faults.items()):
            shown = ", ".join(f"{t:.2f}" for t in times)
            terminalreporter.write_line(f"{launcher:>10}  {fault}: {shown}")
    results = config.stash.get(RESULTS, {})
    if not results:
        return
    terminalreporter.section("fault matrix: seconds from the failure to no process left")
    for launcher in ("mpich", "openmpi", "srun", "srun-plain"):
        rows = {(k, m): o for (lch, k, m), o in results.items() if lch == launcher}
        if not rows:
            continue
        cells = []
        for kind in KINDS:
            for moment in MOMENTS:
                o = rows.get((kind, moment))
                if o is not None:
                    took = "?" if o.end_s is None else f"{o.end_s:.2f}"
                    cells.append(f"{kind}/{moment}={took} (rc {o.returncode})")
        terminalreporter.write_line(f"{launcher}: " + ", ".join(cells))
