"""The bad-input catalogue, multi-rank half: a caller's mistake in a collective is raised on
EVERY rank, BEFORE any communication, with the same typed error and message (invariant 4).

``mpiexec -n N python -m pytest --with-mpi -q tests/mpi/test_error_catalogue.py``
(N = 1..4). Each mistake is made on every rank through a GuardedTransport over the real MPI
transport (eager, the seam) or through a lazy Communicator over it (raised when the node is
built). "Before any communication" is checked three ways: the guard's operation and
collective counters did not move (so no descriptor was announced to a peer), its flight
recorder holds nothing new, and the MPI transport's own operation counter did not move
(nothing was issued to MPI). Then every rank's outcome is all-gathered and every rank
asserts on all of them, and a good collective on the same guarded transport must still
give the numpy answer: a half-issued operation on any rank would have made it mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd.comm import Communicator, GuardedTransport, Recorder
from fuelspmd.errors import ConfigError, DTypeError, FuelError, ShapeError
from fuelspmd.mesh import Mesh
from fuelspmd.tensor_parallel import ColumnParallelLinear

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    from fuelspmd_mpi import plugin

    t = plugin.world(timeout=TIMEOUT)
    yield t
    t.barrier().wait()


@pytest.fixture
def gt(world: Any) -> Iterator[GuardedTransport]:
    g = GuardedTransport(world.split(0, world.rank), timeout=TIMEOUT, recorder=Recorder())
    yield g
    g.close()


def _counters(g: GuardedTransport) -> tuple[int, int, int, int]:
    # the MPI transport numbers every operation it issues (``_seq``, for its timeout messages)
    return g.seq, g.cseq, len(g.guard.recorder or ()), int(g.inner._seq)  # type: ignore[attr-defined]


def _lazy(g: GuardedTransport) -> Communicator:
    return Communicator(g, device="cpu:0", timeout=TIMEOUT)


def _t(n: int, dt: Any = np.float32) -> fs.Tensor:
    return fs.tensor(np.ones(n, dt))


# (id, smallest world it is a mistake at, make it (guarded transport, size) -> None,
#  error class, pieces the message must hold given the size)
Mistake = tuple[str, int, Callable[[GuardedTransport, int], Any], type[FuelError],
                Callable[[int], tuple[str, ...]]]
MISTAKES: list[Mistake] = [
    ("all_gather-recv-size", 1,
     lambda g, n: g.all_gather(np.ones(3, np.float32), np.empty(3 * n + 1, np.float32)),
     ShapeError, lambda n: ("3 elements", f"recv {3 * n + 1}", f"{n} ranks",
                            f"must have {3 * n}", "size recv")),
    ("reduce_scatter-divides", 2,
     lambda g, n: g.reduce_scatter(np.ones(2 * n + 1), np.empty(2), "sum"),
     ShapeError, lambda n: (f"{2 * n + 1} elements", f"{n} ranks", f"multiple of {n}")),
    ("all_gather-dtypes", 1,
     lambda g, n: g.all_gather(np.ones(2, np.float32), np.empty(2 * n, np.float64)),
     DTypeError, lambda n: ("float32", "float64", "use one dtype")),
    ("all_reduce-contiguous", 1,
     lambda g, n: g.all_reduce(np.ones((4, 4), np.float32)[:, ::2], "sum"),
     ShapeError, lambda n: ("(4, 2)", "C-contiguous", "np.ascontiguousarray")),
    ("all_reduce-avg-bool", 1, lambda g, n: g.all_reduce(np.ones(4, np.bool_), "avg"),
     DTypeError, lambda n: ("avg", "bool", "use 'sum'")),
    ("all_reduce-op", 1, lambda g, n: g.all_reduce(np.ones(4, np.float32), "mean"),
     ConfigError, lambda n: ("'mean'", "use one of")),
    ("broadcast-root", 1, lambda g, n: g.broadcast(np.ones(4, np.float32), n),
     ConfigError, lambda n: (f"root {n}", f"{n} ranks", f"0..{n - 1}")),
    ("send-peer", 1, lambda g, n: g.send(np.ones(4, np.float32), n + 1, 0),
     ConfigError, lambda n: (f"peer {n + 1}", f"{n} ranks", f"0..{n - 1}")),
    ("recv-tag", 1, lambda g, n: g.recv(np.empty(4, np.float32), 0, -1),
     ConfigError, lambda n: ("tag -1", "use a smaller non-negative tag")),
    ("lazy-reduce_scatter-divides", 2,
     lambda g, n: _lazy(g).reduce_scatter(_t(3 * n + 1)),
     ShapeError, lambda n: (f"{3 * n + 1} elements", f"{n} ranks",
                            f"pad axis 0 to a multiple of {n}")),
    ("lazy-all_to_all-divides", 2,
     lambda g, n: _lazy(g).all_to_all(fs.tensor(np.ones((n + 1, 2), np.float32)), 0, 1),
     ShapeError, lambda n: (f"{n + 1} elements", f"{n} ranks")),
    ("lazy-broadcast-root", 2, lambda g, n: _lazy(g).broadcast(_t(4), root=n),
     ConfigError, lambda n: (f"{n}", f"0..{n - 1}")),
    ("lazy-send-peer", 2, lambda g, n: _lazy(g).send(_t(4), n),
     ConfigError, lambda n: (f"{n}", f"0..{n - 1}")),
    ("mesh-divides", 1, lambda g, n: Mesh(_lazy(g), tp=n + 1), ConfigError,
     lambda n: (f"tp={n + 1}", f"{n} ranks", "pairs that do")),
    ("tp-divides", 2,
     lambda g, n: ColumnParallelLinear(8, n + 1, comm=_lazy(g), seed=0), ConfigError,
     lambda n: (f"out_features={n + 1}", f"TP size {n}", f"multiple of {n}")),
    ("lazy-recv-dtype", 1, lambda g, n: _lazy(g).recv((4,), "float8", 0),
     DTypeError, lambda n: ("'float8'", "float32")),
]


@pytest.mark.parametrize(("min_size", "make", "kind", "pieces"), [m[1:] for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_mistake_raises_on_every_rank_before_any_communication(
        world: Any, gt: GuardedTransport, min_size: int,
        make: Callable[[GuardedTransport, int], Any], kind: type[Exception],
        pieces: Callable[[int], tuple[str, ...]]) -> None:
    n = world.size
    if n < min_size:
        pytest.skip(f"not a mistake in a world of {n}")
    good = np.full(4, gt.rank + 1.0, np.float32)
    gt.all_reduce(good, "sum").wait()  # the guard has a history, not a fresh start
    before = _counters(gt)
    try:
        make(gt, n)
        mine: tuple[str, str, bool] = ("no error", "", True)
    except FuelError as e:
        mine = (type(e).__name__, str(e), _counters(gt) == before)
    every = world.comm.allgather(mine)
    want = kind.__name__
    for rank, (name, text, still) in enumerate(every):
        assert name == want, f"rank {rank}: {name}: {text}"
        assert still, f"rank {rank} communicated before raising: counters moved"
        missing = [p for p in pieces(n) if p not in text]
        assert not missing, f"rank {rank}: message lacks {missing}: {text}"
    assert len({text for _, text, _ in every}) == 1, every  # the same words on every rank
    assert _counters(gt) == before
    # nothing half-issued on any rank: the next collective still matches and is right
    good[:] = gt.rank + 1.0
    gt.all_reduce(good, "sum").wait()
    np.testing.assert_array_equal(good, np.full(4, n * (n + 1) / 2, np.float32))


def test_a_mistake_on_every_rank_does_not_poison_the_world_comm(world: Any) -> None:
    """The guard of a job: a bad shape built lazily leaves ``world.comm`` usable."""
    g = GuardedTransport(world.split(0, world.rank), timeout=TIMEOUT, recorder=Recorder())
    try:
        comm = _lazy(g)
        if world.size > 1:
            with pytest.raises(ShapeError):
                comm.all_gather(_t(2), axis=1)  # axis out of range for a 1-d tensor
        y = comm.all_gather(fs.tensor(np.full(2, world.rank, np.float32))).numpy()
        np.testing.assert_array_equal(y, np.repeat(np.arange(world.size, dtype=np.float32), 2))
    finally:
        g.close()
