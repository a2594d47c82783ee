"""The cost model's opt-in shared-memory all-reduce (fuelspmd_mpi's shm path), in one process.

The numbers checked are the formula's (two phase syncs, ``N`` of copies at twice the fabric
bandwidth for an input placed in the window, the ring's fold), and the switch-on size, for a
node whose cores are not known (so the cache gate holds), against the crossover ``fuelspmd
bench shm`` measured on a 48 MiB-L3 machine with the whole-size path: lost at 16 MiB and won
at 32 MiB on 2 ranks, won at 16 MiB on 4 ranks.
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


def test_switch_on_size_follows_the_cache_and_the_estimate() -> None:
    llc = 48 << 20
    assert cpu(2).shm_min_bytes([0, 1], llc_bytes=llc) == 32 << 20
    assert cpu(4).shm_min_bytes(range(4), llc_bytes=llc) == 16 << 20
    # without a cache the alpha-beta terms alone decide: a fixed overhead to amortise
    tiny = cpu(2).shm_min_bytes([0, 1], llc_bytes=0)
    assert tiny is not None and 64 << 10 <= tiny <= 4 << 20
    choice = cpu(2).best_algorithm("all_reduce", 64 << 20, [0, 1], opt_in=True)
    assert choice.algorithm == "shm" and "beats ring" in choice.explanation
    small = cpu(2).best_algorithm("all_reduce", 4 << 10, [0, 1], opt_in=True)
    assert small.algorithm != "shm"


def test_shm_needs_one_cpu_node() -> None:
    two = cpu(2, nodes=2)
    assert "shm" not in two.algorithms("all_reduce", range(4), opt_in=True)
    assert two.shm_min_bytes(range(4), llc_bytes=0) is None
    with pytest.raises(ConfigError, match="one node"):
        two.estimate("all_reduce", 1 << 20, range(4), algorithm="shm")
    gpus = CostModel(Topology([Node("g", 2, Link("nvlink", 1e11, 2e-6))]))
    assert gpus.shm_min_bytes([0, 1], llc_bytes=0) is None
    with pytest.raises(ConfigError, match="no algorithm"):
        two.estimate("all_gather", 1 << 20, range(4), algorithm="shm")
