"""Where this process sits in the job: the launcher's word, checked against the transport's.

The launcher is read from the environment before any MPI library loads; after the
transport is up every rank's host name is all-gathered, so ``local_rank``, ``local_size``
and the node list come from the job itself, and a launcher that disagrees with MPI is a
ConfigError raised identically on every rank (they all judge the same gathered table).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fuelspmd.errors import ConfigError
from fuelspmd.transport import Transport

__all__ = ["LaunchInfo", "check_world", "detect_launcher", "gather_places", "local_rank"]

_HOST_CHARS = 64  # host names are gathered as fixed-width int32 code points


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """What the environment says about this process, before any MPI library is loaded."""

    launcher: str  # "mpiexec", "openmpi", "srun", "none"
    rank: int = 0
    size: int = 1
    local_rank: int | None = None
    local_size: int | None = None
    slurm_mpi: str | None = None  # srun's --mpi plugin, when srun started us


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher and this process's place in the job from ``env``.

    Order matters: ``mpiexec`` inside a Slurm allocation starts its processes through
    srun, so they see Slurm's variables too; the MPI launcher's own variables win. A plain
    ``python`` inside an sbatch script sees SLURM_NTASKS but no SLURM_STEP_ID of a task
    step, so it is a plain run.
    """
    env = os.environ if env is None else env
    slurm_mpi = env.get("SLURM_MPI_TYPE")
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo("openmpi", _int(env, "OMPI_COMM_WORLD_RANK") or 0,
                          _int(env, "OMPI_COMM_WORLD_SIZE") or 1,
                          _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), slurm_mpi)
    if "MPI_LOCALRANKID" in env or ("PMI_RANK" in env and "SLURM_STEP_ID" not in env):
        return LaunchInfo("mpiexec", _int(env, "PMI_RANK") or 0, _int(env, "PMI_SIZE") or 1,
                          _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"), slurm_mpi)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return LaunchInfo("srun", _int(env, "SLURM_PROCID") or 0,
                          _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1,
                          _int(env, "SLURM_LOCALID"), None, slurm_mpi)
    return LaunchInfo("none")


def check_world(seam: Transport, info: LaunchInfo) -> None:
    """Raise ConfigError when the launcher and the transport disagree on the job."""
    if info.launcher == "none" or (seam.size == info.size and seam.rank == info.rank):
        return
    if seam.size == 1 and info.size > 1:
        if info.launcher == "srun":
            fix = ("srun started the tasks without a PMI the MPI library understands "
                   f"(--mpi={info.slurm_mpi or 'none'}), so each task is its own world; "
                   "run `srun --mpi=pmi2 ...` (or set MpiDefault=pmi2 in slurm.conf)")
        else:
            fix = (f"{info.launcher} is not the launcher of the MPI library mpi4py uses; run "
                   "the mpiexec of that library (`python -m fuelspmd info` names it)")
        raise ConfigError(f"the environment says {info.size} tasks (this is task {info.rank}) "
                          f"but MPI reports a world of 1: {fix}")
    raise ConfigError(f"the {info.launcher} launcher says rank {info.rank} of {info.size}, but "
                      f"the transport says rank {seam.rank} of {seam.size}; start every rank "
                      "with the same launcher")


def _hostname() -> str:
    return socket.gethostname().split(".")[0][:_HOST_CHARS]


def gather_places(seam: Transport, info: LaunchInfo,
                   timeout: float) -> tuple[list[str], list[int]]:
    """All-gather every rank's host name and the local rank its launcher gave it (-1: none).

    Fixed-width int32 code points, no pickling; one collective, so every rank ends up with
    the same table and reaches the same verdict in :func:`local_rank`.
    """
    name = _hostname()
    if seam.size == 1:
        return [name], [-1 if info.local_rank is None else info.local_rank]
    mine = np.zeros(_HOST_CHARS + 1, dtype=np.int32)
    mine[: len(name)] = [ord(c) for c in name]
    mine[-1] = -1 if info.local_rank is None else info.local_rank
    every = np.empty((_HOST_CHARS + 1) * seam.size, dtype=np.int32)
    seam.all_gather(mine, every).wait(timeout)
    rows = every.reshape(seam.size, _HOST_CHARS + 1)
    return ["".join(chr(c) for c in row[:-1] if c) for row in rows], rows[:, -1].tolist()


def local_rank(nodes: list[str], launcher_local: list[int], rank: int, launcher: str) -> int:
    """This rank's index among the ranks on its host.

    The launcher's numbering is kept when it gives one (Open MPI's default ``--map-by
    core`` numbers local ranks out of rank order, and GPU binding follows it); it must be a
    permutation of ``0..local_size-1`` on every host, or the launcher and MPI disagree about
    the job. Checked on the gathered table, so every rank raises the same error.
    """
    by_host: dict[str, list[int]] = {}
    for r, host in enumerate(nodes):
        by_host.setdefault(host, []).append(r)
    if all(x < 0 for x in launcher_local):
        return by_host[nodes[rank]].index(rank)
    for host, ranks in by_host.items():
        given = sorted(launcher_local[r] for r in ranks)
        if given != list(range(len(ranks))):
            raise ConfigError(
                f"host {host!r} runs ranks {ranks}, but the launcher ({launcher}) gave them "
                f"local ranks {[launcher_local[r] for r in ranks]}, not a numbering "
                f"0..{len(ranks) - 1}: the launcher and MPI disagree about the job (is "
                "mpi4py built against the launcher's MPI?)")
    return launcher_local[rank]
