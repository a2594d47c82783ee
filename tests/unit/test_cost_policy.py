"""The all-reduce plan the MPI transport follows, from the cost model, in one process.

Checked: every band's algorithm is the one the model predicts fastest at each power of two
in the band (the plan follows the model); on a machine like the project's (2 cores,
calibrated regimes) shm is chosen only above its crossover, between 256 KiB and 4 MiB
(``fuelspmd bench shm`` finds the placed shm path ahead of MPI's own from 256-512 KiB on
2-4 ranks); on a declared two-node topology with a slow network the hierarchical
all-reduce wins the large sizes; the words say why.
"""

from __future__ import annotations

import math

import pytest

from fuelspmd.cost import CostModel, Regime
from fuelspmd.cost.policy import _candidates, all_reduce_planner, plan_all_reduce
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology

# the regimes `fuelspmd bench calibrate` fitted on a 2-core machine (mpiexec -n 4, load 7)
HERE = (Regime(11585, 5.3e-6, 4.82e9, 1.85e9, ((1.5, 94e-6), (2.0, 158e-6))),
        Regime(5931642, 6.3e-6, 5.31e9, 2.24e9, ((1.5, 211e-6), (2.0, 376e-6))),
        Regime(math.inf, 3.2e-3, 1.28e9, 1.53e9, ((1.5, 0.0), (2.0, 0.0))))


def this_machine(n: int) -> CostModel:
    node = Node("here", n, Link("shm", HERE[-1].bandwidth, HERE[0].latency),
                reduce_bandwidth=HERE[-1].reduce_bandwidth, cores=2)
    return CostModel(Topology([node]), regimes=HERE)


def two_nodes(per_node: int) -> CostModel:
    return CostModel(Topology.uniform(nodes=2, devices_per_node=per_node,
                                      fabric=Link("shm", 3e9, 5e-6), nics=1,
                                      nic=Link("net", 1.25e8, 50e-6), reduce_bandwidth=3e9))


def follows_the_model(model: CostModel, n: int) -> None:
    plan = plan_all_reduce(model, range(n), largest=1 << 28)
    size = 8
    while size <= 1 << 28:
        cands = {k: v for k, v in _candidates(model, size, list(range(n)), True).items()
                 if k in ("mpi", "shm", "hierarchical")}
        assert plan.choose(size).algorithm == min(cands, key=lambda k: cands[k][0]), size
        size *= 2


@pytest.mark.parametrize("n", [2, 3, 4])
def test_this_machine_uses_shm_only_above_its_crossover(n: int) -> None:
    model = this_machine(n)
    follows_the_model(model, n)
    plan = plan_all_reduce(model, range(n))
    assert [b.algorithm for b in plan.bands] == ["mpi", "shm"]
    assert 256 << 10 <= plan.bands[0].upto <= 4 << 20
    assert "shared memory predicted" in plan.choose(64 << 20).reason
    for size in (8, 4096, 128 << 10):
        band = plan.choose(size)
        assert band.algorithm == "mpi" and "MPI's own" in band.reason


def test_declared_two_node_topology_goes_hierarchical() -> None:
    model = two_nodes(2)
    follows_the_model(model, 4)
    plan = plan_all_reduce(model, range(4))
    assert plan.nodes == (0, 0, 1, 1)
    big = plan.choose(64 << 20)
    assert big.algorithm == "hierarchical"
    assert "over 4 ranks on 2 node(s)" in big.reason and "MPI's own" in big.reason
    assert plan.choose(8).algorithm == "mpi"  # latency-bound: MPI's own doubling is fewer steps
    # no shm across nodes, whatever is asked
    assert all(b.algorithm != "shm" for b in plan.bands)
    # a group of one rank per node has no intra-node half: MPI's own only
    assert {b.algorithm for b in plan_all_reduce(model, [0, 2]).bands} == {"mpi"}


def test_planner_gives_plain_data_in_group_order() -> None:
    planner = all_reduce_planner(two_nodes(2))
    data = planner((3, 2, 1, 0))
    assert data["nodes"] == [1, 1, 0, 0]
    assert all(isinstance(u, float) and a in ("mpi", "shm", "hierarchical") and why
               for u, a, why in data["bands"])
    assert math.isinf(data["bands"][-1][0])
    one = plan_all_reduce(this_machine(1), [0])
    assert [b.algorithm for b in one.bands] == ["mpi"]
    with pytest.raises(ConfigError, match="distinct"):
        plan_all_reduce(this_machine(2), [0, 0])


def test_planner_for_a_job_uses_its_calibration() -> None:
    from dataclasses import dataclass

    from fuelspmd.cost import regimes_to_dict
    from fuelspmd.cost.policy import planner_for

    @dataclass
    class Job:
        rank: int
        size: int
        nodes: list[str]

    cal = {"shm": {"latency": HERE[0].latency, "bandwidth": HERE[-1].bandwidth,
                   "reduce_bandwidth": HERE[-1].reduce_bandwidth},
           "regimes": regimes_to_dict(HERE)}
    data = planner_for(Job(0, 4, ["a"] * 4), calibration=cal)([0, 1, 2, 3])
    assert data["nodes"] == [0, 0, 0, 0]
    assert {a for _, a, _ in data["bands"]} <= {"mpi", "shm"}
    two = planner_for(Job(0, 4, ["a", "a", "b", "b"]), calibration=cal)([0, 1, 2, 3])
    assert two["nodes"] == [0, 0, 1, 1] and "shm" not in {a for _, a, _ in two["bands"]}
