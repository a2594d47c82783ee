"""A real one-node Slurm cluster for the tests in this folder, started once per session.

The ``slurm_cluster`` fixture installs Debian's ``slurmctld slurmd slurm-client munge``
(and ``libpmix-dev``, for ``srun --mpi=pmix``) when they are missing, writes a one-node
``/etc/slurm/slurm.conf``, starts munged, slurmctld and slurmd in the foreground as
children of this process (so their PIDs are exactly the ones started), waits until
``sinfo`` shows the node idle, and at the end cancels any job left, stops those PIDs and
removes the configuration it wrote.

Settings and why (measured on a 2-core machine without systemd or cgroups):
``proctrack/linuxproc`` and ``task/none`` need no cgroups; no accounting, so the exit code
is read from ``scontrol show job``; ``batch_sched_delay=0`` starts a job at once instead of
within 3 s; ``CPUs=4`` with ``SlurmdParameters=config_overrides`` lets 4 tasks share 2
cores; ``MpiDefault=pmi2`` is what the MPICH wheel speaks.

Daemons left by an earlier run that died before its teardown carry ``FUELSPMD_SLURM_FIXTURE``
in their environment and are stopped; a Slurm this fixture did not start is never touched
(the tests skip, saying so). A lock file serialises test sessions on one machine. The
machine-side steps (packages, configuration, daemons, clean-up) are in ``slurm_host.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import slurm_host as host  # beside this file; pytest puts its folder on sys.path

from fuelspmd.launch import detect_launcher

TIMES = pytest.StashKey[str]()  # the cluster's start-up figures, for the summary
# Variables of an enclosing MPI or Slurm job: a job submitted from inside one must not see
# them, or its ranks would take the outer job's place for their own.
INHERITED_LAUNCH = ("PMI_", "PMIX_", "MPI_", "OMPI_", "HYDRA_", "SLURM_", "I_MPI_")


@dataclass(frozen=True)
class Job:
    """A finished batch job as ``scontrol show job`` reports it, and its output file."""

    id: int
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: int
    signal: int
    output: str

    def describe(self) -> str:
        """Return the state, exit code and output, for assertion messages."""
        return (f"job {self.id}: {self.state}, exit code {self.exit_code}, signal "
                f"{self.signal}; output:\n{self.output}")


@dataclass
class Cluster:
    """A running one-node Slurm: submit to it, wait for a job, read how it ended."""

    workdir: Path
    node: str
    env: dict[str, str]  # for sbatch/srun: this interpreter's bin first on PATH
    install_s: float  # seconds apt-get took (0 when Slurm was installed already)
    start_s: float  # seconds from starting munged to an idle node

    def run(self, args: Sequence[str], *, timeout: float = 30.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command with the job environment (plus ``env``)."""
        return subprocess.run(list(args), env={**self.env, **(env or {})}, text=True,
                              capture_output=True, timeout=timeout, cwd=self.workdir)

    def sbatch(self, script: Path, *args: str, options: Sequence[str] = (),
               env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` with ``args``; return the job id. Output goes to workdir."""
        done = self.run(["sbatch", "--parsable", f"--output={self.workdir}/job-%j.out",
                         *options, str(script), *args], env=env)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def wait(self, job_id: int, *, timeout: float = 60.0) -> Job:
        """Poll ``squeue -h -j ID`` every 0.1 s until the job leaves the queue.

        ``sbatch --wait`` polls every 2-10 s; this returns within 0.1 s of the end. On the
        deadline the job is cancelled and TimeoutError names its state and output so far.
        """
        deadline = time.monotonic() + timeout
        while True:
            queued = self.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"])
            if queued.returncode == 0 and not queued.stdout.strip():
                break
            if queued.returncode != 0 and "Invalid job id" in queued.stderr:
                break
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)])
                raise TimeoutError(f"job {job_id} still {queued.stdout.strip()!r} after "
                                   f"{timeout:.0f} s; output so far:\n{self._output(job_id)}")
            time.sleep(0.1)
        fields = self.job_fields(job_id)
        code, _, sig = fields.get("ExitCode", "-1:0").partition(":")
        return Job(job_id, fields.get("JobState", "?"), int(code), int(sig or 0),
                   self._output(job_id))

    def job_fields(self, job_id: int) -> dict[str, str]:
        """Return ``scontrol show job -o ID`` as a dict (no accounting, so no sacct)."""
        shown = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        if shown.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {shown.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))

    def _output(self, job_id: int) -> str:
        path = self.workdir / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else "(no output file)"


def _skip_reason() -> str | None:
    """Say why this machine cannot start Slurm, or return None when it can."""
    if os.environ.get("FUELSPMD_TESTS_NO_SLURM"):
        return ("left out by tests/run.py --no-slurm (FUELSPMD_TESTS_NO_SLURM): these tests "
                "install Debian's Slurm with apt-get and write /etc/slurm/slurm.conf")
    if not sys.platform.startswith("linux"):
        return f"a Slurm test cluster needs Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return (f"starting slurmctld, slurmd and munged needs root; running as uid "
                f"{os.geteuid()}")
    if host.missing_commands() and shutil.which("apt-get", path=host.SBIN_PATH) is None:
        return (f"Slurm is not installed ({', '.join(host.missing_commands())} missing) and "
                "there is no apt-get to install Debian's slurmctld slurmd slurm-client munge")
    if detect_launcher().size > 1:
        return ("this pytest is one rank of an MPI job; the Slurm tests start their own "
                "cluster and run in a plain `pytest` process")
    return None


def _job_env() -> dict[str, str]:
    """This process's environment, minus any enclosing job's, with this venv on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_LAUNCH)}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), host.SBIN_PATH,
                                   env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Start a one-node Slurm (installing it if needed); stop exactly what was started."""
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    lock = host.hold_lock()
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    wrote_conf = False
    try:
        workdir = tmp_path_factory.mktemp("slurm")
        install_s = host.install(workdir) if host.needs_install() else 0.0
        running = host.running_daemons()
        foreign = {pid: name for pid, (name, ours) in running.items()
                   if not ours and name != "munged"}
        if foreign:
            pytest.skip(f"a Slurm these tests did not start is running ({foreign}); they "
                        "will not touch it")
        conf = host.CONF.read_text(errors="replace") if host.CONF.exists() else None
        if conf is not None and not conf.startswith(host.CONF_HEADER):
            pytest.skip(f"{host.CONF} holds a configuration these tests did not write; they "
                        "will not replace it")
        for pid, (name, ours) in running.items():
            if ours:  # left by an earlier session that died before its teardown
                host.stop(pid, name)
        reuse_munge = any(n == "munged" and not ours for n, ours in running.values())

        start = time.monotonic()
        node = socket.gethostname().split(".")[0]
        for sub in ("state", "spool"):
            (workdir / sub).mkdir()
        host.CONF.parent.mkdir(parents=True, exist_ok=True)
        host.CONF.write_text(host.slurm_conf(workdir, node))
        wrote_conf = True
        daemon_env = {"PATH": host.SBIN_PATH, "LANG": "C", host.MARK: str(workdir)}

        def launch(args: list[str], log: str, user: str | None = None) -> None:
            with (workdir / log).open("wb") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=daemon_env,
                                        start_new_session=True, user=user, group=user,
                                        extra_groups=[] if user else None)
            started.append((proc, os.path.basename(args[0])))

        if not reuse_munge:
            host.prepare_munge()
            launch(["munged", "--foreground"], "munged.out", user="munge")
        host.wait_for(host.munge_works, 10, "munged to answer `munge -n | unmunge`",
              started, workdir)
        launch(["slurmctld", "-D", "-f", str(host.CONF)], "slurmctld.out")
        launch(["slurmd", "-D", "-f", str(host.CONF)], "slurmd.out")
        env = _job_env()

        def idle() -> bool:
            shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env,
                                   capture_output=True, text=True, timeout=10)
            return shown.returncode == 0 and f"{node} idle" in shown.stdout

        host.wait_for(idle, 30, f"sinfo to show node {node} idle", started, workdir)
        cluster = Cluster(workdir, node, env, install_s, time.monotonic() - start)
        request.config.stash[TIMES] = (f"slurm test cluster: install {install_s:.1f} s, "
                                       f"daemons up and node idle in {cluster.start_s:.1f} s")
        yield cluster
    finally:
        if len(started) >= 2:  # slurmctld runs: end the jobs of a test that timed out
            host.remove_segments(host.cancel_jobs(_job_env()))
        for proc, name in reversed(started):
            host.stop(proc.pid, name)
            try:
                proc.wait(timeout=5)  # reap it, so no zombie is left behind
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if wrote_conf:
            host.CONF.unlink(missing_ok=True)
        lock.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    """Print how long installing and starting the cluster took, when it was started."""
    if TIMES in config.stash:
        terminalreporter.write_line(config.stash[TIMES])
