"""``fuelspmd bench kvcache`` re-measures docs/kvcache.md's figures: the prefill token counts
exactly, and that the prefix cache brings the first token sooner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import run_job

DOC = Path(__file__).resolve().parents[2] / "docs" / "kvcache.md"


@pytest.mark.timeout(240)
def test_the_documented_prefill_counts_and_a_speedup() -> None:
    job = run_job([sys.executable, "-m", "fuelspmd", "bench", "kvcache", "--json",
                   "--rounds", "2"], deadline=200)
    assert job.code == 0, job.err
    got = json.loads(job.out)
    n, prefix, suffix, block = got["requests"], got["prefix"], got["suffix"], got["block_size"]
    without = n * (prefix + suffix)
    with_cache = prefix + suffix + (n - 1) * suffix  # the shared full blocks are computed once
    text = " ".join(DOC.read_text().split())
    assert (f"prefills {n} requests that share a {prefix}-token prefix ({suffix} tokens each "
            f"of their own, block size {block})") in text
    assert (f"{n} x {prefix + suffix} = {without} to {prefix + suffix} + {n - 1} x {suffix} "
            f"= {with_cache} ({with_cache / without:.3f}") in text
    assert got["computed_share"] == pytest.approx(with_cache / without)
    assert got["ttft_speedup"] > 1.0
