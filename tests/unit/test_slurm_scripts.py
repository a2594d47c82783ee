"""The sbatch scripts run by mistake with plain ``bash`` (no Slurm job around them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import clean_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", sorted((ROOT / "slurm").glob("*.sbatch")),
                         ids=lambda p: p.name)
def test_plain_bash_says_submit_it_with_sbatch(script: Path) -> None:
    done = subprocess.run(["bash", str(script), "examples/hello.py", "--exit-code", "3"],
                          capture_output=True, text=True, timeout=30, env=clean_env(), cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"slurm/{script.name} is a batch script: submit it with sbatch, "
                           f"e.g.\n  sbatch slurm/{script.name} examples/hello.py "
                           "--exit-code 3\n")
    assert done.stdout == ""
