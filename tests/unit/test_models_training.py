"""The reference models as a training loop uses them: the config's dropout in training
mode (keyed by the model's rng and the global layer, so any layout draws the same masks),
none in evaluation mode or through the paged cache, and several pipeline chunks per rank
(interleaved) with the names and numbers of one stage."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import models
from fuelspmd.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

GPT2 = models.GPT2Config(vocab_size=48, n_embd=32, n_layer=4, n_head=4, n_positions=16,
                         embd_pdrop=0.1, attn_pdrop=0.2, resid_pdrop=0.3)
LLAMA = models.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           attention_dropout=0.25)
IDS = np.random.default_rng(0).integers(0, 48, (2, 8))


def _logits(cfg: Any, comm: Any = None, *, train: bool = True, step: int = 3) -> np.ndarray:
    model = (models.GPT2 if isinstance(cfg, models.GPT2Config) else models.Llama)(
        cfg, comm=comm, seed=0)
    model.train(train)
    model.rng.set_step(step, 1)
    return model(IDS).numpy()


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_dropout_acts_in_training_mode_with_the_same_masks_on_any_tp_layout(cfg: Any) -> None:
    plain = _logits(cfg, train=False)
    dropped = _logits(cfg)
    assert not np.allclose(plain, dropped, atol=1e-3)
    np.testing.assert_array_equal(dropped, _logits(cfg))  # a mask is a function of its key
    assert not np.allclose(dropped, _logits(cfg, step=4), atol=1e-3)
    for tp in (2, 4):
        got = fs.DeviceGroup.cpu(tp, timeout=60).run(lambda comm: _logits(cfg, comm))
        for g in got:
            np.testing.assert_allclose(g, dropped, rtol=2e-5, atol=2e-5)


def test_the_config_dropout_round_trips_and_defaults_as_transformers() -> None:
    d = GPT2.to_hf()
    assert (d["embd_pdrop"], d["attn_pdrop"], d["resid_pdrop"]) == (0.1, 0.2, 0.3)
    assert models.GPT2Config.from_hf(d) == GPT2
    bare = {k: v for k, v in d.items() if not k.endswith("pdrop")}
    assert models.GPT2Config.from_hf(bare).arch.resid_dropout == 0.1  # transformers' default
    assert models.LlamaConfig.from_hf(LLAMA.to_hf()).arch.attn_dropout == 0.25


@pytest.mark.parametrize("pp,chunks", [(1, 2), (2, 2), (1, 4)])
def test_chunks_hold_the_virtual_stages_with_the_whole_models_names(pp: int, chunks: int
                                                                    ) -> None:
    """pp x chunks virtual stages: the chunks of every rank chained in virtual-stage order
    give the one-stage model's logits, and the names are the whole model's."""
    whole = models.GPT2(GPT2, seed=0).eval()
    want = whole(IDS).numpy()

    def run(comm: Any) -> tuple[list[str], Any]:
        mesh = fs.Mesh(comm, tp=1, pp=pp)
        m = models.GPT2(GPT2, mesh=mesh, chunks=chunks, seed=0).eval()
        return [n for n, _ in m.named_parameters()], m

    got = fs.DeviceGroup.cpu(pp, timeout=60).run(run)
    names = {n for ns, _ in got for n in ns}
    assert names == {n for n, _ in whole.named_parameters()}
    stages = {v: (st, m.comm.device) for _, m in got for v, st in zip(m.virtual, m.stages)}
    h: Any = IDS
    for v in range(pp * chunks):
        st, dev = stages[v]
        h = st(h if v == 0 else h.to(dev))
    np.testing.assert_allclose(h.numpy(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match=r"model\.stages"):
        got[0][1](IDS)
    with pytest.raises(ConfigError, match="pp=3 pipeline stages for 2 layers"):
        models.GPT2(models.GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4),
                    chunks=3, seed=0)
