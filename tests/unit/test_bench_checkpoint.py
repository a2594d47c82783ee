"""``fuelspmd bench checkpoint`` in one process: the load's peak is about the rank's own
shards plus one saved piece (not the whole model twice), the loaded model equals the
saved one, the timing has every kind, and bad options exit 2."""

from __future__ import annotations

import json

import pytest

from fuelspmd.bench.checkpoint import main

pytestmark = pytest.mark.timeout(120)


def test_load_peak_is_the_shards_plus_one_piece(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hidden", "64", "--layers", "2", "--rounds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["rows"]
    assert row["equal"] and row["shard_bytes"] == row["full_bytes"]  # one rank holds all
    assert row["shard_bytes"] <= row["load_peak"] <= \
        row["shard_bytes"] + 2 * row["largest_piece"] + (64 << 10)
    assert {"plain_ms", "async_ms", "during_ms", "blocking_ms", "async_ratio"} <= \
        set(out["timing"])


@pytest.mark.parametrize("argv", [["--hidden", "0"], ["--rounds", "0"], ["--tp", "0"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "fuelspmd bench checkpoint" in capsys.readouterr().err
