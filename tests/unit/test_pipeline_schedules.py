"""Schedules as data: Action printing/parsing, the generators' orders, the implied messages,
and validate() over stages 1..6 x micro-batches 1..12 for every kind."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuelspmd.errors import ConfigError, ScheduleError
from fuelspmd.pipeline_parallel import Action, schedule, validate

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]


@given(st.integers(0, 99), st.sampled_from("FBIW"), st.integers(0, 999), st.integers(0, 9))
def test_action_prints_and_parses_back(stage: int, kind: str, micro: int, chunk: int) -> None:
    a = Action(stage, kind, micro, chunk)  # type: ignore[arg-type]
    assert Action.parse(str(a)) == a


def test_action_text() -> None:
    assert str(Action(1, "F", 3)) == "1F3"
    assert str(Action(0, "B", 2, 1)) == "0B2.c1"
    assert Action.parse("0B2.c1") == Action(0, "B", 2, 1)
    assert Action.parse("1F3.c0") == Action(1, "F", 3)
    assert Action(2, "W", 11, 2).label == "W11.2"


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "1F3c1", "-1F3", "1F3.c"])
def test_action_parse_rejects(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


def test_action_rejects_bad_fields() -> None:
    with pytest.raises(ScheduleError, match="kind 'X'"):
        Action(0, "X", 0)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="microbatch must be an int >= 0, got -1"):
        Action(0, "F", -1)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_single_chunk_kinds_validate_blocking(kind: str) -> None:
    for p, m in GRID:
        s = schedule(kind, p, m)
        assert s.sends == "blocking"
        assert len(s.actions) == p
        validate(s)
        per_mb = 2 if kind != "zb-h1" else 3
        assert all(len(acts) == per_mb * m for acts in s.actions)


@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_validates(chunks: int) -> None:
    for p, m in GRID:
        if m % p:
            continue
        s = schedule("interleaved", p, m, chunks)
        validate(s)
        assert all(len(acts) == 2 * m * chunks for acts in s.actions)


def test_1f1b_order_is_the_standard_one() -> None:
    s = schedule("1f1b", 4, 8)
    assert " ".join(map(str, s.actions[0])) == (
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    )
    assert " ".join(map(str, s.actions[3])) == (
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"
    )


def test_gpipe_runs_all_forwards_first() -> None:
    s = schedule("gpipe", 3, 5)
    for acts in s.actions:
        assert [a.kind for a in acts] == ["F"] * 5 + ["B"] * 5


def test_interleaved_follows_megatron_warmup() -> None:
    p, m, c = 4, 8, 2
    s = schedule("interleaved", p, m, c)
    for r, acts in enumerate(s.actions):
        warmup = next(n for n, a in enumerate(acts) if a.kind == "B")
        assert warmup == min((p - r - 1) * 2 + (c - 1) * p, m * c) + 1  # +1: steady F
        forwards = [a for a in acts if a.kind == "F"]
        # micro-batches go through in groups of p, chunk 0 of a group before chunk 1
        assert [(a.chunk, a.microbatch) for a in forwards[:8]] == [
            (0, 0),
            (0, 1),
            (0, 2),
            (0, 3),
            (1, 0),
            (1, 1),
            (1, 2),
            (1, 3),
        ]


def test_interleaved_with_one_group_runs_all_forwards_first() -> None:
    s = schedule("interleaved", 3, 3, 2)
    for acts in s.actions:
        assert [a.kind for a in acts] == ["F"] * 6 + ["B"] * 6


@pytest.mark.parametrize(
    ("kind", "p", "m", "c"),
    [("1f1b", 4, 8, 1), ("interleaved", 3, 6, 2), ("zb-h1", 5, 7, 1), ("gpipe", 1, 3, 1)],
)
def test_messages_pair_up(kind: str, p: int, m: int, c: int) -> None:
    s = schedule(kind, p, m, c)
    sends, recvs = Counter(), Counter()
    for r in range(p):
        for step in s.steps(r):
            for msg in step.sends:
                assert msg.src == r and msg.dst != r
                sends[msg] += 1
            for msg in step.recvs:
                assert msg.dst == r and msg.src != r
                recvs[msg] += 1
    assert sends == recvs
    assert all(n == 1 for n in sends.values())
    assert len({msg.tag for msg in sends}) == len(sends)
    # every hop between neighbouring virtual stages crosses ranks once per direction
    assert len(sends) == (2 * (p * c - 1) * m if p > 1 else 0)


def test_peak_in_flight() -> None:
    for p, m in GRID:
        assert schedule("gpipe", p, m).peak_in_flight() == [m] * p
        assert schedule("1f1b", p, m).peak_in_flight() == [min(p - r, m) for r in range(p)]
        # ZB-H1: rank r also keeps the activations of its first r deferred W's
        assert schedule("zb-h1", p, m).peak_in_flight() == [min(p, m)] * p


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("interleaved", 4, 6, 2), "divisible by stages: 6 micro-batches over 4 stages leaves 2"),
        (("interleaved", 4, 8, 1), "needs chunks >= 2"),
        (("1f1b", 4, 8, 2), "use kind='interleaved' for chunks > 1"),
        (("pipedream", 4, 8, 1), "unknown schedule kind 'pipedream'"),
        (("gpipe", 0, 8, 1), "stages must be an int >= 1, got 0"),
        (("gpipe", 2, 0, 1), "microbatches must be an int >= 1, got 0"),
    ],
)
def test_bad_sizes_raise_config_error(args: tuple, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        schedule(*args)


def test_interleaved_error_suggests_sizes() -> None:
    with pytest.raises(ConfigError, match="use microbatches=4 or 8"):
        schedule("interleaved", 4, 6, 2)
