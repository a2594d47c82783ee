"""``fuelspmd bench optim`` in one process: ZeRO-1's bytes per rank are 1/dp of AdamW's,
the two give the same parameters, and bad options exit 2."""

from __future__ import annotations

import json
import math

import pytest

from fuelspmd.bench.optim import main, model_shapes


def test_zero1_holds_one_dp_th_of_the_state_and_the_same_parameters(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hidden", "16", "--layers", "1", "--dp", "1,2,4", "--steps", "1",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    n = sum(math.prod(s) for s in model_shapes(16, 1))
    for row in rows:
        assert row["adamw_bytes"] == 2 * 4 * n  # two float32 moments per element
        assert row["ratio"] == pytest.approx(1 / row["dp"], rel=0.02)
        assert row["max_diff"] == 0.0


def test_bf16_adds_float32_master_weights(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hidden", "16", "--layers", "1", "--dp", "2", "--steps", "1",
                 "--dtype", "bfloat16", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["adamw_bytes"] == 6 * row["param_bytes"]  # (master + 2 moments) x 4 / 2 B
    assert row["ratio"] == pytest.approx(0.5, rel=0.02)


@pytest.mark.parametrize("argv", [["--dp", "0"], ["--dp", "two"], ["--steps", "0"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "fuelspmd bench optim" in capsys.readouterr().err
