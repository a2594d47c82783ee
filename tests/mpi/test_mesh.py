"""Mesh over the MPI world at any world size: every (tp, pp) that divides it.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_mesh.py``
(N = 1..4). The program and reference are the ones tests/unit/test_mesh.py runs in a
DeviceGroup (tests/pipeline_programs.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd.errors import ConfigError
from fuelspmd.mesh import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_programs as P

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def world() -> fs.World:
    return fs.init(timeout=TIMEOUT)


def test_every_factorization_places_tp_fastest(world: fs.World) -> None:
    for tp, pp in P.factorizations(world.size):
        got = P.mesh_program(world, tp, pp)
        assert got == P.mesh_reference(world.size, tp, pp, world.rank), (tp, pp)


def test_a_size_that_does_not_divide_fails_on_every_rank(world: fs.World) -> None:
    with pytest.raises(ConfigError, match=f"does not divide the {world.size} ranks"):
        Mesh(world, tp=world.size + 1)
    world.comm.barrier()  # every rank raised before any communication, and is still here
