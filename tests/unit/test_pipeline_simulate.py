"""simulate(): bubble formulas, a reference recurrence, communication, memory, zero bubble."""

from __future__ import annotations

from itertools import pairwise

import pytest

from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel import Action, Timeline, schedule, simulate

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ratio", [1.0, 2.0, 0.5])
def test_bubble_formula(kind: str, ratio: float) -> None:
    """Uniform stage times, t_comm = 0: step (m + p - 1)(t_f + t_b) for any t_b / t_f."""
    t_f, t_b = 1.5, 1.5 * ratio
    for p, m in GRID:
        tl = simulate(schedule(kind, p, m), t_f, t_b)
        assert tl.makespan == pytest.approx((m + p - 1) * (t_f + t_b), rel=1e-12)
        assert tl.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_bubble_shrinks_by_the_chunk_count(chunks: int) -> None:
    """Each action is 1/c of the rank's model; the fill/drain is p - 1 chunk-steps."""
    for p, m in GRID:
        if m % p:
            continue
        tl = simulate(schedule("interleaved", p, m, chunks), 1.0 / chunks, 2.0 / chunks)
        assert tl.bubble == pytest.approx((p - 1) / (chunks * m + p - 1), abs=1e-12)
        if p > 1:
            plain = simulate(schedule("1f1b", p, m), 1.0, 2.0).bubble
            assert tl.bubble < plain


def gpipe_reference(t_f: list[float], t_b: list[float], m: int, comm: float) -> float:
    """GPipe's step time by the recurrence end = max(own previous, upstream + comm) + t."""
    p = len(t_f)
    fwd = [[0.0] * m for _ in range(p)]
    for r in range(p):
        for i in range(m):
            prev = fwd[r][i - 1] if i else 0.0
            up = fwd[r - 1][i] + comm if r else 0.0
            fwd[r][i] = max(prev, up) + t_f[r]
    bwd = [[0.0] * m for _ in range(p)]
    for r in reversed(range(p)):
        for i in range(m):
            prev = bwd[r][i - 1] if i else fwd[r][m - 1]
            down = bwd[r + 1][i] + comm if r < p - 1 else fwd[r][i]
            bwd[r][i] = max(prev, down) + t_b[r]
    return max(max(row) for row in bwd)


@pytest.mark.parametrize("comm", [0.0, 0.25])
def test_gpipe_matches_reference_with_uneven_stages(comm: float) -> None:
    t_f, t_b = [1.0, 3.0, 0.5, 2.0], [2.0, 5.0, 1.0, 1.5]
    for m in (1, 3, 8):
        tl = simulate(schedule("gpipe", 4, m), t_f, t_b, comm)
        assert tl.makespan == pytest.approx(gpipe_reference(t_f, t_b, m, comm), rel=1e-12)


def test_comm_adds_two_hops_per_stage_boundary() -> None:
    for p, m in GRID:
        tl = simulate(schedule("gpipe", p, m), 1.0, 2.0, 0.5)
        assert tl.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.5)


def test_timeline_respects_order_and_dependencies() -> None:
    s = schedule("interleaved", 3, 6, 2)
    comm = 0.3
    tl = simulate(s, [0.5, 0.7, 0.4], [1.0, 1.1, 0.9], comm)
    for r, acts in enumerate(s.actions):
        for a, b in pairwise(acts):
            assert tl.start[b] >= tl.end[a] - 1e-12  # one action at a time per rank
        for a in acts:
            for key in s.needs(a):
                v = key[1]
                kind = "F" if key[0] == "act" else "B"
                src = s.action_at(kind, v, key[2])  # type: ignore[arg-type]
                hop = comm if src.stage != r else 0.0
                assert tl.start[a] >= tl.end[src] + hop - 1e-12
    assert tl.makespan == max(tl.end.values())


def test_measured_times_as_a_mapping() -> None:
    s = schedule("1f1b", 3, 4)
    times = {a: (1.0 if a.kind == "F" else 2.0) for acts in s.actions for a in acts}
    assert simulate(s, times).makespan == simulate(s, 1.0, 2.0).makespan
    slow = dict(times)
    slow[Action(1, "F", 2)] = 5.0
    assert simulate(s, slow).makespan > simulate(s, times).makespan
    del slow[Action(1, "F", 2)]
    with pytest.raises(ConfigError, match="no duration for action 1F2"):
        simulate(s, slow)


def test_peak_in_flight() -> None:
    for p, m in GRID:
        assert simulate(schedule("gpipe", p, m), 1.0, 2.0).peak_in_flight == [m] * p
        peaks = simulate(schedule("1f1b", p, m), 1.0, 2.0).peak_in_flight
        assert max(peaks) <= p
        assert peaks == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize(("t_f", "t_i", "t_w"), [(1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (2.0, 1.0, 1.0)])
def test_zb_h1_bubble(t_f: float, t_i: float, t_w: float) -> None:
    """ZB-H1 idles (p-1)(t_F + t_I - t_W) per rank where 1F1B idles (p-1)(t_F + t_I + t_W),
    and holds at most p activations on any rank (rank 0's 1F1B peak)."""
    for p, m in GRID:
        zb = simulate(schedule("zb-h1", p, m), t_f, t_i, t_w=t_w)
        base = simulate(schedule("1f1b", p, m), t_f, t_i + t_w)
        assert max(zb.peak_in_flight) <= max(base.peak_in_flight)
        if p > 1:
            assert zb.makespan < base.makespan
        if m >= p:
            expect = m * (t_f + t_i + t_w) + (p - 1) * (t_f + t_i - t_w)
            assert zb.makespan == pytest.approx(expect, rel=1e-12)
            assert base.makespan == pytest.approx((m + p - 1) * (t_f + t_i + t_w), rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"t_f": 1.0, "t_b": -1.0}, "t_b must be finite and >= 0, got -1.0"),
        ({"t_f": [1.0, 2.0], "t_b": 1.0}, "t_f has 2 per-stage times; give 3"),
        ({"t_f": 1.0}, "t_b is missing"),
        ({"t_f": 1.0, "t_b": 1.0, "t_comm": float("nan")}, "t_comm must be finite"),
    ],
)
def test_bad_times(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        simulate(schedule("1f1b", 3, 4), **kwargs)


def test_zb_h1_needs_t_w() -> None:
    with pytest.raises(ConfigError, match="has W actions: give t_w"):
        simulate(schedule("zb-h1", 2, 4), 1.0, 1.0)


def test_measured_timeline_matches_simulation() -> None:
    s = schedule("1f1b", 3, 5)
    sim = simulate(s, 0.002, 0.004, 0.0005)
    offset = 1234.5  # perf_counter readings have an arbitrary origin
    tl = Timeline.measured(
        s,
        {a: t + offset for a, t in sim.start.items()},
        {a: t + offset for a, t in sim.end.items()},
    )
    assert tl.makespan == pytest.approx(sim.makespan, rel=1e-9)
    assert tl.bubble == pytest.approx(sim.bubble, rel=1e-6)
    assert tl.busy == pytest.approx(sim.busy, rel=1e-9)
    assert tl.peak_in_flight == sim.peak_in_flight
    partial = dict(sim.start)
    del partial[Action(2, "B", 4)]
    with pytest.raises(ConfigError, match="lacks 1 of 30 actions, first 2B4"):
        Timeline.measured(s, partial, sim.end)
