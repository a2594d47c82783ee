"""``fs.init``'s arguments are checked before anything starts (issue 41).

A timeout that is not a number of seconds in ``TIMEOUT_RANGE`` (inf, 1e30, 1e-9, nan)
raised OverflowError after MPI had started, or ended the rank through faulthandler's
start-up watchdog; ``init()`` again with other arguments returned the first world
silently; ``device="cuda:0"`` without a GPU passed, and the first operation failed with
"CUDA driver version is insufficient". Each is now a typed error (a ValueError) naming the
argument and its range, raised before the transport starts (no MPI library is loaded), the
same on every rank.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd.backend import cuda_device_count
from fuelspmd.launch import TIMEOUT_RANGE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import mpiexec, needs_mpiexec, run_job

_LAUNCH = ("PMI_", "MPI_", "OMPI_", "SLURM_", "HYDRA")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(_LAUNCH)]:
        monkeypatch.delenv(key)


@pytest.mark.parametrize("timeout", [math.inf, 1e30, 1e-9, 0.5, 0, -1, math.nan, "60", True,
                                     TIMEOUT_RANGE[1] * 2])
def test_a_timeout_out_of_range_is_refused_before_anything_starts(no_launcher: None,
                                                                  timeout: object) -> None:
    with pytest.raises(fs.ConfigError) as e:
        fs.init(timeout=timeout)  # type: ignore[arg-type]
    text = str(e.value)
    assert isinstance(e.value, ValueError)
    assert f"timeout={timeout!r}" in text and "from 1 to 604800" in text, text
    assert fs.launch.current() is None


@pytest.mark.parametrize("timeout", [TIMEOUT_RANGE[0], 600, TIMEOUT_RANGE[1]])
def test_the_range_s_ends_are_taken(no_launcher: None, timeout: float) -> None:
    w = fs.init(timeout=timeout)
    try:
        assert w.timeout == timeout
    finally:
        w.finalize()


def test_init_again_with_other_arguments_is_an_error(no_launcher: None) -> None:
    w = fs.init(timeout=5.0, device="cpu:0")
    try:
        assert fs.init() is w  # no arguments: the world as it is
        assert fs.init(timeout=5.0, device="cpu:0") is w  # the same: the same world
        with pytest.raises(fs.ConfigError, match=r"timeout=5\.0.*timeout=6.*world\.finalize"):
            fs.init(timeout=6, device="cpu:0")
        with pytest.raises(fs.ConfigError, match=r"check='default'.*check='off'"):
            fs.init(timeout=5.0, device="cpu:0", check="off")
    finally:
        w.finalize()


@pytest.mark.skipif(cuda_device_count() > 0, reason="a GPU is visible here")
def test_a_gpu_that_is_not_there_is_a_device_error_at_init(no_launcher: None) -> None:
    with pytest.raises(fs.DeviceError, match=r"init\(device='cuda:0'\): no GPU is usable "
                                             r"here.*device='auto'"):
        fs.init(device="cuda:0")
    assert fs.launch.current() is None


def test_a_device_of_no_known_kind_names_the_argument(no_launcher: None) -> None:
    with pytest.raises(fs.DeviceError, match=r"init\(device='tpu:0'\): unknown device kind"):
        fs.init(device="tpu:0")


BAD_TIMEOUT = """
import sys, fuelspmd as fs
try:
    fs.init(timeout=float("inf"))
except fs.ConfigError as e:
    print("REFUSED", "mpi4py.MPI" in sys.modules, e, flush=True)
    sys.exit(3)
"""


@needs_mpiexec
@pytest.mark.timeout(60)
def test_every_rank_refuses_before_mpi_starts() -> None:
    job = run_job(mpiexec(2, sys.executable, "-c", BAD_TIMEOUT), deadline=30)
    assert job.code != 0, job.out
    lines = [line for line in job.out.splitlines() if line.startswith("REFUSED")]
    assert len(lines) == 2 and all(line.startswith("REFUSED False init(timeout=inf)")
                                   for line in lines), job.out + job.err
