"""``fuelspmd bench train`` at a tiny size in one process: transformers' GPT2LMHeadModel
loads fuelspmd.models.GPT2's weights (its first loss is fuelspmd's), the table has every
ratio, bad options exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.bench.train import SIZES, batch, gpt2, loss, main, save_weights, torch_model
from fuelspmd.comm import Communicator
from fuelspmd.transport import SelfTransport

pytestmark = pytest.mark.timeout(300)


def test_torch_and_fuelspmd_models_give_the_same_loss(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    size = SIZES["tiny"]
    ids, targets = batch(size, 1, 0)
    comm = Communicator(SelfTransport(), device="cpu")
    mine = float(loss(gpt2(size, comm=comm), fs.tensor(ids), fs.tensor(targets),
                      comm=comm).numpy())
    model = torch_model(size, save_weights(size, "cpu", str(tmp_path)))
    theirs = model(torch.from_numpy(ids), torch.from_numpy(targets)).item()
    np.testing.assert_allclose(mine, theirs, rtol=1e-5)


def test_json_rows_have_every_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["--size", "tiny", "--rounds", "1", "--reps", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["mode"] == "tp1" and row["ranks"] == 1
    for key in ("torch_ms", "compiled_ms", "uncompiled_ms", "compiled_vs_torch",
                "uncompiled_vs_torch", "compiled_vs_uncompiled"):
        assert row[key] > 0
    assert row["first_loss_rel_diff"] < 1e-5  # the same weights and batch


@pytest.mark.parametrize("argv", [["--size", "huge"], ["--rounds", "0"], ["--mode", "dp"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "fuelspmd bench train" in capsys.readouterr().err
