"""What every GPU test module starts with: skip cleanly without cupy or a CUDA device."""

from __future__ import annotations

from types import ModuleType

import pytest

from fuelspmd.backend import cuda_device_count, cuda_unavailable_reason


def require_gpus(n: int = 1) -> ModuleType:
    """Return cupy, or skip the calling module: no cupy, or fewer than ``n`` CUDA devices."""
    cupy = pytest.importorskip("cupy", reason="needs cupy: pip install -e '.[gpu]'")
    found = cuda_device_count()
    if found < n:
        why = f": {cuda_unavailable_reason()}" if found == 0 else ""
        pytest.skip(f"needs {n} CUDA GPU(s), cupy sees {found}{why}", allow_module_level=True)
    return cupy
