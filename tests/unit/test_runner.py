"""``tests/run.py --no-slurm`` and ``--no-openmpi``: the parts of the suite that install
things outside the virtual environment skip, and say why."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs import clean_env

TESTS = Path(__file__).resolve().parents[1]


def _runner():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fuelspmd_test_runner", TESTS / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runner_turns_its_options_into_the_fixtures_variables() -> None:
    env, rest = _runner().split_options(["--no-slurm", "-k", "x", "--no-openmpi"])
    assert env == {"FUELSPMD_TESTS_NO_SLURM": "1", "FUELSPMD_TESTS_NO_OPENMPI": "1"}
    assert rest == ["-k", "x"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("variable", "where", "says"), [
    ("FUELSPMD_TESTS_NO_SLURM", ["tests/slurm"], "left out by tests/run.py --no-slurm"),
    ("FUELSPMD_TESTS_NO_OPENMPI", ["tests/faults", "-k", "openmpi"],
     "left out by tests/run.py --no-openmpi"),
])
def test_a_left_out_part_skips_saying_why(variable: str, where: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                           "no:cacheprovider", *where], cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=150, env=clean_env(**{variable: "1"}))
    assert done.returncode == 0, done.stdout[-3000:]
    assert says in done.stdout, done.stdout[-3000:]
    assert " passed" not in done.stdout.splitlines()[-1], done.stdout[-3000:]
    assert " skipped" in done.stdout.splitlines()[-1]


def test_the_readme_says_what_the_test_command_installs_and_how_to_skip_it() -> None:
    sys.path.insert(0, str(TESTS / "slurm"))
    import slurm_host

    readme = " ".join((TESTS.parent / "README.md").read_text().split())
    assert f"`{' '.join(slurm_host.PACKAGES)}`" in readme
    assert str(slurm_host.CONF) in readme and "/etc/munge/munge.key" in readme
    assert "/tmp/fuelspmd-openmpi-*" in readme
    for option, variable in _runner().SKIPS.items():
        assert f"{option}` (or `{variable}=1`)" in readme, option
