"""``fuelspmd.optim`` (layer 7): optimisers that update :class:`~fuelspmd.nn.Parameter` s in
place, learning-rate schedules, clipping by the global norm of a sharded model, ZeRO-1
over data parallelism, and dynamic loss scaling for float16::

    opt = optim.AdamW(model.parameters(), lr=optim.cosine(1e-3, total=1000, warmup=100))
    grads = fs.grad(loss, opt.params)
    grads, norm = optim.clip_grad_norm(opt.params, grads, max_norm=1.0, mesh=mesh)
    opt.step(grads)
"""

from __future__ import annotations

from fuelspmd.optim.clip import clip_grad_norm
from fuelspmd.optim.optimizer import MASTER, SGD, AdamW, Optimizer
from fuelspmd.optim.scaling import LossScaler
from fuelspmd.optim.schedules import Schedule, constant, cosine, linear_warmup
from fuelspmd.optim.zero import ZeRO1

__all__ = ["MASTER", "SGD", "AdamW", "LossScaler", "Optimizer", "Schedule", "ZeRO1",
           "clip_grad_norm", "constant", "cosine", "linear_warmup"]
