"""fuelspmd.models over the MPI world, at any world size: tp = the world size (where the
models' sizes divide by it) and a tp x pp mesh, against transformers.

Run on every rank: ``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_models.py``.
Every rank builds the same Hugging Face directories itself (same seed, its own temporary
directory), so no rank waits for another's files; a directory written by
``save_pretrained`` (rank 0 writes, a collective) goes to a path rank 0 chose and
broadcast.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_hf as H
from budget import bcast_from_rank0

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
IDS = np.random.default_rng(0).integers(0, H.VOCAB, (2, 9))
EXACT = 1e-12
NAMES = ["gpt2", "llama", "llama_tied", "llama_head_dim"]
NEW = 6


def _bcast(value: Any) -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(value, root=0)


_REFS: dict[str, tuple[Path, np.ndarray, list[list[int]]]] = {}


def reference(world: fs.World, name: str) -> tuple[Path, np.ndarray, list[list[int]]]:
    """(directory, transformers' logits of IDS, its greedy tokens of the prompts) of model
    ``name``, built on first use (collective: rank 0 builds, the others never import torch,
    and the result is broadcast); a world size whose tests all skip builds nothing."""
    if name not in _REFS:
        def made() -> tuple[Path, np.ndarray, list[list[int]]]:
            root = Path(tempfile.mkdtemp(prefix="fuelspmd-models-"))
            ref = H.build(name, root / name)
            return (root / name, H.hf_logits(ref, IDS),
                    [H.hf_greedy(ref, p, NEW) for p in H.prompts()])

        _REFS[name] = bcast_from_rank0(made)
    return _REFS[name]


@pytest.fixture(scope="module", autouse=True)
def _remove_references(world: fs.World) -> Iterator[None]:
    yield
    if _REFS:
        world.comm.barrier()
        if world.rank == 0:
            for path, _, _ in _REFS.values():
                shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture()
def shared(world: fs.World) -> Iterator[Path]:
    """A directory every rank names alike (rank 0's, broadcast), removed afterwards."""
    path = Path(_bcast(tempfile.mkdtemp(prefix="fuelspmd-models-out-")
                       if world.rank == 0 else None))
    yield path
    world.comm.barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _need_tp(n: int) -> None:
    if n not in (1, 2, 4):
        pytest.skip(f"the models' heads, vocabulary and MLP width do not divide by {n}")


def _loads_in_transformers(world: fs.World, path: Path, want: np.ndarray) -> None:
    """Rank 0 loads ``path`` with transformers: its logits must be ``want``."""
    if world.rank == 0:
        import torch
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        assert rel(H.hf_logits(back, IDS), want) < EXACT


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_tokens_at_tp_world(world: fs.World, name: str) -> None:
    _need_tp(world.size)
    path, logits, tokens = reference(world, name)
    model = models.from_pretrained(path, comm=world.comm, dtype="float64")
    assert rel(model(IDS).numpy(), logits) < EXACT
    if name in ("gpt2", "llama", "llama_tied"):  # llama: 2 kv heads, shared over tp 4
        assert model.generate(H.prompts(), NEW, block_size=4, check_every=1) == tokens


def test_saved_at_tp_world_loads_in_transformers(world: fs.World, shared: Path) -> None:
    _need_tp(world.size)
    path, logits, _ = reference(world, "llama")
    models.from_pretrained(path, comm=world.comm, dtype="float64").save_pretrained(shared)
    _loads_in_transformers(world, shared, logits)


@pytest.mark.parametrize("name", ["gpt2", "llama_head_dim"])
def test_tp_by_pp_mesh_stage_by_stage(world: fs.World, shared: Path, name: str) -> None:
    """A tp x pp mesh (tp 2 x pp 2 at 4 ranks, pp 2 at 2, pp 3 at 3 for the 3-layer
    model): each stage's hidden states sent to the next give transformers' logits at the
    last; the layout saves a directory transformers loads."""
    n = world.size
    tp_, pp_ = {2: (1, 2), 3: (1, 3), 4: (2, 2)}.get(n, (0, 0))
    layers = H.CONFIGS[name].get("n_layer", H.CONFIGS[name].get("num_hidden_layers"))
    if not pp_ or pp_ > layers:
        pytest.skip(f"no tp x pp mesh of {n} ranks for a model of {layers} layers here")
    path, logits, _ = reference(world, name)
    mesh = fs.Mesh(world, tp=tp_, pp=pp_)
    model = models.from_pretrained(path, mesh=mesh, dtype="float64")
    pp, s = mesh.comm("pp"), mesh.coord("pp")
    x = IDS if model.first else pp.recv((*IDS.shape, model.arch.hidden), "float64", s - 1)
    y = model(x)
    if model.last:
        assert rel(y.numpy(), logits) < EXACT
    else:
        pp.send(y, s + 1).realize()
    model.save_pretrained(shared / name)
    _loads_in_transformers(world, shared / name, logits)

