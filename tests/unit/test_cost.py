"""The cost model against the closed forms in its docstring, the published nccl-tests bus
bandwidths on declared topologies, algorithm choice with its explanation, and the
calibration file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuelspmd.cost import CostModel, calibration_path, load_calibration, save_calibration
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology

A, B, R = 3e-6, 2e9, 5e9  # alpha (s), bandwidth (B/s), reduce bandwidth (B/s)
b, g = 1 / B, 1 / R


def flat(n: int) -> CostModel:
    """n CPU ranks on one node's shared memory: one link class, so the closed forms hold."""
    return CostModel(Topology.uniform(nodes=1, devices_per_node=n, fabric=Link("shm", B, A),
                                      reduce_bandwidth=R))


def closed_form(collective: str, algorithm: str, n: int, N: float) -> float:
    """The docstring's table, written out again independently of the step walk."""
    lg = math.log2(n)
    f = (n - 1) / n
    forms = {
        ("all_reduce", "ring"): 2 * (n - 1) * A + 2 * f * N * b + f * N * g,
        ("all_reduce", "halving_doubling"): 2 * lg * A + 2 * f * N * b + f * N * g,
        ("all_reduce", "doubling"): lg * (A + N * b + N * g),
        ("reduce_scatter", "ring"): (n - 1) * A + f * N * b + f * N * g,
        ("reduce_scatter", "halving"): lg * A + f * N * b + f * N * g,
        ("all_gather", "ring"): (n - 1) * A + f * N * b,
        ("all_gather", "doubling"): lg * A + f * N * b,
        ("broadcast", "tree"): math.ceil(lg) * (A + N * b),
        ("broadcast", "scatter_allgather"): (lg + n - 1) * A + 2 * f * N * b,
        ("all_to_all", "pairwise"): (n - 1) * (A + N / n * b),
    }
    return forms[collective, algorithm]


CASES = [("all_reduce", "ring"), ("all_reduce", "halving_doubling"), ("all_reduce", "doubling"),
         ("reduce_scatter", "ring"), ("reduce_scatter", "halving"), ("all_gather", "ring"),
         ("all_gather", "doubling"), ("broadcast", "tree"), ("broadcast", "scatter_allgather"),
         ("all_to_all", "pairwise")]


@pytest.mark.parametrize(("collective", "algorithm"), CASES)
@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_link_class_matches_the_closed_forms(collective: str, algorithm: str,
                                                 n: int) -> None:
    model = flat(n)
    for nbytes in (8, 65536, 64 * 2**20):
        got = model.predict(collective, nbytes, range(n), algorithm=algorithm)
        assert got == pytest.approx(closed_form(collective, algorithm, n, nbytes), rel=1e-12)


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_non_powers_of_two_fold_the_extra_ranks_in(n: int) -> None:
    p = 1 << (n.bit_length() - 1)
    N = 2**20
    core = 2 * math.log2(p) * A + 2 * (p - 1) / p * N * b + (p - 1) / p * N * g
    fold = (A + N * b + N * g) + (A + N * b)  # extras hand in their data, get the result
    got = flat(n).predict("all_reduce", N, range(n), algorithm="halving_doubling")
    assert got == pytest.approx(core + fold, rel=1e-12)
    ring = flat(n).predict("all_reduce", N, range(n), algorithm="ring")
    assert ring == pytest.approx(closed_form("all_reduce", "ring", n, N), rel=1e-12)


def test_send_recv_and_the_size_one_fast_path() -> None:
    model = flat(4)
    assert model.predict("send_recv", 1000, [3, 1]) == pytest.approx(A + 1000 * b)
    assert model.predict("all_reduce", 2**20, [2]) == 0.0


def _sweep(model: CostModel, group: list[int], per: int = 1) -> list[tuple[int, float]]:
    rows = []
    for nbytes in [2**k for k in range(20, 34, 2)]:
        rows.append((nbytes, model.bus_bandwidth("all_reduce", nbytes, group,
                                                 algorithm="ring") / per))
    return rows


def test_eight_h100_on_nvlink_reach_the_published_ring_bus_bandwidth() -> None:
    """nccl-tests all_reduce on 8 H100 (ring): about 370 GB/s of bus bandwidth."""
    model = CostModel(Topology.load("dgx-h100"))
    rows = _sweep(model, list(range(8)))
    print("\n8x H100 NVLink, ring all_reduce\n     bytes  busbw GB/s")
    for nbytes, bw in rows:
        print(f"{nbytes:>10}  {bw / 1e9:8.1f}")
    large = rows[-1][1]
    assert abs(large / 370e9 - 1) <= 0.15, large
    assert rows[0][1] < large  # latency still shows at 1 MiB


def test_two_h100_nodes_reach_the_published_bus_bandwidth_per_nic() -> None:
    """nccl-tests all_reduce over 2 nodes x 8 GPUs, one 400 Gb/s NIC per GPU: about
    46-48 GB/s of bus bandwidth per NIC."""
    topo = Topology.load("two-node-h100-ib")
    model = CostModel(topo)
    rows = _sweep(model, list(range(16)), per=topo.nodes[0].nics)
    print("\n2x8 H100, 8x 400G IB per node, ring all_reduce\n     bytes  busbw/NIC GB/s")
    for nbytes, bw in rows:
        print(f"{nbytes:>10}  {bw / 1e9:8.1f}")
    large = rows[-1][1]
    assert abs(large / 46e9 - 1) <= 0.15 and abs(large / 48e9 - 1) <= 0.15, large
    best = model.best_algorithm("all_reduce", 2**30, range(16))
    assert best.algorithm == "ring" and "network" in best.explanation


