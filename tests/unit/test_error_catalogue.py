"""The bad-input catalogue: every typed error a caller's mistake raises gives the numbers
and the fix (invariant 4; issue 10, item 4).

Two halves:

- **Every raise site, statically.** Each ``raise ShapeError(...)`` (and DTypeError,
  DeviceError, ConfigError, ScheduleError, CacheCapacityError, CacheUsageError,
  TransportUnavailableError) under ``fuelspmd/`` and ``transports/`` is read from the
  source: its message must say what to do (a fix verb, the valid range or the accepted
  values), and one built from values must interpolate them. A new message without a fix
  fails here, naming its file and line.
- **Each mistake, for real.** A table of caller mistakes, one or more per module and error
  class, is triggered through the public API; the error must be of the typed class (and a
  ``ValueError``, so generic handlers catch it), and its message must contain the numbers
  involved and the fix. The multi-rank half (raised on every rank before any
  communication) is ``tests/mpi/test_error_catalogue.py``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
import fuelspmd.functional as F
from fuelspmd import errors, launch
from fuelspmd.backend import Device, device
from fuelspmd.comm import Communicator, Guard, Recorder
from fuelspmd.comm.recorder import load_dump
from fuelspmd.cost import CostModel
from fuelspmd.device_group import DeviceGroup
from fuelspmd.distributed_cache import BlockPool, KVCacheManager, PrefixRouter
from fuelspmd.dtypes import broadcast_shapes, dtype, normalize_axis
from fuelspmd.errors import (
    CacheCapacityError,
    CacheUsageError,
    ConfigError,
    DeviceError,
    DTypeError,
    ScheduleError,
    ShapeError,
    TransportUnavailableError,
)
from fuelspmd.mesh import Mesh
from fuelspmd.pipeline_parallel import Action, Schedule, partition, schedule, validate
from fuelspmd.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from fuelspmd.topology import Link, Topology
from fuelspmd.transport import ReduceOp, SelfTransport, check_buffers, check_peer, load_plugin

ROOT = Path(__file__).resolve().parents[2]
CALLER_ERRORS = ("ShapeError", "DTypeError", "DeviceError", "ConfigError", "ScheduleError",
                 "CacheCapacityError", "CacheUsageError", "TransportUnavailableError")
# What a message says to fix the mistake: an imperative, the constraint it must meet, the
# valid range ("0..3", ">= 1") or the accepted values ("use one of", "supports").
FIX = re.compile(
    r"\b(use|give|pass|call|run|rerun|set|make|move|choose|install|free|pad|cast|raise|reduce|"
    r"start|launch|build|declare|keep|write|load|name|size|leave|append|split|change|must|"
    r"needs?|expected|valid|supported|supports|e\.g|only|at least|at most|first|takes|like|"
    r"knows|instead|one of|the axes are|found|divide|hint|fix)\b|>=|<=|\d\.\.|\{\}\.\.", re.I)
# an interpolated value whose name says it carries the fix (a hint built beforehand)
_FIX_VALUE = re.compile(r"hint|fix|\bok\b|fits", re.I)


def _message(node: ast.expr) -> tuple[str | None, int]:
    """The message's literal text with ``{}`` for each value, and how many values."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, 0
    if isinstance(node, ast.JoinedStr):
        parts, n = [], 0
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                n += 1
                inner = ast.unparse(v.value)  # type: ignore[attr-defined]
                parts.append(" hint " if _FIX_VALUE.search(inner) else "{}")
        return "".join(parts), n
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        (a, na), (b, nb) = _message(node.left), _message(node.right)
        return (None, 0) if a is None or b is None else (a + b, na + nb)
    return None, 0  # built elsewhere: covered by the table below where it matters


def raise_sites() -> list[tuple[str, int, str, str | None, int]]:
    """Every ``raise <CallerError>(message)`` in the runtime: (file, line, class, text, values)."""
    sites = []
    files = sorted([*(ROOT / "fuelspmd").rglob("*.py"), *(ROOT / "transports").rglob("*.py")])
    for path in files:
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = getattr(func, "id", getattr(func, "attr", None))
            if name in CALLER_ERRORS and node.exc.args:
                text, n = _message(node.exc.args[0])
                sites.append((str(path.relative_to(ROOT)), node.lineno, name, text, n))
    return sites


def test_every_raise_site_gives_a_fix() -> None:
    sites = raise_sites()
    assert len(sites) > 150, "the scan found too few raise sites: is it reading the source?"
    bad = [f"{f}:{line}: {cls}({text!r})" for f, line, cls, text, _ in sites
           if text is not None and not FIX.search(text)]
    assert not bad, "messages that do not say how to fix the mistake:\n" + "\n".join(bad)


