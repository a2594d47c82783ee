"""``fuelspmd`` refuses what it cannot hold or finish, with the bound, and no traceback
(issue 41).

Before: ``schedule --png-width 100000000`` tried to allocate 45.8 GiB and printed a
MemoryError traceback; ``schedule --stages 100000 --microbatches 100000`` ran past two
minutes; ``plan --peak-tflops nan`` said to declare an accelerator; ``plan --gpus`` of a
large prime ran for minutes looking for a count with a layout; ``info`` printed cupy's
warning about NCCL on stderr. The end-to-end cases run the real command as a subprocess.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import run_job

from fuelspmd.cli import plan as plan_cli
from fuelspmd.cli import schedule as schedule_cli

FUELSPMD = [sys.executable, "-m", "fuelspmd"]
PLAN = ["--layers", "128", "--hidden", "25600", "--heads", "160", "--seq", "2048",
        "--vocab", "51200", "--batch", "3072", "--topology", "a100-selene"]

pytestmark = pytest.mark.timeout(120)


def _refused(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run a subcommand's ``main`` in process: exit status 2 (argparse's, or its own), and
    the one line of stderr that says why."""
    try:
        code = main(argv)  # type: ignore[operator]
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "said"), [
    (["--png-width", "100000000", "--png", "x.png"],
     "--png-width: 100000000 is outside the range; give a whole number from 400 to 32768"),
    (["--stages", "100000", "--microbatches", "100000"],
     "--stages: 100000 is outside the range; give a whole number from 1 to 32768"),
    (["--stages", "181", "--microbatches", "180"],
     "is 65341 grid cells, more than the 32768 this command draws in seconds"),
    (["--kind", "interleaved", "--stages", "4", "--microbatches", "4096", "--chunks", "4"],
     "grid cells, more than the 32768"),
    (["--t-f", "nan"], "--t-f: nan is outside the range; give a finite number above 0"),
    (["--t-comm=-inf"], "--t-comm: -inf is outside the range"),
    (["--png-width", "wide"], "--png-width: 'wide' is not a whole number"),
])
def test_schedule_refuses_sizes_it_cannot_draw(argv: list[str], said: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert said in _refused(schedule_cli.main, argv, capsys)


def test_a_picture_too_large_names_the_width_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(schedule_cli.main, ["--stages", "180", "--microbatches", "2", "--png",
                                        str(tmp_path / "x.png"), "--png-width", "32768"], capsys)
    assert "a 32768 x 5525 px picture is more than the 33554432 px" in line, line
    assert "(at most 6073)" in line and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["--peak-tflops", "nan"], "--peak-tflops: nan is outside the range"),
    (["--memory-gib", "-1"], "--memory-gib: -1 is outside the range"),
    (["--matmul-efficiency", "inf"], "--matmul-efficiency: inf is outside the range"),
    (["--gpus", "100000000"],
     "--gpus: 100000000 is outside the range; give a whole number from 1 to 1048576"),
    (["--microbatches", "1,x"], "--microbatches 1,x: 'x' is not a whole number"),
])
def test_plan_refuses_numbers_out_of_range(argv: list[str], said: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = PLAN + (argv if "--gpus" in argv else ["--gpus", "3072", *argv])
    assert said in _refused(plan_cli.main, args, capsys)


def test_plan_of_a_large_prime_gpu_count_answers_in_seconds(
        capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    line = _refused(plan_cli.main, [*PLAN, "--gpus", "65521"], capsys)
    assert time.monotonic() - start < 10
    assert "e.g. --gpus 61440 or 65536" in line, line


def test_the_commands_end_to_end_print_one_line_and_no_traceback() -> None:
    for argv, said in ((["schedule", "--png-width", "100000000", "--png", "x.png"],
                        "--png-width"), (["plan", *PLAN, "--gpus", "8", "--peak-tflops",
                                          "nan"], "--peak-tflops")):
        start = time.monotonic()
        job = run_job([*FUELSPMD, *argv], deadline=60)
        assert job.code == 2 and said in job.err and "Traceback" not in job.err, job.err
        assert time.monotonic() - start < 30


def test_info_prints_nothing_on_stderr() -> None:
    """cupy warns on import when it finds no NCCL; ``info`` reports that in the nccl row."""
    job = run_job([*FUELSPMD, "info"], deadline=60)
    assert job.code == 0, job.err
    assert job.err == "", job.err
    assert "nccl" in job.out


@pytest.mark.parametrize(("edit", "said"), [
    ({"rank": "x"}, "field rank is 'x', not a whole number >= 0"),
    ({"rank": -1}, "field rank is -1"),
    ({"rank": True}, "field rank is True"),
    ({"records": {}}, "field records is {}, not a list"),
    ({"records": [{"op": "all_reduce"}]}, "field records[0].seq is None"),
    ({"groups": {"g": [0]}}, "field groups is"),
])
def test_trace_refuses_a_dump_it_cannot_read(tmp_path: Path, edit: dict[str, object],
                                             said: str) -> None:
    import json

    from fuelspmd.comm import Fingerprint, Recorder

    rec = Recorder()
    rec.mark(rec.push(Fingerprint(0, "all_reduce", (8,), "float32", "sum", group=1)),
             "completed")
    path = rec.dump(tmp_path, 0)
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    job = run_job([*FUELSPMD, "trace", str(tmp_path)], deadline=60)
    assert job.code == 2 and said in job.err and "Traceback" not in job.err, job.err
