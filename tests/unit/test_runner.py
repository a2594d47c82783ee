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
    env, rest = _runner().split_options(["--long", "-x"])
    assert (env, rest) == ({"FUELSPMD_TESTS_LONG": "1"}, ["-x"])


def test_the_budget_option_relaxes_the_budget() -> None:
    run = _runner()
    assert run.budget_option(["-k", "x"]) == (run.BUDGET_S, ["-k", "x"])
    assert run.budget_option(["--budget", "900", "-x"]) == (900.0, ["-x"])
    assert run.budget_option(["-x", "--budget=1200.5"]) == (1200.5, ["-x"])
    for bad in (["--budget"], ["--budget", "soon"], ["--budget=-3"]):
        with pytest.raises(SystemExit, match="--budget"):
            run.budget_option(bad)


def test_a_run_over_its_budget_and_margin_fails_and_names_the_slowest_files(
        capsys: pytest.CaptureFixture[str]) -> None:
    run = _runner()
    files = {f"tests/unit/test_{i}.py": {"one process": float(i)} for i in range(12)}
    files["tests/mpi/test_x.py"] = {"mpi x1": 1.0, "mpi x2": 40.0}
    limit = run.BUDGET_S * (1 + run.MARGIN)
    assert run.report([("one process", limit - 50), ("mpi x1", 49)], files, run.BUDGET_S)
    out = capsys.readouterr().out
    assert f"{limit - 1:7.1f} s  total; budget {run.BUDGET_S:.0f} s" in out
    slow = [line.split()[2] for line in out.split("slowest test files")[1].splitlines()[1:]]
    assert slow == ["tests/mpi/test_x.py", *(f"tests/unit/test_{i}.py"
                                             for i in range(11, 2, -1))], out
    assert "(mpi x1 1.0, mpi x2 40.0)" in out
    assert not run.report([("one process", limit + 1)], files, run.BUDGET_S)
    assert "OVER BUDGET" in capsys.readouterr().out
    assert run.report([("one process", limit + 1)], files, None)  # the long run: no budget


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
