"""The planner on the published 1-trillion-parameter GPT run of Megatron-LM (Narayanan et
al., arXiv 2104.04473: 3072 A100s on Selene, tp 8, pp 64, dp 6, micro-batch 1, interleaved
schedule, recomputation, 163 TFLOP/s per GPU), the model's formulas, and the command."""

from __future__ import annotations

import json

import pytest

from fuelspmd.cli.plan import main, simulate_pipeline
from fuelspmd.cost.transformer import Assumptions, Config, Transformer, candidates, plan, predict
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Topology

GPT_1T = Transformer(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200,
                     global_batch=3072)
ARGS_1T = ("--layers 128 --hidden 25600 --heads 160 --seq 2048 --vocab 51200 --batch 3072 "
           "--gpus 3072 --topology a100-selene").split()


def test_parameter_and_flop_counts_follow_the_paper() -> None:
    assert GPT_1T.params == pytest.approx(1008e9, rel=1e-3)  # Table 1: 1008 billion
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200
    eq3 = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert GPT_1T.flops_per_step() == pytest.approx(eq3, rel=1e-12)
    assert GPT_1T.flops_per_step(recompute=False) == pytest.approx(eq3 * 3 / 4, rel=0.01)


def test_the_published_trillion_parameter_layout_ranks_top_three_near_163_tflops() -> None:
    topo = Topology.load("a100-selene")
    ranked = plan(GPT_1T, 3072, topo)
    print("\n#  tp  pp  dp  mb  v  TFLOP/s/GPU  GiB")
    for i, p in enumerate(ranked[:5]):
        c = p.config
        print(f"{i + 1}  {c.tp:>2}  {c.pp:>3}  {c.dp:>2}  {c.microbatch:>2}  {c.chunks}  "
              f"{p.flops_per_gpu / 1e12:11.1f}  {p.memory / 2**30:.1f}")
    top3 = [(p.config.tp, p.config.pp, p.config.dp) for p in ranked[:3]]
    assert (8, 64, 6) in top3, top3
    published = next(p for p in ranked if (p.config.tp, p.config.pp, p.config.dp) == (8, 64, 6))
    assert published.config.microbatch == 1 and published.config.chunks == 2
    assert abs(published.flops_per_gpu / 163e12 - 1) <= 0.25, published.flops_per_gpu
    # the layouts that do not fit are left out for the right reason: memory
    pp32 = predict(GPT_1T, Config(8, 32, 12, 1, 1), topo)
    assert not pp32.fits and pp32.memory > 80 * 2**30 * 0.9


def test_step_parts_add_up_and_the_bubble_follows_the_schedule() -> None:
    topo = Topology.load("a100-selene")
    for v in (1, 2):
        p = predict(GPT_1T, Config(8, 64, 6, 1, v), topo)
        assert sum(p.parts.values()) == pytest.approx(p.step_time, rel=1e-9)
        m = 3072 // 6
        per_mb = (p.parts["compute"] + p.parts["tp_comm"] + p.parts["pp_comm"]) / m
        assert p.parts["bubble"] == pytest.approx((64 - 1) / v * per_mb, rel=0.02)
    one = predict(GPT_1T, Config(8, 64, 6, 1, 1), topo)
    two = predict(GPT_1T, Config(8, 64, 6, 1, 2), topo)
    assert two.parts["bubble"] == pytest.approx(one.parts["bubble"] / 2, rel=0.02)
    assert two.parts["pp_comm"] == pytest.approx(one.parts["pp_comm"] * 2, rel=1e-9)


def test_tensor_parallelism_across_nodes_costs_more_than_inside_one() -> None:
    topo = Topology.load("a100-selene", nodes=8)
    small = Transformer(layers=32, hidden=8192, heads=64, seq=2048, vocab=51200,
                        global_batch=512)
    inside = predict(small, Config(8, 8, 1), topo)
    across = predict(small, Config(16, 4, 1), topo)
    assert across.parts["tp_comm"] / across.parts["compute"] > \
        inside.parts["tp_comm"] / inside.parts["compute"]
    assert "across 2 nodes" in across.reasons[0] and "inside one node" in inside.reasons[0]


def test_candidates_respect_the_shapes() -> None:
    for c in candidates(GPT_1T, 3072):
        assert c.tp * c.pp * c.dp == 3072 and 160 % c.tp == 0
        assert 128 % (c.pp * c.chunks) == 0 and 3072 % (c.dp * c.microbatch) == 0
        if c.chunks > 1:
            assert (3072 // (c.dp * c.microbatch)) % c.pp == 0


def test_bad_plans_fail_early_with_the_fix() -> None:
    topo = Topology.load("a100-selene", nodes=2)
    with pytest.raises(ConfigError, match="needs 24 GPUs"):
        predict(GPT_1T, Config(8, 3, 1), topo)
    with pytest.raises(ConfigError, match="nodes=384"):
        plan(GPT_1T, 3072, topo)
    with pytest.raises(ConfigError, match="not divisible by heads"):
        Transformer(layers=2, hidden=100, heads=3, seq=8, vocab=8, global_batch=1)
    bare = Topology.uniform(nodes=1, devices_per_node=8, fabric=Link("nvlink", 1e11, 1e-6))
    with pytest.raises(ConfigError, match="declare an 'accelerator'"):
        predict(GPT_1T, Config(8, 1, 1), bare)
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        Assumptions(matmul_efficiency=1.5)


def test_the_command_prints_the_ranking(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS_1T, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "GPT 1008.0B parameters" in out and "#1 why:" in out
    assert main([*ARGS_1T, "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 3
    assert any((r["tp"], r["pp"], r["dp"]) == (8, 64, 6) for r in data["plans"])


def test_the_command_reports_bad_input_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS_1T[:-1], "no-such-cluster"]) == 2
    assert "shipped names" in capsys.readouterr().err
    small = ("--layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 --batch 64 "
             "--gpus 16 --topology two-node-h100-ib --top 2").split()
    assert main([*small, "--memory-gib", "0.5"]) == 2
    assert "nothing fits" in capsys.readouterr().err
    assert main([*small, "--peak-tflops", "400", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert 0 < data["plans"][0]["peak_share"] < 1


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_formula_agrees_with_the_runtimes_schedule_replayed(chunks: int) -> None:
    """The pipeline term of a prediction against fuelspmd.pipeline_parallel's own schedule
    (1F1B or interleaved) replayed in its event simulator with the same per-chunk times."""
    topo = Topology.load("a100-selene", nodes=4)
    gpt = Transformer(layers=16, hidden=4096, heads=32, seq=2048, vocab=51200, global_batch=64)
    pred = predict(gpt, Config(8, 4, 1, 1, chunks), topo)
    sim, formula, idle = simulate_pipeline(pred, gpt)
    print(f"\nv={chunks}: simulated {sim:.3f} s, formula {formula:.3f} s, idle {idle:.1%}")
    assert abs(sim / formula - 1) < 0.05
    assert 0 < idle < 0.5


def test_the_command_replays_the_best_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    # 6 GiB GPUs force a 3.4B model into a pipeline, so the best layout has stages to replay
    args = ("--layers 16 --hidden 4096 --heads 32 --seq 2048 --vocab 51200 --batch 64 "
            "--gpus 32 --topology a100-selene --top 1 --simulate --memory-gib 6").split()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pipeline replayed with fuelspmd.pipeline_parallel (interleaved" in out
    assert "by the formula" in out