def test_best_algorithm_is_the_fastest_and_says_why() -> None:
    model = CostModel(Topology.load("two-node-h100-ib"))
    for nbytes in (8, 2**16, 2**24, 2**30):
        choice = model.best_algorithm("all_reduce", nbytes, range(16))
        assert choice.seconds == min(choice.alternatives.values())
        assert choice.seconds == model.predict("all_reduce", nbytes, range(16))
        assert set(choice.alternatives) == {"ring", "halving_doubling", "doubling",
                                            "hierarchical"}
        assert choice.algorithm in choice.explanation and "beats" in choice.explanation
    small = model.best_algorithm("all_reduce", 8, range(16))
    assert small.algorithm == "doubling" and "latency-bound" in small.explanation
    assert "bandwidth-bound" in model.best_algorithm("all_reduce", 2**30, range(16)).explanation


def test_hierarchical_is_intra_reduce_scatter_inter_all_reduce_intra_all_gather() -> None:
    model = CostModel(Topology.load("two-node-h100-ib"))
    N = 2**28
    parts = (model.predict("reduce_scatter", N, range(8), algorithm="ring")
             + model.predict("all_reduce", N / 8, [0, 8], concurrent=8)
             + model.predict("all_gather", N, range(8), algorithm="ring"))
    assert model.predict("all_reduce", N, range(16), algorithm="hierarchical") == \
        pytest.approx(parts)
    with pytest.raises(ConfigError, match=r"\[8\] per node"):
        model.predict("all_reduce", N, range(8), algorithm="hierarchical")


def test_groups_sharing_nics_slow_down_across_nodes_only() -> None:
    shared = CostModel(Topology.uniform(nodes=2, devices_per_node=8,
                                        fabric=Link("nvlink", 240e9, 1e-6), nics=1,
                                        nic=Link("net", 25e9, 4e-6)))
    alone = shared.predict("all_reduce", 2**28, [0, 8])
    crowded = shared.predict("all_reduce", 2**28, [0, 8], concurrent=8)
    assert crowded > 7 * alone
    assert shared.predict("all_reduce", 2**28, [0, 1], concurrent=8) == \
        shared.predict("all_reduce", 2**28, [0, 1])
    rails = CostModel(Topology.load("two-node-h100-ib"))  # one NIC per GPU: no sharing
    assert rails.predict("all_reduce", 2**28, [0, 8], concurrent=8) == \
        pytest.approx(rails.predict("all_reduce", 2**28, [0, 8]))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(CASES), st.integers(2, 12), st.integers(0, 2**30), st.integers(1, 2**20))
def test_more_bytes_never_take_less_time(case: tuple[str, str], n: int, nbytes: int,
                                         extra: int) -> None:
    model = CostModel(Topology.load("two-node-h100-ib"))
    group = list(range(16 - n, 16))
    collective, algorithm = case
    small = model.predict(collective, nbytes, group, algorithm=algorithm)
    assert model.predict(collective, nbytes + extra, group, algorithm=algorithm) >= small


def test_caller_mistakes_raise_config_errors() -> None:
    model = flat(4)
    with pytest.raises(ConfigError, match="unknown collective 'allreduce'"):
        model.predict("allreduce", 8, range(4))
    with pytest.raises(ConfigError, match="no algorithm 'nccl'"):
        model.predict("all_reduce", 8, range(4), algorithm="nccl")
    with pytest.raises(ConfigError, match="distinct device indices"):
        model.predict("all_reduce", 8, [0, 0])
    with pytest.raises(ConfigError, match="device 9 is not in this topology of 4"):
        model.predict("all_reduce", 8, [0, 9])
    with pytest.raises(ConfigError, match=r"\[src, dst\]"):
        model.predict("send_recv", 8, [0, 1, 2])
    with pytest.raises(ConfigError, match="nbytes must be >= 0"):
        model.predict("all_reduce", -1, range(4))


def test_calibration_file_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert calibration_path() == tmp_path / "cache" / "fuelspmd" / "calibration.json"
    assert load_calibration() is None
    data = {"version": 1, "shm": {"latency": 2e-6, "bandwidth": 3e9, "reduce_bandwidth": 5e9}}
    written = save_calibration(data)
    assert written == calibration_path() and load_calibration() == data
    monkeypatch.setenv("FUELSPMD_CALIBRATION", str(tmp_path / "other.json"))  # read by nobody
    assert calibration_path() == written
    assert calibration_path(tmp_path / "other.json") == tmp_path / "other.json"
    (tmp_path / "other.json").write_text(json.dumps({"shm": {"latency": 1e-6}}))
    with pytest.raises(ConfigError, match=r"shm\.bandwidth"):
        load_calibration(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="no calibration file"):
        load_calibration(tmp_path / "missing.json")


def test_more_busy_ranks_than_cores_share_them_and_wait_to_be_scheduled() -> None:
    """n ranks on c < n cores: copy and reduce rates shrink by c/n, and each message waits
    the oversubscribed latency instead of alpha."""
    late = 400e-6
    node = Node("box", 4, Link("shm", B, A), reduce_bandwidth=R, cores=2,
                oversubscribed_latency=late)
    model = CostModel(Topology([node]))
    N = 2**22
    slow = 4 / 2
    ring = 2 * 3 * late + 2 * 3 / 4 * N * b * slow + 3 / 4 * N * g * slow
    assert model.predict("all_reduce", N, range(4), algorithm="ring") == pytest.approx(ring)
    # two ranks fit on two cores: the plain closed form
    assert model.predict("all_reduce", N, [0, 1], algorithm="ring") == pytest.approx(
        closed_form("all_reduce", "ring", 2, N))
    doubling = 2 * (late + N * b * slow + N * g * slow)
    assert model.predict("all_reduce", N, range(4), algorithm="doubling") == \
        pytest.approx(doubling)
