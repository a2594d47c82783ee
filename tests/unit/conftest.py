"""One-process tests: a world a test starts (a bench's ``main`` calls ``fs.init()``) is
finalized after it, so the next test's ``fs.init(...)`` is not handed a world made with
other settings.

Property tests have no per-example deadline unless they set one: on these shared 2-core
machines a deadline measures the machine's load, not the code. Each sets its own
``max_examples``, its budget (hypothesis's default, 100, where it does not).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from fuelspmd import launch

settings.register_profile("fuelspmd", deadline=None)
settings.load_profile("fuelspmd")


@pytest.fixture(autouse=True)
def _finalize_world() -> Iterator[None]:
    before = launch._WORLD
    yield
    world = launch._WORLD
    if world is not None and world is not before and world.size == 1:
        world.finalize()
