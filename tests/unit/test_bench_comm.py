"""``fuelspmd bench device_group`` in process and ``fuelspmd bench bucketing`` under
mpiexec, small: each checks its own results against numpy before timing (and fails the
run if they are wrong); here the JSON is checked for its fields and arithmetic, not speed."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from fuelspmd.bench import device_group

pytestmark = pytest.mark.timeout(120)
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def test_device_group_bench_json() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert device_group.main(["--devices", "3", "--bytes", "1M", "--iters", "3",
                                  "--json"]) == 0
    res = json.loads(out.getvalue())
    assert res["devices"] == 3 and res["bytes"] == 1 << 20
    assert res["all_reduce_ms"] > 0 and res["copy_ms"] > 0
    assert res["vs_bound"] == pytest.approx(res["vs_copy"] * 2, rel=0.35)  # (3+1)/2, medians
    assert device_group.main(["--devices", "0"]) == 2


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize("check", ["default", "off"])
def test_bucketing_bench_json_at_two_ranks(check: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPI_", "OMPI_", "SLURM_", "HYDRA"))}
    run = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "fuelspmd.bench.bucketing",
                          "--count", "16", "--bytes", "4K", "--bucket", "32K", "--iters", "3",
                          "--check", check, "--json"], capture_output=True, text=True, env=env,
                         timeout=100)
    assert run.returncode == 0, run.stderr
    res = json.loads(run.stdout)
    assert (res["ranks"], res["count"], res["bytes"], res["bucket_bytes"], res["check"]) == (
        2, 16, 4096, 32768, check)
    assert res["mpi4py_ratio"] == 1.0
    assert all(res[f"{k}_ms"] > 0 for k in ("mpi4py", "lazy", "bucketed", "floor", "floor_fs"))
