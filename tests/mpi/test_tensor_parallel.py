"""Tensor parallelism over the MPI world, at any world size.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_tensor_parallel.py`` (N = 1..4). The programs and numpy references are
those tests/unit/test_tensor_parallel.py runs in a DeviceGroup (tests/tp_programs.py):
the same layer objects, the same numbers, processes instead of devices.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd import tensor_parallel as tp
from fuelspmd.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tp_programs as P
from budget import bcast_from_rank0

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
LOOSE = {"attention": dict(rtol=1e-6, atol=1e-7)}  # its reference is finite differences


@pytest.mark.parametrize("case", sorted(P.CASES))
def test_matches_single_device_numpy(world: fs.World, case: str) -> None:
    comm = world.comm
    if P.H % comm.size or P.HEADS % comm.size or P.V % comm.size:
        pytest.skip(f"the test sizes do not divide by {comm.size} ranks")
    program, reference = P.CASES[case]
    got = program(comm)
    # every rank's reference, made once (finite differences, torch for tied_lm) on rank 0
    want = bcast_from_rank0(lambda: reference(comm.size))[comm.rank]
    P.check(got, want, **LOOSE.get(case, {}))


def test_every_rank_raises_the_same_config_error(world: fs.World) -> None:
    """A feature count the world size does not divide fails before any communication."""
    n = world.comm.size
    bad = 2 * n + 1 if n > 1 else None
    if bad is None:
        pytest.skip("every size divides by 1")
    with pytest.raises(ConfigError, match=f"out_features={bad} is not divisible by the TP "
                                          f"size {n}"):
        tp.ColumnParallelLinear(4, bad, comm=world.comm)
    world.comm.barrier()  # every rank got here: nobody was left in a collective


def test_every_rank_raises_the_same_index_range_error(world: fs.World) -> None:
    """Out-of-range targets and ids: the typed error, the same on every rank, before any
    collective (the program ends in a barrier every rank reaches)."""
    if P.V % world.comm.size:
        pytest.skip(f"the vocabulary does not divide by {world.comm.size} ranks")
    seen = P.bad_index_program(world.comm)
    assert all(s.startswith("IndexRangeError: ") for s in seen), seen
    assert world.comm.size == 1 or len({tuple(x) for x in _gather(world, seen)}) == 1


def _gather(world: fs.World, seen: list[str]) -> list[list[str]]:
    """Every rank's messages, through the transport-independent object path of mpi4py."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(seen)
