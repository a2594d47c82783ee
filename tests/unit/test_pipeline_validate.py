"""validate(): broken schedules fail with ScheduleError naming the rank, action and reason."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuelspmd.errors import ScheduleError
from fuelspmd.pipeline_parallel import Action, Schedule, schedule, validate


def make(rows: list[str], *, m: int, c: int = 1, sends: str = "blocking") -> Schedule:
    return Schedule(
        "custom", len(rows), m, c, [[Action.parse(t) for t in r.split()] for r in rows], sends
    )  # type: ignore[arg-type]


def test_hand_written_gpipe_passes() -> None:
    validate(make(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"], m=2))


@pytest.mark.parametrize(
    ("rows", "m", "needle"),
    [
        (["0F0 0B0", "1F0 1B0"], 2, "rank 0 never runs the forward 0F1"),
        (["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"], 2, "rank 1 never runs 1B1"),
        (["0F0 0F0 0B0", "1F0 1B0"], 1, "rank 0 runs 0F0 2 times"),
        (["0F0 0B0", "1F0 0B0"], 1, "rank 1 lists action 0B0 .position 1., which belongs to"),
        (["0F0 0B0 0F1", "1F0 1B0"], 1, "micro-batch 1 is out of range for 1 micro-batches"),
        (["0F0 0B0.c1", "1F0 1B0"], 1, "chunk 1 is out of range for 1 chunks"),
        (["0F0 0B0", "1B0 1F0"], 1, "rank 1 runs 1B0 at position 0 before 1F0 at position 1"),
        (["0F0 0I0 0B0", "1F0 1B0"], 1, "runs the full backward 0B0 and also a split part"),
        (["0F0 0I0", "1F0 1B0"], 1, "rank 0 never runs 0W0"),
        (["0F0 0W0 0I0", "1F0 1B0"], 1, "rank 0 runs 0W0 at position 1 before 0I0"),
        (["0F0 0B0"], 1, "2 action lists for 1 stages"),
    ],
)
def test_broken_schedules(rows: list[str], m: int, needle: str) -> None:
    s = make(rows, m=m)
    if needle.startswith("2 action lists"):
        s = Schedule("custom", 1, 1, 1, [[Action.parse("0F0"), Action.parse("0B0")], []])
    with pytest.raises(ScheduleError, match=needle):
        validate(s)


def test_rendezvous_sends_catch_out_of_order_receives() -> None:
    # Rank 0 sends micro-batch 0 first; rank 1 first waits for micro-batch 1. A rendezvous
    # send blocks until the receive is posted, so both wait forever.
    rows = ["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"]
    with pytest.raises(ScheduleError) as info:
        validate(make(rows, m=2))
    text = str(info.value)
    assert "deadlock" in text
    assert "rank 0 blocks after 0F0, before 0F1, sending the activation of micro-batch 0" in text
    assert "rank 1 blocks before its first action 1F1" in text
    # With non-blocking sends the activation of micro-batch 0 just waits to be received.
    validate(make(rows, m=2, sends="nonblocking"))


def test_cycle_deadlocks_under_every_model() -> None:
    # Rank 0 wants micro-batch 0's gradient before sending micro-batch 1's activation;
    # rank 1 wants micro-batch 1's activation before sending micro-batch 0's gradient.
    rows = ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"]
    for sends in ("blocking", "nonblocking"):
        with pytest.raises(ScheduleError, match="a cycle: deadlock"):
            validate(make(rows, m=2, sends=sends))


def test_unbatched_1f1b_exchange_is_what_interleaving_hits() -> None:
    s = schedule("interleaved", 2, 4, 2)
    assert s.sends == "nonblocking"
    validate(s)
    s.sends = "blocking"
    with pytest.raises(ScheduleError, match=r"rank 0 blocks after 0B0\.c1, before 0F3"):
        validate(s)


def test_unknown_send_mode() -> None:
    with pytest.raises(ScheduleError, match="sends='eager'"):
        validate(make(["0F0 0B0"], m=1, sends="eager"))


def has_cycle(s: Schedule) -> bool:
    """Kahn's algorithm on program order plus data dependencies (an independent oracle
    for the non-blocking model)."""
    nodes = [a for acts in s.actions for a in acts]
    present = set(nodes)
    edges: dict[Action, list[Action]] = {a: [] for a in nodes}
    for acts in s.actions:
        for a, b in pairwise(acts):
            edges[a].append(b)
    for a in nodes:
        for what, v, i in s.needs(a):
            if what == "act":
                src = s.action_at("F", v, i)
            else:
                src = s.action_at("B", v, i)
                src = src if src in present else s.action_at("I", v, i)
            edges[src].append(a)
    indegree = dict.fromkeys(nodes, 0)
    for outs in edges.values():
        for b in outs:
            indegree[b] += 1
    ready = [a for a in nodes if indegree[a] == 0]
    seen = 0
    while ready:
        a = ready.pop()
        seen += 1
        for b in edges[a]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return seen < len(nodes)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]),
    p=st.integers(2, 4),
    groups=st.integers(1, 3),
    swaps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), min_size=1, max_size=3),
)
def test_validate_agrees_with_an_independent_oracle(
    kind: str, p: int, groups: int, swaps: list[tuple[int, int]]
) -> None:
    """Swap neighbouring actions at random: the non-blocking replay rejects exactly the
    orders with a dependency cycle, and whatever passes with rendezvous sends also passes
    with non-blocking ones (rendezvous only adds waits)."""
    s = schedule(kind, p, p * groups, 2 if kind == "interleaved" else 1)
    for rank, at in swaps:
        acts = s.actions[rank % p]
        k = at % (len(acts) - 1)
        acts[k], acts[k + 1] = acts[k + 1], acts[k]
    s.sends = "nonblocking"
    try:
        validate(s)
        nonblocking_ok = True
    except ScheduleError:
        nonblocking_ok = False
    assert nonblocking_ok == (not has_cycle(s))
    s.sends = "blocking"
    try:
        validate(s)
    except ScheduleError:
        return
    assert nonblocking_ok
