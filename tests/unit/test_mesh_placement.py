"""Mesh placement by the cost model: the decision flips with the traffic on declared and
detected topologies, ties keep the convention, the layout follows the chosen order, every
rank agrees, and bad input fails with the numbers."""

from __future__ import annotations

import itertools
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fuelspmd.comm import Communicator
from fuelspmd.cost import CostModel
from fuelspmd.cost.transformer import Transformer
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError
from fuelspmd.mesh import CONVENTION, Mesh, Traffic, place, transformer_traffic
from fuelspmd.mesh.placement import groups
from fuelspmd.topology import Link, Node, Topology, detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mesh_programs as M

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 20.0
MiB = 2**20
# tp-heavy: a transformer's layers all-reduce their activations many times per step
TP_HEAVY = {"tp": ("all_reduce", 8 * MiB, 480), "dp": ("all_reduce", 256 * MiB, 1)}
# dp-heavy: few layers, many parameters (an embedding table): the gradient all-reduce dominates
DP_HEAVY = {"tp": ("all_reduce", 1 * MiB, 4), "dp": ("all_reduce", 4096 * MiB, 1)}


@dataclass
class Hosts:
    """The fields of a World that detect() reads."""

    rank: int
    size: int
    nodes: list[str]


def _inside(order: tuple[str, ...], shape: dict[str, int], axis: str,
            topo: Topology) -> bool:
    return all(len(topo.by_node(g)) == 1 for g in groups(order, shape, axis))


def test_two_nodes_of_eight_gpus_flip_with_the_traffic() -> None:
    topo = Topology.load("two-node-h100-ib")
    shape = {"dp": 2, "pp": 1, "tp": 8}
    tp_heavy = place(shape, topo, TP_HEAVY)
    assert tp_heavy.order == CONVENTION
    assert _inside(tp_heavy.order, shape, "tp", topo)
    dp_heavy = place(shape, topo, DP_HEAVY)
    assert dp_heavy.order[-1] == "dp" and _inside(dp_heavy.order, shape, "dp", topo)
    assert not _inside(dp_heavy.order, shape, "tp", topo)
    # the winner is the cheapest candidate, and the prices are the cost model's own
    model = CostModel(topo)
    inside = model.predict("all_reduce", 4096 * MiB, [0, 1], concurrent=4)
    across = model.predict("all_reduce", 4096 * MiB, [0, 8], concurrent=8)
    assert inside < across
    chosen = dp_heavy.chosen
    assert chosen.axes["dp"].seconds == pytest.approx(inside)
    assert chosen.seconds == min(c.seconds for c in dp_heavy.candidates)
    other = next(c for c in dp_heavy.candidates if c.order == CONVENTION)
    assert other.axes["dp"].seconds == pytest.approx(across)


def test_explain_gives_each_candidate_and_the_reason_in_words() -> None:
    topo = Topology.load("two-node-h100-ib")
    text = place({"dp": 2, "pp": 1, "tp": 8}, topo, DP_HEAVY).explain()
    lines = text.splitlines()
    assert "order pp, tp, dp" in lines[0] and "chosen by predicted" in lines[0]
    assert "dp 1 all-reduce of 4 GiB; tp 4 all-reduces of 1 MiB" in lines[1]
    rows = [ln for ln in lines if ln.startswith("  ") and not ln.startswith("     ") and "ms" in ln]
    assert len(rows) == 2 and rows[0].rstrip().endswith("<- chosen")
    assert "inside a node (nvlink)" in rows[0] and "across 2 nodes" in rows[0]
    why = " ".join(text[text.index("why: "):].split())  # the reason is wrapped at 100 columns
    assert why.startswith("why: dp inside a node (nvlink): 1 all-reduce of 4 GiB per step")
    assert "that outweighs tp across 2 nodes" in why and "next best order (dp, pp, tp)" in why


def test_a_transformer_keeps_tp_inside_and_a_wide_shallow_model_moves_dp_in() -> None:
    topo = Topology.load("two-node-h100-ib")
    gpt = Transformer(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304,
                      global_batch=64)
    traffic = transformer_traffic(gpt, tp=8, pp=1, dp=2)
    assert traffic["tp"] == (Traffic("all_reduce", 2 * 2048 * 2048, 32 * 24 * 6),)
    assert traffic["dp"][0].nbytes == pytest.approx(gpt.params / 8 * 2)
    assert place({"dp": 2, "pp": 1, "tp": 8}, topo, traffic).order == CONVENTION
    wide = Transformer(layers=1, hidden=16384, heads=16, seq=128, vocab=1 << 20,
                       global_batch=2)
    order = place({"dp": 2, "pp": 1, "tp": 8}, topo,
                  transformer_traffic(wide, tp=8, pp=1, dp=2)).order
    assert order[-1] == "dp"


