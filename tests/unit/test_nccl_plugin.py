"""The nccl transport plugin where there is no GPU: import hygiene, the dtype and op
tables (against cupy's own constants when cupy is installed), loading NCCL from the pip
wheel, the errors fs.init gives, and the host channel a GPU job's control traffic uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.errors import ConfigError, DTypeError, TransportUnavailableError
from fuelspmd.transport import ReduceOp, find_transports
from fuelspmd_nccl import plugin
from fuelspmd_nccl._binding import decode_version, load_nccl, nccl_version, unique_id_format
from fuelspmd_nccl._tables import NCCL_DTYPES, NCCL_OPS, plan_for

NEW, OLD = (2, 21, 5), (2, 8, 4)


def _cupy_nccl() -> object | None:
    try:
        return load_nccl()
    except TransportUnavailableError:
        return None


def test_importing_the_plugin_loads_neither_cupy_nor_mpi() -> None:
    code = ("import sys, fuelspmd_nccl, fuelspmd_nccl._tables; "
            "print(sorted(m for m in ('cupy', 'mpi4py', 'mpi4py.MPI') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_registered_as_an_entry_point() -> None:
    assert find_transports()["nccl"].value == "fuelspmd_nccl:plugin"


@pytest.mark.parametrize(("op", "code"), [("sum", 2), ("max", 2), ("prod", 3), ("min", 3)])
def test_bool_reductions_are_uint8_max_and_min(op: str, code: int) -> None:
    plan = plan_for("bool", ReduceOp.parse(op), version=NEW, where="all_reduce")
    assert (plan.datatype, plan.op, plan.divide) == (NCCL_DTYPES["bool"], code, False)


def test_avg_native_for_floats_floor_divided_for_integers_refused_for_bool() -> None:
    for dt in ("float16", "bfloat16", "float32", "float64"):
        plan = plan_for(dt, ReduceOp.AVG, version=NEW, where="x")
        assert (plan.op, plan.divide) == (NCCL_OPS[ReduceOp.AVG], False)
    for dt in ("int32", "int64"):
        plan = plan_for(dt, ReduceOp.AVG, version=NEW, where="x")
        assert (plan.op, plan.divide) == (NCCL_OPS[ReduceOp.SUM], True)
    old = plan_for("float32", ReduceOp.AVG, version=OLD, where="x")
    assert (old.op, old.divide) == (NCCL_OPS[ReduceOp.SUM], True)
    with pytest.raises(DTypeError, match="avg is not defined for bool"):
        plan_for("bool", ReduceOp.AVG, version=NEW, where="all_reduce")


def test_unsupported_dtypes_name_the_fix() -> None:
    with pytest.raises(DTypeError, match=r"NCCL >= 2\.10.*2\.8\.4.*pip install"):
        plan_for("bfloat16", ReduceOp.SUM, version=OLD, where="all_reduce")
    with pytest.raises(DTypeError, match="cast the buffer"):
        plan_for("complex64", ReduceOp.SUM, version=NEW, where="all_gather")


def test_version_decoding_both_encodings() -> None:
    assert decode_version(22105) == (2, 21, 5)
    assert decode_version(23203) == (2, 32, 3)
    assert decode_version(2804) == (2, 8, 4)


def test_tables_match_cupys_nccl_constants() -> None:
    nccl = _cupy_nccl()
    if nccl is None:
        pytest.skip("cupy with NCCL is not installed (the [gpu] extra)")
    names = {"bool": "NCCL_UINT8", "int32": "NCCL_INT32", "int64": "NCCL_INT64",
             "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
             "bfloat16": "NCCL_BFLOAT16"}
    for dt, name in names.items():
        assert NCCL_DTYPES[dt] == getattr(nccl, name), dt
    for op in ReduceOp:
        assert NCCL_OPS[op] == getattr(nccl, f"NCCL_{op.name}"), op


def test_the_pip_wheel_libnccl_loads_without_a_driver() -> None:
    nccl = _cupy_nccl()
    if nccl is None:
        pytest.skip("cupy with NCCL is not installed (the [gpu] extra)")
    assert nccl_version(nccl) >= (2, 18, 1)
    assert plugin.library_version().startswith("NCCL 2.")
    assert unique_id_format() in ("bytes", "tuple")
    assert plugin.unavailable_reason() is None


def test_init_nccl_without_a_gpu_says_how_to_fix_it() -> None:
    if _cupy_nccl() is None:
        with pytest.raises(TransportUnavailableError, match=r"\.\[gpu\]"):
            fs.init(transport="nccl")
        return
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU.*transport='mpi'"):
        fs.init(transport="nccl")


def test_auto_does_not_pick_nccl_for_host_devices() -> None:
    from fuelspmd.launch import _nccl_for

    assert not _nccl_for("cpu:0")
    assert not _nccl_for("strict:0")
    if fs.backend.cuda_device_count() == 0:
        assert not _nccl_for("auto")


def test_a_named_non_gpu_device_is_refused() -> None:
    if _cupy_nccl() is None:
        pytest.skip("cupy with NCCL is not installed (the [gpu] extra)")
    with pytest.raises(ConfigError):
        plugin.world(timeout=5.0, device="cpu:0")


@pytest.mark.timeout(60)
def test_host_buffers_and_splits_use_the_mpi_channel() -> None:
    nccl = _cupy_nccl()
    if nccl is None:
        pytest.skip("cupy with NCCL is not installed (the [gpu] extra)")
    from fuelspmd_mpi import plugin as mpi_plugin
    from fuelspmd_nccl._transport import NCCLTransport

    mpi = mpi_plugin.world(timeout=30.0)
    t = NCCLTransport(mpi, nccl=nccl, device_index=0, timeout=30.0)
    assert t.comm is mpi.comm and "NCCL group world" in t.describe()
    buf = np.arange(5.0)
    t.all_reduce(buf, "sum").wait()
    np.testing.assert_array_equal(buf, np.arange(5.0) * t.size)
    sub = t.split(0, t.rank)
    recv = np.empty(3 * sub.size, np.int32)
    sub.all_gather(np.array([1, 2, 3], np.int32), recv).wait()
    np.testing.assert_array_equal(recv, np.tile([1, 2, 3], sub.size))
    assert sub._comm is None  # the parent has none, so the split makes none either
    assert sub.async_error() is None
    sub.finalize()


_ID_JOB = """
import numpy as np
from fuelspmd_mpi import plugin as mpi_plugin
from fuelspmd_nccl._binding import load_nccl
from fuelspmd_nccl._transport import NCCLTransport

