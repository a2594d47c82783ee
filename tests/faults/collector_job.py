"""Interleaved pipeline transfers at tp 2 x pp 2 under varied garbage-collector timing.

    mpiexec -n 4 python collector_job.py VARIANT [VARIANT ...] [--steps N] [--train]

Each pipeline pair (the pp group of each tp rank) runs steps of an interleaved schedule's
batched transfers, as Megatron's ``send_forward_backward_recv_forward_backward`` posts
them: both receives of a step (a chunk's activation and another chunk's gradient, from the
one peer of pp 2) posted ahead, then the sends and waits, with a tensor-parallel
all_reduce as each stage's compute. Pipeline rank 0 waits for the gradient before it sends
its own, so pipeline rank 1 waits in the first of its two posted receives while rank 0
computes, and rank 0 waits in its receive while rank 1 computes: where a wait passes the
guard's slice decides which notes are sent and when they are read. The collector decides
that here, one VARIANT at a time:

- ``collect``: ``gc.collect()`` over a heap large enough that one takes several slices,
  at the compute points (pipeline rank 0 before its first send, rank 1 after its first
  receive);
- ``threshold1``: ``gc.set_threshold(1)``, a collection at almost every allocation;
- ``threshold0``: ``gc.set_threshold(0)``, the collector off;
- ``inwait``: a thread runs ``gc.collect()`` over that heap whenever the main thread is in
  a guard's wait (the collection holds the interpreter, so the wait stalls inside it).

Every value received is checked. ``--train`` then runs ``examples/train.py --schedule
interleaved`` (tp 2 x pp 2, its ``fuelspmd.models`` import at the top) under each
variant. Prints ``VARIANT <name> ok`` per variant on rank 0; any error ends the job.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import fuelspmd as fs
from fuelspmd.tensor import realize
from fuelspmd.transport import WATCH_S

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("collect", "threshold1", "threshold0", "inwait")
_DEFAULT = gc.get_threshold()


_HEAP: list[list[int]] = []


def big_heap() -> list[list[int]]:
    """Objects enough that a full collection takes at least three of the guard's slices
    (made once, kept for the variants after)."""
    heap = _HEAP
    while len(heap) < 8_000_000:
        heap.extend([i] for i in range(500_000))
        start = time.monotonic()
        gc.collect()
        if time.monotonic() - start > 3 * WATCH_S:
            break
    return heap


def _in_guard_wait(frame: object) -> bool:
    while frame is not None:
        code = frame.f_code  # type: ignore[attr-defined]
        if code.co_name == "wait_work" and "fuelspmd/comm" in code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[attr-defined]
    return False


def variant(name: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """Set the collector up for ``name``; return (what a compute point runs, the undo)."""
    if name == "threshold1":
        gc.set_threshold(1)
        return lambda: None, lambda: gc.set_threshold(*_DEFAULT)
    if name == "threshold0":
        gc.set_threshold(0)
        return lambda: None, lambda: gc.set_threshold(*_DEFAULT)
    big_heap()
    if name == "collect":
        return gc.collect, lambda: None
    main, stop = threading.main_thread().ident, threading.Event()

    def collect_in_waits() -> None:
        last = 0.0
        while not stop.wait(0.002):
            if time.monotonic() - last > 4 * WATCH_S and _in_guard_wait(
                    sys._current_frames().get(main)):
                gc.collect()
                last = time.monotonic()

    helper = threading.Thread(target=collect_in_waits, daemon=True)
    helper.start()

    def undo() -> None:
        stop.set()
        helper.join()

    return lambda: None, undo


def _act(step: int, rank: int) -> float:
    """The activation pipeline rank ``rank`` sends at ``step``: its tp pair's all_reduce."""
    return 2.0 * (100 * step + 10 * rank) + 1


def transfers(world: fs.World, steps: int, compute: Callable[[], None]) -> None:
    """The batched transfers of ``steps`` interleaved steps on each pipeline pair."""
    mesh = fs.Mesh(world, tp=2, pp=2)
    pp, tp = mesh.comm("pp"), mesh.comm("tp")
    me, peer = pp.rank, 1 - pp.rank
    shape = (8, 16)
    for step in range(steps):
        base = float(100 * step + 10 * me + tp.rank)
        act = pp.recv(shape, "float32", peer)
        grad = pp.recv(shape, "float32", peer)
        pp.post(act, grad)  # both of the step's receives from the one peer, ahead
        x = fs.tensor(np.full(shape, base, np.float32))
        if me == 0:
            compute()
        y = tp.all_reduce(x)  # the stage: its tp all_reduce
        sent = [pp.send(y, peer)]
        pp.post(*sent)
        a = act.numpy()
        if me == 1:
            compute()
        g = tp.all_reduce(fs.tensor(a)) if me == 1 else None
        if me == 0:  # waits for the gradient before it sends its own
            got = grad.numpy()
            sent.append(pp.send(fs.tensor(np.full(shape, base, np.float32)), peer))
            pp.post(sent[-1])
        else:
            assert g is not None
            sent.append(pp.send(g, peer))
            pp.post(sent[-1])
            got = grad.numpy()
        realize(*sent)
        np.testing.assert_array_equal(a, np.full(shape, _act(step, peer), np.float32))
        # pipeline rank 1 sends the tp all_reduce of the activation it got, rank 0 its base
        expect_grad = 2 * _act(step, 0) if me == 0 else 100.0 * step + tp.rank
        np.testing.assert_array_equal(got, np.full(shape, expect_grad, np.float32))
    world.comm.barrier()


def train_example() -> Callable[[list[str]], int]:
    """``examples/train.py``'s ``main``, loaded as a module."""
    spec = importlib.util.spec_from_file_location("train_example", REPO / "examples" /
                                                  "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("variants", nargs="+", choices=VARIANTS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--train", action="store_true")
    args = p.parse_args()
    world = fs.init(timeout=30)
    if world.size != 4:
        raise SystemExit(f"collector_job.py runs tp 2 x pp 2: start 4 ranks, not {world.size}")
    train = train_example() if args.train else None
    for name in args.variants:
        compute, undo = variant(name)
        start = time.monotonic()
        try:
            transfers(world, args.steps, compute)
            if train is not None:
                code = train(["--schedule", "interleaved", "--steps", str(args.steps),
                              "--timeout", "30"])
                assert code == 0, f"examples/train.py exited {code}"
        finally:
            undo()
        world.print(f"VARIANT {name} ok in {time.monotonic() - start:.1f} s")
    _HEAP.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
