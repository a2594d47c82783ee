"""docs/first_program.md's program, saved as the page says and run the three ways it shows:
a plain script, ``mpiexec -n 2`` and ``--devices cpu:2``; the losses must agree."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import mpiexec, needs_mpiexec, run_job

PAGE = Path(__file__).resolve().parents[2] / "docs" / "first_program.md"
LOSS = re.compile(r"^(?:\[rank 0\] )?step +(\d+)  loss ([0-9.]+)  \(tp (\d)\)$", re.M)


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    code = re.search(r"^Save this as `first.py`:\n\n```python\n(.*?)^```", PAGE.read_text(),
                     re.S | re.M)
    assert code, "the page no longer shows first.py"
    path = tmp_path_factory.mktemp("first") / "first.py"
    path.write_text(code[1])
    return path


def _losses(out: str, tp: int) -> dict[int, float]:
    found = {int(s): float(v) for s, v, t in LOSS.findall(out) if int(t) == tp}
    assert sorted(found) == [0, 5, 10, 15, 19], out
    return found


@needs_mpiexec
@pytest.mark.timeout(240)
def test_the_three_modes_print_the_same_losses(program: Path) -> None:
    plain = run_job([sys.executable, str(program)], deadline=90)
    assert plain.code == 0, plain.err
    group = run_job([sys.executable, str(program), "--devices", "cpu:2"], deadline=90)
    assert group.code == 0, group.err
    assert "DeviceGroup(cpu:0, cpu:1) from --devices cpu:2" in group.out
    ranks = run_job(mpiexec(2, sys.executable, str(program)), deadline=150)
    assert ranks.code == 0, ranks.err
    one, two, procs = _losses(plain.out, 1), _losses(group.out, 2), _losses(ranks.out, 2)
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-4)
        assert procs[step] == pytest.approx(loss, rel=1e-4)
    assert one[19] < one[0] / 2  # it learns
    # rank 0 alone prints: every line once
    assert len(LOSS.findall(ranks.out)) == 5
    assert "2 rank(s): loss" in ranks.out and ranks.out.count("rank(s): loss") == 1
