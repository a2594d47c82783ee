"""``fuelspmd bench optim``: optimiser memory per rank, AdamW beside ZeRO-1, at dp 1, 2, 4.

    fuelspmd bench optim [--hidden 512] [--layers 4] [--dtype float32] [--dp 1,2,4]
        [--steps 3] [--json]

One process, a ``DeviceGroup.cpu(dp)`` per dp size: every device holds the same model (the
parameters of ``--layers`` transformer blocks of width ``--hidden``: four ``h x h``
attention and two ``h x 4h`` MLP weights with their biases, two norms) and its own
gradients, and steps plain AdamW on the dp-mean gradient (the baseline: what data
parallelism without ZeRO holds on every rank) and ZeRO1(AdamW) on its own gradients.

Reported per dp: each one's optimiser bytes on one rank (state tensors and master weights,
``Optimizer.state_bytes``), their ratio (target ``1/dp`` plus the padding of the last
slice of each bucket), the parameter bytes beside them, the step time of each (median of
``--steps`` after a warm-up step; in a DeviceGroup the devices share the cores, so the
times compare the two at one dp, not across dp), and the largest difference between the
two's parameters after the steps: zero in float32 (ZeRO-1 changes where the state lives,
not the math); for 16-bit parameters the rounding of the mean gradient differs (the
baseline averages in the 16-bit dtype, ZeRO-1 reduce-scatters in float32).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from fuelspmd.bench import Column, median, parser, print_json, print_table
from fuelspmd.comm import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError
from fuelspmd.nn import Parameter
from fuelspmd.optim import AdamW, Optimizer, ZeRO1
from fuelspmd.tensor import realize, tensor

__all__ = ["main", "model_shapes", "run"]


def model_shapes(hidden: int, layers: int) -> list[tuple[int, ...]]:
    """The parameter shapes of ``layers`` pre-norm transformer blocks of width ``hidden``."""
    h = hidden
    block = [(h,), (h,)] + [(h, h), (h,)] * 4 + [(h,), (h,), (h, 4 * h), (4 * h,),
                                                  (4 * h, h), (h,)]
    return block * layers


def _arrays(shapes: list[tuple[int, ...]], seed: int, dt: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 0.02).astype(dt) for s in shapes]


def _device(comm: Communicator, shapes: list[tuple[int, ...]], dtype: str, steps: int
            ) -> dict[str, Any]:
    """One dp rank: ``steps + 1`` steps of each optimiser; bytes, times, parameters."""
    dt = as_dtype(dtype)
    np_dt = np.float32 if dt.itemsize < 4 else np.dtype(dt.name)
    init = _arrays(shapes, 0, np_dt)
    out: dict[str, Any] = {}
    for kind in ("adamw", "zero1"):
        params = [Parameter(tensor(a, device=comm.device, dtype=dt)) for a in init]
        opt: Optimizer | ZeRO1 = AdamW(params, lr=1e-3)
        if kind == "zero1":
            opt = ZeRO1(opt, dp=comm)
        took = []
        for step in range(steps + 1):
            grads = [tensor(g, device=comm.device, dtype=dt)
                     for g in _arrays(shapes, 1 + 1000 * step + comm.rank, np_dt)]
            t0 = time.perf_counter()
            if kind == "adamw":  # plain data parallelism: the mean, then the whole update
                grads = [comm.all_reduce(g, "avg") for g in grads]
                realize(*grads)
                opt.step(grads)
            else:
                opt.step(grads)
            took.append(time.perf_counter() - t0)
        out[kind] = {"bytes": opt.state_bytes(), "ms": median(took[1:]) * 1e3,
                     "params": [p.numpy().astype(np.float64) for p in params]}
    out["param_bytes"] = sum(int(np.prod(s)) for s in shapes) * dt.itemsize
    return out


def run(*, hidden: int, layers: int, dtype: str, dps: list[int], steps: int
        ) -> list[dict[str, Any]]:
    """One row per dp size (see the module docs)."""
    shapes = model_shapes(hidden, layers)
    rows = []
    for dp in dps:
        outs = DeviceGroup.cpu(dp, timeout=600.0).run(
            lambda c: _device(c, shapes, dtype, steps))
        a, z = outs[0]["adamw"], outs[0]["zero1"]
        diff = max(float(np.abs(x - y).max()) for o in outs
                   for x, y in zip(o["adamw"]["params"], o["zero1"]["params"]))
        rows.append({"dp": dp, "params": len(shapes), "param_bytes": outs[0]["param_bytes"],
                     "adamw_bytes": a["bytes"], "zero1_bytes": z["bytes"],
                     "ratio": z["bytes"] / a["bytes"], "adamw_ms": a["ms"],
                     "zero1_ms": z["ms"], "max_diff": diff})
    return rows


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table (or JSON). Returns the exit code."""
    p = parser("fuelspmd bench optim", __doc__)
    p.add_argument("--hidden", type=int, default=512, help="block width (512)")
    p.add_argument("--layers", type=int, default=4, help="blocks (4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter dtype; 16-bit ones keep float32 master weights")
    p.add_argument("--dp", default="1,2,4", help="dp sizes, comma-separated (1,2,4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up (3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        dps = [int(d) for d in args.dp.split(",")]
        if min(dps) < 1 or args.hidden < 1 or args.layers < 1 or args.steps < 1:
            raise ConfigError(f"bench optim: --dp sizes, --hidden, --layers and --steps must "
                              f"be >= 1 (got {args.dp}, {args.hidden}, {args.layers}, "
                              f"{args.steps})")
        rows = run(hidden=args.hidden, layers=args.layers, dtype=args.dtype, dps=dps,
                   steps=args.steps)
    except (ConfigError, ValueError) as e:
        print(f"fuelspmd bench optim: {e}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print_json({"bench": "optim", "hidden": args.hidden, "layers": args.layers,
                    "dtype": args.dtype, "rows": rows})
        return 0
    print_table(f"optimiser bytes per rank, AdamW vs ZeRO-1, {args.layers} blocks of width "
                f"{args.hidden}, {args.dtype} (DeviceGroup.cpu(dp); ms: median of "
                f"{args.steps} steps)",
                [Column("dp", "dp"), Column("param bytes", "param_bytes"),
                 Column("adamw bytes", "adamw_bytes"), Column("zero1 bytes", "zero1_bytes"),
                 Column("zero1/adamw", "ratio", "{:.3f}"),
                 Column("adamw ms", "adamw_ms", "{:.1f}"), Column("zero1 ms", "zero1_ms",
                                                                   "{:.1f}"),
                 Column("max |diff|", "max_diff", "{:.1e}")], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
