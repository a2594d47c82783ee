"""examples/train.py end to end: as a plain script, as a DeviceGroup (``--devices cpu:4``),
and under a real ``mpiexec`` at tp 2 x pp 2 (every schedule) and dp 2 x pp 2 x tp 2.

Each run passes ``--check`` (first-step loss and gradients against the whole model in one
process, exit 1 on disagreement), and its printed first-step loss is compared with a plain
numpy forward of the same weights and batch, so the example's own reference cannot share a
bug with it unnoticed. A last test shows ``check`` rejects a wrong gradient.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.errors import ConfigError
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget import long_only  # noqa: E402
from jobs import mpiexec, needs_mpiexec, run_job  # noqa: E402

SUMMARY = re.compile(r"loss ([0-9.]+) -> ([0-9.]+) in (\d+) steps; ([0-9.]+) ms/step .*"
                     r"measured bubble ([0-9.]+)")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


T = _load()


def run(args: list[str], *, n: int | None = None, deadline: float = 90.0) -> dict[str, Any]:
    """Run the example (under ``mpiexec -n n`` when n is given) in its own process group,
    killed at ``deadline``; return its exit code, output and parsed summary."""
    cmd = [sys.executable, str(TRAIN), *args]
    if n is not None:
        cmd = mpiexec(n, *cmd)
    start = time.monotonic()
    job = run_job(cmd, deadline=deadline)
    out = job.out
    found = SUMMARY.search(out)
    assert job.code == 0 and found, f"{cmd} -> {job.code}\n{out}\n{job.err}"
    # into a pipe the progress is plain lines: no terminal redraws, no colour codes
    assert "\r" not in out and "\x1b" not in out, repr(out)
    assert re.search(r"^step 1/\d+ loss [0-9.]+ ", out, re.M), out
    first, last, steps = float(found[1]), float(found[2]), int(found[3])
    return {"out": out, "first": first, "last": last, "steps": steps,
            "bubble": float(found[5]), "seconds": time.monotonic() - start}


# ---- plain numpy reference of the first step's loss -------------------------------------
def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def numpy_loss(cfg: Any, seed: int, m: int, rows: int, dp: int,
               w: dict[str, Any] | None = None) -> float:
    """Mean next-token cross-entropy of the model with weights ``w`` (default: the initial
    ones) over step 0's micro-batches of every replica, in float64 numpy (no fuelspmd)."""
    w = T.full_weights(cfg, seed) if w is None else w
    h, d = cfg.heads, cfg.hidden // cfg.heads
    total = []
    for r in range(dp):
        xs, ys = T.microbatches(seed, 0, r, m, rows, cfg)
        for ids, tgt in zip(xs, ys):
            b, t = ids.shape
            x = w["emb"][ids] + w["pos"]
            for blk in w["blocks"]:
                a = _ln(x, *blk["ln1"])
                q, k, v = (((a @ blk["attn"][2 * i] + blk["attn"][2 * i + 1])
                            .reshape(b, t, h, d).transpose(0, 2, 1, 3)) for i in range(3))
                s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + np.triu(
                    np.full((t, t), -1e9), 1)
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                ctx = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, h * d)
                x = x + ctx @ blk["attn"][6] + blk["attn"][7]
                f1, b1, f2, b2 = blk["mlp"]
                x = x + _gelu(_ln(x, *blk["ln2"]) @ f1 + b1) @ f2 + b2
            z = (_ln(x, *w["lnf"]) @ w["head"][0] + w["head"][1]).reshape(b * t, -1)
            z = z - z.max(1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(1, keepdims=True))
            total.append(-logp[np.arange(b * t), tgt].mean())
    return float(np.mean(total))


def _assert_trained(got: dict[str, Any], *, dp: int = 1, layers: int = 4, m: int = 4) -> None:
    cfg = T.Config(layers=layers)
    assert "check OK" in got["out"], got["out"]
    want = numpy_loss(cfg, 0, m, 8, dp)
    assert abs(got["first"] - want) < 1e-4 * want, (got["first"], want)
    assert got["last"] < got["first"], got["out"]


# ---- the runs ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_plain_script_trains_and_checks() -> None:
    got = run(["--steps", "6", "--check", "--schedule", "gpipe"])
    _assert_trained(got)
    assert "mesh dp=1 pp=1 tp=1" in got["out"]
    assert got["last"] < 0.75 * got["first"], got["out"]  # visibly falling
    assert got["bubble"] == 0.0  # one stage: nothing to wait for


@pytest.mark.timeout(120)
def test_the_loss_goes_below_the_old_claim_and_never_below_the_floor() -> None:
    """The docstring's floor, log(K) / T, holds, and the floor it used to give,
    (log V + log K) / T, was no floor: 20 steps of the defaults go below it."""
    got = run(["--steps", "20"])
    cfg = T.Config()
    floor = math.log(T.STRIDES) / cfg.seq
    assert T.loss_floor(cfg) == floor
    assert f"the task's loss floor is {floor:.3f}" in got["out"]
    assert floor < got["last"] < (math.log(cfg.vocab) + math.log(T.STRIDES)) / cfg.seq


