"""The cost model's opt-in shared-memory all-reduce (fuelspmd_mpi's shm path), in one process.

The numbers checked are the formula's (two phase syncs and a per-call overhead that crowded
ranks stretch, ``N`` of copies at twice the fabric bandwidth for an input placed in the
window, the ring's fold), and the switch-on size: where the estimate first beats MPI's own.
"""

from __future__ import annotations

import math

import pytest

from fuelspmd.cost.collectives import SHM_CALL_OVERHEAD_S, CostModel
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Node, Topology

BW, ALPHA, RED = 2.2e9, 1.2e-6, 6.0e9


def cpu(n: int, *, nodes: int = 1) -> CostModel:
    fabric = Link("shm", BW, ALPHA)
    return CostModel(Topology([Node(f"h{i}", n, fabric, 1, Link("net", 1e10, 5e-6), None, RED)
                               for i in range(nodes)]))


def test_default_predictions_do_not_assume_shm() -> None:
    m = cpu(2)
    assert "shm" not in m.algorithms("all_reduce", [0, 1])
    assert "shm" in m.algorithms("all_reduce", [0, 1], opt_in=True)
    assert m.estimate("all_reduce", 64 << 20, [0, 1]).algorithm != "shm"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_estimate_is_the_formula(n: int) -> None:
    nbytes = 64 << 20
    e = cpu(n).estimate("all_reduce", nbytes, range(n), algorithm="shm")
    assert e.latency == pytest.approx(2 * math.ceil(math.log2(n)) * ALPHA + SHM_CALL_OVERHEAD_S)
    assert e.transfer == pytest.approx(nbytes / (2 * BW))
    assert e.reduce == pytest.approx((n - 1) / n * nbytes / RED)


def test_switch_on_size_is_where_the_estimate_first_wins() -> None:
    for n in (2, 4):
        m, group = cpu(n), list(range(n))
        on = m.shm_min_bytes(group)
        assert on is not None and 64 << 10 <= on <= 4 << 20  # a fixed overhead to amortise
        assert m.best_algorithm("all_reduce", on, group, opt_in=True).algorithm == "shm"
        assert m.best_algorithm("all_reduce", on // 2, group, opt_in=True).algorithm != "shm"
    choice = cpu(2).best_algorithm("all_reduce", 64 << 20, [0, 1], opt_in=True)
    assert choice.algorithm == "shm" and "beats ring" in choice.explanation
    small = cpu(2).best_algorithm("all_reduce", 4 << 10, [0, 1], opt_in=True)
    assert small.algorithm != "shm"


def test_ranks_that_outnumber_the_cores_stretch_the_call_overhead() -> None:
    def node(cores: int) -> CostModel:
        return CostModel(Topology([Node("h", 4, Link("shm", BW, ALPHA), 1, Link("net", 1e10, 5e-6),
                                        None, RED, cores=cores)]))
    own, shared = (node(c).estimate("all_reduce", 1 << 16, range(4), algorithm="shm")
                   for c in (4, 2))
    assert own.latency == pytest.approx(4 * ALPHA + SHM_CALL_OVERHEAD_S)
    assert shared.latency == pytest.approx(4 * ALPHA + 2 * SHM_CALL_OVERHEAD_S)
    assert shared.transfer == pytest.approx(2 * own.transfer)


def test_shm_needs_one_cpu_node() -> None:
    two = cpu(2, nodes=2)
    assert "shm" not in two.algorithms("all_reduce", range(4), opt_in=True)
    assert two.shm_min_bytes(range(4)) is None
    with pytest.raises(ConfigError, match="one node"):
        two.estimate("all_reduce", 1 << 20, range(4), algorithm="shm")
    gpus = CostModel(Topology([Node("g", 2, Link("nvlink", 1e11, 2e-6))]))
    assert gpus.shm_min_bytes([0, 1]) is None
    with pytest.raises(ConfigError, match="no algorithm"):
        two.estimate("all_gather", 1 << 20, range(4), algorithm="shm")
