"""The programs of the checkpoint tests: a small tp x pp model, its state filled from a
pure function of each tensor's global name, saved, killed, loaded in other layouts and
checked against that function; and a training run that saves, dies and resumes.

Run under ``mpiexec`` (tests/mpi/test_checkpoint.py, tests/faults/test_checkpoint_kill.py),
in one process, or per device of a DeviceGroup (tests/unit/test_checkpoint.py)::

    python tests/checkpoint_programs.py save --path P --tp 2 --pp 2 [--hold FILE --version V]
    python tests/checkpoint_programs.py load --path P --tp 4
    python tests/checkpoint_programs.py kill --path P --tp 2 --rank 1 --at 'shard opened'
    python tests/checkpoint_programs.py train --steps 6 --tp 2 --dp 2 [--save-at 3 --path P]
    python tests/checkpoint_programs.py loop --path RUN --tp 2 --pp 2 --pids DIR [--async]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fuelspmd as fs
from fuelspmd import checkpoint, nn, optim
from fuelspmd import tensor_parallel as tpl
from fuelspmd.functional import gelu
from fuelspmd.mesh import Mesh

D, H, F, L = 4, 8, 16, 4  # input width, width, MLP width (tp 1, 2, 4 divide them), blocks
B = 8  # batch of the training run (dp 1, 2, 4 divide it)
STATES = ("exp_avg", "exp_avg_sq")


def full(key: str, shape: Sequence[int], version: int) -> np.ndarray:
    """The whole value of the tensor named ``key`` in state ``version`` (positive for a
    second moment)."""
    x = np.random.default_rng([version, *key.encode()]).standard_normal(tuple(shape)) * 0.5
    return (np.abs(x) if key.endswith("exp_avg_sq") else x).astype(np.float32)


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): fc1 column-parallel, fc2 row-parallel, norm replicated."""

    def __init__(self, tp: Any) -> None:
        self.norm = nn.LayerNorm(H, empty=True, device=tp.device)
        self.fc1 = tpl.ColumnParallelLinear(H, F, comm=tp, empty=True)
        self.fc2 = tpl.RowParallelLinear(F, H, comm=tp, input_is_parallel=True, empty=True)

    def forward(self, x: Any) -> Any:
        return x + self.fc2(gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Stage ``stage`` of ``pp``: its blocks keyed by global index; the input layer on the
    first stage, the head on the last (one stage: the whole model)."""

    def __init__(self, tp: Any, stage: int = 0, pp: int = 1) -> None:
        if stage == 0:
            self.inp = nn.Linear(D, H, empty=True, device=tp.device)
        per = L // pp
        self.blocks = {str(i): Block(tp) for i in range(stage * per, (stage + 1) * per)}
        if stage == pp - 1:
            self.head = nn.Linear(H, 1, empty=True, device=tp.device)

    def forward(self, x: Any) -> Any:
        h = self.inp(x)
        for b in self.blocks.values():
            h = b(h)
        return self.head(h)


def build(comm: Any, tp: int, pp: int = 1, zero: bool = False
          ) -> tuple[Mesh, Net, optim.Optimizer | optim.ZeRO1]:
    mesh = Mesh(comm, tp=tp, pp=pp)
    net = Net(mesh.comm("tp"), mesh.coord("pp"), pp)
    opt: optim.Optimizer | optim.ZeRO1 = optim.AdamW(net.parameters(), lr=1e-2)
    if zero:
        opt = optim.ZeRO1(opt, dp=mesh.comm("dp"), bucket_bytes=256)
    return mesh, net, opt


def names_of(net: Net) -> list[str]:
    return [f"model/{n}" for n, _ in net.named_parameters()]


def zero_slices(zero: optim.ZeRO1, keys: list[str], version: int) -> list[dict[str, Any]]:
    """This dp rank's slice of every bucket of each state, from ``full``."""
    out = []
    for b in zero.buckets:
        d = {}
        for s in STATES:
            flat = np.zeros(b.padded, np.float32)
            for i, off, n in zip(b.index, b.offsets, b.sizes):
                p = zero.params[i]
                flat[off:off + n] = p.spec.shard(full(f"optim/{keys[i]}/{s}", p.full_shape,
                                                      version)).reshape(-1)
            r = zero.dp.rank
            d[s] = flat[r * b.shard:(r + 1) * b.shard]
        out.append(d)
    return out


def fill_params(net: Net, version: int) -> None:
    """Every parameter from ``full`` (each rank keeps its block)."""
    for key, p in zip(names_of(net), net.parameters()):
        p.assign(np.ascontiguousarray(p.spec.shard(full(key, p.full_shape, version))))


def fill(net: Net, opt: Any, version: int) -> None:
    """Every parameter and optimiser state from ``full``."""
    fill_params(net, version)
    keys = names_of(net)
    if isinstance(opt, optim.ZeRO1):
        opt.load_state_dict({"steps": 3 + version, "dp": (opt.dp.rank, opt.dp.size),
                             "layout": [(list(b.index), b.shard) for b in opt.buckets],
                             "shards": [None] * len(opt.buckets),
                             "state": zero_slices(opt, keys, version)})
        return
    opt.load_state_dict({"steps": 3 + version, "master": [None] * len(keys), "state": [
        {s: p.spec.shard(full(f"optim/{k}/{s}", p.full_shape, version)) for s in STATES}
        for k, p in zip(keys, opt.params)]})


def check(net: Net, opt: Any, version: int) -> int:
    """Assert every parameter and state tensor equals ``full`` of ``version``; return how
    many were compared."""
    keys, n = names_of(net), 0
    for key, p in zip(keys, net.parameters()):
        np.testing.assert_array_equal(p.numpy(), p.spec.shard(full(key, p.full_shape, version)),
                                      err_msg=key)
        n += 1
    assert opt.steps == 3 + version, (opt.steps, version)
    if isinstance(opt, optim.ZeRO1):
        for k, (want, st) in enumerate(zip(zero_slices(opt, keys, version), opt.state)):
            for s in STATES:
                np.testing.assert_array_equal(st[s].numpy(), want[s], err_msg=f"bucket {k} {s}")
                n += 1
        return n
    for k, p, st in zip(keys, opt.params, opt.state):
        for s in STATES:
            np.testing.assert_array_equal(
                st[s].numpy(), p.spec.shard(full(f"optim/{k}/{s}", p.full_shape, version)),
                err_msg=f"{k} {s}")
            n += 1
    return n


def save_state(comm: Any, path: str, tp: int, pp: int, zero: bool, version: int = 1,
               **kw: Any) -> None:
    mesh, net, opt = build(comm, tp, pp, zero)
    fill(net, opt, version)
    checkpoint.save(path, {"model": net, "optim": opt, "version": version}, mesh=mesh, **kw)


def load_state(comm: Any, path: str, tp: int, zero: bool = False) -> tuple[int, int]:
    """Load ``path`` at tp ``tp`` x pp 1; (the version it holds, tensors compared)."""
    mesh, net, opt = build(comm, tp, 1, zero)
    values = checkpoint.load(path, {"model": net, "optim": opt}, mesh=mesh)
    return values["version"], check(net, opt, values["version"])


def killer(rank: int, at: str) -> Callable[[str], None]:
    """A save hook that SIGKILLs this process at the first point matching ``at`` (regex)."""
    def hook(point: str) -> None:
        if re.search(at, point):
            print(f"rank {rank} killed at {point!r}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def loop(world: Any, args: argparse.Namespace) -> None:
    """Save versions 1, 2, ... to ``RUN/step-<v>`` (keep=2) until killed, each rank having
    written its pid to ``DIR/<rank>``; rank 0 prints ``committed <v>`` once a save has
    returned (``--async``: async_save, a step's worth of work, then wait)."""
    os.makedirs(args.pids, exist_ok=True)
    with open(os.path.join(args.pids, str(world.rank)), "w") as f:
        f.write(str(os.getpid()))
    mesh, net, opt = build(world.comm, args.tp, args.pp, args.zero)
    for version in range(1, args.steps + 1):
        fill(net, opt, version)
        state = {"model": net, "optim": opt, "version": version}
        where = os.path.join(args.path, f"step-{version}")
        if args.background:
            handle = checkpoint.async_save(where, state, mesh=mesh, keep=2)
            fill(net, opt, version + 1)  # the next step changes the model meanwhile
            handle.wait()
        else:
            checkpoint.save(where, state, mesh=mesh, keep=2)
        if world.rank == 0:
            print(f"committed {version}", flush=True)


def train(world: Any, args: argparse.Namespace) -> None:
    """``args.steps`` AdamW (ZeRO-1 over dp) steps of MSE on batches from one seeded
    Generator; prints each step's loss (float.hex) on rank 0. ``--save-at k``: async save
    after k steps, one more step while it writes, then SIGKILL. ``--resume P``: start
    from P (model, optimiser, step, data position, Generator state)."""
    mesh, net, opt = build(world.comm, args.tp, 1, args.dp > 1)
    fill_params(net, 0)
    rng, start, seen = np.random.default_rng(1234), 0, 0
    state = {"model": net, "optim": opt}
    if args.resume:
        values = checkpoint.load(args.resume, state, mesh=mesh)
        rng.bit_generator.state = values["rng"]
        start, seen = values["step"], values["seen"]
        assert seen == start * B
    dp, r = mesh.shape["dp"], mesh.coord("dp")
    handle = None
    for step in range(start, args.steps):
        if step == args.save_at:
            handle = checkpoint.async_save(
                args.path, {**state, "step": step, "seen": seen,
                            "rng": rng.bit_generator.state}, mesh=mesh)
        x = rng.standard_normal((B, D)).astype(np.float32)
        y = rng.standard_normal((B, 1)).astype(np.float32)
        seen += B
        part = slice(r * B // dp, (r + 1) * B // dp)
        out = net(fs.tensor(x[part], device=world.device))
        loss = ((out - fs.tensor(y[part], device=world.device)) ** 2).mean()
        grads = fs.grad(loss, opt.params)
        shown = mesh.comm("dp").all_reduce(loss, "avg") if dp > 1 else loss
        opt.step(grads)
        if world.rank == 0:
            print(f"loss {step} {float(shown.numpy()).hex()}", flush=True)
        if handle is not None:
            handle.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["save", "load", "kill", "train", "loop"])
    p.add_argument("--path", default="")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--zero", action="store_true")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--at", default="")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--resume", default="")
    p.add_argument("--pids", default="")
    p.add_argument("--hold", default="")
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--async", dest="background", action="store_true")
    args = p.parse_args(argv)
    world = fs.init(timeout=60)
    if args.what == "save":
        def hold(point: str) -> None:  # --hold F: rank 0 waits for file F before its commit
            if point == "markers seen" and world.rank == 0:
                print("holding", flush=True)
                give_up = time.monotonic() + 60
                while not os.path.exists(args.hold) and time.monotonic() < give_up:
                    time.sleep(0.02)

        try:
            save_state(world.comm, args.path, args.tp, args.pp, args.zero,
                       args.version, _hook=hold if args.hold else None)
        except fs.errors.FuelError as e:
            print(f"rank {world.rank}: {type(e).__name__}: {e}", flush=True)
            return 3
        print(f"rank {world.rank}: saved", flush=True)
    elif args.what == "load":
        version, n = load_state(world.comm, args.path, args.tp, args.zero)
        print(f"rank {world.rank} loaded version {version}: {n} tensors equal", flush=True)
    elif args.what == "kill":
        save_state(world.comm, args.path, args.tp, args.pp, args.zero, 1, keep=2)
        hook = killer(world.rank, args.at) if world.rank == args.rank else None
        save_state(world.comm, args.path, args.tp, args.pp, args.zero, 2, keep=2, _hook=hook)
        if world.rank == 0:
            print("saved without a kill", flush=True)
    elif args.what == "loop":
        loop(world, args)
    else:
        train(world, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
