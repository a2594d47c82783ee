"""``fuelspmd bench recompute`` in one process: recomputing holds fewer bytes at the peak,
with the same gradients, and bad options exit 2."""

from __future__ import annotations

import json

import pytest

from fuelspmd.bench.recompute import main


def test_recompute_lowers_the_peak_and_keeps_the_gradients(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--blocks", "4", "--hidden", "16", "--ffn", "256", "--batch", "64",
                 "--steps", "1", "--json"]) == 0
    kept, recomputed = json.loads(capsys.readouterr().out)["rows"]
    assert (kept["recompute"], recomputed["recompute"]) == (False, True)
    assert recomputed["max_diff"] == 0.0
    activations = [r["peak_bytes"] - r["grad_bytes"] for r in (kept, recomputed)]
    assert activations[1] < 0.5 * activations[0], (kept, recomputed)


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--blocks", "0"]) == 2
    assert "fuelspmd bench recompute" in capsys.readouterr().err
