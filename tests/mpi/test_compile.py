"""``fs.compile`` under mpiexec, at any world size: TP over the world and ZeRO-1 over dp
give the uncompiled losses bit for bit, and a compiled step's collectives still go through
the guard: a rank that calls it with another batch raises CollectiveMismatchError on
every rank within 5 s."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd.comm import Communicator
from fuelspmd.errors import CollectiveMismatchError, CommError
from fuelspmd.transport import SelfTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compile_programs as P

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def test_tp_compiled_equals_uncompiled(world: fs.World) -> None:
    n = world.comm.size
    if P.SIZE.heads % n or P.SIZE.width % n:
        pytest.skip(f"the model does not split over {n} ranks")
    want = P.train(world.comm, compiled=False)[0]
    got, _, step = P.train(world.comm, compiled=True)
    assert got == want
    assert step.replays >= P.STEPS - 3


@pytest.mark.parametrize(("zero", "dtype"), [(False, "float32"), (True, "float32"),
                                             (True, "bfloat16")])
def test_dp_compiled_equals_uncompiled(world: fs.World, zero: bool, dtype: str) -> None:
    """Plain dp (all-reduced gradients) and ZeRO-1 (reduce-scattered, sliced state, the
    16-bit parameters' float32 master slices)."""
    solo = Communicator(SelfTransport(), device=world.device)
    kw = dict(dp=world.comm, zero=zero, replica=world.rank, dtype=dtype)
    want = P.train(solo, compiled=False, **kw)[0]
    got, _, step = P.train(solo, compiled=True, **kw)
    assert got == want
    assert step.replays >= P.STEPS - 3


def test_a_mismatch_in_a_replayed_step_raises_on_every_rank(world: fs.World) -> None:
    """Both ranks replay the step; then rank 1 gives a shorter batch (it traces again, its
    activation all-reduce is smaller) while the others replay: the guard names it."""
    if world.comm.size < 2:
        pytest.skip("needs two ranks")
    comm = world.comm.split(0, world.rank)  # its own guard: the mismatch leaves it failed
    try:
        _mismatch(comm)
    finally:
        comm.transport.close()
        world.comm.barrier()


def _mismatch(comm: Communicator) -> None:
    import numpy as np

    from fuelspmd import nn, optim

    w = nn.Parameter(fs.tensor(np.ones((4, 3), np.float32)))
    opt = optim.SGD([w], lr=0.1)

    def step(x: fs.Tensor) -> fs.Tensor:
        y = comm.all_reduce(x @ w)  # of the batch's shape
        loss = (y * y).mean()
        opt.step([comm.all_reduce(g, "avg") for g in fs.grad(loss, [w])])
        return loss

    fn = fs.compile(step)
    x = fs.tensor(np.ones((8, 4), np.float32))
    for _ in range(5):
        fn(x)
    assert fn.replays == 2
    bad = fs.tensor(np.ones((2, 4), np.float32)) if comm.rank == 1 else x
    comm.transport.barrier().wait()
    t0 = time.monotonic()
    with pytest.raises((CollectiveMismatchError, CommError)) as info:
        for _ in range(3):
            fn(bad).numpy()
    took = time.monotonic() - t0
    assert took < 5.0, took
    assert info.type is CollectiveMismatchError or "mismatch" in str(info.value), info.value
