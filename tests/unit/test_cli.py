"""The ``fuelspmd`` command as a user meets it: statuses, and no traceback for a user's
mistake, a closed pipe or a folder that does not exist.

Every command runs as a real subprocess (``python -m fuelspmd``) with a deadline; the
``--help`` of every command runs in one (``python -m fuelspmd``'s code, by ``runpy``, once
per command, each output and status kept apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import clean_env, run_job

import fuelspmd
from fuelspmd.pipeline_parallel import schedule, simulate
from fuelspmd.pipeline_parallel.render import (
    READABLE_PX,
    figure,
    narrowest_action_px,
    width_for,
)

FUELSPMD = [sys.executable, "-m", "fuelspmd"]
PLAN = [*FUELSPMD, "plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq",
        "2048", "--vocab", "51200", "--batch", "512", "--topology", "dgx-h100"]

pytestmark = pytest.mark.timeout(120)


def test_version() -> None:
    job = run_job([*FUELSPMD, "--version"], deadline=60)
    assert (job.code, job.out) == (0, f"fuelspmd {fuelspmd.__version__}\n"), job.err


HELPS = [["info"], ["plan"], ["schedule"], ["trace"], ["bench", "calibrate"], ["bench", "guard"],
         ["bench", "collectives"], ["bench", "pipeline"]]
# One process runs ``python -m fuelspmd COMMAND --help`` for every command of HELPS: runpy
# runs the package's __main__ as -m does, each with its own sys.argv, stdout and stderr.
HELP_ALL = """
import contextlib, io, json, runpy, sys
seen = []
for command in json.loads(sys.argv[1]):
    sys.argv = ["fuelspmd", *command, "--help"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("fuelspmd", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    seen.append((code, out.getvalue(), err.getvalue()))
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str, str]]:
    """Each command of HELPS (joined by spaces) -> its --help's (status, stdout, stderr)."""
    job = run_job([sys.executable, "-c", HELP_ALL, json.dumps(HELPS)], deadline=90)
    assert job.code == 0, job.err
    return {" ".join(c): tuple(r) for c, r in zip(HELPS, json.loads(job.out))}


@pytest.mark.parametrize("command", HELPS)
def test_help_is_plain_text(helps: dict[str, tuple[int, str, str]], command: list[str]) -> None:
    code, out, err = helps[" ".join(command)]
    assert code == 0, err
    assert "usage: fuelspmd" in out
    for markup in ("``", ":func:", ":mod:", ":class:", ":meth:"):
        assert markup not in out, f"{command}: {markup} in\n{out}"


def _argv(command: list[str]) -> list[str]:
    return PLAN + command[1:] if command[0] == "plan" else [*FUELSPMD, *command]


@pytest.mark.parametrize("command", [["schedule"], ["plan", "--gpus", "8"],
                                     ["plan", "--gpus", "8", "--json"]])
