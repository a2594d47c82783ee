"""``world.print`` and ``world.logger``: rank 0 by default, whole lines, prefixes where
several ranks write; under a real ``mpiexec -n 4`` no two ranks' lines run together."""

from __future__ import annotations

import io
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import clean_env, mpiexec, needs_mpiexec, run_job

import fuelspmd as fs
from fuelspmd.launch.output import rank_logger, rank_print


@dataclass
class Rank:
    rank: int


def printed(rank: int, *values: object, **kw: object) -> str:
    out = io.StringIO()
    rank_print(Rank(rank), *values, file=out, **kw)  # type: ignore[arg-type]
    return out.getvalue()


def test_rank_zero_alone_by_default() -> None:
    assert printed(0, "loss", 0.5) == "loss 0.5\n"
    assert printed(1, "loss", 0.5) == ""


def test_several_ranks_get_a_prefix_on_every_line() -> None:
    assert printed(2, "a\nb", ranks="all") == "[rank 2] a\n[rank 2] b\n"
    assert printed(2, "a", ranks=[1, 2]) == "[rank 2] a\n"
    assert printed(3, "a", ranks=[1, 2]) == ""
    assert printed(2, "a", ranks="all", prefix=False) == "a\n"
    assert printed(0, "a", "b", sep="-", end="!\n", prefix=True) == "[rank 0] a-b!\n"


def test_logger_writes_on_the_chosen_ranks_and_never_twice() -> None:
    out = io.StringIO()
    for rank in (0, 1):
        log = rank_logger(Rank(rank), "unit-test", stream=out)  # type: ignore[arg-type]
        log.info("step %d", 3)
    assert out.getvalue() == "INFO unit-test: step 3\n"
    out = io.StringIO()
    for _ in range(2):  # asked again: reconfigured, not a second handler
        log = rank_logger(Rank(1), "unit-test", ranks="all", stream=out)  # type: ignore[arg-type]
    log.warning("careful")
    log.debug("not shown at INFO")
    assert out.getvalue() == "[rank 1] WARNING unit-test: careful\n"
    assert log.level == logging.INFO


def test_a_plain_world_prints() -> None:
    world = fs.init()
    out = io.StringIO()
    world.print("one rank", file=out)
    assert out.getvalue() == "one rank\n"


LINES = r"""
import fuelspmd as fs
world = fs.init(timeout=60)
for i in range(300):
    world.print(f"line {i:03d} " + "x" * 200, ranks="all")
world.print("done")
"""


@needs_mpiexec
@pytest.mark.timeout(120)
def test_four_ranks_lines_never_run_together() -> None:
    # unbuffered, as in a terminal or an sbatch job: where print() writes the text and the
    # newline separately and two ranks could meet in between
    job = run_job(mpiexec(4, sys.executable, "-c", LINES), deadline=90,
                  env=clean_env(PYTHONUNBUFFERED="1"))
    assert job.code == 0, job.err
    lines = job.out.splitlines()
    whole = re.compile(r"^\[rank [0-3]\] line \d{3} x{200}$")
    assert [line for line in lines if not whole.match(line)] == ["done"]
    assert len(lines) == 4 * 300 + 1
    for r in range(4):
        assert sum(line.startswith(f"[rank {r}] ") for line in lines) == 300
