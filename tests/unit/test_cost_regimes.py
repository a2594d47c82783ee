"""Size regimes in the cost model and the calibration fit, in one process.

The fit is checked on synthetic measurements drawn from a known two-regime machine (plus
multiplicative noise): it must find the band edge, recover the numbers of each band well
enough to predict held-back points, and do better than one alpha-beta line could.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fuelspmd.bench.calibrate import (
    MIN_LATENCY_S,
    SIZES,
    Bounds,
    check,
    copy_bandwidth,
    fit,
    model_for,
    quality,
    summary,
)
from fuelspmd.cost import CostModel, Regime, calibrated_model, regimes_from_dict, regimes_to_dict
from fuelspmd.cost.calibration import save_calibration
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology

SMALL = Regime(50_000, 5e-6, 0.5e9, 2e9, ((1.5, 30e-6), (2.0, 20e-6)))
LARGE = Regime(math.inf, 100e-6, 5e9, 3e9, ((1.5, 60e-6), (2.0, 40e-6)))
CORES = 2


def synthetic(seed: int, regimes: tuple[Regime, ...] = (SMALL, LARGE)
              ) -> list[dict[str, object]]:
    """Records as ``measure`` returns them, from the two-regime model times noise."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (2, 3, 4):
        truth = model_for(n, list(regimes), cores=CORES)
        for size in SIZES:
            for c in ("all_reduce", "all_gather", "reduce_scatter"):
                nbytes = size if c == "all_reduce" else max(1, round(size / 4 / n)) * 4 * n
                t = truth.predict(c, nbytes, range(n))
                a, b = t * rng.lognormal(0, 0.05, 2)
                out.append({"collective": c, "ranks": n, "nbytes": nbytes, "nominal": size,
                            "fit_s": float(a), "check_s": float(b)})
    return out


def test_fit_finds_the_regimes_and_predicts_the_check_set() -> None:
    records = synthetic(0)
    regimes = fit(records, cores=CORES)
    assert 2 <= len(regimes) <= 3
    assert any(32768 < r.upto < 262144 for r in regimes)  # the edge between the bands
    rows = check(records, regimes, cores=CORES)
    med = summary(rows)
    assert med["all"] < 0.1, med
    one = fit(records, cores=CORES, max_regimes=1)
    assert len(one) == 1
    worst = max(r["error"] for r in rows)
    assert worst < 0.3
    assert max(r["error"] for r in check(records, one, cores=CORES)) > 2 * worst


def test_the_fit_stays_inside_physics_and_says_where_it_is_pinned() -> None:
    """Times that a latency of 1 ns and a 50 GB/s link would give: unbounded, the fit
    follows them; bounded, alpha stops at the floor and the bandwidths at the ceiling, and
    the regime says which of its numbers the measurements did not determine."""
    fast = Regime(math.inf, 1e-9, 50e9, 50e9, ((1.5, 30e-6), (2.0, 20e-6)))
    records = synthetic(1, (fast,))
    loose = fit(records, cores=CORES, max_regimes=1, bounds=Bounds(1e-10, 1e12))[0]
    assert loose.latency < MIN_LATENCY_S and loose.bandwidth > 20e9
    bounds = Bounds(max_bandwidth=8e9)
    (tight,) = fit(records, cores=CORES, max_regimes=1, bounds=bounds)
    assert tight.latency >= MIN_LATENCY_S and tight.bandwidth <= 8e9 * (1 + 1e-9)
    assert tight.reduce_bandwidth <= 8e9 * (1 + 1e-9)
    pinned = bounds.at_bound(tight)
    assert "alpha at the 0.1 us floor" in pinned
    assert "bandwidth at the 8 GB/s ceiling" in pinned
    assert bounds.at_bound(SMALL) == []


def test_quality_is_r2_of_log_time_and_the_errors() -> None:
    records = synthetic(0)
    rows = check(records, fit(records, cores=CORES), cores=CORES)
    q = quality(rows)
    assert 0.98 < q["r2_log_time"] <= 1.0
    assert q["median_abs_error"] == summary(rows)["all"]
    assert q["max_abs_error"] == max(r["error"] for r in rows)
    flat = [{**r, "predicted_s": float(np.exp(np.mean(np.log([x["check_s"] for x in rows]))))}
            for r in rows]  # one time for every point: R^2 = 0
    assert quality(flat)["r2_log_time"] == pytest.approx(0.0, abs=1e-9)


