"""``fuelspmd bench compile``: the host time of a compiled step of about 1,000 graph nodes.

    fuelspmd bench compile [--layers 26] [--width 8] [--rounds 7] [--calls 50] [--json]

The step: an MLP of ``--layers`` layers (matmul, bias, GELU) of width ``--width`` on a batch
of 4, its MSE loss, backward and an SGD update (about 38 nodes a layer), on arrays so
small that the kernels cost little beside the Python around them. Three candidates, in
interleaved rounds of ``--calls`` calls: the step uncompiled (it builds its graph and
finds its plans every call), compiled (a replay), and the compiled step's plans alone
(the same kernels run directly over prepared buffers: what any execution of the plans
costs), and the replay with a stand-in that runs no plan: its host time alone (binding
the arguments and the state, handing out the outputs, updating the state in place).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import functional as F
from fuelspmd import graph, nn, optim
from fuelspmd.bench import Column, interleave, median, parser, print_json, print_table, time_calls
from fuelspmd.graph.executor import default_executor
from fuelspmd.graph.plan import Memory

__all__ = ["main", "make_step", "nodes_of"]


def make_step(layers: int, width: int, seed: int = 0) -> tuple[Any, list[nn.Parameter]]:
    """``step(x, t) -> loss`` of the module docstring, and its parameters."""
    rng = np.random.default_rng(seed)
    params = []
    for _ in range(layers):
        params.append(nn.Parameter(fs.tensor((rng.standard_normal((width, width)) * 0.3)
                                             .astype(np.float32))))
        params.append(nn.Parameter(fs.tensor(np.zeros(width, np.float32))))
    opt = optim.SGD(params, lr=1e-3)

    def step(x: fs.Tensor, t: fs.Tensor) -> fs.Tensor:
        h = x
        for i in range(layers):
            h = F.gelu(h @ params[2 * i] + params[2 * i + 1])
        loss = F.mse_loss(h, t)
        opt.step(fs.grad(loss, params))
        return loss

    return step, params


def nodes_of(layers: int, width: int) -> int:
    """Graph nodes one uncompiled step builds (forward, backward, update), counted by
    lowering them without running."""
    _, params = make_step(layers, width)
    x, t = (fs.tensor(np.ones((4, width), np.float32)) for _ in range(2))
    h = x
    for i in range(layers):
        h = F.gelu(h @ params[2 * i] + params[2 * i + 1])
    loss = F.mse_loss(h, t)
    grads = fs.grad(loss, params)
    news = [p + g * -1e-3 for p, g in zip(params, grads)]
    sigs, _, _ = graph.lower([loss.node, *(n.node for n in news)])
    return sum(1 for op, *_ in sigs if op.kind != "leaf")


def main(argv: list[str] | None = None) -> int:
    p = parser("fuelspmd bench compile", __doc__ or "")
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--json", action="store_true")
    try:
        args = p.parse_args(argv)
        if min(args.layers, args.width, args.rounds, args.calls) < 1:
            raise ValueError("--layers, --width, --rounds and --calls must be at least 1")
    except ValueError as e:
        print(f"fuelspmd bench compile: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return int(e.code or 0)
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(1)
    x, t = (fs.tensor(rng.standard_normal((4, args.width)).astype(np.float32))
            for _ in range(2))
    plain, _ = make_step(args.layers, args.width)
    fn, _ = make_step(args.layers, args.width)
    compiled = fs.compile(fn)
    with threadpool_limits(1):
        for _ in range(4):
            plain(x, t).numpy()
            compiled(x, t).numpy()
        replay = next(iter(compiled._entries.values())).replay
        if replay is None:
            print("fuelspmd bench compile: the step was not captured", file=sys.stderr)
            return 1
        run_values = default_executor().run_values
        args_ = [x.node.buffer, t.node.buffer]
        cells = [r().buffer for r in replay.cells]  # type: ignore[union-attr]
        held = [r().buffer for r in replay.held]  # type: ignore[union-attr]
        # the plans as traced (those the replay runs write and free the state's buffers,
        # which the same buffers fed again would alias), their buffers kept as a replay's
        memory = Memory(replay.memory.caps)
        fixed = [(plan if plain is None else plain[0],
                  [(v, kind == 1, a, b) if kind == 1 else
                   (v, False, args_[a] if kind == 0 else cells[a] if kind == 2 else
                    held[a] if kind == 3 else a, 0) for v, kind, a, b in feeds])
                 for (plan, feeds), plain in zip(replay.segments, replay.plain)]

        def plans_alone() -> list[list[Any]]:
            """The captured plans over buffers found once: kernels and the step loop."""
            results: list[list[Any]] = []
            for plan, feeds in fixed:
                vals: list[Any] = [None] * plan.n_values
                for v, earlier, a, b in feeds:
                    vals[v] = results[a][b] if earlier else a
                results.append(run_values(plan, vals, memory))
            return results

        # each plan's outputs of one run: what the stand-in hands the replay
        outs = {id(plan): res for (plan, _), res in zip(replay.segments, plans_alone())}

        def stand_in(plan: Any, vals: list[Any], mem: Any) -> list[Any]:
            return outs[id(plan)]

        tensors = [x, t]
        times = interleave({
            "uncompiled": lambda: time_calls(lambda: plain(x, t), args.calls),
            "compiled": lambda: time_calls(lambda: compiled(x, t), args.calls),
            "plans": lambda: time_calls(plans_alone, args.calls),
            "host": lambda: time_calls(lambda: replay.run(tensors, stand_in), args.calls),
        }, count=args.rounds)
    med = {k: median(v) for k, v in times.items()}
    row = {"nodes": nodes_of(args.layers, args.width), "segments": len(replay.segments),
           "uncompiled_us": med["uncompiled"] * 1e6, "compiled_us": med["compiled"] * 1e6,
           "plans_us": med["plans"] * 1e6,
           "host_us": med["host"] * 1e6,
           "compiled_vs_uncompiled": med["compiled"] / med["uncompiled"]}
    if args.json:
        print_json({"bench": "compile", "rows": [row]})
        return 0
    print_table("a compiled step of small arrays: medians of interleaved rounds", [
        Column("nodes", "nodes"), Column("segments", "segments"),
        Column("uncompiled us", "uncompiled_us", "{:.0f}"),
        Column("compiled us", "compiled_us", "{:.0f}"),
        Column("plans alone us", "plans_us", "{:.0f}"),
        Column("replay host us", "host_us", "{:.1f}"),
        Column("compiled/uncompiled", "compiled_vs_uncompiled", "{:.3f}")], [row])
    return 0