def test_a_closed_pipe_ends_quietly_with_141(command: list[str]) -> None:
    """Output into a pipe whose reader is gone: exit 141 (SIGPIPE's), not a traceback."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE
    try:
        done = subprocess.run(_argv(command), stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=60, env=clean_env())
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize(("command", "statuses"), [
    (["schedule", "--stages", "16", "--microbatches", "256"], {141}),  # more than a pipe holds
    (["plan", "--gpus", "8"], {0, 141}),  # small: written before head may have gone
])
def test_head_1_shows_the_first_line_and_nothing_else(command: list[str],
                                                      statuses: set[int]) -> None:
    """``fuelspmd ... | head -1``: the first line, no traceback, exit 141 when cut off."""
    shell = " ".join(_argv(command)) + ' | head -1; echo "status ${PIPESTATUS[0]}" >&2'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert len(done.stdout.splitlines()) == 1, done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and int(lines[0].split()[1]) in statuses, done.stderr


def test_png_into_a_missing_folder_is_a_clean_error(tmp_path: Path) -> None:
    target = tmp_path / "no-such-folder" / "x.png"
    job = run_job([*FUELSPMD, "schedule", "--png", str(target)], deadline=60)
    assert job.code == 2, job.out
    assert job.err == (f"fuelspmd schedule: cannot write --png {target}: the folder "
                       f"{target.parent} does not exist\n")


def test_a_png_too_narrow_for_its_actions_warns_with_the_width_that_fits(
        tmp_path: Path) -> None:
    target = tmp_path / "big.png"
    job = run_job([*FUELSPMD, "schedule", "--stages", "8", "--microbatches", "512",
                   "--png", str(target)], deadline=60)
    assert job.code == 0, job.err
    timeline = simulate(schedule("1f1b", 8, 512), 1.0, 1.0, 0.0)
    narrow = narrowest_action_px(timeline)
    assert narrow < READABLE_PX
    assert (f"warning: in a 1200 px picture the shortest action is {narrow:.1f} px wide"
            in job.err), job.err
    wide = int(job.err.split("--png-width ")[1].split()[0])
    assert wide == width_for(timeline) and narrowest_action_px(timeline, wide) >= READABLE_PX
    small = run_job([*FUELSPMD, "schedule", "--png", str(target)], deadline=60)
    assert small.code == 0 and "warning" not in small.err, small.err


def test_narrow_actions_keep_their_colour() -> None:
    """Below READABLE_PX the white seams between actions are left out: they would cover
    them."""
    timeline = simulate(schedule("1f1b", 4, 256), 1.0, 1.0, 0.0)
    assert narrowest_action_px(timeline) < READABLE_PX
    bars = figure(timeline).axes[0].collections[1:]
    assert bars and all((c.get_linewidths() == 0).all() for c in bars)
    wide = figure(timeline, width=width_for(timeline)).axes[0].collections[1:]
    assert all((c.get_linewidths() > 0).all() for c in wide)


def test_png_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """matplotlib is the ``plot`` extra: without it ``--png`` is refused before any work,
    in one line, and everything else runs (importing fuelspmd never needs it)."""
    target = tmp_path / "x.png"
    blocked = ("import sys; sys.modules['matplotlib'] = None; from fuelspmd.cli import main; "
               "raise SystemExit(main(sys.argv[1:]))")
    job = run_job([sys.executable, "-c", blocked, "schedule", "--png", str(target)],
                  deadline=60)
    assert job.code == 2 and job.out == "", job.out
    assert job.err == ("fuelspmd schedule: --png needs matplotlib, which is not installed; "
                       "pip install 'fuelspmd[plot]'\n")
    assert not target.exists()
    job = run_job([sys.executable, "-c", blocked, "schedule"], deadline=60)
    assert job.code == 0 and "bubble" in job.out, job.err


def test_png_of_an_unknown_format_is_refused(tmp_path: Path) -> None:
    job = run_job([*FUELSPMD, "schedule", "--png", str(tmp_path / "x.jpg")], deadline=60)
    assert job.code == 2 and job.out == "", job.out
    assert job.err.endswith("give a file name ending in .png, .svg or .pdf\n"), job.err


def test_plan_says_why_a_prime_gpu_count_has_no_layout() -> None:
    job = run_job([*PLAN, "--gpus", "7"], deadline=60)
    assert job.code == 2
    assert ("no layout splits 7 GPUs for this model: 7 is prime, so one axis takes all 7 "
            "GPUs") in job.err
    assert "tp 7 x pp 1 x dp 1: tp 7 does not divide the 32 heads" in job.err
    assert "tp 1 x pp 7 x dp 1: pp 7 does not divide the 32 layers" in job.err
    assert "tp 1 x pp 1 x dp 7: dp 7 x micro-batch 1/2/4/8 divides no batch of 512" in job.err
    assert job.err.rstrip().endswith("use a GPU count that has a layout, e.g. --gpus 4 or 8")
    assert "add GPUs" not in job.err and "Traceback" not in job.err


def test_plan_that_does_not_fit_in_memory_gives_the_numbers() -> None:
    job = run_job([*PLAN, "--gpus", "8", "--memory-gib", "0.5"], deadline=60)
    assert job.code == 2
    assert "nothing fits: none of the" in job.err
    assert "GiB per GPU, 0.45 GiB usable of 0.50)" in job.err


@pytest.mark.parametrize("args", [["frobnicate"], ["bench", "no-such-bench"]])
def test_unknown_commands_exit_2(args: list[str]) -> None:
    job = run_job([*FUELSPMD, *args], deadline=60)
    assert job.code == 2 and "unknown" in job.err and "Traceback" not in job.err
