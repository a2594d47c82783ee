"""Training runs shared by tests/unit/test_compile.py and tests/mpi/test_compile.py: the
bench's GPT-2 (fuelspmd.models) stepped uncompiled and under ``fs.compile`` from the same
weights and data, so the two can be compared bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
from budget import runs

import fuelspmd as fs
from fuelspmd import optim
from fuelspmd.bench.train import SIZES, batch, gpt2, make_step
from fuelspmd.comm import Communicator

SIZE = SIZES["tiny"]
# Enough for the warm-up (3 steps), then cosine steps, each with its own coefficients, and
# at least 5 replays; the long run (tests/run.py --long) steps 20 times.
STEPS = runs(ci=8, long=20)


def train(comm: Communicator, *, compiled: bool, steps: int = STEPS, dtype: str = "float32",
          dp: Communicator | None = None, zero: bool = False, replica: int = 0
          ) -> tuple[list[float], list[np.ndarray], Any]:
    """Losses of ``steps`` AdamW steps (a warm-up then cosine learning rate, so every step's
    coefficients differ), the final parameters, and the step function."""
    model = gpt2(SIZE, comm=comm, dtype=dtype)
    adam = optim.AdamW(model.parameters(), lr=optim.cosine(1e-2, steps, warmup=3),
                       weight_decay=0.1)
    opt = optim.ZeRO1(adam, dp=dp) if zero and dp is not None else adam
    step = make_step(model, opt, comm=comm, dp=dp)
    fn = fs.compile(step) if compiled else step
    losses = []
    for i in range(steps):
        ids, targets = batch(SIZE, 1, i, replica)
        loss = fn(fs.tensor(ids, device=comm.device), fs.tensor(targets, device=comm.device))
        losses.append(float(loss.numpy()))
    return losses, [p.numpy() for p in model.parameters()], fn