def test_one_node_ties_keep_the_convention() -> None:
    topo = Topology.load("dgx-h100")
    for traffic in (TP_HEAVY, DP_HEAVY):
        p = place({"dp": 2, "pp": 2, "tp": 2}, topo, traffic)
        assert p.order == CONVENTION
        assert len({round(c.seconds, 15) for c in p.candidates}) == 1
        assert "the convention (dp, pp, tp: tp fastest) stands" in " ".join(p.explain().split())


def test_on_this_machines_detected_topology() -> None:
    """One host: every group is inside it, so auto keeps the convention. Two hosts of this
    machine's kind joined by 1 GbE: the heavier axis goes inside a node, and flips with the
    traffic (over the default 100 Gb/s network the model finds shm the slower link)."""
    host = socket.gethostname()
    here = detect(Hosts(0, 4, [host] * 4))
    for traffic in (TP_HEAVY, DP_HEAVY):
        assert place({"dp": 2, "pp": 1, "tp": 2}, here, traffic).order == CONVENTION
    slow_net = Link("net", 1e9 / 8, 50e-6)
    two = detect(Hosts(0, 4, ["a", "a", "b", "b"]), network=slow_net)
    shape = {"dp": 2, "pp": 1, "tp": 2}
    assert place(shape, two, TP_HEAVY).order == CONVENTION
    dp_in = place(shape, two, DP_HEAVY)
    assert dp_in.order[-1] == "dp" and _inside(dp_in.order, shape, "dp", two)


def test_pipeline_traffic_is_priced_at_the_slowest_boundary() -> None:
    topo = Topology.load("two-node-h100-ib")
    shape = {"dp": 1, "pp": 4, "tp": 4}
    p = place(shape, topo, {"pp": ("send_recv", 64 * MiB, 10)}, order=("tp", "dp", "pp"))
    model = CostModel(topo)
    within = model.predict("send_recv", 64 * MiB, [0, 1], concurrent=2)
    crossing = model.predict("send_recv", 64 * MiB, [0, 8], concurrent=4)
    assert within < crossing
    given = p.chosen  # pp fastest: groups 0-3 inside a node
    assert given.axes["pp"].seconds == pytest.approx(10 * within)
    conv = next(c for c in p.candidates if c.order == CONVENTION)  # pp stride 4: 4->8 crosses
    assert conv.axes["pp"].seconds == pytest.approx(10 * crossing)
    assert "auto" not in p.explain().splitlines()[0]
    assert "order='auto' would choose" not in p.explain()


def test_a_given_order_is_priced_against_the_best() -> None:
    topo = Topology.load("two-node-h100-ib")
    p = place({"dp": 2, "pp": 1, "tp": 8}, topo, TP_HEAVY, order=("tp", "pp", "dp"))
    assert p.order == ("tp", "pp", "dp") and not p.auto
    assert "order='auto' would choose: dp, pp, tp at" in " ".join(p.explain().split())


@pytest.mark.parametrize("order", list(itertools.permutations(("dp", "pp", "tp"))))
def test_the_layout_follows_the_order(order: tuple[str, ...]) -> None:
    group = DeviceGroup.cpu(8, timeout=TIMEOUT)
    outs = group.run(lambda comm: M.ordered_program(comm, 2, 2, order=order))
    for rank, got in enumerate(outs):
        assert got["order"] == order
        ref = M.ordered_reference(8, 2, 2, order, rank)
        assert {a: got[a] for a in ("dp", "pp", "tp")} == ref, (order, rank)


def test_auto_over_a_device_group_on_a_declared_topology() -> None:
    """Eight devices as 2 nodes of 4 GPUs: the dp-heavy traffic puts dp fastest."""
    small = _nodes_of(4)
    group = DeviceGroup.cpu(8, timeout=TIMEOUT)
    outs = group.run(lambda comm: M.ordered_program(comm, 4, 1, order="auto",
                                                    traffic=DP_HEAVY, topology=small))
    order = outs[0]["order"]
    assert order[-1] == "dp"
    for rank, got in enumerate(outs):
        assert got["order"] == order and got["explain"] == outs[0]["explain"]
        ref = M.ordered_reference(8, 4, 1, order, rank)
        assert {a: got[a] for a in ("dp", "pp", "tp")} == ref
    assert "<- chosen" in outs[0]["explain"]


