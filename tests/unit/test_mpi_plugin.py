"""The ``mpi`` transport plugin seen from one process: discovery, the PMIx trap, lazy
imports, and ``abort`` ending a real 2-rank ``mpiexec`` job.

Anything that initialises MPI runs in a subprocess, so this pytest process stays free of
MPI (the one-process suite must not become a singleton MPI job).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fuelspmd.transport import find_transports, load_plugin
from fuelspmd_mpi import plugin, pmix_trap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import clean_env as _env
from jobs import mpiexec, needs_mpiexec, run_job

MPICH = "MPICH Version:      5.0.2\nMPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra"
MPICH_PMIX = "MPICH Version:      4.2.0\nMPICH configure:    --with-pmix=/usr"
OPENMPI = "Open MPI v5.0.3, package: Open MPI Distribution, ident: 5.0.3"


def _python(code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env or _env(), timeout=60)


def test_registered_under_the_entry_point_group() -> None:
    assert find_transports()["mpi"].value == "fuelspmd_mpi:plugin"
    assert load_plugin("mpi") is plugin
    assert plugin.name == "mpi"


@pytest.mark.parametrize(("version", "env", "trapped"), [
    (MPICH, {"SLURM_MPI_TYPE": "pmix"}, True),
    (MPICH, {"SLURM_MPI_TYPE": "pmix_v4"}, True),
    (MPICH, {"PMIX_RANK": "0"}, True),
    (MPICH, {"SLURM_MPI_TYPE": "pmi2"}, False),
    (MPICH, {}, False),
    (MPICH_PMIX, {"SLURM_MPI_TYPE": "pmix"}, False),
    (OPENMPI, {"PMIX_RANK": "3"}, False),
])
def test_pmix_trap(version: str, env: dict[str, str], trapped: bool) -> None:
    reason = pmix_trap(version, env)
    assert (reason is not None) == trapped
    if trapped:
        assert "MPICH Version" in reason
        if "SLURM_MPI_TYPE" in env:
            assert "srun --mpi=pmi2" in reason
        else:  # a PMIx launcher that is not srun: Open MPI's mpirun
            assert "PMIX_RANK is set" in reason and "mpiexec of that MPICH" in reason


def test_import_touches_no_mpi_and_version_needs_no_init() -> None:
    out = _python(
        "import sys, fuelspmd_mpi\n"
        "assert 'mpi4py' not in sys.modules\n"
        "v = fuelspmd_mpi.library_version()\n"
        "assert fuelspmd_mpi.plugin.library_version(full=True).startswith(v)\n"
        "from mpi4py import MPI\n"
        "assert not MPI.Is_initialized()\n"
        "assert fuelspmd_mpi.plugin.unavailable_reason() is None\n"
        "print(v)\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # e.g. "MPICH Version: 5.0.2"


def test_world_refuses_srun_pmix_before_mpi_init() -> None:
    """Under srun --mpi=pmix the MPICH wheel would abort in MPI_Init; we raise instead."""
    out = _python(
        "from fuelspmd_mpi import plugin\n"
        "from fuelspmd.errors import ConfigError\n"
        "print('reason:', plugin.unavailable_reason())\n"
        "try:\n"
        "    plugin.world(timeout=5)\n"
        "except ConfigError as e:\n"
        "    print('ConfigError:', e)\n"
        "from mpi4py import MPI\n"
        "print('initialized:', MPI.Is_initialized())\n",
        env=_env(SLURM_MPI_TYPE="pmix", PMIX_RANK="0"))
    assert out.returncode == 0, out.stderr
    if "MPICH" not in out.stdout:
        pytest.skip("the MPI library here is not MPICH")
    assert "ConfigError:" in out.stdout and "--mpi=pmi2" in out.stdout
    assert "reason: None" in out.stdout  # MPI is there; the launch is what is wrong
    assert "initialized: False" in out.stdout


def test_singleton_world_and_bad_timeout() -> None:
    out = _python(
        "import numpy as np\n"
        "from fuelspmd_mpi import plugin\n"
        "from fuelspmd.errors import ConfigError\n"
        "t = plugin.world(timeout=5)\n"
        "b = np.arange(3.0)\n"
        "t.all_reduce(b, 'avg').wait()\n"
        "print(t.rank, t.size, t.world_ranks, b.tolist(), t.describe())\n"
        "try:\n"
        "    plugin.world(timeout=-1)\n"
        "except ConfigError as e:\n"
        "    print('ConfigError:', e)\n")
    assert out.returncode == 0, out.stderr
    assert "0 1 (0,) [0.0, 1.0, 2.0] MPI group world of 1 (world ranks [0])" in out.stdout
    assert "ConfigError: timeout must be a positive number" in out.stdout


# Markers go to files, not stdout: mpiexec's proxies forward output asynchronously, and
# the abort may kill them before a flushed line reaches the test.
ABORT = """
import sys, pathlib
from fuelspmd_mpi import plugin
mark = pathlib.Path(sys.argv[1])
t = plugin.world(timeout=60)
if t.rank == 1:
    (mark / "aborting").write_text("rank 1")
    t.abort(7)
t.barrier().wait()  # rank 0 would wait 60 s here; the abort must end it first
(mark / "survived").write_text(f"rank {t.rank}")
"""


@needs_mpiexec
@pytest.mark.timeout(60)
def test_abort_ends_every_rank_quickly(tmp_path: Path) -> None:
    job = run_job(mpiexec(2, sys.executable, "-c", ABORT, str(tmp_path)), deadline=40,
                  env=_env())
    assert job.code != 0, job.out + job.err
    assert job.seconds < 20
    assert (tmp_path / "aborting").exists(), job.out + job.err
    assert not (tmp_path / "survived").exists(), job.out + job.err


LEFT_OPEN = """
import numpy as np
from fuelspmd.comm import GuardedTransport
from fuelspmd_mpi import plugin
t = plugin.world(timeout=60)
g = GuardedTransport(t)
b = np.ones(2, np.float32)
g.all_reduce(b, "sum").wait()
t.split(0, t.rank).barrier().wait()
if t.rank == 0:  # one rank prints: mpiexec interleaves the ranks' output byte by byte
    print("sum", b.tolist(), flush=True)
"""


@needs_mpiexec
@pytest.mark.timeout(60)
def test_a_job_that_never_finalizes_leaves_no_persistent_meeting() -> None:
    """The transports' persistent check meetings (the world's, the guard's split, a split
    never finalized) are freed before MPI_Finalize: MPI names every one left at exit."""
    job = run_job(mpiexec(2, sys.executable, "-c", LEFT_OPEN), deadline=40, env=_env())
    assert job.code == 0, job.out + job.err
    assert "sum [2.0, 2.0]" in job.out, job.out
    assert "persistent" not in job.err, job.err
