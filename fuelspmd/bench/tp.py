"""``fuelspmd bench tp``: a tensor-parallel MLP step at TP N against TP 1.

    fuelspmd bench tp [--tp 2] [--batch 64] [--hidden 1024] [--ffn 8192] [--rounds 10] [--json]
    mpiexec -n 2 fuelspmd bench tp      # ranks as processes (TP = world size)

One step is the forward and backward of ``ParallelMLP(hidden, ffn)`` (column-parallel,
tanh-GELU, row-parallel; float32) on a ``(batch, hidden)`` input with an MSE loss: the
loss and the gradients of the input and of every parameter shard, realised as one graph.
The total work is the same at every TP degree; each rank does 1/N of the matmuls. BLAS
gets one thread per rank (threadpoolctl), so TP N can use N cores and TP 1 one: on two
cores the limit of the speedup is 2x.

In one process (the default) TP N is a ``DeviceGroup.cpu(N)`` and TP 1 a
``DeviceGroup.cpu(1)``. Under mpiexec TP N is the world and TP 1 is rank 0 running the
whole step alone while the other ranks wait; rank 0's times are reported. Three
candidates are interleaved round by round:

- ``tp1``: the step at TP 1; ``tpN``: the step at TP N;
- ``comm``: only the step's collectives at TP N (the forward all_reduce of the row layer's
  ``(batch, hidden)`` output and the backward all_reduce of dX), on the same group.

Reported: ``speedup`` = median of paired tp1/tpN ratios (target >= 1.7 at TP 2 on two
cores) and ``comm_share`` = median of paired comm/tpN ratios, the share of step time
spent in communication when it is not overlapped with compute.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fuelspmd.autograd import grad
from fuelspmd.bench import Column, interleave, median, parser, print_json, print_table
from fuelspmd.comm.communicator import Communicator
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError
from fuelspmd.functional import mse_loss
from fuelspmd.launch import detect_launcher, init
from fuelspmd.tensor import realize, tensor
from fuelspmd.tensor_parallel import ParallelMLP
from fuelspmd.transport import SelfTransport

__all__ = ["main", "run"]


class _Step:
    """One rank's MLP step: built once (weights from one seed), called per round."""

    def __init__(self, comm: Communicator, batch: int, hidden: int, ffn: int) -> None:
        self.comm = comm
        self.mlp = ParallelMLP(hidden, ffn, comm=comm, seed=0)
        rng = np.random.default_rng(1)
        self.x = tensor(rng.standard_normal((batch, hidden)).astype(np.float32),
                        device=comm.device)
        self.y = tensor(rng.standard_normal((batch, hidden)).astype(np.float32),
                        device=comm.device)
        self.part = tensor(np.ones((batch, hidden), np.float32), device=comm.device)

    def __call__(self) -> float:
        loss = mse_loss(self.mlp(self.x), self.y)
        grads = grad(loss, [self.x, *self.mlp.parameters()])
        realize(loss, *grads)
        return float(loss.numpy())

    def collectives(self) -> None:
        """The step's two all_reduces alone, same shapes."""
        realize(self.comm.all_reduce(self.part), self.comm.all_reduce(self.part))


def _self_comm(device: Any) -> Communicator:
    return Communicator(SelfTransport(), device=device)


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    def once() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return once


