"""The scripts in slurm/ and fs.init() under srun, on the real cluster of conftest.py.

Each job runs examples/hello.py, whose ranks print one JSON line each; the checks are
against a numpy reference of the all-reduce and against the layout the job asked for.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

if TYPE_CHECKING:  # the fixture's types; conftest.py is pytest's to import
    from conftest import Cluster, Job

# 300 s: the first test also pays for installing Slurm (about 10 s here, more on a slow
# mirror); every job wait has its own 90 s deadline.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
HELLO = str(REPO / "examples" / "hello.py")
SINGLE = REPO / "slurm" / "single-node.sbatch"
MULTI = REPO / "slurm" / "multi-node.sbatch"
INIT = "import fuelspmd as fs; fs.init()"


def records(job: Job) -> list[dict[str, Any]]:
    """Return the JSON line of every rank in the job's output."""
    return [json.loads(line) for line in job.output.splitlines() if line.startswith("{")]


def check_world(found: list[dict[str, Any]], *, size: int, launcher: str,
                context: str) -> None:
    """Assert one record per rank 0..size-1, the all-reduce result and the local ranks."""
    assert sorted(r["rank"] for r in found) == list(range(size)), context
    reference = np.sum([np.arange(3, dtype=np.float64) + r for r in range(size)], axis=0)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in found:
        assert r["size"] == size, context
        assert r["launcher"] == launcher, context
        np.testing.assert_array_equal(r["all_reduce"], reference, err_msg=context)
        by_node.setdefault(r["node"], []).append(r)
    for node, ranks in by_node.items():
        ranks.sort(key=lambda r: r["rank"])
        assert [r["local_rank"] for r in ranks] == list(range(len(ranks))), (node, context)
        assert {r["local_size"] for r in ranks} == {len(ranks)}, (node, context)


def run_job(cluster: Cluster, script: Path, *args: str, options: list[str],
            env: dict[str, str] | None = None) -> Job:
    """Submit ``script`` with ``args`` and return the finished job."""
    return cluster.wait(cluster.sbatch(script, *args, options=options, env=env), timeout=90)


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_single_node_script(slurm_cluster: Cluster, launcher: str) -> None:
    """Three ranks on one node; FUELSPMD_SETUP runs before the program."""
    env = {"FUELSPMD_LAUNCHER": launcher, "FUELSPMD_SETUP": "echo setup-ran-in-job-$SLURM_JOB_ID"}
    job = run_job(slurm_cluster, SINGLE, HELLO, options=["--ntasks=3"], env=env)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.describe()
    check_world(records(job), size=3, launcher=launcher, context=job.describe())
    assert len({r["node"] for r in records(job)}) == 1, job.describe()
    assert f"setup-ran-in-job-{job.id}" in job.output, job.describe()


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_multi_node_script_on_one_node(slurm_cluster: Cluster, launcher: str) -> None:
    """Nodes x tasks per node, with the venv activated by FUELSPMD_VENV, on the one node."""
    env = {"FUELSPMD_LAUNCHER": launcher}
    if sys.prefix != sys.base_prefix:
        env["FUELSPMD_VENV"] = sys.prefix
    job = run_job(slurm_cluster, MULTI, HELLO, options=["--nodes=1", "--ntasks-per-node=4"],
                  env=env)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.describe()
    check_world(records(job), size=4, launcher=launcher, context=job.describe())
    header = next(line for line in job.output.splitlines() if line.startswith("fuelspmd:"))
    assert "1 nodes x 4 tasks" in header and sys.prefix in header, job.describe()


@pytest.mark.parametrize("script", [SINGLE, MULTI], ids=["single", "multi"])
def test_failed_rank_surfaces_its_exit_code(slurm_cluster: Cluster, script: Path) -> None:
    """Rank 1 exits 3 after the all-reduce: the job is FAILED with ExitCode 3."""
    options = ["--ntasks=2"] if script is SINGLE else ["--nodes=1", "--ntasks-per-node=2"]
    job = run_job(slurm_cluster, script, HELLO, "--exit-code", "3", "--exit-rank", "1",
                  options=options)
    assert (job.state, job.exit_code) == ("FAILED", 3), job.describe()


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_one_failing_rank_ends_the_job(slurm_cluster: Cluster, launcher: str) -> None:
    """Rank 1 raises while ranks 0 and 2 wait in the all-reduce: the job ends in seconds.

    Without the abort, ranks 0 and 2 would wait out hello.py's 60 s timeout; the bound of
    30 s leaves room for a loaded machine.
    """
    start = time.monotonic()
    job = run_job(slurm_cluster, SINGLE, HELLO, "--raise-on-rank", "1", options=["--ntasks=3"],
                  env={"FUELSPMD_LAUNCHER": launcher})
    took = time.monotonic() - start
    assert job.state == "FAILED" and job.exit_code != 0, job.describe()
    assert took < 30, f"{took:.1f} s\n{job.describe()}"
    assert job.output.count("[rank 1] unhandled RuntimeError; aborting all 3 ranks") == 1, \
        job.describe()
    assert "[rank 1] RuntimeError: rank 1 fails on purpose" in job.output, job.describe()
    assert not records(job), job.describe()


def test_script_without_program_fails_with_usage(slurm_cluster: Cluster) -> None:
    """No program after the script's name: exit code 2 and a usage line, not a hang."""
    job = run_job(slurm_cluster, SINGLE, options=["--ntasks=1"])
    assert (job.state, job.exit_code) == ("FAILED", 2), job.describe()
    assert "usage: sbatch" in job.output, job.describe()


def test_srun_pmi2_forms_one_world(slurm_cluster: Cluster) -> None:
    """An interactive srun (its own allocation) with --mpi=pmi2 gives one 2-rank world."""
    done = slurm_cluster.run(["srun", "-n", "2", "--mpi=pmi2", sys.executable, HELLO],
                             timeout=60)
    assert done.returncode == 0, done.stderr
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    check_world(found, size=2, launcher="srun", context=done.stdout + done.stderr)


def test_srun_mpi_none_is_a_config_error(slurm_cluster: Cluster) -> None:
    """--mpi=none gives every task a size-1 MPI world; init says to use --mpi=pmi2."""
    done = slurm_cluster.run(["srun", "-n", "2", "--mpi=none", sys.executable, "-c", INIT],
                             timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "fuelspmd.errors.ConfigError" in done.stderr, done.stderr
    assert "--mpi=pmi2" in done.stderr, done.stderr
    assert "MPI reports a world of 1" in done.stderr, done.stderr


def test_srun_mpi_pmix_names_the_fix(slurm_cluster: Cluster) -> None:
    """The MPICH wheel lacks PMIx and would abort in MPI_Init; init says to use --mpi=pmi2."""
    done = slurm_cluster.run(["srun", "-n", "2", "--mpi=pmix", sys.executable, "-c", INIT],
                             timeout=60)
    if "can not load PMIx library" in done.stderr:
        pytest.skip("Slurm's mpi/pmix plugin cannot load libpmix here (libpmix-dev missing)")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "--mpi=pmi2" in done.stderr and "PMIx" in done.stderr, done.stderr
    assert ("fuelspmd.errors.ConfigError" in done.stderr
            or "fuelspmd.errors.TransportUnavailableError" in done.stderr), done.stderr
