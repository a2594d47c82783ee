"""fuelspmd.models against transformers: GPT-2 and Llama (tied, untied, an explicit
head_dim) built by transformers from small configs with random float64 weights, loaded
from their Hugging Face directories at tp 1 and as devices of a DeviceGroup (tp 2, pp 2):
logits equal to float64 rounding, greedy tokens equal ``generate``, directories written
by ``save_pretrained`` loaded back by transformers, the sharded index, bfloat16 files, and
the refusals."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import models
from fuelspmd.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_hf as H

pytestmark = pytest.mark.timeout(120)
IDS = np.random.default_rng(0).integers(0, H.VOCAB, (2, 11))
EXACT = 1e-12  # float64 rounding, relative to the largest logit


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (directory, transformers model), each built once."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, H.build(name, root / name)) for name in H.CONFIGS}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", sorted(H.CONFIGS))
def test_logits_equal_transformers_at_tp1(hf: dict, name: str) -> None:
    path, ref = hf[name]
    model = models.from_pretrained(path, dtype="float64")
    got = model(IDS).numpy()
    assert got.shape == (2, 11, H.VOCAB)
    assert rel(got, H.hf_logits(ref, IDS)) < EXACT
    # transformers as it runs (float32 RMSNorm and rotary tables in Llama): its rounding
    assert rel(got, H.hf_logits(ref, IDS, exact=False)) < 1e-6
    other = H.hf_logits(H.build(name, path.with_name(name + "_seed1"), seed=1), IDS)
    assert rel(got, other) > 1e-2  # another model's logits are far: the check can fail


@pytest.mark.parametrize("name", ["gpt2", "llama_tied", "llama_head_dim"])
def test_device_group_tp2_and_pp2_give_the_same_logits(hf: dict, name: str) -> None:
    path, ref = hf[name]
    want = H.hf_logits(ref, IDS)
    group = fs.DeviceGroup.cpu(2)
    tp2 = group.run(lambda comm: models.from_pretrained(path, comm=comm, dtype="float64")(IDS)
                    .numpy())
    for got in tp2:
        assert rel(got, want) < EXACT

    def stages(comm: Any) -> Any:  # pp 2: stage 0's hidden states sent to stage 1
        mesh = fs.Mesh(comm, pp=2)
        model = models.from_pretrained(path, mesh=mesh, dtype="float64")
        pp = mesh.comm("pp")
        if model.first:
            pp.send(model(IDS), 1).realize()
            return model
        return model, model(pp.recv((*IDS.shape, model.arch.hidden), "float64", 0)).numpy()

    first, (last, got) = group.run(stages)
    assert rel(got, want) < EXACT
    assert not hasattr(first, "head") and not hasattr(last, "pos")
    whole = dict(models.from_pretrained(path, dtype="float64").named_parameters())
    split = {**dict(first.named_parameters()), **dict(last.named_parameters())}
    assert list(split) == list(whole)  # the same names on every layout, in the same order
    assert first.layer_range[1] == last.layer_range[0]


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_tied"])
def test_greedy_tokens_equal_transformers_generate(hf: dict, name: str) -> None:
    path, ref = hf[name]
    ps, n = H.prompts(), 8
    want = [H.hf_greedy(ref, p, n) for p in ps]
    model = models.from_pretrained(path, dtype="float64")
    out = models.greedy(model, ps, n, block_size=4)
    assert out.tokens == want
    assert model._decode.replays > 0  # the decode steps ran compiled
    assert out.prefill_tokens_computed == len(ps[0]) + len(ps[1]) - 4  # one shared block
    for p, toks in zip(ps, want):  # the comparison is meaningful: no near-tie is decided
        logits = model([p + toks[:-1]]).numpy()[0, len(p) - 1:]
        assert H.margins(logits).min() > 1e-6
    tp2 = fs.DeviceGroup.cpu(2).run(lambda comm: models.from_pretrained(
        path, comm=comm, dtype="float64").generate(ps, n, block_size=4, check_every=1))
    assert tp2 == [want, want]


def test_saved_directories_load_in_transformers(hf: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    for name in ("gpt2", "llama", "llama_tied"):
        path, ref = hf[name]
        want = H.hf_logits(ref, IDS)
        one = tmp_path / f"{name}_tp1"
        models.from_pretrained(path, dtype="float64").save_pretrained(one)

        def save(comm: Any, path: Path = path, name: str = name) -> None:
            mesh = fs.Mesh(comm, pp=2)
            models.from_pretrained(path, mesh=mesh, dtype="float64").save_pretrained(
                tmp_path / f"{name}_pp2")

        fs.DeviceGroup.cpu(2).run(save)
        for out in (one, tmp_path / f"{name}_pp2"):
            back = AutoModelForCausalLM.from_pretrained(out, dtype=__import__("torch").float64)
            assert rel(H.hf_logits(back, IDS), want) < EXACT
            assert sorted(p.name for p in out.iterdir()) == [
                "config.json", "generation_config.json", "model.safetensors"]
            cfg = json.loads((out / "config.json").read_text())
            assert cfg["tie_word_embeddings"] == (name != "llama")


def test_sharded_index_format(hf: dict, tmp_path: Path) -> None:
    _, ref = hf["llama"]
    path = tmp_path / "sharded"
    H.build("llama", path, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    got = fs.DeviceGroup.cpu(2).run(lambda comm: models.from_pretrained(
        path, comm=comm, dtype="float64")(IDS).numpy())
    assert rel(got[1], H.hf_logits(ref, IDS)) < EXACT


def test_bfloat16_files_read_and_written(tmp_path: Path) -> None:
    """A bf16 directory reads into float32 bit-exactly (bf16 widens exactly) and a bf16
    model writes a bf16 file transformers reads back to the same bits."""
    import torch

    ref = H.build("llama", tmp_path / "bf16", dtype="bfloat16")
    model = models.from_pretrained(tmp_path / "bf16", dtype="float32")
    theirs = {k: v.float().numpy() for k, v in ref.state_dict().items()}
    ours = model.state_dict()
    assert np.array_equal(ours["blocks.1.attn.k.weight"],
                          theirs["model.layers.1.self_attn.k_proj.weight"].T)
    assert np.array_equal(ours["embed.weight"], theirs["model.embed_tokens.weight"])
    bf = models.from_pretrained(tmp_path / "bf16", dtype="bfloat16")
    bf.save_pretrained(tmp_path / "bf16_out")
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16_out", dtype=torch.bfloat16)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def _edit(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_values_and_sizes_are_refused(hf: dict, tmp_path: Path) -> None:
    llama, gpt2 = hf["llama"][0], hf["gpt2"][0]
    scaled = _edit(llama, tmp_path / "scaled", rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match=r"rope_scaling=.*set it to null"):
        models.from_pretrained(scaled)
    with pytest.raises(ConfigError, match="activation_function='relu'"):
        models.from_pretrained(_edit(gpt2, tmp_path / "relu", activation_function="relu"))
    with pytest.raises(ConfigError, match="attention_bias=True"):
        models.from_pretrained(_edit(llama, tmp_path / "bias", attention_bias=True))
    with pytest.raises(ConfigError, match="model_type 'bert'"):
        models.from_pretrained(_edit(llama, tmp_path / "bert", model_type="bert"))
    cfg = models.LlamaConfig.from_hf(json.loads((llama / "config.json").read_text()))

    def tp3(comm: Any) -> str:
        with pytest.raises(ConfigError) as err:
            models.Llama(cfg, comm=comm)
        return str(err.value)

    msg = fs.DeviceGroup.cpu(3).run(tp3)
    assert len(set(msg)) == 1  # every rank the same error, before any communication
    assert "TP size 3 does not divide heads=4, kv_heads=2" in msg[0]
    assert "ffn=128" in msg[0] and "TP sizes that fit this model: [1, 2, 4]" in msg[0]


def test_a_tied_head_that_differs_from_the_embedding_is_refused(hf: dict,
                                                                tmp_path: Path) -> None:
    """An untied directory whose config claims tied embeddings: lm_head.weight differs."""
    lie = _edit(hf["llama"][0], tmp_path / "lie", tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"lm_head\.weight differs from the embedding"):
        models.from_pretrained(lie)


def test_seeded_model_round_trips_through_its_own_directory(tmp_path: Path) -> None:
    """Without transformers: a seeded GPT-2 saved and loaded holds the same numbers."""
    cfg = models.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16)
    model = models.GPT2(cfg, seed=3, dtype="float64")
    model.save_pretrained(tmp_path / "m")
    back = models.from_pretrained(tmp_path / "m", dtype="float64")
    ids = np.arange(12).reshape(2, 6)
    assert np.array_equal(model(ids).numpy(), back(ids).numpy())
    assert not np.array_equal(model(ids).numpy(),
                              models.GPT2(cfg, seed=4, dtype="float64")(ids).numpy())


def test_a_save_that_fails_midway_leaves_the_old_directory(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The file is written under a temporary name and renamed: a save that fails after
    its first tensor leaves the previous model loadable and no temporary file behind."""
    from fuelspmd.models import safetensors_io

    cfg = models.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16)
    old = models.GPT2(cfg, seed=3, dtype="float64")
    old.save_pretrained(tmp_path)
    write = safetensors_io.StreamingWriter.write

    def fail_after_one(self: Any, name: str, array: np.ndarray) -> None:
        if len(self.crcs) == 1:
            raise OSError("disk full")
        write(self, name, array)

    monkeypatch.setattr(safetensors_io.StreamingWriter, "write", fail_after_one)
    with pytest.raises(OSError, match="disk full"):
        models.GPT2(cfg, seed=4, dtype="float64").save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors"]
    ids = np.arange(8).reshape(2, 4)
    back = models.from_pretrained(tmp_path, dtype="float64")
    assert np.array_equal(back(ids).numpy(), old(ids).numpy())
