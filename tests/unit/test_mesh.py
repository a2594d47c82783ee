"""Mesh over the devices of a DeviceGroup: layout, per-axis Communicators, errors.

The program and its reference are in tests/pipeline_programs.py; tests/mpi/test_mesh.py
runs the same program under mpiexec.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError
from fuelspmd.mesh import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_programs as P

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 20.0


@pytest.mark.parametrize("size", [1, 2, 4, 6, 8])
def test_every_factorization_places_tp_fastest(size: int) -> None:
    group = DeviceGroup.cpu(size, timeout=TIMEOUT)
    for tp, pp in P.factorizations(size):
        outs = group.run(lambda comm, tp=tp, pp=pp: P.mesh_program(comm, tp, pp))
        for rank, got in enumerate(outs):
            assert got == P.mesh_reference(size, tp, pp, rank), (size, tp, pp, rank)


def test_mesh_over_a_size_one_world() -> None:
    world = fs.init(timeout=TIMEOUT)
    if world.size != 1:
        pytest.skip("one-process test run under a launcher")
    mesh = Mesh(world)
    assert mesh.shape == {"dp": 1, "pp": 1, "tp": 1}
    assert all(mesh.coord(a) == 0 and mesh.comm(a).size == 1 for a in ("dp", "pp", "tp"))
    assert "dp=1" in repr(mesh)


def test_bad_sizes_name_the_numbers_and_what_would_fit() -> None:
    comm = DeviceGroup.cpu(4, timeout=TIMEOUT).comms[0]
    with pytest.raises(ConfigError, match=r"tp=3 x pp=1 = 3 does not divide the 4 ranks.*\(2, 2\)"):
        Mesh(comm, tp=3)
    with pytest.raises(ConfigError, match=r"dp=4 x pp=2 x tp=1 = 8 ranks, but the group has 4"):
        Mesh(comm, pp=2, dp=4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="int >= 1"):
            Mesh(comm, tp=bad)  # type: ignore[arg-type]


def test_unknown_axis_and_wrong_argument() -> None:
    group = DeviceGroup.cpu(1, timeout=TIMEOUT)
    mesh = Mesh(group.comms[0])
    with pytest.raises(ConfigError, match=r"unknown axis 'ep'.*dp, pp, tp"):
        mesh.comm("ep")
    with pytest.raises(ConfigError, match="unknown axis"):
        mesh.coord("x")
    with pytest.raises(ConfigError, match=r"inside group\.run"):
        Mesh(group)
    with pytest.raises(ConfigError, match=r"World .* or a Communicator, got int"):
        Mesh(3)
    with pytest.raises(ConfigError, match=r"outside 0\.\.0"):
        mesh.rank_of(pp=1)


def test_a_tp_group_may_not_span_nodes() -> None:
    """Over a World whose nodes hold 2 ranks each, tp=4 would cross a node."""
    group = DeviceGroup.cpu(4, timeout=TIMEOUT)

    def build(comm: fs.Communicator) -> tuple[int, int]:
        world_like = types.SimpleNamespace(comm=comm, local_size=2)
        with pytest.raises(ConfigError,
                           match=r"tp=4 does not divide the 2 ranks per node.*\[1, 2\]"):
            Mesh(world_like, tp=4)
        mesh = Mesh(world_like, tp=2)
        return mesh.coord("tp"), mesh.rank_of(dp=mesh.coord("dp"), tp=mesh.coord("tp"))

    assert group.run(build) == [(0, 0), (1, 1), (0, 2), (1, 3)]
