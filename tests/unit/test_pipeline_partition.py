"""``partition``: exact against brute force over every cut, deterministic ties, typed errors."""

from __future__ import annotations

import math
from itertools import combinations, pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel import partition


def brute_force(costs: list[float], stages: int, first: float, last: float) -> float:
    """The smallest bottleneck over every placement of ``stages - 1`` cuts (numpy sums)."""
    n, best = len(costs), math.inf
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        loads = [float(np.sum(costs[a:b])) for a, b in pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=9),
    data=st.data(),
    first=st.sampled_from([0.0, 0.5, 4.0]),
    last=st.sampled_from([0.0, 1.5, 7.0]),
)
def test_matches_brute_force(
    costs: list[float], data: st.DataObject, first: float, last: float
) -> None:
    stages = data.draw(st.integers(1, len(costs)))
    result = partition(costs, stages, first_extra=first, last_extra=last)
    assert len(result) == stages
    assert result.boundaries[0] == 0 and result.boundaries[-1] == len(costs)
    assert all(len(r) >= 1 for r in result)
    assert [r.stop for r in result.ranges[:-1]] == [r.start for r in result.ranges[1:]]
    loads = [float(np.sum(costs[r.start : r.stop])) for r in result]
    loads[0] += first
    loads[-1] += last
    np.testing.assert_allclose(result.costs, loads, rtol=1e-12)
    assert result.bottleneck == pytest.approx(brute_force(costs, stages, first, last), rel=1e-12)


def test_beats_the_greedy_average_split() -> None:
    # Cutting where the running sum passes total/stages gives [9], [1, 1, 9] -> 11;
    # the optimum is [9, 1], [1, 9] -> 10.
    result = partition([9, 1, 1, 9], 2)
    assert result.bottleneck == 10
    assert result.ranges == (range(0, 2), range(2, 4))


def test_ties_fill_early_stages_first() -> None:
    result = partition([1.0] * 6, 4)
    assert result.ranges == (range(0, 2), range(2, 4), range(4, 5), range(5, 6))
    assert result.costs == (2.0, 2.0, 1.0, 1.0)
    assert partition([1.0] * 6, 4).ranges == result.ranges  # same answer every call


def test_extras_move_layers_off_the_end_stages() -> None:
    result = partition([1.0] * 8, 4, first_extra=2.0, last_extra=2.0)
    assert [len(r) for r in result] == [1, 3, 3, 1]
    assert result.bottleneck == 3.0


def test_one_stage_and_one_layer_per_stage() -> None:
    assert partition([3.0, 4.0], 1, first_extra=1, last_extra=2).costs == (10.0,)
    assert partition([3.0, 4.0, 5.0], 3).ranges == (range(0, 1), range(1, 2), range(2, 3))


def test_many_layers_is_fast_and_balanced() -> None:
    rng = np.random.default_rng(0)
    costs = rng.uniform(0.5, 2.0, size=300).tolist()
    result = partition(costs, 8)
    assert result.bottleneck >= sum(costs) / 8
    assert result.bottleneck <= sum(costs) / 8 + max(costs)


@pytest.mark.parametrize(
    ("costs", "stages", "kwargs", "needle"),
    [
        ([1.0, 2.0], 3, {}, "cannot split 2 layers into 3 stages"),
        ([1.0, 2.0], 0, {}, "stages must be an int >= 1, got 0"),
        ([1.0, 0.0, 2.0], 2, {}, "layer 1 has cost 0.0"),
        ([1.0, -2.0], 1, {}, "layer 1 has cost -2.0"),
        ([math.nan, 1.0], 1, {}, "layer 0 has cost nan"),
        ([1.0, math.inf], 1, {}, "layer 1 has cost inf"),
        ([1.0], 1, {"first_extra": -1.0}, "first_extra must be"),
        ([1.0], 1, {"last_extra": math.nan}, "last_extra must be"),
        ([], 1, {}, "cannot split 0 layers into 1 stages"),
    ],
)
def test_bad_input_raises_config_error(
    costs: list[float], stages: int, kwargs: dict, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        partition(costs, stages, **kwargs)
