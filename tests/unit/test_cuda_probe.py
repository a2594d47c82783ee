"""``cuda_device_count`` and ``cuda_unavailable_reason`` on machines without a usable GPU:
no driver, and a driver's device node without a CUDA that starts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuelspmd import backend


@pytest.fixture
def probe() -> Iterator[None]:
    backend._cuda_probe.cache_clear()
    yield
    backend._cuda_probe.cache_clear()


@pytest.mark.skipif(any(map(os.path.exists, backend._DRIVER_NODES)), reason="a driver is here")
def test_no_driver_is_named(probe: None) -> None:
    assert backend.cuda_device_count() == 0
    assert backend.cuda_unavailable_reason() == (
        "no NVIDIA driver: none of /dev/nvidiactl, /dev/dxg exists")


@pytest.mark.skipif(any(map(os.path.exists, backend._DRIVER_NODES)), reason="a driver is here")
def test_a_driver_node_without_a_cuda_that_starts_is_told_apart(
        probe: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cupy")
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(backend, "_DRIVER_NODES", (str(node),))
    assert backend.cuda_device_count() == 0
    why = backend.cuda_unavailable_reason()
    assert why is not None and why.startswith("the NVIDIA driver is there, but CUDA does not "
                                              "start with it (CUDARuntimeError: cudaError")