def run(*, tp: int, batch: int, hidden: int, ffn: int, rounds: int,
        world: Any = None) -> dict[str, Any]:
    """Time TP 1, TP ``tp`` and the collectives alone, interleaved; return the medians."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        if world is None:
            one, many = DeviceGroup.cpu(1), DeviceGroup.cpu(tp)
            steps1 = one.run(lambda c: _Step(c, batch, hidden, ffn))
            stepsn = many.run(lambda c: _Step(c, batch, hidden, ffn))
            loss1 = one.run(lambda c: steps1[0]())[0]
            lossn = many.run(lambda c: stepsn[c.rank]())[0]
            cand = {"tp1": _timed(lambda: one.run(lambda c: steps1[0]())),
                    "tpN": _timed(lambda: many.run(lambda c: stepsn[c.rank]())),
                    "comm": _timed(lambda: many.run(lambda c: stepsn[c.rank].collectives()))}
        else:
            comm = world.comm
            # TP 1 is rank 0 alone with the whole model while the others wait: one rank
            # beside N, with no second copy of the step competing for memory bandwidth
            s1 = _Step(_self_comm(comm.device), batch, hidden, ffn) if comm.rank == 0 \
                else None
            sn = _Step(comm, batch, hidden, ffn)
            lossn = sn()
            loss1 = s1() if s1 is not None else lossn

            def fenced(fn: Callable[[], object]) -> Callable[[], None]:
                def body() -> None:
                    comm.barrier()  # every rank starts together
                    fn()
                    comm.barrier()
                return body

            cand = {"tp1": _timed(fenced(s1 if s1 is not None else (lambda: None))),
                    "tpN": _timed(fenced(sn)), "comm": _timed(fenced(sn.collectives))}
        if not np.isclose(loss1, lossn, rtol=1e-4):
            raise RuntimeError(f"bench tp: the TP {tp} loss {lossn} differs from the TP 1 "
                               f"loss {loss1}; the layers are wrong")
        cand["tp1"]()  # warm: plans cached, buffers pooled
        cand["tpN"]()
        times = interleave(cand, count=rounds)
    t1, tn, tc = times["tp1"], times["tpN"], times["comm"]
    flops = 3 * 2 * 2 * batch * hidden * ffn  # two matmuls, each forward + two backward
    return {"tp": tp, "batch": batch, "hidden": hidden, "ffn": ffn, "rounds": rounds,
            "mode": "group" if world is None else "mpi",
            "tp1_ms": median(t1) * 1e3, "tpN_ms": median(tn) * 1e3,
            "comm_ms": median(tc) * 1e3,
            "tp1_gflops": flops / median(t1) / 1e9, "tpN_gflops": flops / median(tn) / 1e9,
            "speedup": median([a / b for a, b in zip(t1, tn)]),
            "comm_share": median([c / b for c, b in zip(tc, tn)])}


def main(argv: list[str]) -> int:
    """Run the benchmark and print the table (or JSON). Returns the exit code."""
    p = parser("fuelspmd bench tp", __doc__)
    p.add_argument("--tp", type=int, default=2, help="TP degree in one process (2); under "
                   "mpiexec the world size")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per candidate (10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    world = init(timeout=600.0) if detect_launcher().size > 1 else None
    try:
        if args.tp < 1 or args.rounds < 1:
            raise ConfigError(f"bench tp: --tp and --rounds must be >= 1 (got {args.tp}, "
                              f"{args.rounds})")
        res = run(tp=world.size if world else args.tp, batch=args.batch,
                  hidden=args.hidden, ffn=args.ffn, rounds=args.rounds, world=world)
    except ConfigError as e:
        print(f"fuelspmd bench tp: {e}", file=sys.stderr, flush=True)
        return 2
    if world is not None and world.rank != 0:
        return 0
    if args.json:
        print_json({"bench": "tp", **res})
        return 0
    print_table(f"ParallelMLP {res['hidden']}->{res['ffn']}->{res['hidden']}, batch "
                f"{res['batch']}, float32, fwd+bwd, 1 BLAS thread per rank ({res['mode']}; "
                f"median of {res['rounds']} interleaved rounds)",
                [Column("TP1 ms", "tp1_ms", "{:.1f}"), Column(f"TP{res['tp']} ms", "tpN_ms",
                                                               "{:.1f}"),
                 Column("speedup", "speedup", "{:.2f}"),
                 Column("comm ms", "comm_ms", "{:.2f}"),
                 Column("comm share", "comm_share", "{:.1%}"),
                 Column("TP1 GFLOP/s", "tp1_gflops", "{:.1f}"),
                 Column(f"TP{res['tp']} GFLOP/s", "tpN_gflops", "{:.1f}")], [res])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