def test_messages_built_from_values_show_them() -> None:
    """A message that names a given value (``got``, ``has``, ``is``) must interpolate it."""
    bad = [f"{f}:{line}: {cls}({text!r})" for f, line, cls, text, n in raise_sites()
           if text is not None and n == 0 and re.search(r"\bgot\b|\bhas \d|\bis \d", text)]
    assert not bad, "messages that mention a value without showing it:\n" + "\n".join(bad)


def test_the_scan_knows_bad_messages() -> None:
    """The checks above can fail: a message without a fix, or without its value, is caught."""
    tree = ast.parse('raise ShapeError(f"shape {s} is wrong")\nraise ConfigError("got it")')
    texts = [_message(n.exc.args[0]) for n in ast.walk(tree)
             if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)]
    assert not FIX.search(texts[0][0] or "") and texts[0][1] == 1
    assert texts[1] == ("got it", 0)


def _size1_comm() -> Communicator:
    return Communicator(SelfTransport(), device="cpu:0", timeout=5.0)


def _t(*shape: int, dt: Any = np.float32) -> fs.Tensor:
    return fs.tensor(np.ones(shape, dt))


def _bad_schedule() -> Schedule:
    s = schedule("1f1b", 2, 4)
    actions = [list(a) for a in s.actions]
    actions[1] = [a for a in actions[1] if str(a) != "1F2"]
    return Schedule(**{**{k: getattr(s, k) for k in s.__dataclass_fields__},
                       "actions": tuple(tuple(a) for a in actions)})


def _dump_file(tmp: Path) -> str:
    p = tmp / "rank0.json"
    p.write_text('{"format": 99}')
    return str(p)


