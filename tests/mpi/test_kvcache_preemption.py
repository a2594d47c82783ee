"""Preemption forced by a small pool over the MPI world (tp = the world size where the
models divide by it): greedy tokens equal transformers' ``generate``, every rank
preempting the same sequences (the coordinator checks each preempting decision).

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q
tests/mpi/test_kvcache_preemption.py``; the one-process twin is
tests/unit/test_kvcache_preemption.py.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_hf as H
from budget import bcast_from_rank0

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
NEW, BS, SMALL = 8, 4, 6


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_preempted_tokens_equal_transformers_at_tp_world(world: fs.World, name: str) -> None:
    if world.size not in (1, 2, 4):
        pytest.skip(f"the models' heads and vocabulary do not divide by {world.size}")
    from mpi4py import MPI

    def made() -> tuple[Path, list[list[int]]]:
        root = Path(tempfile.mkdtemp(prefix="fuelspmd-preempt-"))
        ref = H.build(name, root / name)
        return root, [H.hf_greedy(ref, p, NEW) for p in H.prompts()]

    # rank 0 builds the reference; the others never import torch
    root, want = bcast_from_rank0(made)
    try:
        model = models.from_pretrained(root / name, comm=world.comm, dtype="float64")
        out = models.greedy(model, H.prompts(), NEW, block_size=BS, samples=2,
                            num_blocks=SMALL, check_every=1)
        assert out.tokens == [w for w in want for _ in range(2)]
        assert out.preemptions > 0 and out.recomputed_tokens > 0
        counts = MPI.COMM_WORLD.allgather(out.preemptions)
        assert len(set(counts)) == 1
    finally:
        world.comm.barrier()
        if world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
