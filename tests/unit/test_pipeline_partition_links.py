"""``partition(links=...)``: stage-to-stage transfers in the min-max objective, exact against
brute force, a slow link moves a boundary, the same errors as without links."""

from __future__ import annotations

import math
from itertools import combinations, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError
from fuelspmd.mesh import Mesh
from fuelspmd.pipeline_parallel import partition
from fuelspmd.pipeline_parallel.partition import stage_links
from fuelspmd.topology import Link, Topology


def stage_times(costs: list[float], bounds: tuple[int, ...], first: float, last: float,
                cross: list[list[float]]) -> list[float]:
    """Each stage's compute + extras + the transfer at each of its boundaries;
    ``cross[s][k]``: crossing boundary s when the next stage starts at layer k."""
    out = []
    stages = len(bounds) - 1
    for s, (a, b) in enumerate(pairwise(bounds)):
        t = sum(costs[a:b]) + (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)
        t += (cross[s - 1][a] if s > 0 else 0.0) + (cross[s][b] if s < stages - 1 else 0.0)
        out.append(t)
    return out


def brute_force(costs: list[float], stages: int, first: float, last: float,
                cross: list[list[float]]) -> tuple[float, tuple[int, ...]]:
    """The smallest bottleneck over every cut, and the lexicographically largest cuts that
    reach it (each stage from the first takes as many layers as it can: the tie rule)."""
    n = len(costs)
    best, cuts = math.inf, ()
    for c in combinations(range(1, n), stages - 1):
        bounds = (0, *c, n)
        worst = max(stage_times(costs, bounds, first, last, cross))
        if worst < best or (worst == best and bounds > cuts):
            best, cuts = worst, bounds
    return best, cuts


@settings(max_examples=120, deadline=None)
@given(costs=st.lists(st.integers(1, 9), min_size=1, max_size=8), data=st.data(),
       first=st.sampled_from([0, 2]), last=st.sampled_from([0, 3]))
def test_fixed_link_times_match_brute_force(costs: list[int], data: st.DataObject, first: int,
                                            last: int) -> None:
    """Integer costs and link times, so both sides add exactly and ties are real ties."""
    stages = data.draw(st.integers(1, len(costs)))
    links = data.draw(st.lists(st.integers(0, 12), min_size=stages - 1, max_size=stages - 1))
    n = len(costs)
    cross = [[float(x)] * (n + 1) for x in links]
    got = partition([float(c) for c in costs], stages, first_extra=first, last_extra=last,
                    links=[float(x) for x in links])
    best, bounds = brute_force([float(c) for c in costs], stages, first, last, cross)
    assert got.bottleneck == best
    assert got.boundaries == bounds
    assert list(got.costs) == stage_times([float(c) for c in costs], got.boundaries, first,
                                          last, cross)


@settings(max_examples=80, deadline=None)
@given(costs=st.lists(st.integers(1, 9), min_size=2, max_size=8), data=st.data())
def test_link_times_that_depend_on_the_cut_match_brute_force(costs: list[int],
                                                              data: st.DataObject) -> None:
    """Per-layer activation sizes over Links: the transfer depends on where the cut falls,
    so a stage's time is not monotone in its length (the greedy check would be wrong)."""
    n = len(costs)
    stages = data.draw(st.integers(2, n))
    acts = data.draw(st.lists(st.integers(0, 16), min_size=n, max_size=n))
    links = [Link("net" if data.draw(st.booleans()) else "nvlink",
                  data.draw(st.sampled_from([0.5, 1.0, 4.0])), data.draw(st.sampled_from([0, 1])))
             for _ in range(stages - 1)]
    cross = [[0.0] + [lk.latency + acts[k - 1] / lk.bandwidth for k in range(1, n)] + [0.0]
             for lk in links]
    got = partition([float(c) for c in costs], stages, links=links,
                    activation_bytes=[float(a) for a in acts])
    best, _ = brute_force([float(c) for c in costs], stages, 0.0, 0.0, cross)
    assert got.bottleneck == pytest.approx(best, rel=1e-12)
    assert max(stage_times([float(c) for c in costs], got.boundaries, 0.0, 0.0, cross)) \
        == pytest.approx(best, rel=1e-12)


def test_a_slow_link_moves_the_boundary() -> None:
    """Eight equal layers on 2 stages split 4/4; a 3-unit link on the boundary makes both
    stages pay it, and on 3 stages the slow boundary pulls layers away from its ends."""
    plain = partition([1.0] * 8, 2)
    assert plain.boundaries == (0, 4, 8)
    cheap = partition([1.0] * 9, 3, links=[0.0, 0.0])
    assert cheap.boundaries == (0, 3, 6, 9) and cheap.bottleneck == 3.0
    slow = partition([1.0] * 9, 3, links=[0.0, 3.0])
    # stages 1 and 2 both pay the slow link; stage 0 takes the layers they shed
    assert slow.boundaries == (0, 5, 7, 9) and slow.bottleneck == 5.0
    assert slow.transfers == (0.0, 3.0, 3.0)
    text = slow.explain()
    assert "stage 1: layers 5-6 (2), compute 2 + in 0 + out 3 = 5" in text
    assert "the links move boundary 0 (link 0->1, 0) from layer 3 to 5" in text
    assert "the slowest stage would take 6 with the links, against 5" in text


