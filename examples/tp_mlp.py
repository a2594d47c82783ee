"""Train a tensor-parallel MLP for a few steps on synthetic data.

The same program runs with ranks as processes or as devices of one process::

    python examples/tp_mlp.py                       # one rank: TP 1
    mpiexec -n 2 python examples/tp_mlp.py          # two processes: TP 2
    python examples/tp_mlp.py --devices cpu:2       # two devices of one process: TP 2

The task: regress y = tanh(x @ T) for a fixed random T with a seeded ``ParallelMLP`` and
plain SGD. Every rank holds its shards of the same seeded weights, so the loss curve is
the same at every TP degree (to float tolerance); rank 0 prints it, one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import tensor_parallel as tp
from fuelspmd.functional import mse_loss


def batch(step: int, rows: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s synthetic (inputs, targets), the same on every rank."""
    teacher = np.random.default_rng(1).standard_normal((hidden, hidden)) / np.sqrt(hidden)
    x = np.random.default_rng([2, step]).standard_normal((rows, hidden)).astype(np.float32)
    return x, np.tanh(x @ teacher).astype(np.float32)


def train(comm: Any, args: argparse.Namespace) -> list[float]:
    """Run ``args.steps`` SGD steps; return the losses (replicated on every rank)."""
    mlp = tp.ParallelMLP(args.hidden, args.ffn, comm=comm, seed=0)
    losses = []
    for step in range(args.steps):
        xa, ya = batch(step, args.batch, args.hidden)
        x, y = fs.tensor(xa, device=comm.device), fs.tensor(ya, device=comm.device)
        loss = mse_loss(mlp(x), y)
        params = mlp.parameters()
        grads = fs.grad(loss, params)
        new = [p - args.lr * g for p, g in zip(params, grads)]
        fs.realize(loss, *new)  # forward, backward and update: one graph
        for p, v in zip(params, new):
            p.assign(v)  # the parameter's value replaced in place
        losses.append(float(loss.numpy()))
        fs.rank_print(comm, json.dumps({"step": step, "tp": comm.size,
                                        "loss": round(losses[-1], 6)}))  # rank 0 only
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--devices", default=None,
                        help="run as a DeviceGroup in this process: 'cpu:2' (a count: "
                             "cpu:0 and cpu:1) or a list 'cpu:0,strict:0'")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.devices is not None:
        group = fs.DeviceGroup.parse(args.devices, timeout=60.0)
        print(f"{group} from --devices {args.devices}", file=sys.stderr)
        losses = group.run(train, [args] * group.size)[0]
    else:
        losses = train(fs.init(timeout=60.0).comm, args)
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
