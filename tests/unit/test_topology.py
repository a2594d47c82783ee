"""Topology: declarations load, links and NICs are what the files say, detect() groups ranks
by host, and bad declarations fail with the numbers and the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

import fuelspmd as fs
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology, declared, detect


@dataclass
class Hosts:
    """The three fields of a World that detect() reads, for a job of several hosts."""

    rank: int
    size: int
    nodes: list[str]


def test_shipped_declarations_load_with_the_documented_numbers() -> None:
    assert {"dgx-h100", "two-node-h100-ib", "a100-selene"} <= set(declared())
    h100 = Topology.load("dgx-h100")
    assert h100.size == 8 and len(h100.nodes) == 1
    assert h100.nodes[0].fabric.kind == "nvlink"
    assert h100.nodes[0].fabric.bandwidth == pytest.approx(18 * 20.6e9)
    two = Topology.load("two-node-h100-ib")
    assert two.size == 16 and two.nodes[1].nics == 8
    assert two.nodes[0].nic is not None
    assert two.nodes[0].nic.bandwidth == pytest.approx(400e9 / 8 * 4096 / 4122, rel=1e-4)
    selene = Topology.load("a100-selene")
    assert selene.size == 3072
    acc = selene.nodes[0].accelerator
    assert acc is not None and acc.peak_flops == 312e12 and acc.memory == 80 * 2**30
    assert Topology.load("a100-selene", nodes=2).size == 16


def test_links_inside_and_between_nodes() -> None:
    two = Topology.load("two-node-h100-ib")
    assert two.link(0, 7).kind == "nvlink"
    assert two.link(3, 12).kind == "net"
    assert two.node_of(8).name == "node1" and two.local_index(9) == 1
    assert two.by_node([9, 0, 8, 1]) == {0: [0, 1], 1: [8, 9]}
    with pytest.raises(ConfigError, match=r"device 16 is not in this topology of 16"):
        two.link(0, 16)


def test_node_egress_counts_rail_nics_and_shares_them_between_concurrent_groups() -> None:
    two = Topology.load("two-node-h100-ib")
    nic = two.nodes[0].nic
    assert nic is not None
    assert two.node_egress(0, [0]) == pytest.approx(nic.bandwidth)
    assert two.node_egress(0, list(range(8))) == pytest.approx(8 * nic.bandwidth)
    # one NIC shared by 4 devices: two members on the same NIC get one NIC's worth
    shared = Topology.uniform(nodes=2, devices_per_node=8, fabric=Link("pcie", 24e9, 3e-6),
                              nics=2, nic=Link("net", 10e9, 5e-6))
    assert shared.nodes[0].nic_of(3) == 0 and shared.nodes[0].nic_of(4) == 1
    assert shared.node_egress(0, [0, 1]) == pytest.approx(10e9)
    assert shared.node_egress(0, [0, 4]) == pytest.approx(20e9)
    assert shared.node_egress(0, [0, 4], concurrent=4) == pytest.approx(5e9)


def test_table_lists_nodes_links_and_devices() -> None:
    table = Topology.load("two-node-h100-ib").table()
    assert "node0..node1 (2 nodes)" in table and "0-15" in table
    assert "nvlink" in table and "370.8" in table and "49.7" in table
    assert "H100-SXM5-80GB" in table and "between nodes" in table
    pairs = Node("box", 4, Link("pcie", 24e9, 3e-6), pairs={(0, 1): Link("nvlink", 50e9, 1e-6)})
    topo = Topology([pairs])
    assert topo.link(1, 0).kind == "nvlink" and topo.link(0, 2).kind == "pcie"
    assert "local 0<->1 nvlink 50.0 GB/s" in topo.table()


def test_bad_declarations_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="devices_per_node"):
        Topology.from_dict({"fabric": {"kind": "shm", "bandwidth_gbs": 1}})
    with pytest.raises(ConfigError, match="bandwidth_gbs"):
        Topology.from_dict({"devices_per_node": 2, "fabric": {"kind": "shm"}})
    with pytest.raises(ConfigError, match="shipped names"):
        Topology.load("no-such-cluster")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Topology.load(bad)
    with pytest.raises(ConfigError, match="positive number of bytes/s"):
        Link("nvlink", 0.0, 1e-6)
    with pytest.raises(ConfigError, match="need a network"):
        Topology([Node("a", 1, Link("shm", 1e9, 1e-6)), Node("b", 1, Link("shm", 1e9, 1e-6))])


def test_a_declaration_written_by_hand_round_trips(tmp_path: Path) -> None:
    spec = {"name": "lab", "nodes": 3, "devices_per_node": 4,
            "fabric": {"kind": "pcie", "bandwidth_gbs": 24, "latency_us": 3},
            "nic": {"count": 1, "rate_gbps": 100, "latency_us": 5}}
    path = tmp_path / "lab.json"
    path.write_text(json.dumps(spec))
    lab = Topology.load(path)
    assert lab.size == 12 and lab.name == "lab"
    assert lab.link(0, 4).bandwidth == pytest.approx(12.5e9)
    assert lab.link(0, 4).latency == pytest.approx(5e-6)
    assert lab.link(0, 1).time(24e9) == pytest.approx(1 + 3e-6)


def test_detect_groups_ranks_by_host_and_uses_calibration() -> None:
    topo = detect(Hosts(0, 5, ["a", "a", "a", "b", "b"]))
    assert [n.name for n in topo.nodes] == ["a", "b"] and topo.size == 5
    assert topo.link(0, 2).kind == "shm" and topo.link(2, 3).kind == "net"
    cal = {"shm": {"latency": 2e-6, "bandwidth": 3e9, "reduce_bandwidth": 4e9}}
    tuned = detect(Hosts(0, 2, ["a", "a"]), calibration=cal)
    assert tuned.nodes[0].fabric == Link("shm", 3e9, 2e-6)
    assert tuned.nodes[0].reduce_bandwidth == 4e9
    with pytest.raises(ConfigError, match="not grouped by host"):
        detect(Hosts(0, 3, ["a", "b", "a"]))
    with pytest.raises(ConfigError, match="3 host names for a world of 2"):
        detect(Hosts(0, 2, ["a", "b", "c"]))


def test_detect_on_the_real_size_one_world() -> None:
    world = fs.init()
    try:
        topo = detect(world)
        assert topo.size == world.size == 1
        assert topo.nodes[0].name == world.node
    finally:
        world.finalize()