def test_copy_bandwidth_is_a_plausible_memory_rate() -> None:
    rate = copy_bandwidth(8 << 20, reps=3)
    assert 1e8 < rate < 1e12


def test_regimes_price_each_size_with_its_band() -> None:
    node = Node("h", 4, Link("shm", 1e9, 1e-6), reduce_bandwidth=1e9, cores=CORES)
    topo = Topology([node])
    plain = CostModel(topo)
    banded = CostModel(topo, regimes=[SMALL, LARGE])
    two = [0, 1]
    for nbytes, r in ((4096, SMALL), (1 << 24, LARGE)):
        want = CostModel(Topology([Node("h", 4, Link("shm", r.bandwidth, r.latency),
                                        reduce_bandwidth=r.reduce_bandwidth, cores=CORES)]))
        assert banded.predict("all_reduce", nbytes, two) == pytest.approx(
            want.predict("all_reduce", nbytes, two))
    assert banded.predict("all_gather", 1 << 24, two) != plain.predict("all_gather", 1 << 24,
                                                                       two)
    # ranks beyond the cores: each step waits the crowded latency of the ratio measured
    e = banded.estimate("all_gather", 64, range(3), algorithm="ring")
    assert e.latency == pytest.approx(2 * 30e-6)
    e4 = banded.estimate("all_gather", 64, range(4), algorithm="ring")
    assert e4.latency == pytest.approx(3 * 20e-6)
    # between and beyond the measured ratios: interpolated, then scaled by the extra ranks
    assert SMALL.crowded_latency(1.75) == pytest.approx(25e-6)
    assert SMALL.crowded_latency(3.0) == pytest.approx(20e-6 * 2)
    assert SMALL.crowded_latency(1.0) is None and Regime(1, 0, 1, 1).crowded_latency(2) is None


def test_regimes_round_trip_and_are_checked() -> None:
    data = regimes_to_dict([SMALL, LARGE])
    assert data[-1]["upto"] is None
    assert regimes_from_dict(data) == (SMALL, LARGE)
    with pytest.raises(ConfigError, match="ascending"):
        regimes_from_dict(list(reversed(data)))
    with pytest.raises(ConfigError, match="bandwidth"):
        Regime(10, 1e-6, 0.0, 1e9)
    with pytest.raises(ConfigError, match="ratios > 1"):
        Regime(10, 1e-6, 1e9, 1e9, ((0.5, 1e-6),))
    topo = Topology([Node("h", 2, Link("shm", 1e9, 1e-6), reduce_bandwidth=1e9)])
    assert calibrated_model(topo, {"shm": {}, "regimes": data}).regimes == (SMALL, LARGE)
    assert calibrated_model(topo, None).regimes == ()


def test_gpu_links_ignore_the_shm_regimes() -> None:
    topo = Topology([Node("g", 2, Link("nvlink", 1e11, 2e-6))])
    assert CostModel(topo, regimes=[SMALL, LARGE]).predict("all_reduce", 1 << 20, [0, 1]) == \
        CostModel(topo).predict("all_reduce", 1 << 20, [0, 1])


def test_a_file_that_breaks_its_own_bounds_is_refused(tmp_path: Path) -> None:
    data = {"shm": {"latency": 5e-6, "bandwidth": 5e9, "reduce_bandwidth": 3e9},
            "regimes": regimes_to_dict([SMALL, LARGE]),
            "bounds": {"min_latency": 1e-7, "max_bandwidth": 10e9}}
    save_calibration(data, tmp_path / "ok.json")
    data["bounds"]["max_bandwidth"] = 4e9  # LARGE's 5 GB/s is past it
    with pytest.raises(ConfigError, match=r"breaks the file's own bounds .*bandwidths <= "
                                          r"4e\+09 B/s"):
        save_calibration(data, tmp_path / "bad.json")
