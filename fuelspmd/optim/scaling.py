"""Dynamic loss scaling for float16 training (torch's ``GradScaler`` rule).

Layer 7. float16's smallest normal is 6e-5, so small gradients underflow to zero; scaling
the loss by ``S`` scales every gradient by ``S`` and keeps them representable. Too large an
``S`` overflows to inf instead, so the scale adapts: a step whose gradients hold an inf or
a nan is skipped and ``S`` is multiplied by ``backoff`` (0.5); after ``interval`` good steps
in a row ``S`` is multiplied by ``growth`` (2), unless that would make it inf (then it
stays, as torch's).

The skip decision must be the same on every rank, or the replicas diverge and the next
collectives mismatch: :meth:`LossScaler.unscale` sums ``0 * g`` over the gradients (nan iff
some element is inf or nan) and all-reduces that one number over ``comm``, the group of
every rank that steps together (the whole mesh: ``mesh.comm_group``), so a non-finite
gradient on one rank skips the step on all.

The scale, the count of good steps and of skips are 0-d tensors, and ``finite`` is a 0-d
bool tensor: :meth:`LossScaler.update` adapts them with ``where`` and an optimiser skips
with ``step(grads, apply=finite)``, so a scaled step never reads the host and compiles
(``fs.compile``). ``if finite:`` still works in a plain loop (it reads the value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd.comm import Communicator
from fuelspmd.dtypes import float32, float64
from fuelspmd.errors import ConfigError
from fuelspmd.optim.clip import scale_by
from fuelspmd.tensor import Tensor, realize, tensor, where, zeros

__all__ = ["LossScaler"]


class LossScaler:
    """Scale the loss, unscale and check the gradients, adapt the scale; see the module
    docs. Typical step::

        grads = fs.grad(scaler.scale(loss), params)
        grads, finite = scaler.unscale(grads, comm=mesh.comm_group)
        opt.step(grads, apply=finite)   # or: if finite: opt.step(grads)
        scaler.update(finite)
    """

    def __init__(self, scale: float = 2.0 ** 16, *, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000) -> None:
        if not (scale > 0 and growth > 1 and 0 < backoff < 1 and interval >= 1):
            raise ConfigError(f"LossScaler: need scale > 0, growth > 1, 0 < backoff < 1, "
                              f"interval >= 1; got scale={scale}, growth={growth}, "
                              f"backoff={backoff}, interval={interval}")
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self._most = float(np.finfo(np.float64).max) / self.growth  # the largest that grows
        # (scale, finite steps since the scale last changed, skipped steps): numbers until
        # the first scale() places them on its loss's device as float64 0-d tensors
        self._start: tuple[float, int, int] = (float(scale), 0, 0)
        self._state: tuple[Tensor, Tensor, Tensor] | None = None

    def _tensors(self, device: Any) -> tuple[Tensor, Tensor, Tensor]:
        if self._state is None or self._state[0].device != device:
            self._state = tuple(tensor(np.float64(v), device=device,  # type: ignore[assignment]
                                       dtype=float64) for v in self._numbers())
        assert self._state is not None
        return self._state

    def _numbers(self) -> tuple[float, int, int]:
        if self._state is None:
            return self._start
        s, g, k = (float(t) for t in self._state)
        return s, int(g), int(k)

    @property
    def factor(self) -> Tensor:
        """The scale as a float64 0-d tensor (lazy; made by the first :meth:`scale`)."""
        if self._state is None:
            raise ConfigError("LossScaler.factor: call scale(loss) first, which places the "
                              "scale on the loss's device")
        return self._state[0]

    @property
    def value(self) -> float:
        """The scale, read to the host."""
        return self._numbers()[0]

    @property
    def good(self) -> int:
        return self._numbers()[1]

    @property
    def skipped(self) -> int:
        return self._numbers()[2]

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * scale`` (differentiate this one)."""
        return loss * self._tensors(loss.device)[0].astype(loss.dtype)

    def unscale(self, grads: Sequence[Tensor], *, comm: Communicator | None = None
                ) -> tuple[list[Tensor], Tensor]:
        """The gradients divided by the scale, and whether every element of every rank's
        gradients is finite (a 0-d bool tensor, agreed over ``comm``; collective over it)."""
        if not grads:
            raise ConfigError("LossScaler.unscale: no gradients given; pass the list "
                              "fs.grad(scaled_loss, params) returned")
        device: Any = grads[0].device
        probe = zeros((1,), device=device, dtype=float32)
        for g in grads:  # 0 * inf and 0 * nan are nan: the sum is nan iff one is not finite
            probe = probe + (g.astype(float32) * 0.0).sum()
        if comm is not None and comm.size > 1:
            probe = comm.all_reduce(probe)
        finite = probe[0] == 0.0  # nan compares unequal
        return scale_by(grads, 1.0 / self._tensors(device)[0]), finite

    def update(self, finite: Tensor | bool) -> None:
        """Adapt the scale after a step: back off and count a skip when not ``finite``,
        grow after ``interval`` finite steps in a row (lazily, with ``where``)."""
        if not isinstance(finite, Tensor):
            dev = self._state[0].device if self._state is not None else None
            finite = tensor(bool(finite), device=dev)
        scale, good, skipped = self._tensors(finite.device)
        good1 = good + 1.0
        due = good1 >= float(self.interval)
        # as torch's: the count restarts when due, and the scale grows only if it stays
        # finite (asked before the product, which would overflow)
        grow, keep, back = (tensor(np.float64(v), device=finite.device, dtype=float64)
                            for v in (self.growth, 1.0, self.backoff))
        by = where(finite, where(due & (scale <= self._most), grow, keep), back)
        self._state = (
            scale * by,
            where(finite, where(due, good * 0.0, good1), good * 0.0),
            where(finite, skipped, skipped + 1.0))
        realize(*self._state)  # the next step reads values, not this step's graph

    def state_dict(self) -> dict[str, float | int]:
        s, g, k = self._numbers()
        return {"scale": s, "good": g, "skipped": k}

    def load_state_dict(self, d: dict[str, float | int]) -> None:
        self._start = (float(d["scale"]), int(d["good"]), int(d["skipped"]))
        self._state = None
