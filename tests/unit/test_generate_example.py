"""examples/generate.py: tokens EQUAL to a no-cache numpy reference at TP 1 and 2, as devices
of one process and as processes under a real ``mpiexec -n 2``, and the prefix cache saving
exactly the shared blocks' prefill work."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--requests", "4", "--prefix", "40", "--suffix", "5", "--new-tokens", "6",
         "--block-size", "8", "--hidden", "32", "--heads", "4", "--ffn", "64",
         "--check-every", "1"]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import mpiexec, needs_mpiexec, run_job  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" /
                                                  "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(gen: ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc = gen.main([*SMALL, *argv])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == (0 if out.get("check", "EQUAL") == "EQUAL" else 1)
    return out


@pytest.mark.parametrize(("devices", "mode"), [("cpu:1", "check"), ("cpu:2", "check"),
                                              ("cpu:2", "leader")])
def test_tokens_equal_the_no_cache_reference(gen: ModuleType, devices: str, mode: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(gen, capsys, "--devices", devices, "--check", "--coordinate", mode)
    assert out["check"] == "EQUAL" and out["tp"] == int(devices[-1])
    assert len(out["tokens"]) == 4 and all(len(t) == 6 for t in out["tokens"])
    assert len({tuple(t) for t in out["tokens"]}) > 1  # the requests do not all agree


def test_prefix_cache_saves_the_shared_blocks(gen: ModuleType,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    on = _run(gen, capsys, "--devices", "cpu:2")
    off = _run(gen, capsys, "--devices", "cpu:2", "--no-prefix-cache")
    prompt = 40 + 5
    # the first request computes everything; the others reuse the 5 full shared blocks
    assert off["prefill_tokens_computed"] == 4 * prompt
    assert on["prefill_tokens_computed"] == prompt + 3 * (prompt - 40)
    assert on["hit_rate"] == pytest.approx(3 * 40 / (4 * prompt), abs=1e-4)
    assert off["hit_rate"] == 0.0
    assert on["blocks_used"] == off["blocks_used"] - 3 * 5
    assert on["tokens"] == off["tokens"]


def test_forked_samples_copy_on_write_and_stay_equal(gen: ModuleType,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(gen, capsys, "--devices", "cpu:2", "--check", "--samples", "2")
    assert out["check"] == "EQUAL" and len(out["tokens"]) == 8
    assert out["copies"] == 4  # one per request: the first append to its shared partial block


def test_skipping_the_copy_on_write_is_caught(gen: ModuleType, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the copies a fork reads zeros for its prompt's last tokens: not EQUAL."""
    monkeypatch.setattr(gen.PagedKVStore, "copy", lambda self, copies: None)
    out = _run(gen, capsys, "--devices", "cpu:1", "--check", "--samples", "2")
    assert out["check"] == "DIFFERENT"


def test_reference_detects_a_different_model(gen: ModuleType) -> None:
    """The comparison can fail: another seed's weights give other tokens."""
    args = gen.parse(SMALL)
    other = gen.parse([*SMALL, "--seed", "1"])
    assert gen.reference_tokens(args) != gen.reference_tokens(other)


@needs_mpiexec
def test_two_processes_under_mpiexec() -> None:
    job = run_job(mpiexec(2, sys.executable, str(ROOT / "examples" / "generate.py"), *SMALL,
                          "--check"), deadline=60)
    out = job.out
    assert job.code == 0, job.err
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 reports
    assert lines[0]["tp"] == 2 and lines[0]["check"] == "EQUAL"


def test_bench_kvcache_reports_the_expected_prefill_saving(capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    from fuelspmd.bench import kvcache

    rc = kvcache.main(["--requests", "4", "--prefix", "64", "--suffix", "4", "--block-size",
                       "16", "--layers", "1", "--hidden", "16", "--heads", "2", "--rounds", "2",
                       "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["cache"]: r for r in res["rows"]}
    assert rows["off"]["computed"] == rows["off"]["expected"] == 4 * 68
    assert rows["on"]["computed"] == rows["on"]["expected"] == 68 + 3 * 4
    assert rows["on"]["hit_rate"] == pytest.approx(3 * 64 / (4 * 68))
    assert res["computed_share"] == pytest.approx(80 / 272)
    assert res["ttft_speedup"] > 0


def test_pool_blocks_sizes_the_pool_and_changes_no_token(gen: ModuleType,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    base = _run(gen, capsys, "--devices", "cpu:1", "--check")
    big = _run(gen, capsys, "--devices", "cpu:1", "--check", "--pool-blocks",
               str(16 * base["blocks_total"]))
    assert big["blocks_total"] == 16 * base["blocks_total"]
    assert big["check"] == "EQUAL" and big["tokens"] == base["tokens"]
    assert big["tokens_per_s"] > 0 and big["ttft_s"] > 0


def test_bench_generate_reports_against_transformers(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """A 1-layer GPT-2: the tokens equal transformers' generate, and the first call makes
    3 plans for its 8 tokens (the two prefill shapes, one decode bucket)."""
    from fuelspmd.bench import generate

    rc = generate.main(["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                        "--requests", "2", "--prefix", "16", "--suffix", "4",
                        "--new-tokens", "4", "--block-size", "8", "--rounds", "1", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["candidate"]: r for r in res["rows"]}
    assert set(rows) == {"hf", "tp1"} and rows["tp1"]["tokens_equal"] is True
    assert rows["tp1"]["plan_misses_per_token"] == 3 / 8
    assert [p["blocks"] for p in res["pools"]] == [7, 28, 112]  # 2 x 3 blocks + 1, x4, x16
    assert res["tp1_over_hf"] > 0 and res["pool_ratio"] > 0


@needs_mpiexec
def test_bench_generate_at_tp_2_under_mpiexec() -> None:
    job = run_job(mpiexec(2, sys.executable, "-m", "fuelspmd", "bench", "generate",
                          "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                          "--requests", "2", "--prefix", "16", "--suffix", "4",
                          "--new-tokens", "3", "--block-size", "8", "--rounds", "1",
                          "--json"), deadline=120)
    assert job.code == 0, job.err
    res = json.loads(job.out)  # rank 0 alone prints
    rows = {r["candidate"]: r for r in res["rows"]}
    assert set(rows) == {"hf", "tp1", "tp2"}
    assert rows["tp1"]["tokens_equal"] is True and rows["tp2"]["tokens_equal"] is True
    assert res["tp2_over_tp1"] > 0
