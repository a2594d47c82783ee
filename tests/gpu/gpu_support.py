"""What every GPU test module starts with: skip cleanly without cupy or a CUDA device."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from fuelspmd.backend import cuda_device_count


def require_gpus(n: int = 1) -> ModuleType:
    """Return cupy, or skip the calling module: no cupy, or fewer than ``n`` CUDA devices."""
    cupy = pytest.importorskip("cupy", reason="needs cupy: pip install -e '.[gpu]'")
    found = cuda_device_count()
    if found < n:
        pytest.skip(f"needs {n} CUDA GPU(s), cupy sees {found}", allow_module_level=True)
    return cupy


def unit_module(name: str) -> ModuleType:
    """Load ``tests/unit/<name>.py`` (its cases are reused here, not copied)."""
    path = Path(__file__).resolve().parent.parent / "unit" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_unit_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
