"""``fuelspmd bench checkpoint``: each rank's peak memory while loading beside its shard
bytes, and the step time of training with an async save, a blocking save and none.

    [mpiexec -n N] fuelspmd bench checkpoint [--hidden 256] [--layers 4] [--tp N]
        [--rounds 3] [--dir DIR] [--json]

The model: ``--layers`` blocks (LayerNorm, a column-parallel ``h x 4h`` and a row-parallel
``4h x h`` linear) over tp (the world by default; the rest of the world is dp replicas),
AdamW after one step. It is saved, then loaded into a model built without values, with
``tracemalloc`` tracing: the peak above the start is what the load holds at once. A rank
must end up holding its shards (parameters and the two moments); beside them the table
shows the largest saved piece (what one read may add) and the bytes of the whole model
and state (what a load of full arrays on every rank would hold: the baseline).

Timing: ``--rounds`` rounds, each one step of each kind in turn (plain; with
``async_save``, which blocks for the host copy and the agreement; one more plain step
while that save writes; then, after waiting for it, a step with a blocking ``save``);
medians, and each kind's ratio to the plain step.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import checkpoint, nn, optim
from fuelspmd import tensor_parallel as tpl
from fuelspmd.bench import Column, median, parser, print_json, print_table
from fuelspmd.checkpoint.api import gather_json
from fuelspmd.checkpoint.layout import volume
from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import ConfigError
from fuelspmd.functional import gelu
from fuelspmd.mesh import Mesh

__all__ = ["main", "run"]


class _Block(nn.Module):
    def __init__(self, tp: Any, h: int, empty: bool, seed: int) -> None:
        kw: dict[str, Any] = {"empty": True} if empty else {}
        self.norm = nn.LayerNorm(h, device=tp.device, **kw)
        self.fc1 = tpl.ColumnParallelLinear(h, 4 * h, comm=tp,
                                            **(kw or {"seed": [seed, 0]}))
        self.fc2 = tpl.RowParallelLinear(4 * h, h, comm=tp, input_is_parallel=True,
                                         **(kw or {"seed": [seed, 1]}))

    def forward(self, x: Any) -> Any:
        return x + self.fc2(gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, tp: Any, h: int, layers: int, empty: bool) -> None:
        self.blocks = [_Block(tp, h, empty, i) for i in range(layers)]

    def forward(self, x: Any) -> Any:
        for b in self.blocks:
            x = b(x)
        return x


def _step(net: _Net, opt: optim.AdamW, x: fs.Tensor) -> None:
    loss = (net(x) ** 2).mean()
    opt.step(fs.grad(loss, opt.params))


def run(*, hidden: int, layers: int, tp: int | None, rounds: int, where: Path
        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-rank load rows and rank 0's timing (see the module docs)."""
    world = fs.init()
    mesh = Mesh(world, tp=tp or world.size)
    tpc = mesh.comm("tp")
    net = _Net(tpc, hidden, layers, empty=False)
    opt = optim.AdamW(net.parameters(), lr=1e-3)
    x = fs.tensor(np.random.default_rng(0).standard_normal((8, hidden)).astype(np.float32),
                  device=world.device)
    _step(net, opt, x)
    path = where / "ck"
    state = {"model": net, "optim": opt}
    checkpoint.save(path, state, mesh=mesh)

    fresh = _Net(tpc, hidden, layers, empty=True)
    fresh_opt = optim.AdamW(fresh.parameters(), lr=1e-3)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    checkpoint.load(path, {"model": fresh, "optim": fresh_opt}, mesh=mesh)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    ok = all(np.array_equal(p.numpy(), q.numpy())
             for p, q in zip(net.parameters(), fresh.parameters()))
    shard = sum(p.size * p.dtype.itemsize for p in fresh.parameters()) + \
        fresh_opt.state_bytes()
    full = 3 * sum(int(np.prod(p.full_shape)) * p.dtype.itemsize for p in net.parameters())
    index = json.loads((path / "index.json").read_text())
    largest = max(volume(tuple(map(tuple, pc["box"]))) * to_numpy(t["dtype"]).itemsize
                  for t in index["tensors"].values() for pc in t["pieces"])
    mine = {"rank": world.rank, "shard_bytes": shard, "largest_piece": largest,
            "load_peak": peak, "peak_ratio": peak / shard, "full_bytes": full, "equal": ok}
    rows = gather_json(world.comm, mine)

    times: dict[str, list[float]] = {k: [] for k in ("plain", "async", "during", "blocking")}
    for r in range(rounds):
        for kind in times:
            t0 = time.perf_counter()
            _step(net, opt, x)
            if kind == "async":
                handle = checkpoint.async_save(where / f"a{r}", state, mesh=mesh)
            elif kind == "blocking":
                checkpoint.save(where / f"b{r}", state, mesh=mesh)
            times[kind].append(time.perf_counter() - t0)
            if kind == "during":
                handle.wait()
    ms = {k: median(v) * 1e3 for k, v in times.items()}
    timing = {**{f"{k}_ms": v for k, v in ms.items()},
              **{f"{k}_ratio": ms[k] / ms["plain"] for k in ("async", "during", "blocking")}}
    world.comm.barrier()
    return rows, timing


