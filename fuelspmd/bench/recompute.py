"""``fuelspmd bench recompute``: the peak bytes of one training step with and without
activation recomputation.

    fuelspmd bench recompute [--blocks 8] [--hidden 256] [--ffn 1024] [--batch 512]
        [--dtype float32] [--steps 3] [--json]
    mpiexec -n 2 fuelspmd bench recompute ...     # the MLPs tensor-parallel over 2 ranks

A stack of ``--blocks`` pre-norm residual blocks ``x + dropout(mlp(layer_norm(x)))`` (a
``ParallelMLP`` over the world's communicator), a mean-square loss and the gradients of
every parameter, realised as one graph: once keeping every block's activations for the
backward, once with ``block.recompute = True`` (each block's forward rerun in the
backward). Reported on rank 0: the graph executor's peak live bytes of the step (values it
allocated, gradients included; parameters and inputs are the caller's), the gradient bytes
(alive to the end either way), the step time (median of ``--steps`` after a warm-up) and the
largest difference between the two's gradients (zero: the same ops in the same order).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from fuelspmd.autograd import grad
from fuelspmd.bench import Column, median, parser, print_json, print_table
from fuelspmd.errors import ConfigError
from fuelspmd.functional import mse_loss
from fuelspmd.graph import default_executor
from fuelspmd.launch import init
from fuelspmd.nn import Dropout, DropoutRNG, LayerNorm, Module
from fuelspmd.tensor import Tensor, realize, tensor
from fuelspmd.tensor_parallel import ParallelMLP

__all__ = ["main", "run"]


class _Block(Module):
    def __init__(self, comm: Any, i: int, hidden: int, ffn: int, dtype: str,
                 rng: DropoutRNG) -> None:
        self.norm = LayerNorm(hidden, device=comm.device, dtype=dtype)
        self.mlp = ParallelMLP(hidden, ffn, comm=comm, seed=i, dtype=dtype)
        self.drop = Dropout(0.1, rng=rng, layer=i)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.mlp(self.norm(x)))


def _step(blocks: list[_Block], x: Tensor, y: Tensor) -> tuple[int, float, list[np.ndarray]]:
    t0 = time.perf_counter()
    h = x
    for b in blocks:
        h = b(h)
    loss = mse_loss(h, y)
    params = [p for b in blocks for p in b.parameters()]
    grads = grad(loss, params)
    realize(loss, *grads)
    ms = (time.perf_counter() - t0) * 1e3
    return default_executor().peak_bytes, ms, [g.numpy() for g in grads]


def run(comm: Any, *, blocks: int, hidden: int, ffn: int, batch: int, dtype: str,
        steps: int) -> list[dict[str, Any]]:
    """One row per mode: peak bytes, gradient bytes, median ms, max gradient difference."""
    rng = DropoutRNG(0)
    model = [_Block(comm, i, hidden, ffn, dtype, rng) for i in range(blocks)]
    g = np.random.default_rng(1)
    x = tensor(g.standard_normal((batch, hidden)).astype(dtype), device=comm.device)
    y = tensor(g.standard_normal((batch, hidden)).astype(dtype), device=comm.device)
    rows, ref = [], None
    for recompute in (False, True):
        for b in model:
            b.recompute = recompute
        times, peak, grads = [], 0, []
        for _ in range(steps + 1):
            peak, ms, grads = _step(model, x, y)
            times.append(ms)
        ref = grads if ref is None else ref
        rows.append({"recompute": recompute, "peak_bytes": peak,
                     "grad_bytes": sum(a.nbytes for a in grads), "ms": median(times[1:]),
                     "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(grads, ref))})
    return rows


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table (or JSON) on rank 0. Returns the exit code."""
    p = parser("fuelspmd bench recompute", __doc__)
    p.add_argument("--blocks", type=int, default=8, help="residual MLP blocks (8)")
    p.add_argument("--hidden", type=int, default=256, help="block width (256)")
    p.add_argument("--ffn", type=int, default=1024, help="MLP inner width (1024)")
    p.add_argument("--batch", type=int, default=512, help="rows (512)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up (3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    world = init(timeout=120.0)
    try:
        if min(args.blocks, args.hidden, args.ffn, args.batch, args.steps) < 1:
            raise ConfigError("bench recompute: --blocks, --hidden, --ffn, --batch and "
                              "--steps must be >= 1")
        rows = run(world.comm, blocks=args.blocks, hidden=args.hidden, ffn=args.ffn,
                   batch=args.batch, dtype=args.dtype, steps=args.steps)
    except ConfigError as e:
        print(f"fuelspmd bench recompute: {e}", file=sys.stderr, flush=True)
        return 2
    if world.rank != 0:
        return 0
    if args.json:
        print_json({"bench": "recompute", "tp": world.size, **{k: getattr(args, k) for k in
                    ("blocks", "hidden", "ffn", "batch", "dtype")}, "rows": rows})
        return 0
    print_table(f"one training step's peak bytes, {args.blocks} blocks {args.hidden}x"
                f"{args.ffn}, batch {args.batch}, {args.dtype}, tp {world.size} (ms: median "
                f"of {args.steps})",
                [Column("recompute", "recompute"), Column("peak bytes", "peak_bytes"),
                 Column("grad bytes", "grad_bytes"), Column("ms", "ms", "{:.1f}"),
                 Column("max |diff|", "max_diff", "{:.1e}")], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
