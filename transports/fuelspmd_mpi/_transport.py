"""MPITransport: the Transport seam over one MPI communicator, through mpi4py's buffer API.

Every operation is the non-blocking MPI call (Iallreduce, Iallgather, Ireduce_scatter_block,
Ibcast, Ialltoall, Isend, Irecv, Ibarrier; the uppercase buffer methods: the lowercase ones
pickle) in an :class:`~fuelspmd_mpi._work.MPIWork`, waited against a deadline, and numbered
(``seq``) so that a timeout names the one that hung. An all_reduce that the route
(:meth:`MPITransport.set_all_reduce_policy`) sends through shared memory
(:mod:`fuelspmd_mpi._shm`) or the node and rail splits (:mod:`fuelspmd_mpi._hier`)
completes inside the call. GPU buffers: :mod:`fuelspmd_mpi._staging`, on the slow path
only. Collectives on empty buffers complete without MPI (every rank has the same sizes);
sends and receives of 0 elements still go to MPI to match their peer.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from functools import cached_property, partial
from typing import Any, NamedTuple, NoReturn

import numpy as np

from fuelspmd.backend import through_host
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.dtypes import to_numpy
from fuelspmd.errors import CommError, ConfigError
from fuelspmd.transport import (
    CHECK_WORDS,
    DONE,
    Check,
    Disagreement,
    ReduceOp,
    Work,
    agree,
    check_buffers,
    check_peer,
)
from fuelspmd_mpi._hier import Hierarchical
from fuelspmd_mpi._policy import ALGORITHMS, Route, manual_bands, parse_bands
from fuelspmd_mpi._shm import MIN_CLASS, SHM_DTYPES, ShmAllReduce, fold_piece, size_class
from fuelspmd_mpi._staging import cuda_aware
from fuelspmd_mpi._work import (
    UFUNCS,
    YIELD_AFTER_S,
    MPIWork,
    Types,
    divide,
    late_text,
    local_reduce,
    spin,
)

__all__ = ["MPITransport"]

_MPI_ONLY = Route.of(manual_bands("mpi", 0, 0, "the default"))
_ndarray = np.ndarray
DEFAULT_SHM_CAP = 256 << 20  # bytes of shared window per rank, by default
INLINE = 512  # bytes of a check record's payload (MPITransport.checked)
_RECORD = CHECK_WORDS + INLINE // 8


class _Inline(NamedTuple):
    """A kind of small all_reduce carried in the check record: dtype, op, shape, the views of
    this rank's slot and every rank's part (whole and row by row), the ufunc where it alone
    reduces them, the plan."""

    dtype: np.dtype
    op: ReduceOp
    shape: tuple[int, ...]
    slot: np.ndarray
    parts: np.ndarray
    rows: tuple[np.ndarray, ...]
    ufunc: Any
    plan: Any


def _records(size: int) -> tuple[np.ndarray, ...]:
    """A check record, every rank's, and the views the meetings read: the words, this
    rank's payload slot, every rank's payload."""
    mine, rows, w = np.zeros(_RECORD, np.int64), np.empty((size, _RECORD), np.int64), CHECK_WORDS
    return mine, rows, rows[:, :w], mine[w:].view(np.uint8), rows[:, w:].view(np.uint8)


_MEETINGS: dict[int, Any] = {}  # persistent meetings not freed yet, by id


def _held(meeting: Any) -> None:
    """Keep ``meeting`` to free before MPI_Finalize (MPI names each one left at exit); the
    hook is registered after MPI's own, so it runs first."""
    if not _MEETINGS:
        atexit.unregister(_free_meetings)
        atexit.register(_free_meetings)
    _MEETINGS[id(meeting)] = meeting


def _free_meetings() -> None:
    """Free the inactive persistent meetings still held (a failed one was dropped)."""
    from mpi4py import MPI  # imported already: a meeting exists

    if MPI.Is_finalized():
        return
    while _MEETINGS:
        _MEETINGS.popitem()[1].Free()


