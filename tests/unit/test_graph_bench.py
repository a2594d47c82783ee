"""``fuelspmd bench graph`` at small sizes: the two steps agree, the report is complete,
and the lazy step's live-bytes peak is no more than eager numpy's traced peak."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fuelspmd import graph
from fuelspmd.bench import graph as bench


@pytest.mark.parametrize("sizes", [(8, 32, 64), (20, 48, 4096)])  # the second runs chunked
def test_lazy_step_matches_eager_numpy_to_float32_tolerance(sizes: tuple[int, ...]) -> None:
    batch, d_in, d_hidden = sizes
    args = bench.make_inputs(batch=batch, d_in=d_in, d_hidden=d_hidden, seed=3)
    for want, got in zip(bench.eager_step(*args), bench.lazy_step(*args)):
        assert np.asarray(got).dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_lazy_peak_is_at_most_eager_peak() -> None:
    args = bench.make_inputs(batch=32, d_in=256, d_hidden=1024)
    bench.lazy_step(*args)  # plan once, so only the run is measured below
    eager_peak = bench.traced_peak(bench.eager_step, args)
    bench.lazy_step(*args)
    lazy_peak = graph.default_executor().peak_bytes
    grads = 4 * (256 * 1024 * 2 + 1024 + 256)  # the outputs alone
    assert grads <= lazy_peak <= eager_peak


@pytest.mark.timeout(60)
def test_main_prints_json_with_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--repeat", "2", "--build-repeat", "1", "--nodes", "60,240",
            "--batch", "4", "--d-in", "16", "--d-hidden", "32"]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["blas_threads"] == [1]
    assert r["max_rel_error"] < 1e-5 and r["lazy_ms"] > 0 and r["eager_ms"] > 0
    assert [abs(b["nodes"] - n) <= 6 for b, n in zip(r["build"], (60, 240))] == [True, True]
    assert r["cpu_ratio_lazy_over_eager"] > 0 and r["build_cpu_ratio_last_over_first"] > 0
    assert r["plan_cache"]["hits"] >= 2


def test_main_prints_tables(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--repeat", "1", "--build-repeat", "1", "--nodes", "30", "--batch", "2",
            "--d-in", "8", "--d-hidden", "8"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "eager numpy" in out and "lazy fuelspmd" in out and "build + optimise" in out
