"""Mesh over the MPI world at any world size: every (tp, pp) that divides it, every axis
order, and ``order="auto"`` on the detected topology.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_mesh.py``
(N = 1..4). The program and reference are the ones tests/unit/test_mesh.py runs in a
DeviceGroup (tests/pipeline_programs.py).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.errors import ConfigError
from fuelspmd.mesh import CONVENTION, Mesh
from fuelspmd.topology import Node, Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mesh_programs as M
import pipeline_programs as P

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_every_factorization_places_tp_fastest(world: fs.World) -> None:
    for tp, pp in P.factorizations(world.size):
        got = P.mesh_program(world, tp, pp)
        assert got == P.mesh_reference(world.size, tp, pp, world.rank), (tp, pp)


def test_a_size_that_does_not_divide_fails_on_every_rank(world: fs.World) -> None:
    with pytest.raises(ConfigError, match=f"does not divide the {world.size} ranks"):
        Mesh(world, tp=world.size + 1)
    world.comm.barrier()  # every rank raised before any communication, and is still here


def test_every_order_lays_out_like_the_reference(world: fs.World) -> None:
    tp = 2 if world.size % 2 == 0 else 1
    pp = 2 if world.size % 4 == 0 else 1
    for order in itertools.permutations(("dp", "pp", "tp")):
        got = M.ordered_program(world, tp, pp, order=order)
        ref = M.ordered_reference(world.size, tp, pp, order, world.rank)
        assert {a: got[a] for a in ("dp", "pp", "tp")} == ref, order


def test_auto_on_the_detected_topology_agrees_on_every_rank(world: fs.World) -> None:
    """On one host every group is inside it: auto keeps the convention and every rank
    prints the same explanation. Over a declared two-node topology a dp-heavy model puts
    dp fastest, on every rank."""
    tp = 2 if world.size % 2 == 0 else 1
    traffic = {"tp": ("all_reduce", 1 << 20, 48), "dp": ("all_reduce", 64 << 20, 1)}
    got = M.ordered_program(world, tp, 1, order="auto", traffic=traffic)
    hosts = len(set(world.nodes))
    if hosts == 1:
        assert got["order"] == CONVENTION
    codes = np.frombuffer(got["explain"].encode().ljust(4096)[:4096], dtype=np.uint8)
    texts = world.comm.all_gather(fs.tensor(codes.astype(np.int32)), axis=0).numpy()
    assert len({bytes(t) for t in texts.reshape(world.size, -1)}) == 1
    ref = M.ordered_reference(world.size, tp, 1, got["order"], world.rank)
    assert {a: got[a] for a in ("dp", "pp", "tp")} == ref
    if world.size % 2 == 0 and world.size >= 4:
        n = Topology.load("two-node-h100-ib").nodes[0]
        per = world.size // 2
        two = Topology([Node(f"n{i}", per, n.fabric, per, n.nic) for i in range(2)])
        heavy = {"tp": ("all_reduce", 1 << 20, 4), "dp": ("all_reduce", 4 << 30, 1)}
        mesh = Mesh(world, tp=per, order="auto", traffic=heavy, topology=two)
        assert mesh.order[-1] == "dp"
        assert mesh.group("dp") == [mesh.rank - mesh.rank % 2, mesh.rank - mesh.rank % 2 + 1]
