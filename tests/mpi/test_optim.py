"""clip_grad_norm over the MPI world at any size (TP 2 x PP 2 at 4 ranks) against torch's
``clip_grad_norm_`` on the unsharded model, and float16 loss scaling skipping a step on
every rank alike: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_optim.py`` (N = 1..4). The program is tests/optim_programs.py, which
tests/unit/test_optim.py also runs in a DeviceGroup."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fuelspmd as fs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optim_programs as P
from budget import bcast_from_rank0

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_is_torchs_on_the_unsharded_model(world: fs.World,
                                                          max_norm: float) -> None:
    _, pp = P.mesh_for(world.comm.size)
    ref = bcast_from_rank0(lambda: P.reference(pp, max_norm))  # only rank 0 imports torch
    P.check(P.clip(world.comm, max_norm), world.comm.size, max_norm, ref)


def test_fp16_loss_scaling_skips_the_step_on_every_rank_alike(world: fs.World) -> None:
    """One rank's overflow skips the step on all (a world of 1: that rank's own)."""
    mine = P.scaling(world.comm)
    P.check_scaling([mine])
