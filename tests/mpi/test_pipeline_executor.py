"""PipelineExecutor over the MPI world at any world size (pp = size, and dp x pp at 4).

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_pipeline_executor.py`` (N = 1..4). The program and its numpy reference are
the ones tests/unit/test_pipeline_executor.py runs in a DeviceGroup
(tests/pipeline_programs.py): one SPMD function, the same numbers in both modes.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.pipeline_parallel import schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_programs as P

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def _micro(size: int) -> int:
    """At least 4 micro-batches, a multiple of the stages (interleaved needs one)."""
    return size * -(-4 // size)


@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_pp_equals_world_size(world: fs.World, kind: str, chunks: int) -> None:
    m = _micro(world.size)
    got = P.run(world.comm, kind, m, chunks)
    P.check(got, world.size * chunks, m)


@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_dp_by_pp(world: fs.World, kind: str, chunks: int) -> None:
    if world.size % 2:
        pytest.skip("dp=2 needs an even world size")
    got = P.run(world.comm, kind, 4, chunks, dp=2)
    P.check(got, world.size // 2 * chunks, 4, dp=2)


@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_dp_buckets_start_in_the_last_backward(world: fs.World, kind: str, chunks: int) -> None:
    if world.size % 2:
        pytest.skip("dp=2 needs an even world size")
    got = P.run(world.comm, kind, 4, chunks, dp=2, bucket_bytes=1)
    P.check(got, world.size // 2 * chunks, 4, dp=2)
    p = world.size // 2
    P.check_buckets(got["result"], schedule(kind, p, 4, chunks), world.rank % p, buckets=2)


def test_nonblocking_sends_and_recompute(world: fs.World) -> None:
    got = P.run(world.comm, "1f1b", 4, 1, sends="nonblocking", recompute=True)
    P.check(got, world.size, 4)


def test_measured_timeline_is_the_same_on_every_rank(world: fs.World) -> None:
    m = _micro(world.size)
    tl = P.run(world.comm, "1f1b", m, 1)["timeline"]
    sched = schedule("1f1b", world.size, m)
    assert set(tl.start) == {a for acts in sched.actions for a in acts}
    for acts in sched.actions:
        for a, b in itertools.pairwise(acts):
            assert tl.start[a] <= tl.end[a] <= tl.start[b]
    mine = np.array([tl.makespan, tl.bubble])
    every = world.comm.all_gather(fs.tensor(mine[None], device=world.device), axis=0).numpy()
    assert (every == mine).all()