# (id, trigger, error class, pieces the message must hold: the numbers and the fix)
CASES: list[tuple[str, Callable[..., Any], type[Exception], tuple[str, ...]]] = [
    # layer 0: dtypes and shapes
    ("dtype-unknown", lambda: dtype("float8"), DTypeError, ("'float8'", "float32")),
    ("broadcast", lambda: broadcast_shapes((2, 3), (4, 3), op="add"), ShapeError,
     ("(2, 3)", "(4, 3)", "2 vs 4", "make the sizes equal or one of them 1")),
    ("axis-range", lambda: normalize_axis(3, 2, op="sum"), ShapeError,
     ("axis 3", "2-d", "-2..1")),
    # layer 1: devices and the transport seam
    ("device-kind", lambda: device("gpu:0"), DeviceError, ("'gpu'", "use one of", "cpu")),
    ("device-index", lambda: device("cuda:x"), DeviceError, ("'cuda:x'", "'cuda:1'")),
    ("device-negative", lambda: Device("cpu", -1), DeviceError, ("-1", ">= 0")),
    ("reduce-op", lambda: ReduceOp.parse("mean"), ConfigError, ("'mean'", "use one of", "sum")),
    ("no-transport", lambda: load_plugin("carrier-pigeon"), TransportUnavailableError,
     ("'carrier-pigeon'", "mpi", "entry-point group")),
    ("gather-sizes", lambda: check_buffers("all_gather", 4, np.ones(3), np.ones(10),
                                           recv_factor=4), ShapeError,
     ("3 elements", "recv 10", "4 ranks", "must have 12", "size recv")),
    ("scatter-divides", lambda: check_buffers("reduce_scatter", 4, np.ones(10), np.ones(2),
                                              send_factor=4),
     ShapeError, ("10 elements", "4 ranks", "pad it to a multiple of 4")),
    ("buffer-dtypes", lambda: check_buffers("all_gather", 2, np.ones(2, np.float32),
                                            np.ones(4, np.float64), recv_factor=2),
     DTypeError, ("float32", "float64", "use one dtype")),
    ("buffer-contiguous", lambda: check_buffers("all_reduce", 2, np.ones((4, 4))[:, ::2]),
     ShapeError, ("(4, 2)", "C-contiguous", "np.ascontiguousarray")),
    ("peer-range", lambda: check_peer("send", 5, 4), ConfigError, ("5", "4 ranks", "0..3")),
    # layer 2-3: graph, tensor, autograd, functional (raised when the node is built)
    ("matmul", lambda: _t(2, 3) @ _t(4, 5), ShapeError, ("(2, 3)", "(4, 5)", "(3)", "(4)",
                                                         "must equal")),
    ("add-broadcast", lambda: _t(2, 3) + _t(4, 3), ShapeError, ("(2, 3)", "(4, 3)")),
    ("reshape", lambda: _t(6).reshape(4, -1), ShapeError, ("(6,)", "6 elements", "4")),
    ("split", lambda: fs.split(_t(10), 3, 0), ShapeError, ("size 10", "3", "use one of")),
    ("index", lambda: _t(3)[5], ShapeError, ("index 5", "size 3")),
    ("exp-int", lambda: _t(3, dt=np.int64).exp(), DTypeError, ("int64", ".astype")),
    ("concat-shapes", lambda: fs.concat([_t(2, 3), _t(2, 4)], 0), ShapeError,
     ("(2, 3)", "(2, 4)", "axis 0", "must match")),
    ("vjp-dtype", lambda: fs.vjp([_t(2, dt=np.int64)], [_t(2, dt=np.int64)],
                                 [np.ones(2, np.int64)]), DTypeError, ("int64", "cast it first")),
    ("grad-scalar", lambda: fs.grad(_t(2, 3) * 2, [_t(1)]), ShapeError,
     ("(2, 3)", "scalar", ".sum()")),
    ("cross-entropy", lambda: F.cross_entropy(_t(4, 3), fs.tensor(np.zeros(5, np.int64))),
     ShapeError, ("(4, 3)", "(5,)", "(..., C)")),
    ("gelu", lambda: F.gelu(_t(2), approximate="erf"), ConfigError, ("'erf'", "'tanh'")),
    # layer 4: the Communicator and its guard
    ("comm-timeout", lambda: Communicator(SelfTransport(), device="cpu:0", timeout=0),
     ConfigError, ("timeout=0", "600")),
    ("comm-device", lambda: _size1_comm().all_reduce(
        fs.tensor(np.ones(2, np.float32), device="strict:0")), DeviceError,
     ("strict:0", "cpu:0", ".to('cpu:0')")),
    ("comm-divides", lambda: DeviceGroup.cpu(3).comms[0].reduce_scatter(_t(4)), ShapeError,
     ("axis 0", "(4,)", "4 elements", "3 ranks", "pad axis 0 to a multiple of 3")),
    ("comm-all-to-all", lambda: DeviceGroup.cpu(4).comms[0].all_to_all(_t(6, 2), 0, 1),
     ShapeError, ("6 elements", "4 ranks", "[1, 2, 3, 6]")),
    ("comm-root", lambda: DeviceGroup.cpu(2).comms[0].broadcast(_t(2), root=2), ConfigError,
     ("2", "2 ranks", "0..1")),
    ("comm-recv-self", lambda: _size1_comm().recv((2,), "float32", 0), ConfigError,
     ("rank 0", "size-1", "send(t, 0) first")),
    ("guard-mode", lambda: Guard(SelfTransport(), mode="paranoid"), ConfigError,
     ("'paranoid'", "use one of", "debug")),
    ("recorder-capacity", lambda: Recorder(capacity=0), ConfigError, ("capacity=0", "1024")),
    ("dump-format", lambda tmp: load_dump(_dump_file(tmp)), ConfigError,
     ("rank0.json", "format 1", "Recorder.dump")),
    # layer 5: launch, device group, topology and cost
    ("init-timeout", lambda: fs.init(timeout=0), ConfigError, ("timeout=0", "600")),
    ("local-ranks", lambda: launch._local_rank(["a", "a"], [0, 0], 0, "mpiexec"), ConfigError,
     ("ranks [0, 1]", "[0, 0]", "0..1", "mpi4py built against")),
    ("group-empty", lambda: DeviceGroup([]), ConfigError, ("at least one", "DeviceGroup.cpu(2)")),
    ("group-repeat", lambda: DeviceGroup(["cpu:0", "cpu:0"]), ConfigError,
     ("['cpu:0', 'cpu:0']", "name each device once")),
    ("group-args", lambda: DeviceGroup.cpu(2).run(lambda c, a: a, [1, 2, 3]), ConfigError,
     ("3 entries", "2 devices", "one per device")),
    ("link-kind", lambda: Link("warp", 1e9, 1e-6), ConfigError, ("'warp'", "nvlink")),
    ("topology-sizes", lambda: Topology.uniform(nodes=0, devices_per_node=8,
                                                fabric=Link("nvlink", 1e11, 1e-6)),
     ConfigError, ("nodes >= 1", "got 0 and 8")),
    ("cost-bytes", lambda: CostModel(Topology.uniform(
        nodes=1, devices_per_node=2, fabric=Link("nvlink", 1e11, 1e-6))).estimate(
        "all_reduce", -1, [0, 1]), ConfigError, ("nbytes", ">= 0", "-1")),
    ("cost-device", lambda: CostModel(Topology.uniform(
        nodes=1, devices_per_node=2, fabric=Link("nvlink", 1e11, 1e-6))).estimate(
        "all_reduce", 8, [0, 5]), ConfigError, ("device 5", "2 devices", "0..1")),
    # layers 6-7: the mesh and tensor parallelism (the design's example of invariant 4)
    ("mesh-divides", lambda: Mesh(DeviceGroup.cpu(4).comms[0], tp=3), ConfigError,
     ("tp=3", "4 ranks", "(2, 2)")),
    ("mesh-product", lambda: Mesh(DeviceGroup.cpu(4).comms[0], tp=2, pp=2, dp=3), ConfigError,
     ("12 ranks", "has 4", "dp=None")),
    ("tp-column", lambda: ColumnParallelLinear(16, 6, comm=DeviceGroup.cpu(4).comms[0], seed=0),
     ConfigError, ("out_features=6", "TP size 4", "[1, 2, 3, 6]", "multiple of 4")),
    ("tp-row", lambda: RowParallelLinear(10, 6, comm=DeviceGroup.cpu(4).comms[0], seed=0),
     ConfigError, ("in_features=10", "TP size 4", "[1, 2, 5, 10]")),
    # layer 7: pipeline schedules and the KV cache
    ("schedule-kind", lambda: schedule("zigzag", 4, 8), ConfigError, ("'zigzag'", "1f1b")),
    ("schedule-interleaved", lambda: schedule("interleaved", 4, 6, chunks=2), ConfigError,
     ("6 micro-batches", "4 stages", "leaves 2", "microbatches=")),
    ("partition", lambda: partition([1.0, 2.0], 3), ConfigError,
     ("2 layers", "3 stages", "stages <= 2")),
    ("partition-cost", lambda: partition([1.0, -2.0], 1), ConfigError, ("layer 1", "-2.0", "> 0")),
    ("action-parse", lambda: Action.parse("1Q3"), ScheduleError, ("'1Q3'", "e.g. '1F3'")),
    ("schedule-coverage", lambda: validate(_bad_schedule()), ScheduleError, ("rank 1", "1F2")),
    ("pool-size", lambda: BlockPool(0, 16), ConfigError, ("num_blocks", "got 0")),
    ("kv-capacity", lambda: KVCacheManager(4, 4).allocate("a", list(range(100))),
     CacheCapacityError, ("25 more blocks", "100 tokens", "only 4", "num_blocks >= 25")),
    ("kv-free-unknown", lambda: KVCacheManager(4, 4).free("ghost"), CacheUsageError,
     ("'ghost'", "0 live sequences", "allocate it first")),
    ("kv-double-alloc", lambda: _double_alloc(), CacheUsageError,
     ("'a'", "already allocated", "4 tokens", "free it first")),
    ("kv-tokens", lambda: KVCacheManager(4, 4).allocate("a", ["x"]), CacheUsageError,
     ("'x'", "pass token ids")),
    ("router-empty", lambda: PrefixRouter([], block_size=4), ConfigError,
     ("at least one replica", "[]")),
    ("router-unknown", lambda: PrefixRouter(["r0"], block_size=4).finish("r9"),
     CacheUsageError, ("'r9'", "['r0']")),
]