def test_stage_links_over_two_nodes_move_stages_off_the_network_boundary() -> None:
    """Four stages on 2 nodes x 8 H100s (stage s on GPU 4s): the boundary between stage 1
    and 2 crosses InfiniBand, so stages 1 and 2 take fewer layers."""
    topo = Topology.load("two-node-h100-ib")
    links = stage_links(topo, [0, 4, 8, 12])
    assert [lk.kind for lk in links] == ["nvlink", "net", "nvlink"]
    act = 2 * 4 * 2048 * 8192  # 2 bytes x tokens x hidden, forward and backward
    layers = [1e-3] * 32
    p = partition(layers, 4, links=links, activation_bytes=act)
    assert p.boundaries != partition(layers, 4).boundaries
    assert len(p[1]) < 8 and len(p[2]) < 8 and len(p[0]) > 8 and len(p[3]) > 8
    net = links[1].latency + act / links[1].bandwidth
    assert p.transfers[1] == pytest.approx(links[0].latency + act / links[0].bandwidth + net)
    assert "costliest link: 1->2 over net" in p.explain()
    assert stage_links(topo, [3]) == []


def test_links_fail_like_partition_does() -> None:
    with pytest.raises(ConfigError, match="stages must be an int >= 1"):
        partition([1.0], 0, links=[])
    with pytest.raises(ConfigError, match="cannot split 2 layers into 3 stages"):
        partition([1.0, 1.0], 3, links=[0.0, 0.0])
    with pytest.raises(ConfigError, match="layer 1 has cost 0"):
        partition([1.0, 0.0], 2, links=[0.0])
    with pytest.raises(ConfigError, match=r"3 stages have 2 boundaries, got 1 links"):
        partition([1.0] * 4, 3, links=[0.0])
    with pytest.raises(ConfigError, match=r"links\[0\] = -1.0; give seconds"):
        partition([1.0] * 4, 2, links=[-1.0])
    lk = Link("net", 1e9, 0.0)
    with pytest.raises(ConfigError, match="need activation_bytes="):
        partition([1.0] * 4, 2, links=[lk])
    with pytest.raises(ConfigError, match="activation_bytes has 3 entries for 4 layers"):
        partition([1.0] * 4, 2, links=[lk], activation_bytes=[1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match=r"activation_bytes\[1\] = nan"):
        partition([1.0] * 4, 2, links=[lk], activation_bytes=[1.0, math.nan, 1.0, 1.0])


def test_one_stage_and_no_links_explain_too() -> None:
    one = partition([2.0, 3.0], 1, links=[])
    assert one.boundaries == (0, 2) and one.costs == (5.0,) and one.transfers == (0.0,)
    text = partition([1.0] * 4, 2).explain()
    assert "stage 1: layers 2-3 (2), cost 2" in text and "bottleneck: stage 0, 2" in text


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=12), data=st.data(),
       first=st.sampled_from([0.0, 0.5, 4.0]), last=st.sampled_from([0.0, 1.5, 7.0]))
def test_free_links_give_exactly_the_plain_partition(costs: list[float], data: st.DataObject,
                                                     first: float, last: float) -> None:
    """The dynamic programme with zero-cost links and the greedy search agree bit for bit,
    ties included."""
    stages = data.draw(st.integers(1, len(costs)))
    plain = partition(costs, stages, first_extra=first, last_extra=last)
    linked = partition(costs, stages, first_extra=first, last_extra=last,
                       links=[0.0] * (stages - 1))
    assert linked.ranges == plain.ranges and linked.costs == plain.costs


def test_a_mesh_prices_its_own_pipeline() -> None:
    """The pipeline ranks a mesh gives, on the topology it used, into stage_links."""
    topo = Topology.load("dgx-h100", nodes=2)
    traffic = {"pp": ("send_recv", 1 << 20, 8)}

    def kinds(comm: object) -> list[str]:
        mesh = Mesh(comm, pp=4, tp=4, order=("tp", "dp", "pp"), traffic=traffic, topology=topo)
        assert mesh.topology is topo
        return [lk.kind for lk in stage_links(topo, mesh.group("pp"))]

    outs = DeviceGroup.cpu(16, timeout=20.0).run(kinds)
    assert outs[0] == ["nvlink"] * 3 and all(o == outs[0] for o in outs)
