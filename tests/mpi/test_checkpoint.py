"""Checkpoints over the MPI world at any size: saved at tp = the world (1, 2, 4) or as
dp replicas (3), loaded back in the same layout, and by every rank alone at tp 1; a
layout the ranks disagree on is refused on every rank before any file is written:
``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_checkpoint.py``."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd import checkpoint, nn
from fuelspmd.checkpoint.api import gather_json
from fuelspmd.checkpoint.files import shard_name
from fuelspmd.comm import Communicator
from fuelspmd.errors import CheckpointCorruptError, CheckpointMismatchError
from fuelspmd.transport import SelfTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_programs as cp

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture
def shared(world: fs.World) -> Iterator[Path]:
    """A directory every rank of the job sees (made by rank 0, its name all-gathered)."""
    mine = tempfile.mkdtemp(prefix="fuelspmd-ckpt-") if world.rank == 0 else ""
    where = Path(gather_json(world.comm, mine)[0])
    yield where
    world.comm.barrier()
    if world.rank == 0:
        shutil.rmtree(where, ignore_errors=True)


def test_save_and_load_in_the_world_and_alone(world: fs.World, shared: Path) -> None:
    tp = world.size if world.size in (1, 2, 4) else 1
    path = str(shared / "ck")
    cp.save_state(world.comm, path, tp, 1, False)
    assert cp.load_state(world.comm, path, tp) == (1, 84)
    alone = Communicator(SelfTransport(), device=world.device)
    assert cp.load_state(alone, path, 1) == (1, 84)
    world.comm.barrier()


def test_ranks_that_disagree_are_refused_on_every_rank(world: fs.World, shared: Path) -> None:
    if world.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    lin = nn.Linear(3, 4 + world.rank, seed=0)
    with pytest.raises(CheckpointMismatchError, match=r"weight: rank 0 has shape \(3, 4\)"):
        checkpoint.save(shared / "bad", {"lin": lin}, comm=world.comm)
    world.comm.barrier()
    assert not list(shared.glob("bad*"))


def test_replicated_state_saved_without_a_group_is_one_checkpoint_of_the_world(
        world: fs.World, shared: Path) -> None:
    """No mesh, no comm, nothing sharded (dp replicas): the world of fs.init() is the group,
    so the ranks write one checkpoint together (each block once) instead of racing."""
    lin = nn.Linear(3, 4, seed=0)
    checkpoint.save(shared / "rep", {"lin": lin, "step": 3})
    assert len(list((shared / "rep").glob("*.safetensors"))) == 1
    again = nn.Linear(3, 4, seed=1)
    assert checkpoint.load(shared / "rep", {"lin": again}) == {"step": 3}
    assert (again.weight.numpy() == lin.weight.numpy()).all()
    world.comm.barrier()


def test_a_piece_damaged_on_one_rank_raises_on_every_rank(world: fs.World, shared: Path) -> None:
    """Only the rank holding a block reads (and checks) it; the ranks then compare outcomes
    before anything is assigned, so the damage one rank found raises the same
    CheckpointCorruptError on all, naming that rank, and every rank's model and optimiser
    keep what they held (before: rank 0 had its model replaced, the damaged rank part)."""
    if world.size not in (2, 4):
        pytest.skip("a tp layout of the whole world (2 or 4 ranks)")
    path = shared / "bad-piece"
    cp.save_state(world.comm, str(path), world.size, 1, False)
    if world.rank == 0:
        last = path / shard_name(world.size - 1, world.size)
        data = bytearray(last.read_bytes())
        data[-1] ^= 0xFF  # the last byte of the last piece the last rank wrote
        last.write_bytes(bytes(data))
    world.comm.barrier()
    mesh, net, opt = cp.build(world.comm, world.size)
    cp.fill(net, opt, 7)
    with pytest.raises(CheckpointCorruptError, match=f"rank\\(s\\) \\[{world.size - 1}\\]") as e:
        checkpoint.load(path, {"model": net, "optim": opt}, mesh=mesh)
    assert cp.check(net, opt, 7) == 84  # untouched
    messages = gather_json(world.comm, str(e.value))
    assert len(set(messages)) == 1, messages
    world.comm.barrier()
