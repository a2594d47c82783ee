"""fs.init() without a launcher, and the launcher detection and checks on given environments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from threadpoolctl import ThreadpoolController

import fuelspmd as fs
from fuelspmd.launch import _THREAD_VARS, _check_world, _local_rank, _share_cores, detect_launcher
from fuelspmd.transport import SelfTransport


def test_plain_python_is_a_size_one_world_without_mpi() -> None:
    code = ("import sys, fuelspmd as fs; w = fs.init(); "
            "print(w.rank, w.size, w.local_rank, w.local_size, w.launcher, w.transport.name, "
            "'mpi4py' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_", "HYDRA"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, env=env).stdout.split()
    assert out == ["0", "1", "0", "1", "none", "self", "False"]


def test_init_is_idempotent_and_finalize_starts_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in __import__("os").environ if k.startswith(("PMI_", "SLURM_", "OMPI_"))]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("MPI_LOCALRANKID", raising=False)
    w = fs.init(device="cpu:0", timeout=5.0)
    try:
        assert fs.init() is w
        assert (w.rank, w.size, w.device, w.timeout, w.nodes) == (0, 1, fs.device("cpu:0"), 5.0,
                                                                   [w.node])
    finally:
        w.finalize()
    w2 = fs.init(device="strict:0")
    assert w2 is not w and str(w2.device) == "strict:0"
    w2.finalize()


def test_bad_timeout_is_a_config_error() -> None:
    with pytest.raises(fs.ConfigError, match="positive number"):
        fs.init(timeout=0)


@pytest.mark.parametrize("env, expected", [
    ({}, ("none", 0, 1, None)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"},
     ("mpiexec", 2, 4, 2)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
     ("openmpi", 1, 3, 1)),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
      "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_MPI_TYPE": "pmi2", "PMI_RANK": "3"},
     ("srun", 3, 4, 1)),
    # mpiexec inside an sbatch allocation: Hydra's variables win over Slurm's
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "1",
      "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, ("mpiexec", 1, 2, 1)),
    # a plain python in a batch script: no task step, so no launcher
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, ("none", 0, 1, None)),
])
def test_detect_launcher(env: dict[str, str], expected: tuple) -> None:
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == expected


def test_srun_without_pmi_names_the_fix() -> None:
    info = detect_launcher({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
                            "SLURM_STEP_NUM_TASKS": "2", "SLURM_MPI_TYPE": "none"})
    with pytest.raises(fs.ConfigError, match=r"--mpi=pmi2") as e:
        _check_world(SelfTransport(), info)
    assert "2 tasks" in str(e.value) and "world of 1" in str(e.value)


def test_mpiexec_of_another_mpi_is_named() -> None:
    info = detect_launcher({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})
    with pytest.raises(fs.ConfigError, match="not the launcher of the MPI library"):
        _check_world(SelfTransport(), info)


def test_self_transport_refuses_a_multi_rank_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    with pytest.raises(fs.ConfigError, match="transport='self' runs one rank"):
        fs.init(transport="self")


def test_unknown_transport_lists_what_is_installed() -> None:
    with pytest.raises(fs.TransportUnavailableError, match="no transport named 'carrier-pigeon'"):
        fs.init(transport="carrier-pigeon")


def test_local_rank_keeps_the_launchers_numbering_when_it_is_a_permutation() -> None:
    nodes = ["a", "a", "a", "b"]
    # Open MPI's --map-by core numbers local ranks out of rank order
    assert [_local_rank(nodes, [0, 2, 1, 0], r, "openmpi") for r in range(4)] == [0, 2, 1, 0]
    # no launcher numbering: rank order within each host
    assert [_local_rank(nodes, [-1] * 4, r, "none") for r in range(4)] == [0, 1, 2, 0]


def test_local_ranks_that_are_no_numbering_are_a_config_error() -> None:
    with pytest.raises(fs.ConfigError, match=r"host 'a' runs ranks \[0, 1\].*\[0, 0\]"):
        _local_rank(["a", "a"], [0, 0], 1, "mpiexec")


def test_ranks_on_one_node_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on a node get half the cores each for BLAS; a user's setting wins."""
    for var in _THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    blas = [p["num_threads"] for p in ThreadpoolController().info() if p["user_api"] == "blas"]
    try:
        got = _share_cores(2)
        assert got == max(1, len(os.sched_getaffinity(0)) // 2)
        now = [p["num_threads"] for p in ThreadpoolController().info()
               if p["user_api"] == "blas"]
        assert all(n == got for n in now)
        assert _share_cores(1) is None
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert _share_cores(2) is None
    finally:
        if blas:
            ThreadpoolController().limit(limits=max(blas), user_api="blas")
