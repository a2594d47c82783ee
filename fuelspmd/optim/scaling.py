"""Dynamic loss scaling for float16 training (torch's ``GradScaler`` rule).

Layer 7. float16's smallest normal is 6e-5, so small gradients underflow to zero; scaling
the loss by ``S`` scales every gradient by ``S`` and keeps them representable. Too large an
``S`` overflows to inf instead, so the scale adapts: a step whose gradients hold an inf or
a nan is skipped and ``S`` is multiplied by ``backoff`` (0.5); after ``interval`` good steps
in a row ``S`` is multiplied by ``growth`` (2).

The skip decision must be the same on every rank, or the replicas diverge and the next
collectives mismatch: :meth:`LossScaler.unscale` sums ``0 * g`` over the gradients (nan iff
some element is inf or nan) and all-reduces that one number over ``comm``, the group of
every rank that steps together (the whole mesh: ``mesh.comm_group``), so a non-finite
gradient on one rank skips the step on all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fuelspmd.comm import Communicator
from fuelspmd.dtypes import float32
from fuelspmd.errors import ConfigError
from fuelspmd.tensor import Tensor, zeros

__all__ = ["LossScaler"]


class LossScaler:
    """Scale the loss, unscale and check the gradients, adapt the scale; see the module
    docs. Typical step::

        grads = fs.grad(scaler.scale(loss), params)
        grads, finite = scaler.unscale(grads, comm=mesh.comm_group)
        if finite:
            opt.step(grads)
        scaler.update(finite)
    """

    def __init__(self, scale: float = 2.0 ** 16, *, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000) -> None:
        if not (scale > 0 and growth > 1 and 0 < backoff < 1 and interval >= 1):
            raise ConfigError(f"LossScaler: need scale > 0, growth > 1, 0 < backoff < 1, "
                              f"interval >= 1; got scale={scale}, growth={growth}, "
                              f"backoff={backoff}, interval={interval}")
        self.value = float(scale)
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self.good = 0  # finite steps since the scale last changed
        self.skipped = 0

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * scale`` (differentiate this one)."""
        return loss * self.value

    def unscale(self, grads: Sequence[Tensor], *, comm: Communicator | None = None
                ) -> tuple[list[Tensor], bool]:
        """The gradients divided by the scale, and whether every element of every rank's
        gradients is finite (agreed over ``comm``; collective over it)."""
        if not grads:
            raise ConfigError("LossScaler.unscale: no gradients given; pass the list "
                              "fs.grad(scaled_loss, params) returned")
        device: Any = grads[0].device
        probe = zeros((1,), device=device, dtype=float32)
        for g in grads:  # 0 * inf and 0 * nan are nan: the sum is nan iff one is not finite
            probe = probe + (g.astype(float32) * 0.0).sum()
        if comm is not None and comm.size > 1:
            probe = comm.all_reduce(probe)
        finite = math.isfinite(float(probe.numpy()[0]))
        inv = 1.0 / self.value
        return [g * inv for g in grads], finite

    def update(self, finite: bool) -> None:
        """Adapt the scale after a step: back off and count a skip when not ``finite``,
        grow after ``interval`` finite steps in a row."""
        if not finite:
            self.value *= self.backoff
            self.good = 0
            self.skipped += 1
            return
        self.good += 1
        if self.good == self.interval:
            self.value *= self.growth
            self.good = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.value, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, d: dict[str, float | int]) -> None:
        self.value, self.good, self.skipped = float(d["scale"]), int(d["good"]), int(d["skipped"])
