"""GPU buffers on the MPI transport, the parts that run without a GPU: deciding whether
the MPI library is CUDA-aware, which buffers are staged (fuelspmd.backend.through_host),
and the staged Work's copy back."""

from __future__ import annotations

import array_api_strict as xps
import numpy as np
import pytest

from fuelspmd.backend import StagedWork, on_gpu, through_host
from fuelspmd.errors import DeviceError, ShapeError
from fuelspmd.transport import SelfTransport
from fuelspmd_mpi._staging import cuda_aware, detect_cuda_aware

MPICH = "MPICH Version: 5.0.2\nMPICH configure: --with-device=ch4:ucx,ofi --with-pm=hydra"
MPICH_CUDA = "MPICH Version: 4.2.1\nMPICH configure: --with-device=ch4:ofi --with-cuda=/usr"
OMPI = "Open MPI v5.0.3, package: Open MPI builder Distribution"


def test_detect_from_memory_alloc_kinds_first() -> None:
    assert detect_cuda_aware(alloc_kinds="mpi,system,cuda:device", library_version=MPICH,
                             env={})[0]
    aware, why = detect_cuda_aware(alloc_kinds="mpi,system", library_version=MPICH, env={})
    assert not aware and "--with-cuda" in why


def test_detect_mpich_built_with_cuda_and_its_switch() -> None:
    assert detect_cuda_aware(alloc_kinds=None, library_version=MPICH_CUDA, env={})[0]
    aware, why = detect_cuda_aware(alloc_kinds=None, library_version=MPICH_CUDA,
                                   env={"MPIR_CVAR_ENABLE_GPU": "0"})
    assert not aware and "MPIR_CVAR_ENABLE_GPU=0" in why


def test_detect_open_mpi_from_ompi_info() -> None:
    yes = "mca:mpi:base:param:mpi_built_with_cuda_support:value:true\n"
    no = "mca:mpi:base:param:mpi_built_with_cuda_support:value:false\n"
    assert detect_cuda_aware(alloc_kinds=None, library_version=OMPI, env={},
                             ompi_info=lambda: yes)[0]
    assert not detect_cuda_aware(alloc_kinds=None, library_version=OMPI, env={},
                                 ompi_info=lambda: no)[0]


@pytest.mark.timeout(60)
def test_the_installed_mpi_is_asked() -> None:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=30.0)
    aware, why = cuda_aware(t._MPI)
    assert isinstance(aware, bool) and why
    assert t.cuda_aware == (aware, why)
    if "pypi.org/p/mpich" in str(t._MPI.Get_library_version()):
        assert not aware  # the PyPI wheel is built without CUDA


def test_host_arrays_are_never_staged() -> None:
    a = np.arange(4.0)
    s = xps.asarray([1.0, 2.0])
    assert not on_gpu(a) and not on_gpu(s)  # strict has __dlpack__ but no CUDA face
    asked: list[bool] = []

    def aware() -> bool:
        asked.append(True)
        return False

    run = SelfTransport().all_reduce
    assert through_host(run, (a,), (0,), op="all_reduce", direct=aware) is None
    assert asked == []  # the library is asked about GPU buffers only
    with pytest.raises(DeviceError, match="numpy or GPU"):
        through_host(run, (s,), (0,), op="all_reduce", direct=aware)


@pytest.mark.timeout(60)
def test_the_mpi_transport_still_refuses_other_arrays() -> None:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=30.0)  # a host array that is not numpy: refused, not staged
    with pytest.raises(ShapeError, match="all_reduce"):
        t.all_reduce(xps.asarray([1.0, 2.0]), "sum")
    with pytest.raises(ShapeError, match="all_gather"):
        t.all_gather(xps.asarray([1.0]), xps.asarray([1.0] * t.size))


def test_staged_work_copies_back_once_when_the_inner_work_completes() -> None:
    seam = SelfTransport()
    host = np.zeros(3)
    target = np.full(3, -1.0)
    copies: list[int] = []

    def copy_back() -> None:
        copies.append(1)
        target[...] = host

    work = StagedWork(seam.recv(host, 0, 7), copy_back)
    assert not work.test() and copies == []  # the receive has no message yet
    seam.send(np.array([1.0, 2.0, 3.0]), 0, 7)
    assert work.test()
    work.wait()
    assert copies == [1]
    np.testing.assert_array_equal(target, [1.0, 2.0, 3.0])