def _plain(buf: Any, move: dict[np.dtype, Any]) -> bool:
    """Whether ``buf`` surely passes check_buffers (a C-contiguous numpy array of a known
    dtype), in a few attribute reads; anything else goes through check_buffers."""
    return type(buf) is _ndarray and buf.flags.c_contiguous and buf.dtype in move


class MPITransport:
    """The Transport of one MPI communicator (COMM_WORLD, or a split of it)."""

    name = "mpi"
    capabilities = frozenset({"checked", "probe", "lend", "route", "finalize"})

    def __init__(self, comm: Any, *, MPI: Any, timeout: float, label: str = "world",
                 types: Types | None = None) -> None:
        if not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._MPI = MPI
        self.comm = comm  # the mpi4py communicator (for baselines and tests; not for arrays)
        self.timeout = float(timeout)
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.label = label
        self._types = types if types is not None else Types(MPI)
        self._move = self._types.move
        self._plans = self._types.plans
        self.mpi_error: type[Exception] = MPI.Exception
        group = comm.Get_group()
        try:  # every rank of the group, into COMM_WORLD's
            self.world_ranks: tuple[int, ...] = tuple(group.Translate_ranks())
        finally:
            group.Free()
        self.tag_bound = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        # more of this group's ranks on the node than cores: they take turns, so a wait
        # yields its core at once (a rank spinning keeps the core its peer needs); with a
        # core each it spins a while first
        self.core_each = node.Get_size() <= cores
        node.Free()
        self.spin_s = YIELD_AFTER_S if self.core_each else 0.0
        self._status, self._any = MPI.Status(), MPI.ANY_SOURCE  # probe's
        self._seq = 0
        # the route (set_all_reduce_policy: MPI's own until then) and the paths it may use
        self._shm: ShmAllReduce | None = None
        self._kept_windows: list[Any] = []  # lent windows still held at a free (_shm.free)
        self._hier: Hierarchical | None = None
        self._route = _MPI_ONLY
        self._planner: Any = None
        self._cap = DEFAULT_SHM_CAP
        self._records = _records(self.size)  # _meet's buffers and views, reused
        self._inline: _Inline | None = None  # the last inline all_reduce's kind (_inline_for)
        # _meet's all_gather of the records, set up once where MPI has persistent
        # collectives (4.0): a Start reuses its schedule where an Iallgather builds one
        self._meeting: Any = None
        if self.size > 1 and MPI.Get_version() >= (4, 0):
            self._meeting = comm.Allgather_init(*self._records[:2])
            _held(self._meeting)
        self._met_failed: str | None = None  # why a meeting was left posted (see _meet)

    def describe(self) -> str:
        """Name this group for messages: its label, size and members' world ranks."""
        ranks = list(self.world_ranks)
        shown = str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)})"
        return f"MPI group {self.label} of {self.size} (world ranks {shown})"

    def __repr__(self) -> str:
        return f"MPITransport(rank={self.rank}, {self.describe()})"

    def _next(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        return seq

    def explain(self, op: str | tuple[str, int, int], seq: int) -> tuple[str, str]:
        """Name operation ``seq`` (``op``: a name, or (name, peer, tag) for send and recv)
        and say who failed to join it (for CommTimeoutError)."""
        where = f"on rank {self.rank} of {self.describe()}"
        if isinstance(op, tuple):
            op, peer, tag = op
            direction, other = ("to", "recv") if op == "send" else ("from", "send")
            return (f"{op} #{seq} {direction} peer {peer} (world rank "
                    f"{self.world_ranks[peer]}) tag {tag} {where}",
                    f"peer {peer} never posted the matching {other} with tag {tag}")
        return (f"{op} #{seq} {where}", "a rank of the group never joined it, or joined a "
                "different collective (every rank must issue the same collectives in order)")

    @cached_property
    def cuda_aware(self) -> tuple[bool, str]:
        """Whether this MPI library reads GPU memory itself, and how that was decided."""
        return cuda_aware(self._MPI)

    def _staged(self, op: str, bufs: tuple[Any, ...], outs: tuple[int, ...], *extra: Any,
                send_factor: int = 1, recv_factor: int = 1) -> Work | None:
        """Buffers that are not plain numpy: check_buffers' error, DeviceError, None to go
        on (a CUDA-aware MPI), or the Work on pinned host copies (16-bit floats always:
        MPI reduces them in a float32 host copy)."""
        check_buffers(op, self.size, *bufs, send_factor=send_factor, recv_factor=recv_factor)
        return through_host(
            lambda *hosts: getattr(self, op)(*hosts, *extra), bufs, outs, op=op,
            direct=lambda: self.cuda_aware[0] and not any(
                str(b.dtype) in ("float16", "bfloat16") for b in bufs))

    def all_reduce(self, buf: Any, op: ReduceOp | str) -> Work:
        """Reduce ``buf`` over the group in place (``MPI_Iallreduce`` with ``MPI_IN_PLACE``,
        or the path the route gives its size: then complete on return)."""
        return self._all_reduce(buf, op, None)

    def checked(self, check: Check, op: str, *args: Any) -> Work:
        """The ``checked`` capability: the words meet in the shared-memory header, else in
        one all_gather of a fixed-size record per rank (the words, then a payload of at most
        ``INLINE`` bytes) that ranks which disagree still complete alike. A small all_reduce
        (every rank reduces the same rows in rank order: the same bits), all_gather or
        broadcast rides whole in the payload; for those and a barrier the meeting is the
        collective."""
        if op == "all_reduce":  # the guard's hot path: one frame to the meeting
            buf, rop = args
            k = self._inline
            # (strides need no look: the copy in and the reduce out take any layout)
            if not (k is not None and buf.__class__ is _ndarray and buf.dtype is k.dtype
                    and rop is k.op and buf.shape == k.shape):
                k = self._inline_for(buf, rop)
                if k is None:
                    return self._all_reduce(buf, rop, check)
            seq = self._seq
            self._seq = seq + 1
            k.slot[...] = buf
            self._meet(check, seq, "all_reduce")
            if k.ufunc is not None:  # the shm path's left fold in rank order: the same bits
                fold_piece(k.rows, k.ufunc, False, buf, None)  # (buf is none of the rows)
            else:
                local_reduce(k.parts, k.op, k.plan, buf)
            return DONE
        if op == "all_gather":
            send, recv = args
            if (send.nbytes <= INLINE and _plain(send, self._move) and _plain(recv, self._move)
                    and recv.dtype == send.dtype and recv.size == send.size * self.size):
                rows = self._meet(check, self._next(), "all_gather", send)
                recv.reshape(-1).view(np.uint8).reshape(self.size, -1)[...] = \
                    rows[:, :send.nbytes]
                return DONE
        elif op == "broadcast":
            buf, root = args
            check_peer("broadcast", root, self.size, what="root")
            if buf.nbytes <= INLINE and _plain(buf, self._move):
                rows = self._meet(check, self._next(), "broadcast",
                                  buf if self.rank == root else None)
                if self.rank != root:
                    buf.reshape(-1).view(np.uint8)[...] = rows[root, :buf.nbytes]
                return DONE
        elif op == "barrier":
            self._meet(check, self._next(), "barrier")  # no rank leaves before all came
            return DONE
        self._meet(check, self._seq, op)
        return getattr(self, op)(*args)  # type: ignore[no-any-return]

    def _all_reduce(self, buf: Any, op: ReduceOp | str, check: Check | None) -> Work:
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        # The hot path: a plan cached for this dtype means a supported dtype, so a
        # contiguous ndarray needs no check_buffers.
        plan = (self._plans[op._value_].get(buf.dtype)
                if type(buf) is _ndarray and buf.flags.c_contiguous else None)
        if plan is None:
            if check is not None and not isinstance(buf, _ndarray):
                # a GPU buffer's host copy is reduced unchecked: the words meet first, and
                # a caller's mistake raises before the meeting, as on every other path
                check_buffers("all_reduce", self.size, buf)
                self._meet(check, self._seq, "all_reduce")
                check = None
            if (staged := self._staged("all_reduce", (buf,), (0,), op)) is not None:
                return staged
            plan = self._types.plan(buf.dtype, op, "all_reduce")
        seq = self._seq
        self._seq = seq + 1
        if self.size == 1:
            return DONE
        # (a size below every band but MPI's own skips the call)
        algo = self._path(buf.nbytes, buf.dtype) if buf.nbytes > self._route.smallest else "mpi"
        if algo == "shm":
            if self._shm.all_reduce(buf, op, seq, check):  # type: ignore[union-attr]
                return DONE
            check = None  # over the cap: compared in its header, MPI's own moves the data
        if check is not None:
            self._meet(check, seq, "all_reduce")
        if buf.size == 0:
            return DONE
        if algo == "hierarchical":
            self._hier.all_reduce(buf, plan, seq, None if check is None else check.watch)
            return DONE
        into = buf if plan.stage is None else buf.astype(plan.stage)
        req = self.comm.Iallreduce(self._MPI.IN_PLACE, [into, plan.datatype], plan.mpi_op)
        return MPIWork(req, self, "all_reduce", seq, self._finish(into, buf, plan.avg),
                       (into, buf))

    def _path(self, nbytes: int, dtype: Any) -> str:
        """The path of an all_reduce of ``nbytes`` of ``dtype`` (None: one the path reduces):
        its band's where that path reduces the dtype as it is (not through a float32 stage;
        shm: its dtypes, under its cap), else MPI's own. The route's one rule: the calls,
        :meth:`lend` and :meth:`explain_all_reduce` all follow it."""
        route = self._route
        if self.size == 1 or nbytes <= route.smallest:
            return "mpi"
        algo = route.band(nbytes).algorithm
        # a dtype's name (asked by explain_all_reduce) through fuelspmd's table: numpy
        # knows "bfloat16" only once ml_dtypes is imported
        dt = (None if dtype is None else to_numpy(as_dtype(dtype)) if isinstance(dtype, str)
              else np.dtype(dtype))
        if dt is not None:
            self._types.know(dt)
        if algo == "mpi" or (dt is not None
                             and self._types.reduce_as.get(dt, (None, None))[1] is not None):
            return "mpi"
        if algo == "shm":  # (a band whose path could not be set up runs mpi: Route.without)
            shm = self._shm
            fits = shm is not None and shm.fits(nbytes)
            return "shm" if fits and (dt is None or dt in SHM_DTYPES) else "mpi"
        return algo

    def _inline_for(self, buf: Any, op: ReduceOp) -> _Inline | None:
        """The kind of an all_reduce of ``buf`` that rides whole in its check's meeting (a
        plain array of at most ``INLINE`` bytes the route does not send through shared
        memory, whose header carries the check), kept for the next call of that kind (a loop
        repeats one); None for any other, and on one rank (nothing to meet or reduce)."""
        if not (self.size > 1 and _plain(buf, self._move) and buf.nbytes <= INLINE):
            return None
        plan = self._types.plan(buf.dtype, op, "all_reduce")  # DTypeError before the meeting
        if self._path(buf.nbytes, buf.dtype) == "shm":
            return None
        rec, n = self._records, buf.nbytes
        slot = rec[3][:n].view(buf.dtype).reshape(buf.shape)
        parts = rec[4][:, :n].view(buf.dtype).reshape((self.size, *buf.shape))
        simple = plan.stage is None and not plan.avg and buf.dtype != np.bool_
        kind = _Inline(buf.dtype, op, buf.shape, slot, parts,
                       tuple(parts[i, ...] for i in range(self.size)),  # views, 0-d too
                       UFUNCS[op] if simple else None, plan)
        if np.shares_memory(parts, rec[1]) and np.shares_memory(slot, rec[0]):
            self._inline = kind
        return kind

    def _meet(self, check: Check, seq: int, op: str, payload: Any = None) -> np.ndarray:
        """All-gather the check records (``payload``: a plain array of at most ``INLINE``
        bytes, or None); Disagreement unless the words agree; every rank's payload bytes."""
        if self._met_failed is not None:
            raise CommError(f"{op} #{seq} on rank {self.rank} of {self.describe()}: "
                            f"{self._met_failed}; the job must end")
        rec = self._records
        mine, rows = rec[0], rec[1]
        mine[0], mine[1], mine[2] = check.words  # CHECK_WORDS of them
        if payload is not None:  # as bytes: numpy names bfloat16, the buffer protocol not
            rec[3][:payload.nbytes] = payload.reshape(-1).view(np.uint8)
        req = self._meeting
        if req is None:
            req = self.comm.Iallgather(mine, rows)
        else:
            req.Start()
        if not req.Test():  # spun on directly: a Work is built only for a failed wait
            try:
                spin(req.Test, min(check.timeout, self.timeout),
                     partial(late_text, self, op + " (check)", seq), check.watch, self.spin_s)
            except BaseException as e:
                # MPI may still write the records: never reused, never freed (MPIWork).
                # The meeting stays posted, so no later one may start: a persistent
                # all_gather matches no other kind, and every rank must end anyway.
                _MEETINGS.pop(id(self._meeting), None)
                self._records, self._inline, self._meeting = _records(self.size), None, None
                self._met_failed = f"the check of {op} #{seq} failed ({type(e).__name__})"
                work = MPIWork(req, self, op + " (check)", seq, keep=rec)
                if isinstance(e, self.mpi_error):
                    raise work.error(e) from e
                raise
        words = rec[2].tolist()
        if not check.agrees(words):
            raise Disagreement(f"{op} #{seq} on rank {self.rank} of {self.describe()}", words)
        return rec[4]

    def probe(self, peer: int | None, tag: int) -> int | None:
        """The rank of a peer (``peer``, or any when None) whose message with ``tag`` has
        arrived, or None (``MPI_Iprobe``: nothing is received)."""
        status = self._status
        if self.comm.Iprobe(self._any if peer is None else peer, tag, status):
            return status.Get_source()  # type: ignore[no-any-return]
        return None

    def set_all_reduce_policy(self, *, algorithm: str, min_bytes: int = 0,
                              max_bytes: int | None = None,
                              cap_bytes: int = DEFAULT_SHM_CAP, planner: Any = None,
                              nodes: Any = None) -> str:
        """Choose how all_reduce runs; return the choice ("mpi", "shm", "hierarchical", "auto").

        Collective, with the same arguments on every rank (checked: CollectiveMismatchError).
        ``"auto"``: the planner's bands (:mod:`fuelspmd_mpi._policy`), and a ``split`` plans
        its group with it too; ``"shm"`` or ``"hierarchical"``: that path for
        ``min_bytes..max_bytes`` (shm: float32/float64/int32/int64, at most ``cap_bytes`` of
        window per rank; hierarchical: split by ``nodes``, each rank's node index, else by
        shared memory); ``"mpi"``: MPI's own, the windows and splits freed. A path that cannot
        apply runs MPI's own and says why (:meth:`explain_all_reduce`); a manual choice then
        returns "mpi". A split starts with MPI's own unless the policy is auto.
        """
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"set_all_reduce_policy: algorithm must be one of "
                              f"{list(ALGORITHMS)}, got {algorithm!r}")
        if int(cap_bytes) < MIN_CLASS:
            raise ConfigError(f"set_all_reduce_policy: cap_bytes={cap_bytes} is below the "
                              f"smallest shared window ({MIN_CLASS} bytes per rank); pass at "
                              f"least {MIN_CLASS}")
        top = 2**62 if max_bytes is None else int(max_bytes)
        if not 0 <= int(min_bytes) <= top:
            raise ConfigError(f"set_all_reduce_policy: need 0 <= min_bytes <= max_bytes, got "
                              f"min_bytes={min_bytes}, max_bytes={max_bytes}")
        auto = algorithm == "auto"
        source = f"set_all_reduce_policy(algorithm={algorithm!r})"
        if auto:
            if planner is None:
                raise ConfigError("set_all_reduce_policy(algorithm='auto') needs planner=, "
                                  "e.g. fuelspmd.cost.all_reduce_planner(model)")
            data = planner(self.world_ranks)
            bands = parse_bands(data["bands"])
            nodes = data.get("nodes")
        else:
            bands = manual_bands(algorithm, int(min_bytes), top, source)
        if nodes is not None and len(nodes) != self.size:
            raise ConfigError(f"set_all_reduce_policy: nodes has {len(nodes)} entries for a "
                              f"group of {self.size}; give the node index of every rank")
        agree(self, f"set_all_reduce_policy on {self.describe()} (planners must be built "
              f"from the same calibration)", algorithm=algorithm, min_bytes=int(min_bytes),
              max_bytes=top, cap_bytes=int(cap_bytes), plan=[(u, a) for u, a, _ in bands],
              nodes=None if nodes is None else list(nodes))
        self._free_shm()
        self._planner = planner if auto else None
        self._cap = int(cap_bytes)
        route = Route.of(bands)
        if self.size > 1 and "shm" in route.algorithms:
            self._shm = ShmAllReduce.create(self.comm, MPI=self._MPI, cap_bytes=cap_bytes,
                                            owner=self)
            if self._shm is None:
                route = route.without("shm", "does not apply: the ranks do not all share "
                                      "memory (a split per node can use it)")
        if self.size > 1 and "hierarchical" in route.algorithms:
            self._hier = Hierarchical.create(self.comm, MPI=self._MPI, owner=self,
                                             nodes=nodes)
            if self._hier is None:
                route = route.without("hierarchical", "does not apply: the group is on one "
                                      "node, or its nodes hold different numbers of its ranks")
        self._route = route  # one rank: never looked at (nothing to reduce)
        if auto:
            return "auto"
        return algorithm if self.size > 1 and algorithm in route.algorithms else "mpi"

    def all_reduce_algorithm(self, nbytes: int, dtype: Any = None) -> str:
        """The algorithm an all-reduce of ``nbytes`` (of ``dtype``) runs: mpi, shm or
        hierarchical (a dtype those paths do not reduce, float16 say, runs MPI's own)."""
        return self._path(int(nbytes), dtype)

    def explain_all_reduce(self, nbytes: int, dtype: Any = None) -> str:
        """Say which algorithm an all-reduce of ``nbytes`` (of ``dtype``) runs, and why."""
        nbytes = int(nbytes)
        if self.size == 1:
            return f"all_reduce of {nbytes} B: nothing to do (one rank)"
        text, shm = self._route.explain(nbytes), self._shm
        algo = self._route.band(nbytes).algorithm
        if self._path(nbytes, dtype) == algo:
            return text
        if algo == "shm" and shm is not None and not shm.fits(nbytes):
            return (f"{text}; but its window ({size_class(nbytes)} B per rank) is above the "
                    f"cap of {shm.cap_bytes} B per rank, so MPI's own runs it"
                    + (f" ({shm.cap_note})" if shm.cap_note else ""))
        return f"{text}; but {np.dtype(dtype).name} runs MPI's own (that path does not reduce it)"

    def lend(self, nbytes: int, dtype: Any) -> np.ndarray | None:
        """A free lent area (uint8, at least ``nbytes``) where an all_reduce of ``nbytes`` of
        ``dtype`` reduces as it lies (the ``lend`` capability), or None: ShmAllReduce.lend."""
        if nbytes > 0 and self._path(nbytes, dtype) == "shm":
            return self._shm.lend(nbytes)  # type: ignore[union-attr]
        return None

    def lent(self, buf: Any) -> bool:
        """Whether ``buf`` lies in one of this transport's lent areas (see :meth:`lend`)."""
        return self._shm is not None and type(buf) is _ndarray and self._shm.lent(buf)

    @property
    def shared_window_bytes(self) -> int:
        """Bytes of shared window this rank holds for the shm all-reduce (0 when it is off)."""
        return 0 if self._shm is None else self._shm.allocated_bytes

    def _free_shm(self) -> None:
        """Free the shm windows and the node/rail splits; the route falls back to MPI."""
        self._inline = None  # its path was chosen under the old route
        if self._shm is not None:
            self._kept_windows += self._shm.free()
            self._shm = None
        if self._hier is not None:
            self._hier.free()
            self._hier = None
        self._route = _MPI_ONLY

    def _finish(self, result: np.ndarray, out: Any, avg: bool) -> Callable[[], None] | None:
        """What completes a reduction into ``result``: avg's division, then the copy into
        ``out`` when ``result`` is a float32 stage (one rounding to the 16-bit type)."""
        size = self.size
        if result is out:
            return (lambda: divide(out, size)) if avg else None

        def finish() -> None:
            if avg:
                divide(result, size)
            out.reshape(-1)[...] = result.reshape(-1)

        return finish

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp | str) -> Work:
        """Reduce ``send`` (``n * size``) over the group; block ``rank`` lands in ``recv``."""
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        return self._blocks("reduce_scatter", send, recv, self.size, 1, op)

    def all_gather(self, send: Any, recv: Any) -> Work:
        """Gather every rank's ``send`` (``n``) into ``recv`` (``n * size``), in rank order."""
        return self._blocks("all_gather", send, recv, 1, self.size)

    def broadcast(self, buf: Any, root: int) -> Work:
        """Copy ``root``'s ``buf`` into every rank's ``buf``."""
        check_peer("broadcast", root, self.size, what="root")
        if not _plain(buf, self._move):
            if (staged := self._staged("broadcast", (buf,), (0,), root)) is not None:
                return staged
        seq = self._next()
        if buf.size == 0 or self.size == 1:
            return DONE
        req = self.comm.Ibcast(self._types.spec(buf), root=int(root))
        return MPIWork(req, self, f"broadcast(root={root})", seq, keep=buf)

    def all_to_all(self, send: Any, recv: Any) -> Work:
        """Send block ``r`` of ``send`` to rank ``r``; block ``r`` of ``recv`` comes from r."""
        return self._blocks("all_to_all", send, recv, self.size, self.size)

    def _blocks(self, op: str, send: Any, recv: Any, send_factor: int, recv_factor: int,
                *reduce: ReduceOp) -> Work:
        """reduce_scatter (``reduce``: its op), all_gather and all_to_all, whose ``send``
        and ``recv`` sizes are in the ratio of the factors; one rank (or nothing to move)
        completes without MPI."""
        if not (_plain(send, self._move) and _plain(recv, self._move)
                and send.dtype == recv.dtype
                and recv.size * send_factor == send.size * recv_factor
                and send.size % send_factor == 0):
            staged = self._staged(op, (send, recv), (1,), *reduce, send_factor=send_factor,
                                  recv_factor=recv_factor)
            if staged is not None:
                return staged
        plan = self._types.plan(send.dtype, reduce[0], op) if reduce else None
        seq = self._next()
        if send.size == 0:
            return DONE
        if self.size == 1:
            recv.reshape(-1)[...] = send.reshape(-1)
            return DONE
        if plan is None:
            spec = self._types.spec
            start = self.comm.Iallgather if op == "all_gather" else self.comm.Ialltoall
            return MPIWork(start(spec(send), spec(recv)), self, op, seq, keep=(send, recv))
        src, dst = ((send, recv) if plan.stage is None
                    else (send.astype(plan.stage), np.empty(recv.size, plan.stage)))
        req = self.comm.Ireduce_scatter_block([src, plan.datatype], [dst, plan.datatype],
                                               plan.mpi_op)
        return MPIWork(req, self, op, seq, self._finish(dst, recv, plan.avg), (src, dst, recv))

    def barrier(self) -> Work:
        """Complete once every rank of the group has entered the barrier."""
        seq = self._next()
        if self.size == 1:
            return DONE
        return MPIWork(self.comm.Ibarrier(), self, "barrier", seq)

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        """Send ``buf`` to ``peer`` (a rank of this group) with ``tag``."""
        return self._p2p("send", buf, peer, tag)

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        """Receive into ``buf`` from ``peer`` with ``tag``; the sender's size must match."""
        return self._p2p("recv", buf, peer, tag)

    def _p2p(self, op: str, buf: Any, peer: int, tag: int) -> Work:
        check_peer(op, peer, self.size)
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= self.tag_bound:
            raise ConfigError(f"{op}: tag {tag!r} is outside 0..{self.tag_bound}, the tags this "
                              f"MPI library allows; use a smaller non-negative tag")
        if not _plain(buf, self._move):
            if (staged := self._staged(op, (buf,), (0,) if op == "recv" else (), peer,
                                       tag)) is not None:
                return staged
        start = self.comm.Isend if op == "send" else self.comm.Irecv
        req = start(self._types.spec(buf), int(peer), int(tag))
        return MPIWork(req, self, (op, int(peer), int(tag)), self._next(), keep=buf)

    def split(self, color: int, key: int) -> MPITransport:
        """Return the transport of the ranks that pass the same ``color``, ordered by ``key``.
        ``MPI_Comm_split`` has no deadline, so the colors are first all-gathered under the
        transport's: a rank that never calls split gives CommTimeoutError, not a hang."""
        for name, v, lo in (("color", color, 0), ("key", key, -(2**31))):
            if not isinstance(v, (int, np.integer)) or not lo <= v < 2**31:
                raise ConfigError(f"split: {name} must be an integer in {lo}..2**31-1, "
                                  f"got {v!r}")
        self.all_gather(np.array([color, key], np.int64), np.empty(2 * self.size, np.int64)).wait()
        comm = self.comm.Split(int(color), int(key))
        child = MPITransport(comm, MPI=self._MPI, timeout=self.timeout, types=self._types,
                             label=f"split(color={color}) of {self.label}")
        if self._planner is not None:  # the cost model plans every group it splits into
            child.set_all_reduce_policy(algorithm="auto", planner=self._planner,
                                        cap_bytes=self._cap)
        return child

    def finalize(self) -> None:
        """Free the shared windows and a split's communicator (collective when either is
        held). MPI itself stays initialised until the process exits (mpi4py finalizes it
        then): it cannot be initialised twice, and a later ``fs.init()`` builds a fresh
        transport over the same COMM_WORLD."""
        self._free_shm()
        if self._meeting is not None:  # inactive: a failed meeting dropped it (see _meet)
            _MEETINGS.pop(id(self._meeting), None)
            self._meeting.Free()
            self._meeting = None
        MPI = self._MPI
        if self.comm not in (MPI.COMM_NULL, MPI.COMM_WORLD, MPI.COMM_SELF):
            self.comm.Free()

    def abort(self, code: int = 1) -> NoReturn:
        """Flush stdio and end every rank of the job with ``code`` (``MPI_Abort``)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(int(code))
        # MPICH's MPI_Abort can return once it has told the process manager, which then
        # kills the job; this rank must not run on meanwhile (nor print a second report).
        os._exit(int(code) or 1)