def _nodes_of(per_node: int) -> Topology:
    """Two H100 nodes of ``per_node`` GPUs each, one NIC per GPU."""
    n = Topology.load("two-node-h100-ib").nodes[0]
    return Topology([Node(f"n{i}", per_node, n.fabric, per_node, n.nic) for i in range(2)],
                    name=f"2x{per_node}")


def test_ranks_that_disagree_fail_on_every_rank() -> None:
    """Ranks 0-1 think the model is tp-heavy, ranks 2-3 dp-heavy: every rank raises."""
    group = DeviceGroup.cpu(4, timeout=TIMEOUT)

    def build(comm: Communicator) -> str:
        traffic = TP_HEAVY if comm.rank < 2 else DP_HEAVY
        with pytest.raises(ConfigError) as e:
            Mesh(comm, tp=2, order="auto", traffic=traffic, topology=_nodes_of(2))
        text = str(e.value)  # the decision, then the input that differs, by field and rank
        assert re.search(r"same traffic= and topology=\): the ranks disagree \(order: rank 0 "
                         r"has \('dp', 'pp', 'tp'\), rank 2 has \(.*order: rank 0 has .*, "
                         r"rank 3 has .*Its inputs: the ranks disagree \(traffic: rank 0 has "
                         r".*, rank 2 has .*traffic: rank 0 has .*, rank 3 has ", text), text
        assert "rank 1 has" not in text and "topology:" not in text, text
        return "raised"

    assert group.run(build) == ["raised"] * 4


def test_bad_input_names_the_numbers_and_the_fix() -> None:
    topo = Topology.load("dgx-h100")
    comm = DeviceGroup.cpu(1, timeout=TIMEOUT).comms[0]
    with pytest.raises(ConfigError, match=r"order='auto'\) needs traffic="):
        Mesh(comm, order="auto")
    with pytest.raises(ConfigError, match=r"give 'auto' or the three axes"):
        Mesh(comm, order="fastest")
    with pytest.raises(ConfigError, match=r"name each of dp, pp, tp once"):
        Mesh(comm, order=("dp", "tp", "tp"))
    with pytest.raises(ConfigError, match=r"pass topology="):
        Mesh(comm, order="auto", traffic=TP_HEAVY)
    with pytest.raises(ConfigError, match=r"unknown axis 'ep'"):
        place({"dp": 1, "pp": 1, "tp": 1}, topo, {"ep": ("all_reduce", 8, 1)})
    with pytest.raises(ConfigError, match=r"unknown collective 'allreduce'"):
        Traffic("allreduce", 8)
    with pytest.raises(ConfigError, match=r"nbytes must be a finite number >= 0, got -1"):
        Traffic("all_reduce", -1)
    with pytest.raises(ConfigError, match=r"count must be an int >= 0"):
        Traffic("all_reduce", 8, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"mesh has 16 ranks but the topology dgx-h100 has 8"):
        place({"dp": 2, "pp": 1, "tp": 8}, topo, TP_HEAVY)


def test_without_traffic_nothing_changes_and_explain_says_so() -> None:
    comm = DeviceGroup.cpu(1, timeout=TIMEOUT).comms[0]
    mesh = Mesh(comm)
    assert mesh.order == CONVENTION and mesh.placement is None
    assert "by convention: tp fastest" in mesh.explain()
    assert "as given" in Mesh(comm, order=("tp", "pp", "dp")).explain()


def test_the_worked_explanation_in_the_docs_is_what_the_code_prints() -> None:
    """docs/topology.md shows two mesh.explain() outputs; they are pure functions of
    declared inputs, so the page must match them exactly."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "topology.md").read_text()
    start = page.index("```text\nMesh dp=2 x pp=1 x tp=8 on two-node-h100-ib") + len("```text\n")
    shown = page[start:page.index("```", start)].rstrip("\n")
    topo = Topology.load("two-node-h100-ib")
    shape = {"dp": 2, "pp": 1, "tp": 8}
    gpt = Transformer(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304,
                      global_batch=64)
    deep = place(shape, topo, transformer_traffic(gpt, **shape)).explain()
    wide = place(shape, topo, {"tp": ("all_reduce", 1 << 20, 4),
                               "dp": ("all_reduce", 4 << 30, 1)}).explain()
    assert shown == f"{deep}\n\n{wide}"