def _double_alloc() -> None:
    m = KVCacheManager(4, 4)
    m.allocate("a", [1, 2, 3, 4])
    m.allocate("a", [5])


def _ids() -> list[str]:
    return [c[0] for c in CASES]


@pytest.mark.parametrize(("trigger", "kind", "pieces"), [c[1:] for c in CASES], ids=_ids())
def test_mistake_raises_with_numbers_and_fix(trigger: Callable[..., Any],
                                             kind: type[Exception], pieces: tuple[str, ...],
                                             tmp_path: Path) -> None:
    args = (tmp_path,) if trigger.__code__.co_argcount else ()
    with pytest.raises(kind) as info:
        trigger(*args)
    assert isinstance(info.value, errors.FuelError)
    assert isinstance(info.value, ValueError) or kind is TransportUnavailableError
    text = str(info.value)
    missing = [p for p in pieces if p not in text]
    assert not missing, f"{kind.__name__} message lacks {missing}: {text}"
    assert FIX.search(text), text


def test_table_covers_every_error_class() -> None:
    """Each caller-error class the runtime raises is triggered by the table at least once."""
    raised = {cls for _, _, cls, _, _ in raise_sites()}
    covered = {c[2].__name__ for c in CASES}
    assert raised <= covered, f"no case triggers {sorted(raised - covered)}"
