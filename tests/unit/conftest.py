"""One-process tests: a world a test starts (a bench's ``main`` calls ``fs.init()``) is
finalized after it, so the next test's ``fs.init(...)`` is not handed a world made with
other settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fuelspmd import launch


@pytest.fixture(autouse=True)
def _finalize_world() -> Iterator[None]:
    before = launch._WORLD
    yield
    world = launch._WORLD
    if world is not None and world is not before and world.size == 1:
        world.finalize()
