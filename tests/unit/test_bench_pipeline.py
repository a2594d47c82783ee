"""``fuelspmd bench pipeline`` in one process (a one-stage pipeline): the figures it
prints come from a real measured timeline and a real simulation.

Under ``mpiexec -n 2 fuelspmd bench pipeline`` the same code compares p = 2 stages.
"""

from __future__ import annotations

import json

import pytest

from fuelspmd.bench import pipeline

pytestmark = pytest.mark.timeout(60)


def test_one_stage_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--microbatches", "4", "--hidden", "16", "--batch", "4", "--layers", "3",
            "--steps", "2", "--json"]
    assert pipeline.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["kind"]: r for r in res["rows"]}
    assert set(rows) == {"gpipe", "1f1b"}
    for r in rows.values():
        assert r["stages"] == 1 and r["formula"] == 0.0
        assert r["step_ms"] > 0 and r["sim_ms"] > 0
        assert 0.5 < r["step_vs_sim"] < 2.0  # one rank: the step is the sum of its actions
        assert r["jitter"] >= 0.0
    # one stage: GPipe keeps all 4 micro-batches, 1F1B one at a time
    assert res["peak_1f1b_vs_gpipe"] == pytest.approx(res["bound"]) == 0.25
    # the partition of the measured costs: all 3 layers on the one stage
    assert res["layers_per_stage"] == [3]
    assert all(c > 0 for c in res["costs_ms"].values())


def test_bad_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert pipeline.main(["--steps", "0"]) == 2
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err
    assert pipeline.main(["--dp", "2", "--steps", "1"]) == 2
    assert "--dp 2 does not divide the 1 ranks; use one of [1]" in capsys.readouterr().err


def test_jitter_is_the_spread_of_identical_actions() -> None:
    from fuelspmd.pipeline_parallel import schedule

    s = schedule("1f1b", 2, 4)
    even = {a: (1.0 if a.kind == "F" else 2.0) for acts in s.actions for a in acts}
    assert pipeline._jitter(s, even) == 0.0
    # every rank's F times 1, 1, 3, 3 (std 1, mean 2): 0.5; B times stay even: 0.0
    uneven = {a: ((1.0 if a.microbatch < 2 else 3.0) if a.kind == "F" else 2.0)
              for acts in s.actions for a in acts}
    assert pipeline._jitter(s, uneven) == pytest.approx(0.25)  # median of 0.5, 0.5, 0, 0
