"""Size regimes in the cost model and the calibration fit, in one process.

The fit is checked on synthetic measurements drawn from a known two-regime machine (plus
multiplicative noise): it must find the band edge, recover the numbers of each band well
enough to predict held-back points, and do better than one alpha-beta line could.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fuelspmd.bench.calibrate import SIZES, check, fit, model_for, summary
from fuelspmd.cost import CostModel, Regime, calibrated_model, regimes_from_dict, regimes_to_dict
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology

SMALL = Regime(50_000, 5e-6, 0.5e9, 2e9, ((1.5, 30e-6), (2.0, 20e-6)))
LARGE = Regime(math.inf, 100e-6, 5e9, 3e9, ((1.5, 60e-6), (2.0, 40e-6)))
CORES = 2


def synthetic(seed: int) -> list[dict[str, object]]:
    """Records as ``measure`` returns them, from the two-regime model times noise."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (2, 3, 4):
        truth = model_for(n, [SMALL, LARGE], cores=CORES)
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
