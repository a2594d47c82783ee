"""examples/generate.py and examples/train.py started from a Hugging Face directory
(``--from DIR``): generation EQUAL to the model's no-cache forward at tp 2, and
fine-tuning that lowers the loss at tp 1 and at pp 2 with tied embeddings, whose two
copies stay equal."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_hf as H

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" /
                                                  f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # train.py's dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for name in ("gpt2", "llama"):
        H.build(name, root / name)
    return {name: root / name for name in ("gpt2", "llama")}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_from_a_directory(dirs: dict[str, Path], name: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    gen = _example("generate")
    argv = ["--from", str(dirs[name]), "--requests", "3", "--prefix", "16", "--suffix", "3",
            "--new-tokens", "5", "--block-size", "8", "--check-every", "1"]
    assert gen.main([*argv, "--devices", "cpu:2", "--check"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["check"] == "EQUAL" and out["tp"] == 2
    assert out["prefill_tokens_computed"] == 19 + 2 * 3  # two full shared blocks hit
    assert all(0 <= t < H.VOCAB for seq in out["tokens"] for t in seq)
    with pytest.raises(SystemExit):  # GPT-2 has 64 positions: 70 do not fit
        gen.parse([*argv, "--prefix", "62"] if name == "gpt2" else ["--bad"])


def _losses(out: str) -> tuple[float, float]:
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) in", out)
    assert m is not None, out
    return float(m[1]), float(m[2])


def test_train_from_a_directory(dirs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    train = _example("train")
    base = ["--steps", "6", "--lr", "3e-3", "--microbatches", "2", "--batch", "4"]
    assert train.main(["--from", str(dirs["llama"]), *base]) == 0
    first, last = _losses(capsys.readouterr().out)
    assert last < first - 0.1

    # pp 2 with GPT-2's tied table on both stages: after training, the copies are equal
    seen: dict[int, np.ndarray] = {}
    load = models.from_pretrained

    def keep(*a: object, **kw: object) -> models.Decoder:
        model = load(*a, **kw)  # type: ignore[arg-type]
        seen[model.stage] = model.embed.weight  # type: ignore[assignment]
        return model

    monkeypatch.setattr(models, "from_pretrained", keep)
    assert train.main(["--from", str(dirs["gpt2"]), "--devices", "cpu:2", "--tp", "1",
                       "--pp", "2", *base]) == 0
    first, last = _losses(capsys.readouterr().out)
    assert last < first - 0.1
    a, b = (np.asarray(seen[s].numpy()) for s in (0, 1))  # type: ignore[attr-defined]
    assert np.array_equal(a, b)
    start = models.from_pretrained(dirs["gpt2"]).embed.weight.numpy()
    assert not np.array_equal(a, start)  # it was trained


def test_a_table_tied_across_stages_counts_once_in_the_clip_norm(
        dirs: dict[str, Path]) -> None:
    """pp 2 holds GPT-2's tied table on both stages: the gradient norm the clip uses (and
    so every clipped step) is the one-stage model's, not one with the table counted twice."""
    train = _example("train")
    base = ["--from", str(dirs["gpt2"]), "--steps", "3", "--lr", "3e-3", "--clip", "0.5",
            "--microbatches", "2", "--batch", "4", "--tp", "1"]
    one = fs.DeviceGroup.cpu(1, timeout=60).run(train.train, [train.parse(base)])[0]
    two = fs.DeviceGroup.cpu(2, timeout=60).run(
        train.train, [train.parse([*base, "--pp", "2"])] * 2)[0]
    np.testing.assert_allclose(two["norms"], one["norms"], rtol=1e-5)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)


def test_train_from_refuses_the_builtin_only_options(dirs: dict[str, Path]) -> None:
    train = _example("train")
    with pytest.raises(SystemExit):
        train.parse(["--from", str(dirs["llama"]), "--check"])
    assert fs.DeviceGroup  # the module imports fuelspmd as the examples do
