"""A job run in the background under a real launcher, for tests that signal it meanwhile.

:class:`Background` starts the job in its own session with the fault matrix's tag in its
environment (``faultjobs.TAG``), so that on exit every process of the job, the ranks under
srun included, is found and killed whatever the test did; every wait has a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType

import pytest
from faultjobs import (
    TAG,
    Launcher,
    clean_env,
    kill_tagged,
    mpich_launcher,
    openmpi_launcher,
    tagged,
)

__all__ = ["Background", "launcher_for", "line_of"]


def launcher_for(name: str, request: pytest.FixtureRequest) -> Launcher:
    """The launcher ``name``: "mpich", "openmpi", "srun" (``--kill-on-bad-exit=1``, as
    slurm/*.sbatch run) or "srun-plain" (Slurm's default), the last two on the one-node
    Slurm of the module (the ``fault_slurm`` fixture)."""
    if name == "mpich":
        return mpich_launcher()
    if name == "openmpi":
        return openmpi_launcher()
    slurm = request.getfixturevalue("fault_slurm")
    prefix = ("srun", "-n", "{n}", "--mpi=pmi2")
    if name == "srun":
        prefix += ("--kill-on-bad-exit=1",)
    return Launcher(name, prefix, {**clean_env(), "PATH": slurm.env["PATH"]}, parallel=1)


def line_of(path: Path, marker: str) -> int:
    """The number of the line of ``path`` that ends in the comment ``# marker``."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# {marker}"):
            return n
    raise AssertionError(f"{path} has no line marked {marker!r}")


class Background:
    """``python ARGS`` on ``n`` ranks of ``launcher``, output to a log in ``workdir``."""

    def __init__(self, launcher: Launcher, n: int, args: list[str], workdir: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.log = workdir / f"job-{self.tag[:8]}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                launcher.argv(n, [sys.executable, *args]), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**launcher.env, TAG: self.tag}, cwd=workdir, start_new_session=True)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=3)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        left = kill_tagged(self.tag)
        self.proc.wait(timeout=10)
        if left and kind is None:
            pytest.fail(f"processes of the job left behind (killed now): {left}\n"
                        f"{self.output()}")

    def output(self) -> str:
        """What the job wrote so far, stdout and stderr together."""
        return self.log.read_bytes().decode(errors="replace")

    def running(self) -> bool:
        """Whether the launcher is still running."""
        return self.proc.poll() is None

    def wait_for(self, pattern: str, count: int, timeout: float = 60.0) -> list[re.Match[str]]:
        """Wait until ``pattern`` matches ``count`` lines of the output; return the matches."""
        deadline = time.monotonic() + timeout
        while True:
            found = list(re.finditer(pattern, self.output(), re.M))
            if len(found) >= count:
                return found
            if time.monotonic() > deadline or not self.running():
                pytest.fail(f"{count} lines matching {pattern!r} never came (the job "
                            f"{'runs' if self.running() else 'ended'})\n{self.output()}")
            time.sleep(0.05)

    def ready(self, n: int) -> dict[int, int]:
        """Wait for ``READY rank R pid P`` from ``n`` ranks; return their PIDs by rank."""
        found = self.wait_for(r"^READY rank (\d+) pid (\d+)$", n)
        return {int(m[1]): int(m[2]) for m in found}

    def signal_ranks(self, pids: dict[int, int], sig: int) -> None:
        """Send ``sig`` to every rank, as a scheduler signals every task."""
        for pid in pids.values():
            os.kill(pid, sig)

    def signal_launcher(self, sig: int) -> None:
        """Send ``sig`` to the launcher alone (Ctrl-C at its terminal)."""
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> tuple[int | None, str]:
        """Wait for the launcher to end, then for the job's processes to be gone; return
        its exit status and output. A job that outlives ``timeout`` fails the test."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job outlived its {timeout:.0f} s deadline\n{self.output()}")
        deadline = time.monotonic() + 3.0
        while tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.02)
        return code, self.output()
