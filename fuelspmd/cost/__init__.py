"""The alpha-beta cost model: predicted collective times on a topology, and the planner.

Layer 5, pure policy: nothing here touches a tensor or a transport, so every rank computes
the same prediction and a test checks it in one process.

- :mod:`fuelspmd.cost.collectives`: :class:`CostModel` (``predict``, ``best_algorithm``,
  ``bus_bandwidth``) for every collective and algorithm.
- :mod:`fuelspmd.cost.calibration`: the JSON file of measured alpha, beta and gamma.
- :mod:`fuelspmd.cost.transformer`: step time of a transformer under tp x pp x dp, and the
  ranked plans ``fuelspmd plan`` prints.
"""

from __future__ import annotations

from fuelspmd.cost.calibration import calibration_path, load_calibration, save_calibration
from fuelspmd.cost.collectives import ALGORITHMS, COLLECTIVES, Choice, CostModel, Estimate

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "Choice",
    "CostModel",
    "Estimate",
    "calibration_path",
    "load_calibration",
    "save_calibration",
]