def test_device_group_of_four_interleaved() -> None:
    got = run(["--devices", "cpu:4", "--steps", "2", "--check", "--schedule", "interleaved"])
    assert "mesh dp=1 pp=2 tp=2 (4 ranks" in got["out"]
    _assert_trained(got)


@needs_mpiexec
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_mpiexec_tp2_pp2(kind: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    chunks = 2 if kind == "interleaved" else 1
    layers, m = 2 * chunks, 2 * chunks  # the smallest model each schedule can cut
    got = run(["--tp", "2", "--pp", "2", "--steps", "2", "--check", "--schedule", kind,
               "--trace", str(trace), "--layers", str(layers), "--microbatches", str(m)], n=4)
    assert "mesh dp=1 pp=2 tp=2 (4 ranks" in got["out"]
    _assert_trained(got, layers=layers, m=m)
    assert 0.0 < got["bubble"] < 1.0  # two stages always wait for each other somewhat
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 2 * m * chunks  # F and B per mb


@needs_mpiexec
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", [pytest.param("gpipe", marks=long_only),
                                  pytest.param("1f1b", marks=long_only), "interleaved"])
def test_mpiexec_dp2_pp2_tp2(kind: str) -> None:
    """The heaviest runs (8 ranks on the machine's cores, about 6-8 s each on 2 cores): in
    CI the interleaved schedule (two chunks a rank, the most of the three to cut wrong;
    test_mpiexec_tp2_pp2 runs each schedule under mpiexec), every schedule in the long
    run (tests/budget.py)."""
    chunks = 2 if kind == "interleaved" else 1
    layers, m = 2 * chunks, 2 * chunks
    got = run(["--dp", "2", "--pp", "2", "--tp", "2", "--steps", "2", "--check",
               "--schedule", kind, "--layers", str(layers), "--microbatches", str(m)],
              n=8, deadline=150.0)
    assert "mesh dp=2 pp=2 tp=2 (8 ranks" in got["out"]
    _assert_trained(got, dp=2, layers=layers, m=m)


@needs_mpiexec
@pytest.mark.timeout(180)
def test_mpiexec_pp2_compiled_gives_the_uncompiled_losses() -> None:
    """Under mpiexec the pipeline's transfers replay through MPI (and the guard): six
    steps, four of them replays, give --no-compile's losses digit for digit."""
    base = ["--pp", "2", "--tp", "1", "--steps", "6", "--layers", "2", "--microbatches", "2"]
    outs = [run(base + flags, n=2) for flags in ([], ["--no-compile"])]
    assert ", compiled" in outs[0]["out"] and ", uncompiled" in outs[1]["out"]
    curves = [re.findall(r"^step \d+/6 loss ([0-9.]+)", o["out"], re.M) for o in outs]
    assert len(curves[0]) == 6 and curves[0] == curves[1], curves


# ---- in process: the check's reference, the check failing, bad sizes ---------------------
def _solo() -> fs.Communicator:
    return fs.DeviceGroup.cpu(1).comms[0]


@pytest.mark.timeout(60)
def test_reference_gradients_match_numpy_finite_differences() -> None:
    """The one-process gradients ``--check`` compares against, entry by entry, against
    central differences of the numpy loss (float64, a small batch), found by name."""
    args = T.parse(["--dtype", "float64", "--microbatches", "2", "--batch", "2", "--seed", "3"])
    cfg = T.config(args)
    loss, ref = T.reference(cfg, args, [(0, cfg.layers)], 1, _solo())
    g = ref[0]
    w = T.full_weights(cfg, 3)
    assert abs(loss - numpy_loss(cfg, 3, 2, 2, 1, w)) < 1e-10
    blk0, blk1 = w["blocks"][0], w["blocks"][-1]
    last = f"blocks.{cfg.layers - 1}"
    # (array in w, the name of its gradient, an entry)
    probes = [(w["emb"], "emb.weight", (3, 5)), (w["pos"], "pos", (2, 1)),
              (blk0["ln1"][0], "blocks.0.ln1.weight", (4,)),
              (blk0["ln2"][1], "blocks.0.ln2.bias", (7,)),
              (blk0["attn"][0], "blocks.0.attn.q.weight", (4, 7)),
              (blk0["attn"][6], "blocks.0.attn.out.weight", (0, 1)),
              (blk1["mlp"][0], f"{last}.mlp.fc1.weight", (1, 2)),
              (blk1["mlp"][3], f"{last}.mlp.fc2.bias", (6,)),
              (w["lnf"][0], "lnf.weight", (9,)), (w["head"][0], "head.weight", (5, 9)),
              (w["head"][1], "head.bias", (3,))]
    for arr, name, at in probes:
        assert arr.shape == g[name].shape, (name, arr.shape, g[name].shape)
        keep, eps = arr[at], 1e-6
        arr[at] = keep + eps
        up = numpy_loss(cfg, 3, 2, 2, 1, w)
        arr[at] = keep - eps
        down = numpy_loss(cfg, 3, 2, 2, 1, w)
        arr[at] = keep
        np.testing.assert_allclose(g[name][at], (up - down) / (2 * eps), rtol=1e-5,
                                   atol=1e-8, err_msg=name)


