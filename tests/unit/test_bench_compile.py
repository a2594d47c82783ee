"""``fuelspmd bench compile`` at a small size: it captures the step, counts its nodes and
reports every figure; bad options exit 2."""

from __future__ import annotations

import json

import pytest

from fuelspmd.bench.compile import main, nodes_of

pytestmark = pytest.mark.timeout(300)


def test_json_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--layers", "2", "--rounds", "1", "--calls", "2", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["nodes"] == nodes_of(2, 8) > 50
    for key in ("uncompiled_us", "compiled_us", "plans_us", "host_us"):
        assert row[key] > 0


def test_the_default_step_has_about_a_thousand_nodes() -> None:
    assert 1000 <= nodes_of(26, 8) <= 1200


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--calls", "0"]) == 2
    assert "fuelspmd bench compile" in capsys.readouterr().err