mpi = mpi_plugin.world(timeout=30.0)
t = NCCLTransport(mpi, nccl=load_nccl(), device_index=0, timeout=30.0)

def everyone(uid):
    mine = np.frombuffer(uid, np.int64).copy()
    out = np.empty(16 * t.size, np.int64)
    t.all_gather(mine, out).wait()  # host buffers: over the MPI channel
    return [bytes(row) for row in out.reshape(t.size, 16)]

world = everyone(t.unique_id())
assert len(world[0]) == 128 and len(set(world)) == 1, "ranks got different ids"
sub = t.split(t.rank % 2, t.rank)
ids = everyone(sub.unique_id())
assert ids[0] not in world, "a split must draw a fresh id"
assert all(ids[r] == ids[r % 2] for r in range(t.size)), "one id per group"
assert len(set(ids)) == min(2, t.size), "each group its own id"
sub.finalize()
print("OK", t.rank)
"""


@pytest.mark.timeout(90)
def test_unique_id_is_broadcast_per_group_over_mpi() -> None:
    """The bootstrap without a GPU: rank 0 of each group draws an ncclUniqueId (no CUDA
    needed) and MPI broadcasts it; every rank of a group holds the same, groups differ."""
    if _cupy_nccl() is None:
        pytest.skip("cupy with NCCL is not installed (the [gpu] extra)")
    mpiexec = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
               or shutil.which("mpiexec"))
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "OMPI_", "SLURM_", "HYDRA"))}
    done = subprocess.run([mpiexec, "-n", "3", sys.executable, "-c", _ID_JOB],
                          capture_output=True, text=True, timeout=80, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("OK") == 3, done.stdout  # ranks' lines may interleave
