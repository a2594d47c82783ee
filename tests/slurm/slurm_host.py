"""The machine side of the test cluster: packages, daemons, configuration, clean-up.

Used by ``conftest.py``; nothing here runs on import. Every function acts only on what it
can prove belongs to the test cluster: daemons carrying ``MARK`` in their environment, the
configuration file that starts with ``CONF_HEADER``, the shared memory of the cluster's own
job ids.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

__all__ = [
    "COMMANDS",
    "CONF",
    "CONF_HEADER",
    "LOCK",
    "MARK",
    "PACKAGES",
    "SBIN_PATH",
    "cancel_jobs",
    "cmdline",
    "fnv1a",
    "hold_lock",
    "install",
    "missing_commands",
    "munge_works",
    "needs_install",
    "prepare_munge",
    "remove_segments",
    "running_daemons",
    "slurm_conf",
    "stop",
    "tail",
    "wait_for",
]

MARK = "FUELSPMD_SLURM_FIXTURE"  # in the environment of every daemon the fixture starts
CONF = Path("/etc/slurm/slurm.conf")
CONF_HEADER = "# Written by fuelspmd tests/slurm/conftest.py for its test cluster; removed after.\n"
LOCK = Path("/tmp/fuelspmd-slurm-tests.lock")
# libpmix-dev holds the libpmix.so that Slurm's mpi/pmix plugin opens; without it
# `srun --mpi=pmix` fails inside srun and the PMIx trap of fs.init() cannot be tested.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "libpmix-dev")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo",
            "munged", "munge", "unmunge")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_commands() -> list[str]:
    """Return the Slurm and munge commands not found on the system path."""
    return [c for c in COMMANDS if shutil.which(c, path=SBIN_PATH) is None]


def needs_install() -> bool:
    """Whether a command is missing, or libpmix.so is and apt-get could add it."""
    pmix = any(Path("/usr/lib").glob("*/pmix*/lib/libpmix.so"))
    apt = shutil.which("apt-get", path=SBIN_PATH) is not None
    return bool(missing_commands()) or (not pmix and apt)


def install(workdir: Path) -> float:
    """Install the Debian packages; return the seconds it took. Fails loudly on error."""
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": SBIN_PATH}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=120", *PACKAGES]
    log = workdir / "apt.log"
    with log.open("w") as out:
        lists = Path("/var/lib/apt/lists")
        if not any(lists.glob("*_Packages*")):
            subprocess.run(["apt-get", "update", "-q"], stdout=out, stderr=out, env=env,
                           timeout=300, check=False)
        done = subprocess.run(command, stdout=out, stderr=out, env=env, timeout=300)
        if done.returncode != 0:  # stale package lists: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], stdout=out, stderr=out, env=env,
                           timeout=300, check=False)
            done = subprocess.run(command, stdout=out, stderr=out, env=env, timeout=300)
    if done.returncode != 0 or missing_commands():
        pytest.fail(f"apt-get install {' '.join(PACKAGES)} failed (exit {done.returncode}); "
                    f"still missing {missing_commands()}; last lines of {log}:\n{tail(log)}")
    return time.monotonic() - start


def slurm_conf(workdir: Path, node: str) -> str:
    """Return the one-node configuration.

    ``FirstJobId`` differs on every start (hundredths of a second, modulo 60 million):
    Slurm numbers jobs from 1 again after a cold start, and MPICH names its shared-memory
    segment after the PMI job id ``JOBID.STEP``; a rank killed in an earlier session leaves
    ``/dev/shm/mpich_shm_*`` behind, and a step reusing its id would attach to it and hang
    or fail with "Invalid GenQ flag" in MPI_Init.
    """
    first_job = 1 + int(time.time() * 100) % 60_000_000
    return CONF_HEADER + f"""\
ClusterName=fuelspmd-test
FirstJobId={first_job}
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd.pid
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdLogFile={workdir}/slurmd.log
NodeName={node} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def prepare_munge() -> None:
    """Give munged its key (owned by munge, 0400) and its socket directory."""
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(mode=0o700, exist_ok=True)
        key.write_bytes(os.urandom(1024))
        shutil.chown(key.parent, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    for folder in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge")):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    Path("/run/munge").chmod(0o755)


def munge_works() -> bool:
    """Whether munged answers: a credential made by ``munge -n`` decodes with ``unmunge``."""
    cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                          timeout=10).returncode == 0


