"""A Hugging Face directory is untrusted (DESIGN.md invariant 11), each finding of issue 40
in turn: ``from_pretrained`` checks config.json's types, ranges and head sizes and every
tensor's shape and dtype against it before it builds anything; names in the weight map
stay in the folder; every path to tensor bytes takes the same header checks (BF16 with
overlapping offsets); a damaged tensor of a directory ``save_pretrained`` wrote is found
by its CRC-32; and ``save_pretrained`` writes the float32 masters of 16-bit training and
``generation_config.json``. Models are small and seeded (no transformers but where it is
the oracle of the files it reads)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_damage as dmg

import fuelspmd as fs
from fuelspmd import models, optim
from fuelspmd.comm import Communicator
from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import CheckpointCorruptError, ConfigError, FuelError
from fuelspmd.transport import SelfTransport

pytestmark = pytest.mark.timeout(120)
IDS = np.arange(12).reshape(2, 6) % 32
GPT2 = dict(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=16)
LLAMA = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GPT-2 and a Llama directory, float32 and bfloat16, saved by save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (cls, cfg) in {"gpt2": (models.GPT2, models.GPT2Config(**GPT2)),
                             "llama": (models.Llama, models.LlamaConfig(**LLAMA))}.items():
        for dt in ("float32", "bfloat16"):
            cls(cfg, seed=1, dtype=dt).save_pretrained(root / f"{name}-{dt}")
            out[f"{name}-{dt}"] = root / f"{name}-{dt}"
    return out


def _copy(src: Path, dst: Path, **config: Any) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---- config.json --------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "match"), [
    ("{not json", "not JSON"), ("[1, 2]", "a JSON list, not an object"),
    ('{"model_type": ["llama"]}', "model_type"),
])
def test_a_config_that_is_no_object_is_refused(dirs: dict[str, Path], tmp_path: Path,
                                               text: str, match: str) -> None:
    """Before: JSONDecodeError, AttributeError."""
    d = _copy(dirs["llama-float32"], tmp_path / "d")
    (d / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=match):
        models.from_pretrained(d)


@pytest.mark.parametrize(("name", "change", "match"), [
    ("llama", {"vocab_size": -64}, r"vocab_size=-64 \(give an int >= 1\)"),
    ("llama", {"num_attention_heads": 0}, r"num_attention_heads=0"),
    ("llama", {"hidden_size": "32"}, r"hidden_size='32'"),
    ("llama", {"num_hidden_layers": 2.5}, r"num_hidden_layers=2.5"),
    ("llama", {"rms_norm_eps": -1}, r"rms_norm_eps=-1 \(give a number > 0\)"),
    ("llama", {"tie_word_embeddings": "no"}, r"tie_word_embeddings='no'"),
    ("llama", {"rope_parameters": {"rope_theta": "x"}}, r"rope_theta='x'"),
    ("llama", {"num_key_value_heads": 3}, r"4 heads are not a multiple of 3"),
    ("gpt2", {"n_head": 5}, r"5 heads do not divide the width 32"),
    ("gpt2", {"n_inner": 0}, r"n_inner=0"),
])
def test_a_config_of_wrong_types_or_ranges_is_refused(dirs: dict[str, Path], tmp_path: Path,
                                                      name: str, change: dict[str, Any],
                                                      match: str) -> None:
    """Before: ValueError, AttributeError, or a model whose logits were wrong (GPT-2 with
    n_head 5 for n_embd 32)."""
    d = _copy(dirs[f"{name}-float32"], tmp_path / "d", **change)
    with pytest.raises(ConfigError, match=match):
        models.from_pretrained(d)


@pytest.mark.parametrize(("name", "change", "match"), [
    ("llama", {"num_hidden_layers": 1}, r"not in the model \['model\.layers\.1\."),
    ("llama", {"num_hidden_layers": 3}, r"missing \['model\.layers\.2\."),
    ("llama", {"head_dim": 4}, r"q_proj\.weight is \(32, 32\), config\.json gives \(16, 32\)"),
    ("gpt2", {"n_positions": 8}, r"wpe\.weight is \(16, 32\), config\.json gives \(8, 32\)"),
    ("llama", {"vocab_size": 64}, r"embed_tokens\.weight is \(32, 32\)"),
    ("llama", {"torch_dtype": "float16"}, r"dtypes \['float32'\], config\.json says float16"),
])
def test_tensors_that_the_config_does_not_describe_are_refused(
        dirs: dict[str, Path], tmp_path: Path, name: str, change: dict[str, Any],
        match: str) -> None:
    """Before: a config with fewer layers than the file, or head_dim 4 instead of 8,
    loaded without error and gave logits off by 1.6 to 3.3."""
    d = _copy(dirs[f"{name}-float32"], tmp_path / "d", **change)
    with pytest.raises(ConfigError, match=match):
        models.from_pretrained(d)


def test_a_huge_config_is_refused_before_anything_is_allocated(dirs: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """hidden_size 2**31: before, about 12 GB were allocated per rank before any check
    (the OOM killer ended the job). Under a 3 GiB address-space limit it is a ConfigError."""
    d = _copy(dirs["llama-float32"], tmp_path / "d", hidden_size=2 ** 31,
              intermediate_size=2 ** 31, num_attention_heads=2 ** 5)
    code = ("import sys\nfrom fuelspmd import models\nfrom fuelspmd.errors import FuelError\n"
            "try:\n    models.from_pretrained(sys.argv[1])\n"
            "except FuelError as e:\n    print(type(e).__name__, str(e)[:300])\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    run = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                         timeout=60, preexec_fn=limit,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.stdout.startswith("ConfigError") and "embed_tokens" in run.stdout, \
        (run.stdout, run.stderr[-2000:])


# ---- the weight files ----------------------------------------------------------------------
def _index(d: Path, weight_map: dict[str, str]) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                "weight_map": weight_map}))


@pytest.mark.parametrize("target", ["../outside.safetensors", "/tmp/outside.safetensors",
                                    "model.bin"])
def test_a_weight_map_entry_out_of_the_folder_is_never_read(dirs: dict[str, Path],
                                                            tmp_path: Path, target: str) -> None:
    d = _copy(dirs["llama-float32"], tmp_path / "d")
    shutil.copy(d / "model.safetensors", tmp_path / "outside.safetensors")
    _, header = dmg.read_header(d / "model.safetensors")
    names = [n for n in header if n != "__metadata__"]
    (d / "model.safetensors").rename(d / "part.safetensors")
    _index(d, {n: target if k == 0 else "part.safetensors" for k, n in enumerate(names)})
    with pytest.raises(ConfigError, match="never read"):
        models.from_pretrained(d)


def test_a_weight_file_linked_out_of_the_folder_is_never_read(dirs: dict[str, Path],
                                                              tmp_path: Path) -> None:
    d = _copy(dirs["llama-float32"], tmp_path / "d")
    (d / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (d / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(CheckpointCorruptError, match="link out of the folder"):
        models.from_pretrained(d)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapping_offsets_through_an_index_are_refused(dirs: dict[str, Path],
                                                         tmp_path: Path, dtype: str) -> None:
    """Before: BF16 tensors were read from the header's offsets without safetensors' own
    checks, so two tensors sharing bytes loaded garbage."""
    d = _copy(dirs[f"llama-{dtype}"], tmp_path / "d")
    _, header = dmg.read_header(d / "model.safetensors")
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    header["__metadata__"].pop("fuelspmd.crc32", None)
    dmg.write_header(d / "model.safetensors", header)
    _index(d, dict.fromkeys((k for k in header if k != "__metadata__"), "model.safetensors"))
    with pytest.raises(CheckpointCorruptError, match="a gap or an overlap"):
        models.from_pretrained(d)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_damaged_tensor_of_a_saved_directory_is_found(dirs: dict[str, Path],
                                                       tmp_path: Path, dtype: str) -> None:
    d = _copy(dirs[f"gpt2-{dtype}"], tmp_path / "d")
    dmg.flip(d / "model.safetensors", -3)

    def load(comm: Any) -> str:
        try:
            models.from_pretrained(d, comm=comm)
        except FuelError as e:
            return f"{type(e).__name__}: {e}"
        return "loaded"

    got = fs.DeviceGroup.cpu(2).run(load)
    assert got[0] == got[1] and got[0].startswith("CheckpointCorruptError") \
        and "CRC-32" in got[0], got


def test_a_pickle_directory_is_refused(tmp_path: Path, dirs: dict[str, Path]) -> None:
    d = _copy(dirs["gpt2-float32"], tmp_path / "d")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pickle files, which are never read"):
        models.from_pretrained(d)


# ---- save_pretrained -----------------------------------------------------------------------
def test_save_pretrained_writes_the_masters_of_16bit_training(tmp_path: Path) -> None:
    """bfloat16 training with AdamW's float32 masters: the directory holds the masters
    (float32), transformers loads it with them, and its generation_config.json."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = models.LlamaConfig(**LLAMA, extra={"bos_token_id": 1, "eos_token_id": 2})
    model = models.Llama(cfg, seed=1, dtype="bfloat16")
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(IDS).astype("float32").mean()
        opt.step(fs.grad(loss, opt.params))
    model.save_pretrained(tmp_path / "m", masters=opt)
    files = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert {v.dtype for v in files.values()} == {np.dtype("float32")}
    masters = {n: m.numpy() for (n, _), m in zip(model.named_parameters(), opt.master)}
    q = files["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(q.T, masters["blocks.0.attn.q.weight"])
    assert not np.array_equal(q.T, masters["blocks.0.attn.q.weight"].astype(
        to_numpy("bfloat16")).astype(np.float32))  # more than the 16-bit values
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float32"
    gen = GenerationConfig.from_pretrained(tmp_path / "m")
    assert (gen.bos_token_id, gen.eos_token_id) == (1, 2)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert back.dtype == torch.float32
    again = models.from_pretrained(tmp_path / "m")
    assert np.array_equal(dict(again.named_parameters())["blocks.0.attn.q.weight"].numpy(),
                          masters["blocks.0.attn.q.weight"])


def test_save_pretrained_writes_zero1_masters_gathered_over_dp(tmp_path: Path) -> None:
    """ZeRO-1 over dp 2 holds half of each master on each rank: the file holds them whole,
    equal to one process's AdamW masters after the same steps."""
    cfg = models.GPT2Config(**GPT2)

    def train(comm: Any, zero: bool) -> Any:
        mesh = fs.Mesh(comm, dp=comm.size)
        model = models.GPT2(cfg, seed=1, dtype="bfloat16", mesh=mesh)
        inner = optim.AdamW(model.parameters(), lr=1e-3)
        opt: Any = optim.ZeRO1(inner, dp=mesh.comm("dp"), bucket_bytes=4096) if zero else inner
        loss = model(IDS).astype("float32").mean()
        opt.step(fs.grad(loss, opt.params))
        model.save_pretrained(tmp_path / ("z" if zero else "a"), masters=opt)

    fs.DeviceGroup.cpu(2).run(lambda c: train(c, True))
    train(Communicator(SelfTransport(), device="cpu:0"), False)
    from safetensors.numpy import load_file

    z, a = (load_file(str(tmp_path / w / "model.safetensors")) for w in "za")
    assert set(z) == set(a)
    for k in a:
        np.testing.assert_allclose(z[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
