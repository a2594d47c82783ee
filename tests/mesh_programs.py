"""A mesh program under any axis order and its reference, shared by tests/unit/test_mesh_
placement.py (DeviceGroup) and tests/mpi/test_mesh.py (mpiexec)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd.mesh import Mesh


def ordered_program(comm_or_world: Any, tp: int, pp: int, **kwargs: Any) -> dict[str, Any]:
    """Build ``Mesh(comm_or_world, tp=, pp=, **kwargs)``; per axis, all-gather the group
    ranks of its members (so a wrong split shows as wrong members or a wrong order)."""
    mesh = Mesh(comm_or_world, tp=tp, pp=pp, **kwargs)
    comm = mesh.comm_group
    me = fs.tensor(np.array([float(comm.rank)]), device=comm.device)
    out: dict[str, Any] = {"order": mesh.order, "explain": mesh.explain()}
    for axis in ("dp", "pp", "tp"):
        c = mesh.comm(axis)
        members = c.all_gather(me, axis=0).numpy().astype(int).tolist()
        out[axis] = (mesh.coord(axis), c.rank, members, mesh.group(axis))
        assert mesh.rank_of(**{a: mesh.coord(a) for a in ("dp", "pp", "tp")}) == comm.rank
    return out


def ordered_reference(size: int, tp: int, pp: int, order: tuple[str, ...],
                      rank: int) -> dict[str, Any]:
    """What :func:`ordered_program` returns on ``rank`` for the layout ``order`` (slowest
    axis first): ranks are numbered by nested loops over the axes in that order."""
    shape = {"dp": size // (tp * pp), "pp": pp, "tp": tp}
    coords = [dict(zip(order, c)) for c in itertools.product(*(range(shape[a])
                                                                for a in order))]
    out: dict[str, Any] = {}
    for axis in ("dp", "pp", "tp"):
        others = [a for a in ("dp", "pp", "tp") if a != axis]
        members = sorted((r for r in range(size)
                          if all(coords[r][a] == coords[rank][a] for a in others)),
                         key=lambda r: coords[r][axis])
        out[axis] = (coords[rank][axis], coords[rank][axis], members, members)
    return out