def cmdline(pid: int) -> list[str]:
    """Return the argv of ``pid``; empty for a zombie or a process that is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def running_daemons() -> dict[int, tuple[str, bool]]:
    """Find running munged/slurmctld/slurmd: pid -> (name, started by this fixture)."""
    found: dict[int, tuple[str, bool]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = cmdline(int(entry.name))
        name = os.path.basename(argv[0]) if argv else ""
        if name not in ("munged", "slurmctld", "slurmd"):
            continue
        try:
            ours = f"{MARK}=".encode() in (entry / "environ").read_bytes()
        except OSError:
            ours = False
        found[int(entry.name)] = (name, ours)
    return found


def stop(pid: int, name: str, *, timeout: float = 10.0) -> None:
    """SIGTERM ``pid`` if it still runs ``name``; SIGKILL it after ``timeout`` seconds.

    A stopped daemon whose parent has not reaped it stays a zombie, so being gone means
    /proc/PID/cmdline no longer names the daemon (``kill -0`` would still succeed).
    """
    def alive() -> bool:
        argv = cmdline(pid)
        return bool(argv) and os.path.basename(argv[0]) == name

    if not alive():
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        os.kill(pid, signal.SIGKILL)


def hold_lock() -> IO[str]:
    """Hold the machine-wide lock; wait up to 120 s for another session to finish."""
    handle = LOCK.open("a")
    deadline = time.monotonic() + 120
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                pytest.fail(f"another test session has held {LOCK} for 120 s; its Slurm "
                            "cluster is in use")
            time.sleep(0.2)


def wait_for(done: Callable[[], bool], seconds: float, what: str,
          started: list[tuple[subprocess.Popen[bytes], str]], workdir: Path) -> None:
    """Poll ``done()`` every 0.1 s; fail with the logs if a daemon exits or time runs out."""
    deadline = time.monotonic() + seconds
    while not done():
        dead = [(p, n) for p, n in started if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {log}:\n{tail(workdir / log)}" for log in (
                "munged.out", "slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log"))
            why = (", ".join(f"{n} exited with {p.returncode}" for p, n in dead) or
                   f"{seconds:.0f} s passed")
            pytest.fail(f"waiting for {what}: {why}\n{logs}")
        time.sleep(0.1)


def tail(path: Path, lines: int = 15) -> str:
    """Return the last ``lines`` lines of a log, for failure messages."""
    if not path.exists():
        return f"({path} does not exist)"
    return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])


def cancel_jobs(env: Mapping[str, str], *, timeout: float = 15.0) -> list[int]:
    """Cancel every job of this cluster, wait for the queue to empty, return all job ids.

    slurmstepd and the ranks it started outlive slurmd, so a job left running by a test
    that timed out would keep its processes after the daemons stop.
    """
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=dict(env), capture_output=True, text=True,
                              timeout=10)

    run("scancel", "--user", str(os.getuid()))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = run("squeue", "-h", "-o", "%i")
        if queued.returncode != 0 or not queued.stdout.strip():
            break
        time.sleep(0.1)
    shown = run("scontrol", "show", "jobs", "-o")  # finished jobs stay listed for 300 s
    return [int(j) for j in re.findall(r"^JobId=(\d+)", shown.stdout, re.M)]


def fnv1a(text: str) -> int:
    """Return the 32-bit FNV-1a hash of ``text`` (MPICH's HASH_FNV of its PMI job id)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value


def remove_segments(job_ids: Sequence[int], steps: int = 8) -> None:
    """Remove the MPICH shared memory that killed ranks of this cluster's jobs left behind.

    MPICH names a job step's segment ``/dev/shm/mpich_shm_<h>_<node>``, ``h`` the 32-bit
    FNV-1a hash of its PMI job id, which under ``srun --mpi=pmi2`` is ``JOBID.STEP``; the
    segment is unlinked by MPI_Finalize, so a rank killed on purpose (the abort tests)
    leaves it. Only names computed from this cluster's job ids are removed, and only when
    no process maps them.
    """
    names = {f"mpich_shm_{fnv1a(f'{job}.{step}'):x}_0" for job in job_ids
             for step in range(steps)}
    found = [Path("/dev/shm", n) for n in names if Path("/dev/shm", n).exists()]
    if not found:
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.rsplit("/", 1)[-1].split()[0]
                          for line in maps.read_text().splitlines() if "/mpich_shm_" in line)
        except (OSError, IndexError):
            continue
    for path in found:
        if path.name not in mapped:
            path.unlink(missing_ok=True)
