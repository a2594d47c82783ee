"""``DropoutRNG``: the key of a model's dropout masks (see :mod:`.layers` for the masks).

A mask is a pure function of ``(seed, step, micro, layer)``, never of a generator's
history, so a recomputed forward (:mod:`.recompute`) redraws the same one: a recomputed
block keys its masks by the (step, micro) its forward saw, whatever the loop has set since.
``micro`` counts the micro-batches of the global batch: a data-parallel replica whose
first micro-batch is the global batch's ``offset``-th keys its ``i``-th by ``offset + i``,
so the masks, like the data, are the same whatever the number of replicas.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DropoutRNG"]


class DropoutRNG:
    """The key of every dropout mask of a model: ``seed`` for the run, ``step`` and
    ``micro`` (micro-batch) set by the training loop before each forward, ``offset`` the
    global index of this replica's first micro-batch."""

    def __init__(self, seed: int = 0, *, offset: int = 0) -> None:
        self.seed, self.step, self.micro, self.offset = int(seed), 0, 0, int(offset)

    def set_step(self, step: int, micro: int = 0) -> None:
        """Key the next forward's masks by ``(step, micro)``; build its backward first."""
        self.step, self.micro = int(step), int(micro)

    def keep(self, layer: int, shape: tuple[int, ...], p: float, *,
             micro: int | None = None) -> np.ndarray:
        """The full boolean keep mask of ``layer`` at the current step (and micro-batch,
        or ``micro``)."""
        micro = self.offset + (self.micro if micro is None else micro)
        rng = np.random.default_rng([self.seed, self.step, micro, int(layer)])
        return rng.random(shape) >= p
