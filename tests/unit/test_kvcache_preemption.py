"""Preemption forced by a small pool: greedy tokens equal transformers' ``generate`` for
GPT-2 and Llama (grouped-query) models at tp 1 and as two devices of a DeviceGroup, with
prefix hits, forked samples and copy-on-write in the same runs. The MPI twin is
tests/mpi/test_kvcache_preemption.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import fuelspmd as fs
from fuelspmd import models
from fuelspmd.errors import CacheCapacityError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_hf as H

pytestmark = pytest.mark.timeout(120)
NEW, BS = 8, 4
SMALL = 6  # blocks: the longer sequence alone needs 5 (12 + 7 tokens), both at once 9


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """name -> (directory, transformers' greedy tokens of each prompt), built once."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in ("gpt2", "llama"):
        ref = H.build(name, root / name)
        out[name] = (root / name, [H.hf_greedy(ref, p, NEW) for p in H.prompts()])
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("samples", [1, 2])
def test_preempted_and_recomputed_tokens_equal_transformers(refs: dict, name: str,
                                                            samples: int) -> None:
    path, want = refs[name]
    model = models.from_pretrained(path, dtype="float64")
    out = models.greedy(model, H.prompts(), NEW, block_size=BS, samples=samples,
                        num_blocks=SMALL, check_every=1)
    assert out.tokens == [w for w in want for _ in range(samples)]
    assert out.preemptions > 0 and out.recomputed_tokens > 0
    assert out.blocks_used <= SMALL and out.hit_rate > 0
    roomy = models.greedy(model, H.prompts(), NEW, block_size=BS, samples=samples)
    assert roomy.tokens == out.tokens and roomy.preemptions == roomy.recomputed_tokens == 0
    uncached = models.greedy(model, H.prompts(), NEW, block_size=BS, samples=samples,
                             num_blocks=SMALL, prefix_caching=False)
    assert uncached.tokens == out.tokens and uncached.preemptions > 0
    assert uncached.recomputed_tokens > out.recomputed_tokens  # no block of its own served


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_preemption_at_tp2_on_two_devices(refs: dict, name: str) -> None:
    path, want = refs[name]

    def gen(comm: Any, mode: str) -> Any:
        model = models.from_pretrained(path, comm=comm, dtype="float64")
        return models.greedy(model, H.prompts(), NEW, block_size=BS, samples=2,
                             num_blocks=SMALL, check_every=1, coordinate=mode)

    for mode in ("check", "leader"):
        outs = fs.DeviceGroup.cpu(2).run(lambda comm, mode=mode: gen(comm, mode))
        for out in outs:
            assert out.tokens == [w for w in want for _ in range(2)]
            assert out.preemptions > 0
        assert outs[0].preemptions == outs[1].preemptions


def test_a_pool_no_sequence_fits_is_refused_before_any_work(refs: dict) -> None:
    model = models.from_pretrained(refs["gpt2"][0], dtype="float64")
    with pytest.raises(CacheCapacityError, match="num_blocks >= 5"):
        models.greedy(model, H.prompts(), NEW, block_size=BS, num_blocks=4)