def main(argv: list[str]) -> int:
    """Run the benchmark and print the tables (or JSON). Returns the exit code."""
    p = parser("fuelspmd bench checkpoint", __doc__)
    p.add_argument("--hidden", type=int, default=256, help="block width (256)")
    p.add_argument("--layers", type=int, default=4, help="blocks (4)")
    p.add_argument("--tp", type=int, default=None, help="tp size (the world)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (3)")
    p.add_argument("--dir", default=None, help="where to write (a temporary directory, "
                   "removed after; give a shared one under mpiexec across nodes)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    made = args.dir is None
    where = Path(tempfile.mkdtemp(prefix="fuelspmd-bench-ckpt-") if made else args.dir)
    try:
        if min(args.hidden, args.layers, args.rounds, 1 if args.tp is None else args.tp) < 1:
            raise ConfigError(f"bench checkpoint: --hidden, --layers, --rounds and --tp must "
                              f"be >= 1 (got {args.hidden}, {args.layers}, {args.rounds}, "
                              f"{args.tp})")
        if made and fs.init().size > 1:  # every rank must write into one directory
            where = Path(gather_json(fs.init().comm, str(where))[0])
        rows, timing = run(hidden=args.hidden, layers=args.layers, tp=args.tp,
                           rounds=args.rounds, where=where)
    except ConfigError as e:
        print(f"fuelspmd bench checkpoint: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if made and fs.init().rank == 0:
            shutil.rmtree(where, ignore_errors=True)
    if fs.init().rank != 0:
        return 0
    if args.json:
        print_json({"bench": "checkpoint", "hidden": args.hidden, "layers": args.layers,
                    "rows": rows, "timing": timing})
        return 0
    print_table(f"load: each rank's peak (tracemalloc) beside the shards it holds, "
                f"{args.layers} blocks of width {args.hidden} + AdamW",
                [Column("rank", "rank"), Column("shard bytes", "shard_bytes"),
                 Column("largest piece", "largest_piece"), Column("load peak", "load_peak"),
                 Column("peak/shard", "peak_ratio", "{:.2f}"),
                 Column("whole model+state", "full_bytes"), Column("equal", "equal")], rows)
    print_table(f"step time (median of {args.rounds} rounds, rank 0)",
                [Column("plain ms", "plain_ms", "{:.1f}"),
                 Column("async ms", "async_ms", "{:.1f}"),
                 Column("while writing ms", "during_ms", "{:.1f}"),
                 Column("blocking ms", "blocking_ms", "{:.1f}"),
                 Column("async/plain", "async_ratio", "{:.2f}"),
                 Column("writing/plain", "during_ratio", "{:.2f}"),
                 Column("blocking/plain", "blocking_ratio", "{:.2f}")], [timing])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
