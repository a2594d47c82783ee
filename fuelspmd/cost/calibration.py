"""Where calibrated alpha, beta and gamma live, and how they are read back.

``fuelspmd bench calibrate`` measures this machine's shared-memory link and writes a JSON
file; :func:`fuelspmd.topology.detect` reads it (through :func:`load_calibration`) so the
cost model of a CPU job predicts this machine, not a default one. The file is::

    {"version": 2, "host": "...", "cores": c, "shm": {"latency": s, "bandwidth": B/s,
     "reduce_bandwidth": B/s, "oversubscribed_latency": s},
     "regimes": [{"upto": B or null, "latency": s, "bandwidth": B/s,
                  "reduce_bandwidth": B/s, "oversubscribed_latency": s}, ...],
     "bounds": {"min_latency": s, "max_bandwidth": B/s},
     "fit": {"median_abs_error": ..., "max_abs_error": ..., "r2_log_time": ..., ...}}

``shm`` is the one-link view :func:`fuelspmd.topology.detect` reads (small-message latency,
large-message rates); ``oversubscribed_latency`` (optional) is the per-message latency when
more ranks than cores are busy (see :class:`fuelspmd.topology.Node`). ``regimes`` (optional,
version 2) are the per-size-band numbers :mod:`fuelspmd.cost.regimes` describes; give them
to the model with :func:`calibrated_model`. ``bounds`` (optional) are the physical limits
the fit was held to (a latency floor, one core's copy rate as the bandwidth ceiling); a
file whose numbers break them was not written by the fit, and is refused.

Its place: the ``path`` argument (``fs.init(calibration=...)`` passes it on), else
``$XDG_CACHE_HOME/fuelspmd/calibration.json`` (``~/.cache`` when XDG_CACHE_HOME is unset).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fuelspmd.cost.collectives import CostModel
from fuelspmd.cost.regimes import regimes_from_dict
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Topology

__all__ = ["calibrated_model", "calibration_path", "load_calibration", "save_calibration"]

_KEYS = ("latency", "bandwidth", "reduce_bandwidth")


def calibration_path(path: str | Path | None = None) -> Path:
    """The calibration file to read or write (see the module docstring for the order)."""
    if path is not None:
        return Path(path)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fuelspmd" / "calibration.json"


def _check(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    shm = data.get("shm")
    if not isinstance(shm, Mapping):
        raise ConfigError(f"{where}: a calibration needs an 'shm' object with {list(_KEYS)}; "
                          "rerun `mpiexec -n 2 fuelspmd bench calibrate`")
    for key in _KEYS:
        value = shm.get(key)
        ok = isinstance(value, (int, float)) and math.isfinite(value)
        if not ok or value < 0 or (key != "latency" and value == 0):
            raise ConfigError(f"{where}: shm.{key} = {value!r} is not a usable number "
                              "(latency >= 0 s, bandwidths > 0 B/s); rerun the calibration")
    crowded = shm.get("oversubscribed_latency")
    if crowded is not None and not (isinstance(crowded, (int, float)) and crowded >= 0):
        raise ConfigError(f"{where}: shm.oversubscribed_latency = {crowded!r} must be >= 0 s")
    try:
        regimes = regimes_from_dict(data.get("regimes"))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: unreadable regimes ({e}); rerun the calibration") from None
    bounds = data.get("bounds")
    if isinstance(bounds, Mapping):
        floor, ceiling = bounds.get("min_latency", 0.0), bounds.get("max_bandwidth", math.inf)
        for r in regimes:
            if (r.latency < floor * (1 - 1e-9) or max(r.bandwidth, r.reduce_bandwidth)
                    > ceiling * (1 + 1e-9)):
                raise ConfigError(
                    f"{where}: a regime (latency {r.latency:.3g} s, bandwidth "
                    f"{r.bandwidth:.3g} B/s, reduce {r.reduce_bandwidth:.3g} B/s) breaks the "
                    f"file's own bounds (latency >= {floor:.3g} s, bandwidths <= "
                    f"{ceiling:.3g} B/s); rerun the calibration")
    return dict(data)


def calibrated_model(topology: Topology,
                     calibration: Mapping[str, Any] | None = None) -> CostModel:
    """The cost model of ``topology`` with the calibration's size regimes (none: one link).

    ``calibration`` is :func:`load_calibration`'s dictionary; build ``topology`` from the
    same one (``detect(world, calibration=...)``) so both views agree.
    """
    if calibration is None:
        return CostModel(topology)
    return CostModel(topology, regimes=regimes_from_dict(calibration.get("regimes")))


def load_calibration(path: str | Path | None = None) -> dict[str, Any] | None:
    """The saved calibration, or None when there is none (then defaults apply).

    A ``path`` given explicitly must exist; the default places may be empty.
    """
    file = calibration_path(path)
    if not file.is_file():
        if path is not None:
            raise ConfigError(f"no calibration file at {str(file)!r}; write one with "
                              "`mpiexec -n 2 fuelspmd bench calibrate --out FILE`")
        return None
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e}); rerun the calibration") from None
    return _check(data, str(file))


def save_calibration(data: Mapping[str, Any], path: str | Path | None = None) -> Path:
    """Write ``data`` (checked first) where :func:`load_calibration` finds it."""
    file = calibration_path(path)
    checked = _check(data, "calibration to save")
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(checked, indent=2) + "\n")
    tmp.replace(file)
    return file
