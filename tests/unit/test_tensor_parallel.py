"""Tensor parallelism in a DeviceGroup (devices of one process) at TP 1..4, against the
single-device numpy references of tests/tp_programs.py (the same programs
tests/mpi/test_tensor_parallel.py runs under mpiexec); plus the size checks, the seeded
shards and the cost of the size-1 paths, in one process."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import tensor_parallel as tp
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError, ShapeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tp_programs as P

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 10.0
LOOSE = {"attention": dict(rtol=1e-6, atol=1e-7)}  # its reference is finite differences


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], list[dict[str, np.ndarray]]]:
    return {}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(P.CASES))
def test_matches_single_device_numpy(case: str, n: int, references: dict) -> None:
    program, reference = P.CASES[case]
    outs = DeviceGroup.cpu(n, timeout=TIMEOUT).run(program)
    key = (case, n)
    if key not in references:
        references[key] = reference(n)
    for got, want in zip(outs, references[key]):
        P.check(got, want, **LOOSE.get(case, {}))


@pytest.mark.parametrize("case", sorted(P.CASES))
def test_mixed_numpy_and_strict_devices(case: str, references: dict) -> None:
    """A numpy and an array-api-strict device in one group give the same numbers."""
    program, reference = P.CASES[case]
    outs = DeviceGroup(["cpu:0", "strict:0"], timeout=TIMEOUT).run(program)
    if (case, 2) not in references:
        references[(case, 2)] = reference(2)
    for got, want in zip(outs, references[(case, 2)]):
        P.check(got, want, **LOOSE.get(case, {}))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_rank_raises_the_same_index_range_error(n: int) -> None:
    """Out-of-range targets and ids, each naming the value and where it is, alike on every
    device, and no device left waiting in a collective."""
    outs = DeviceGroup.cpu(n, timeout=TIMEOUT).run(P.bad_index_program)
    assert all(o == outs[0] for o in outs)
    assert [s.split(":")[0] for s in outs[0]] == ["IndexRangeError"] * 4, outs[0]
    assert f"target {P.V} at position (3,) is outside [0, {P.V})" in outs[0][0]
    assert "id -1 at position (1, 2)" in outs[0][2]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_seeded_layers_hold_shards_of_one_weight(n: int) -> None:
    """Results do not depend on the TP degree: each shard is a slice of seeded_weight."""
    full = tp.seeded_weight(3, 8, 16)

    def shards(comm: fs.Communicator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        col = tp.ColumnParallelLinear(8, 16, comm=comm, seed=3, dtype="float64")
        row = tp.RowParallelLinear(8, 16, comm=comm, seed=3, dtype=np.float64)
        return col.weight.numpy(), row.weight.numpy(), row.bias.numpy()

    for r, (cw, rw, rb) in enumerate(DeviceGroup.cpu(n, timeout=TIMEOUT).run(shards)):
        np.testing.assert_array_equal(cw, np.split(full, n, axis=1)[r])
        np.testing.assert_array_equal(rw, np.split(full, n, axis=0)[r])
        np.testing.assert_array_equal(rb, np.zeros(16))


def test_mlp_output_same_at_every_tp_degree() -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)

    def fwd(comm: fs.Communicator) -> np.ndarray:
        return tp.ParallelMLP(8, 16, comm=comm, seed=11)(fs.tensor(x, device=comm.device)
                                                         ).numpy()

    one = DeviceGroup.cpu(1).run(fwd)[0]
    for n in (2, 4):
        for got in DeviceGroup.cpu(n, timeout=TIMEOUT).run(fwd):
            np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-6)


def _config_error(n: int, build: object) -> str:
    def body(comm: fs.Communicator) -> None:
        build(comm)  # type: ignore[operator]

    with pytest.raises(ConfigError) as info:
        DeviceGroup.cpu(n, timeout=TIMEOUT).run(body)
    return str(info.value)


def test_sizes_that_do_not_divide_list_the_degrees_that_do() -> None:
    msg = _config_error(4, lambda c: tp.ColumnParallelLinear(8, 6, comm=c))
    assert "out_features=6" in msg and "TP size 4" in msg and "[1, 2, 3, 6]" in msg
    msg = _config_error(3, lambda c: tp.RowParallelLinear(10, 4, comm=c))
    assert "in_features=10" in msg and "[1, 2, 5, 10]" in msg
    msg = _config_error(4, lambda c: tp.ParallelAttention(12, 6, comm=c))
    assert "heads=6" in msg and "[1, 2, 3, 6]" in msg
    msg = _config_error(3, lambda c: tp.VocabParallelEmbedding(10, 4, comm=c))
    assert "vocab=10" in msg and "[1, 2, 5, 10]" in msg
    msg = _config_error(2, lambda c: tp.ParallelMLP(8, 9, comm=c))
    assert "out_features=9" in msg and "[1, 3, 9]" in msg


def test_caller_mistakes_are_typed() -> None:
    comm = DeviceGroup.cpu(1).comms[0]
    with pytest.raises(ConfigError, match="not both"):
        tp.ColumnParallelLinear(4, 4, comm=comm, seed=1, full=(np.zeros((4, 4)), None))
    with pytest.raises(ShapeError, match=r"expected \(4, 6\)"):
        tp.ColumnParallelLinear(4, 6, comm=comm, full=(np.zeros((6, 4)), np.zeros(6)))
    with pytest.raises(ConfigError, match="heads=5"):
        tp.ParallelAttention(12, 5, comm=comm)
    with pytest.raises(ShapeError, match="TP sizes that divide it"):
        DeviceGroup.cpu(2).run(lambda c: tp.scatter_to_tp(
            fs.tensor(np.zeros((2, 3)), device=c.device), comm=c))


def test_size_one_mappings_add_no_node() -> None:
    comm = DeviceGroup.cpu(1).comms[0]
    x = fs.tensor(np.arange(6.0).reshape(2, 3), device=comm.device)
    for f in (tp.copy_to_tp, tp.reduce_from_tp, tp.scatter_to_tp, tp.gather_from_tp):
        assert f(x, comm=comm) is x


def test_mlp_has_one_all_reduce_each_way() -> None:
    """Forward: one all_reduce (the row layer's); backward: one more (dX of the column
    layer); counted on the graph, with no other collective."""
    def count(comm: fs.Communicator) -> tuple[int, int]:
        mlp = tp.ParallelMLP(8, 16, comm=comm, seed=1)
        x = fs.tensor(np.ones((2, 8), np.float32), device=comm.device)
        y = mlp(x)
        grads = fs.grad(y.sum(), [x, *mlp.parameters()])
        return _collectives([y.node]), _collectives([g.node for g in grads])

    assert DeviceGroup.cpu(2, timeout=TIMEOUT).run(count) == [(1, 2), (1, 2)]


def _collectives(roots: list) -> int:
    seen: set[int] = set()
    stack, n = list(roots), 0
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        n += node.op.name.startswith("comm.")
        stack.extend(node.inputs)
    return n


def test_bench_tp_runs_small_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    """The bench on a small MLP: its TP 1 / TP 2 loss check passes and it reports times,
    a speedup and a communication share (the 1.7x target is measured at full size)."""
    import json

    from fuelspmd.bench import tp as bench

    assert bench.main(["--json", "--rounds", "2", "--batch", "4", "--hidden", "16",
                       "--ffn", "32"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bench"] == "tp" and res["tp"] == 2 and res["mode"] == "group"
    assert res["tp1_ms"] > 0 and res["tpN_ms"] > 0 and res["speedup"] > 0
    assert 0 < res["comm_share"] < 10
    assert bench.main(["--tp", "0"]) == 2


def test_example_trains_the_same_in_every_mode() -> None:
    """examples/tp_mlp.py: TP 1, TP 2 as devices and TP 2 as mpiexec processes print the
    same decreasing losses."""
    import json
    import os
    import shutil
    import subprocess

    script = str(Path(__file__).resolve().parents[2] / "examples" / "tp_mlp.py")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_"))}
    runs = [[sys.executable, script], [sys.executable, script, "--devices", "cpu:2"]]
    if shutil.which("mpiexec"):
        runs.append(["mpiexec", "-n", "2", sys.executable, script])
    curves = []
    for cmd in runs:
        out = subprocess.run([*cmd, "--steps", "4"], env=env, capture_output=True, text=True,
                             timeout=120, check=True).stdout
        curves.append([json.loads(line)["loss"] for line in out.splitlines()])
    assert len(curves[0]) == 4 and curves[0][-1] < curves[0][0]
    for c in curves[1:]:
        np.testing.assert_allclose(c, curves[0], rtol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cached_attention_equals_the_whole_sequence(n: int) -> None:
    """GQA (8 query, 2 key/value heads: shared at TP 4) with RoPE through the paged store:
    a 5-token prefill then 3 one-token decode steps give the outputs of one causal forward
    over all 8 tokens, the positions coming from the cache."""
    from fuelspmd.distributed_cache import KVCacheManager, PagedKVStore

    x = np.random.default_rng(9).standard_normal((1, 8, 32))

    def program(comm: fs.Communicator) -> tuple[np.ndarray, np.ndarray]:
        att = tp.ParallelAttention(32, 8, kv_heads=2, comm=comm, rope_base=100.0, seed=4,
                                   dtype="float64")
        whole = att(fs.tensor(x, device=comm.device)).numpy()
        manager = KVCacheManager(8, 2, enable_prefix_caching=False)
        kv, d = att.cache_heads
        store = PagedKVStore(num_layers=1, num_blocks=8, block_size=2, kv_heads=kv,
                             head_dim=d, device=comm.device, dtype="float64")
        manager.allocate(0, list(range(5)))
        outs = [att(fs.tensor(x[:, :5], device=comm.device),
                    cache=store.view(0, tables=[manager.block_table(0)], starts=[0]))]
        for t in range(5, 8):
            store.copy(manager.append(0, [t]))
            outs.append(att(fs.tensor(x[:, t:t + 1], device=comm.device),
                            cache=store.view(0, tables=[manager.block_table(0)], starts=[t])))
            fs.realize(outs[-1], *store.tensors())
        return whole, np.concatenate([o.numpy() for o in outs], 1)

    for whole, cached in DeviceGroup.cpu(n, timeout=TIMEOUT).run(program):
        np.testing.assert_allclose(cached, whole, rtol=1e-12, atol=1e-13)
