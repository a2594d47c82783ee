"""``fuelspmd bench collectives`` and the shared bench helpers.

The helpers are checked in process; the benchmark itself runs as a real job (one plain
process on the size-1 transport, and 2 ranks under ``mpiexec`` with the mpi4py baseline),
and its JSON is checked for the nccl-tests arithmetic, not for speed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuelspmd.bench import Column, interleave, median, parse_bytes, print_table
from fuelspmd.bench.collectives import BUS_FACTOR, main

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "MPI_", "OMPI_", "SLURM_", "HYDRA"))}


def _bench(prefix: list[str], *args: str) -> dict:
    out = subprocess.run([*prefix, sys.executable, "-m", "fuelspmd.bench.collectives", *args,
                          "--json"], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # one document: only rank 0 prints


def test_parse_bytes() -> None:
    assert [parse_bytes(s) for s in ("8", "64K", "1M", "1MiB", "64mb", "2G")] == [
        8, 64 << 10, 1 << 20, 1 << 20, 64 << 20, 2 << 30]
    with pytest.raises(ValueError, match="64MiB"):
        parse_bytes("1.5M")


def test_interleave_alternates_candidates() -> None:
    order: list[str] = []

    def make(name: str, secs: float):
        def run() -> float:
            order.append(name)
            return secs
        return run

    times = interleave({"a": make("a", 1.0), "b": make("b", 2.0)}, count=3)
    assert order == ["a", "b"] * 3
    assert times == {"a": [1.0] * 3, "b": [2.0] * 3}
    assert median([3.0, 1.0, 2.0, 100.0, 0.5]) == 2.0


def test_print_table_aligns_and_marks_missing() -> None:
    buf = io.StringIO()
    print_table("t", [Column("size", "n"), Column("us", "t", "{:.1f}")],
                [{"n": 8, "t": 1.25}, {"n": 1048576}], out=buf)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "# t"
    assert lines[1:4] == ["   size   us", "      8  1.2", "1048576    -"]


def test_bad_arguments_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ops", "all_sum"]) == 2
    assert "ops must be among" in capsys.readouterr().err
    assert main(["--min-bytes", "1M", "--max-bytes", "8"]) == 2
    assert "min-bytes" in capsys.readouterr().err


def _check_rows(doc: dict, ops: list[str], sizes: int, n: int, baseline: bool) -> None:
    assert doc["ranks"] == n and len(doc["rows"]) == len(ops) * sizes
    for row in doc["rows"]:
        assert row["op"] in ops and row["bytes"] == row["count"] * 4 and row["count"] % n == 0
        for name in ("fuelspmd", "mpi4py") if baseline else ("fuelspmd",):
            r = row[name]
            assert r["algbw"] == pytest.approx(row["bytes"] / r["time_us"] / 1e3)
            assert r["busbw"] == pytest.approx(r["algbw"] * BUS_FACTOR[row["op"]](n))
        if baseline:
            t_fs, t_mpi = row["fuelspmd"]["time_us"], row["mpi4py"]["time_us"]
            # the paired ratio lies between the extremes of per-round ratios; with a
            # stable machine it is close to the ratio of the medians
            assert row["ratio"] > 0
            assert min(t_mpi / t_fs, 1.0) / 10 < row["ratio"] < max(t_mpi / t_fs, 1.0) * 10
            assert row["added_us"] == pytest.approx(t_fs - t_mpi)
        else:
            assert "ratio" not in row


@pytest.mark.timeout(120)
def test_one_process_on_the_size1_transport() -> None:
    doc = _bench([], "--max-bytes", "64", "--step-factor", "2", "--iters", "2",
                 "--warmup", "1")
    assert doc["transport"] == "self"
    _check_rows(doc, list(BUS_FACTOR), 4, 1, baseline=False)  # 8, 16, 32, 64 bytes


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
@pytest.mark.timeout(120)
def test_two_ranks_with_the_mpi4py_baseline() -> None:
    ops = ["all_reduce", "all_gather", "all_to_all"]
    doc = _bench([str(MPIEXEC), "-n", "2"], "--ops", ",".join(ops), "--max-bytes", "4K",
                 "--step-factor", "8", "--iters", "3", "--warmup", "1", "--baseline", "mpi4py")
    assert doc["transport"] == "guarded-mpi" and doc["baseline"] == "mpi4py"
    _check_rows(doc, ops, 4, 2, baseline=True)  # 8, 64, 512, 4096 bytes
