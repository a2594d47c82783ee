"""``fuelspmd bench calibrate`` under a real mpiexec: it measures, fits, prints the table of
the check set against the model, and writes a file that ``detect`` then uses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fuelspmd.cost import load_calibration
from fuelspmd.topology import detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget import long_only


@dataclass
class Hosts:
    rank: int
    size: int
    nodes: list[str]


MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
    "mpiexec")


@pytest.mark.timeout(180)
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec beside python or on PATH")
def test_calibrate_writes_what_detect_reads(tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_", "HYDRA_"))}
    assert MPIEXEC is not None
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "fuelspmd", "bench", "calibrate",
           "--groups", "2", "--max-bytes", "262144", "--reps", "2", "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    print(result.stdout)
    assert result.returncode == 0, result.stderr
    table = [line for line in result.stdout.splitlines()
             if line.startswith(("all_reduce", "all_gather", "reduce_scatter"))
             and line.endswith(("ring", "doubling", "halving"))]
    assert len(table) == 3 * 6  # three collectives at 8 B .. 256 KiB
    assert "ranks per core 1" in result.stdout and "median |error|" in result.stdout
    data = load_calibration(out)
    assert data is not None and data["world"] == 2 and len(data["fit"]["points"]) == 18
    assert 1 <= len(data["regimes"]) <= 3 and data["regimes"][-1]["upto"] is None
    shm = data["shm"]
    assert 0 < shm["latency"] < 1e-2 and 1e7 < shm["bandwidth"] < 1e12
    for point in data["fit"]["points"]:
        assert point["predicted_s"] > 0 and point["check_s"] > 0
        assert point["error"] == pytest.approx(
            abs(point["predicted_s"] - point["check_s"]) / point["check_s"])
    topo = detect(Hosts(0, 2, ["here", "here"]), calibration=data)
    assert topo.nodes[0].fabric.bandwidth == shm["bandwidth"]
    assert topo.nodes[0].fabric.latency == shm["latency"]
    assert json.loads(out.read_text())["shm"] == shm


@long_only
@pytest.mark.timeout(400)
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec beside python or on PATH")
def test_full_calibration_table_at_2_3_4_ranks(tmp_path: Path) -> None:
    """The issue's check: all_reduce, all_gather and reduce_scatter at 2, 3 and 4 ranks,
    8 B to 64 MiB, fitted on set A and judged on set B interleaved with it; the table is
    printed (``pytest -s``). The 25% target is a measurement of a quiet machine (see the
    report); here the bound is loose, since other jobs on these 2 cores change the 3-4
    rank latencies by 10x from one point to the next. A measurement at full size, so in
    the long run only (tests/budget.py); CI runs the command, its table and its file at
    2 ranks up to 256 KiB above."""
    out = tmp_path / "calibration.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_", "HYDRA_"))}
    assert MPIEXEC is not None
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "fuelspmd", "bench", "calibrate",
           "--reps", "3", "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380)
    print(result.stdout)
    assert result.returncode == 0, result.stderr
    data = load_calibration(out)
    assert data is not None and len(data["fit"]["points"]) == 3 * 3 * 9
    assert data["fit"]["ranks_per_core"][0] == pytest.approx(2 / data["cores"])
    assert data["fit"]["median_abs_error_check"] < 0.5