@pytest.mark.timeout(60)
def test_check_rejects_a_wrong_gradient() -> None:
    args = T.parse(["--steps", "1", "--check"])
    cfg = T.config(args)
    comm = _solo()
    mesh = fs.Mesh(comm)
    st = T.Stage(cfg, T.full_weights(cfg, 0), 0, cfg.layers, first=True, last=True, comm=comm)
    ex = PipelineExecutor(schedule("1f1b", 1, args.microbatches), comm=comm, stages=[st],
                          loss=st.loss)
    xs, ys = T.microbatches(0, 0, 0, args.microbatches, args.batch, cfg)
    res = ex.step(xs, ys)
    good = T.check(mesh, [st], [0], res.grads[0], float(res.loss), cfg, args)
    assert good["ok"], good["line"]
    names = [n for n, _ in st.named_parameters()]
    bad_grads = list(res.grads[0])
    k = names.index("blocks.0.attn.q.weight")
    bad_grads[k] = bad_grads[k] * 1.01
    bad = T.check(mesh, [st], [0], bad_grads, float(res.loss), cfg, args)
    assert not bad["ok"] and "FAILED" in bad["line"], bad["line"]
    assert 5e-3 < bad["worst"] < 2e-2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [["--zero", "--dropout", "0.1"], ["--recompute"],
                                   ["--dtype", "bfloat16"], ["--dtype", "float16"]])
def test_zero_dropout_recompute_and_16_bit_variants_check(extra: list[str]) -> None:
    """ZeRO-1 with dropout over dp 2 (a DeviceGroup), block recomputation, and 16-bit
    parameters with float32 master weights (float16 with loss scaling) all pass --check
    and train."""
    dev = ["--devices", "cpu:4", "--dp", "2", "--tp", "1", "--pp", "2"] \
        if "--zero" in extra else []
    got = run([*dev, "--steps", "4", "--check", *extra])
    assert "check OK" in got["out"], got["out"]
    assert got["last"] < got["first"], got["out"]
    assert re.search(r"peak bytes: saved activations \d+, graph working set \d+, "
                     r"optimiser state \d+", got["out"]), got["out"]


def test_layers_that_do_not_split_into_stages_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"3 layers .* 2 equal virtual stages"):
        T.stage_layers(T.Config(layers=3), 2)
    with pytest.raises(ConfigError, match="make the product 4"):
        T.plan(4, argparse.Namespace(tp=2, pp=1, dp=1))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n, extra", [
    (1, ["--dropout", "0.1"]), (2, ["--tp", "2", "--dtype", "float16"]),
    (2, ["--dp", "2", "--zero", "--dropout", "0.1"]),
    (2, ["--pp", "2", "--schedule", "interleaved", "--layers", "4", "--recompute"]),
    (4, ["--pp", "2", "--tp", "2", "--dtype", "float16"]),
    (4, ["--pp", "2", "--dp", "2", "--zero"])])
def test_compiled_steps_give_the_uncompiled_losses_bit_for_bit(n: int, extra: list[str]) -> None:
    """The default (the step under fs.compile, replayed after its traces) and --no-compile
    give the same losses and norms, exactly: dropout masks, the clip coefficient, the
    float16 loss scale and its skip decision, ZeRO-1 over dp 2, tp 2, and the pipeline's
    posted transfers at pp 2 (interleaved with recomputation, and beside tp and dp), as
    DeviceGroups."""
    base = ["--steps", "7", "--layers", "2", "--microbatches", "2", "--batch", "4", *extra]
    for flag, one in (("--tp", "1"), ("--pp", "1"), ("--dp", "1")):
        if flag not in extra:
            base += [flag, one]
    outs = [fs.DeviceGroup.cpu(n, timeout=60).run(T.train, [T.parse(base + flags)] * n)
            for flags in ([], ["--no-compile"])]
    (compiled, *_), (plain, *_) = outs
    assert compiled["replays"] >= 4 and plain["replays"] == 0, compiled["replays"]
    assert compiled["losses"] == plain["losses"], (compiled["losses"], plain["losses"])
    assert compiled["norms"] == plain["norms"]
    assert compiled["skipped"] == plain["skipped"]
    assert compiled["losses"][-1] < compiled["losses"][0]
