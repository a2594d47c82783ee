"""The alpha-beta cost model: predicted collective times on a topology, and the planner.

Layer 5, pure policy: nothing here touches a tensor or a transport, so every rank computes
the same prediction and a test checks it in one process.

- :mod:`fuelspmd.cost.collectives`: :class:`CostModel` (``predict``, ``best_algorithm``,
  ``bus_bandwidth``) for every collective and algorithm.
- :mod:`fuelspmd.cost.calibration`: the JSON file of measured alpha, beta and gamma, and
  :func:`calibrated_model`.
- :mod:`fuelspmd.cost.regimes`: the shared-memory link's numbers per band of sizes.
- :mod:`fuelspmd.cost.transformer`: step time of a transformer under tp x pp x dp, and the
  ranked plans ``fuelspmd plan`` prints.
"""

from __future__ import annotations

from fuelspmd.cost.calibration import (
    calibrated_model,
    calibration_path,
    load_calibration,
    save_calibration,
)
from fuelspmd.cost.collectives import ALGORITHMS, COLLECTIVES, Choice, CostModel, Estimate
from fuelspmd.cost.regimes import Regime, regimes_from_dict, regimes_to_dict

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "Choice",
    "CostModel",
    "Estimate",
    "Regime",
    "calibrated_model",
    "calibration_path",
    "load_calibration",
    "regimes_from_dict",
    "regimes_to_dict",
    "save_calibration",
]
