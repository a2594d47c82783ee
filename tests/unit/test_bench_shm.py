"""``fuelspmd bench shm`` in one process: its options, its reference, its refusal without MPI.

The measurement itself needs 2+ ranks: tests/mpi/test_shm_allreduce.py runs its correctness
check, and ``mpiexec -n 2 fuelspmd bench shm`` the timing.
"""

from __future__ import annotations

import numpy as np
import pytest

from fuelspmd.bench.shm import inputs, main, reference


def test_reference_is_the_left_fold_in_rank_order() -> None:
    want = (inputs(0, 1001) + inputs(1, 1001)) + inputs(2, 1001)
    np.testing.assert_array_equal(reference(3, 1001), want)
    assert not np.array_equal(inputs(0, 97), inputs(1, 97))


@pytest.mark.parametrize("argv", [["--sizes", "lots"], ["--sizes", "2"], ["--rounds", "0"],
                                  ["--cap", "many"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "fuelspmd bench shm" in capsys.readouterr().err


def test_refuses_a_world_of_one(capsys: pytest.CaptureFixture[str]) -> None:
    # no launcher: the self transport; under ``mpiexec -n 1``: MPI, but one rank
    assert main(["--sizes", "4K", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "mpiexec" in err or "2+ ranks" in err
