"""MPITransport: the Transport seam over one MPI communicator, through mpi4py's buffer API.

Every operation is the non-blocking MPI call (Iallreduce, Iallgather,
Ireduce_scatter_block, Ibcast, Ialltoall, Isend, Irecv, Ibarrier) wrapped in an
:class:`~fuelspmd_mpi._work.MPIWork`, whose ``wait`` polls ``MPI_Test`` against a deadline:
a rank that never joins gives CommTimeoutError, never a hang. Only the uppercase buffer
methods are used (mpi4py's pickle API is 10x slower on arrays); all_reduce works in place
(``MPI_IN_PLACE``). Buffers follow the layout in :mod:`fuelspmd.transport`; dtypes and
reduce ops map onto MPI as :mod:`fuelspmd_mpi._work` describes.

Each transport numbers the operations it starts (``seq``, from 0, collectives and
point-to-point alike) so that a timeout names which one of the group's operations hung.
The one exception to non-blocking: an all_reduce switched onto the shared-memory path
(:meth:`MPITransport.set_all_reduce_policy`, :mod:`fuelspmd_mpi._shm`) runs to completion
inside the call, its three barriers polled under the same deadline.

Collectives on empty buffers complete at once without calling MPI (every rank of the
group has the same, empty, sizes); sends and receives of 0 elements still go through MPI
so that they match their peer's.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import numpy as np

from fuelspmd.errors import CollectiveMismatchError, ConfigError, DeviceError
from fuelspmd.transport import DONE, ReduceOp, Work, check_buffers, check_peer
from fuelspmd_mpi._shm import MIN_CLASS, SHM_DTYPES, ShmAllReduce
from fuelspmd_mpi._work import MPIWork, Types, divide

__all__ = ["MPITransport"]

_COLLECTIVE_HINT = ("a rank of the group never joined it, or joined a different collective "
                    "(every rank must issue the same collectives in the same order)")
_ndarray = np.ndarray
_ALGORITHMS = ("mpi", "shm")
DEFAULT_SHM_CAP = 256 << 20  # bytes of shared window per rank, by default


def _plain(buf: Any, move: dict[np.dtype, Any]) -> bool:
    """Whether ``buf`` surely passes check_buffers: a C-contiguous numpy array of a known dtype.

    check_buffers costs ~4 us (a dtype lookup by name); this costs ~0.15 us. Anything else
    goes through check_buffers, which raises the typed error, so the errors are its own.
    """
    return type(buf) is _ndarray and buf.flags.c_contiguous and buf.dtype in move


def _on_host(op: str, *bufs: Any) -> None:
    """Raise DeviceError for a buffer that is not a numpy array (a cupy array, say).

    The PyPI MPICH is not CUDA-aware, so handing it device memory would crash the rank;
    device buffers go through the nccl transport, or are staged by the caller.
    """
    for b in bufs:
        if not isinstance(b, _ndarray):
            raise DeviceError(
                f"{op}: the MPI transport takes host (numpy) buffers, got "
                f"{type(b).__module__}.{type(b).__name__}; move it to the host first "
                f"(fuelspmd.backend.to_host) or use a device transport (nccl)")


class MPITransport:
    """The Transport of one MPI communicator (COMM_WORLD, or a split of it)."""

    name = "mpi"

    def __init__(self, comm: Any, *, MPI: Any, timeout: float, label: str = "world",
                 types: Types | None = None) -> None:
        if not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._MPI = MPI
        self._comm = comm
        self.timeout = float(timeout)
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.label = label
        self._types = types if types is not None else Types(MPI)
        self._move = self._types.move
        self._plans = self._types.plans
        self.mpi_error: type[Exception] = MPI.Exception
        group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(self.size)), world_group)
        finally:
            group.Free()
            world_group.Free()
        self.world_ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        self._tag_ub = int(comm.Get_attr(MPI.TAG_UB) or 32767)
        self._seq = 0
        # the shared-memory all-reduce (set_all_reduce_policy): off until the layer above
        # decides; (min, max) bytes it serves
        self._shm: ShmAllReduce | None = None
        self._shm_range = (0, -1)

    @property
    def comm(self) -> Any:
        """The mpi4py communicator underneath (for baselines and tests; not for arrays)."""
        return self._comm

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
        """Name operation ``seq`` and say who failed to join it (for CommTimeoutError).

        ``op`` is an op name, or (name, peer, tag) for send and recv.
        """
        where = f"on rank {self.rank} of {self.describe()}"
        if isinstance(op, tuple):
            op, peer, tag = op
            direction, other = ("to", "recv") if op == "send" else ("from", "send")
            return (f"{op} #{seq} {direction} peer {peer} (world rank "
                    f"{self.world_ranks[peer]}) tag {tag} {where}",
                    f"peer {peer} never posted the matching {other} with tag {tag}")
        return f"{op} #{seq} {where}", _COLLECTIVE_HINT

    def _check2(self, op: str, send: Any, recv: Any, send_factor: int, recv_factor: int) -> None:
        if not (_plain(send, self._move) and _plain(recv, self._move)
                and send.dtype == recv.dtype
                and recv.size * send_factor == send.size * recv_factor
                and send.size % send_factor == 0):
            check_buffers(op, self.size, send, recv, send_factor=send_factor,
                          recv_factor=recv_factor)
            _on_host(op, send, recv)

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(self, buf: Any, op: ReduceOp | str) -> Work:
        """Reduce ``buf`` over the group in place (``MPI_Iallreduce`` with ``MPI_IN_PLACE``).

        Sizes that :meth:`set_all_reduce_policy` put on the shared-memory path go through
        it instead and are complete when this returns (the Work is already done).
        """
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        # The hot path (measured: issue + wait cost ~1.5-2.5 us of Python over the MPI
        # calls): a plan cached for this dtype means a supported dtype, so a contiguous
        # ndarray needs no check_buffers.
        plan = (self._plans[op._value_].get(buf.dtype)
                if type(buf) is _ndarray and buf.flags.c_contiguous else None)
        if plan is None:
            check_buffers("all_reduce", self.size, buf)
            _on_host("all_reduce", buf)
            plan = self._types.plan(buf.dtype, op, "all_reduce")
        seq = self._seq
        self._seq = seq + 1
        if buf.size == 0 or self.size == 1:
            return DONE
        shm = self._shm
        if (shm is not None and self._shm_range[0] <= buf.nbytes <= self._shm_range[1]
                and plan.stage is None and buf.dtype in SHM_DTYPES
                and shm.all_reduce(buf, op, seq)):
            return DONE
        IN_PLACE = self._MPI.IN_PLACE
        if plan.stage is None:
            req = self._comm.Iallreduce(IN_PLACE, [buf, plan.datatype], plan.mpi_op)
            if not plan.avg:
                return MPIWork(req, self, "all_reduce", seq, keep=buf)
            size = self.size
            return MPIWork(req, self, "all_reduce", seq, lambda: divide(buf, size), buf)
        stage = buf.astype(plan.stage)
        req = self._comm.Iallreduce(IN_PLACE, [stage, plan.datatype], plan.mpi_op)
        return MPIWork(req, self, "all_reduce", seq, self._unstage(stage, buf, plan.avg),
                       (stage, buf))

    def set_all_reduce_policy(self, *, algorithm: str, min_bytes: int = 0,
                              max_bytes: int | None = None,
                              cap_bytes: int = DEFAULT_SHM_CAP) -> str:
        """Choose how all_reduce runs for buffers of ``min_bytes..max_bytes``; return the choice.

        Collective: every rank calls it with the same arguments (checked: ranks that differ
        raise CollectiveMismatchError). ``algorithm="shm"`` routes float32/float64/int32/
        int64 all-reduces of that size range through the shared-memory path
        (:mod:`fuelspmd_mpi._shm`), holding at most ``cap_bytes`` of shared window per rank;
        ``"mpi"`` turns it off and frees the windows. The decision belongs to the layer
        above (the cost model predicts where shm wins: it loses to MPI below about 1 MiB
        on the measured machines). Returns "shm", or "mpi" when shm cannot apply here: a
        group of one rank, or one whose ranks do not all share memory (several nodes; a
        split per node can use it). A split starts with the policy off.
        """
        if algorithm not in _ALGORITHMS:
            raise ConfigError(f"set_all_reduce_policy: algorithm must be one of "
                              f"{list(_ALGORITHMS)}, got {algorithm!r}")
        if int(cap_bytes) < MIN_CLASS:
            raise ConfigError(f"set_all_reduce_policy: cap_bytes={cap_bytes} is below the "
                              f"smallest shared window ({MIN_CLASS} bytes per rank); pass at "
                              f"least {MIN_CLASS}")
        top = 2**62 if max_bytes is None else int(max_bytes)
        if not 0 <= int(min_bytes) <= top:
            raise ConfigError(f"set_all_reduce_policy: need 0 <= min_bytes <= max_bytes, got "
                              f"min_bytes={min_bytes}, max_bytes={max_bytes}")
        mine = np.array([_ALGORITHMS.index(algorithm), int(min_bytes), top, int(cap_bytes)],
                        np.int64)
        every = np.empty((self.size, 4), np.int64)
        self.all_gather(mine, every.reshape(-1)).wait()
        if (every != mine).any():
            rows = "; ".join(f"rank {k}: {_ALGORITHMS[int(a)]} {lo}..{hi} cap {c}"
                             for k, (a, lo, hi, c) in enumerate(every.tolist()))
            raise CollectiveMismatchError(
                f"set_all_reduce_policy on {self.describe()}: the ranks passed different "
                f"policies ({rows}); every rank must pass the same arguments")
        if algorithm == "mpi" or self.size == 1:
            self._free_shm()
            return "mpi"
        if self._shm is None or self._shm.cap_bytes != cap_bytes:
            self._free_shm()
            self._shm = ShmAllReduce.create(self._comm, MPI=self._MPI, cap_bytes=cap_bytes,
                                            sync=self._shm_sync)
        if self._shm is None:
            return "mpi"
        self._shm_range = (int(min_bytes), top)
        return "shm"

    def shared_buffer(self, nbytes: int) -> np.ndarray:
        """Return ``nbytes`` (uint8) that an all_reduce can take without copying them in.

        Collective when the shm policy is on (it may allocate a window; every rank passes
        the same ``nbytes``): the view lies at the start of this rank's segment of the
        shared window, so ``all_reduce(buf.view(dtype).reshape(shape))`` of those bytes
        skips the copy in. Without the shm path (policy off, several nodes) it is a plain
        array. Valid until :meth:`finalize` or the next ``set_all_reduce_policy``.
        """
        if self._shm is None:
            return np.empty(int(nbytes), np.uint8)
        return self._shm.shared_buffer(int(nbytes))

    @property
    def shared_window_bytes(self) -> int:
        """Bytes of shared window this rank holds for the shm all-reduce (0 when it is off)."""
        return 0 if self._shm is None else self._shm.allocated_bytes

    def _shm_sync(self, node: Any, seq: int) -> None:
        MPIWork(node.Ibarrier(), self, "all_reduce (shared memory)", seq).wait()

    def _free_shm(self) -> None:
        if self._shm is not None:
            self._shm.free()
            self._shm = None
        self._shm_range = (0, -1)

    def _unstage(self, stage: np.ndarray, out: Any, avg: bool) -> Any:
        size = self.size

        def finish() -> None:
            if avg:
                np.divide(stage, size, out=stage)
            out.reshape(-1)[...] = stage.reshape(-1)

        return finish

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp | str) -> Work:
        """Reduce ``send`` (``n * size``) over the group; block ``rank`` lands in ``recv``."""
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        self._check2("reduce_scatter", send, recv, self.size, 1)
        plan = self._types.plan(send.dtype, op, "reduce_scatter")
        seq = self._next()
        if recv.size == 0:
            return DONE
        if self.size == 1:
            recv.reshape(-1)[...] = send.reshape(-1)
            return DONE
        if plan.stage is None:
            req = self._comm.Ireduce_scatter_block([send, plan.datatype], [recv, plan.datatype],
                                                   plan.mpi_op)
            size = self.size
            finish = (lambda: divide(recv, size)) if plan.avg else None
            return MPIWork(req, self, "reduce_scatter", seq, finish, (send, recv))
        stage_send = send.astype(plan.stage)
        stage = np.empty(recv.size, plan.stage)
        req = self._comm.Ireduce_scatter_block([stage_send, plan.datatype],
                                               [stage, plan.datatype], plan.mpi_op)
        return MPIWork(req, self, "reduce_scatter", seq, self._unstage(stage, recv, plan.avg),
                       (stage_send, stage, recv))

    def all_gather(self, send: Any, recv: Any) -> Work:
        """Gather every rank's ``send`` (``n``) into ``recv`` (``n * size``), in rank order."""
        self._check2("all_gather", send, recv, 1, self.size)
        seq = self._next()
        if send.size == 0:
            return DONE
        if self.size == 1:
            recv.reshape(-1)[...] = send.reshape(-1)
            return DONE
        t = self._types
        dt = t.move[send.dtype]
        req = self._comm.Iallgather([t.view(send), dt], [t.view(recv), dt])
        return MPIWork(req, self, "all_gather", seq, keep=(send, recv))

    def broadcast(self, buf: Any, root: int) -> Work:
        """Copy ``root``'s ``buf`` into every rank's ``buf``."""
        check_peer("broadcast", root, self.size, what="root")
        if not _plain(buf, self._move):
            check_buffers("broadcast", self.size, buf)
            _on_host("broadcast", buf)
        seq = self._next()
        if buf.size == 0 or self.size == 1:
            return DONE
        t = self._types
        req = self._comm.Ibcast([t.view(buf), t.move[buf.dtype]], root=int(root))
        return MPIWork(req, self, f"broadcast(root={root})", seq, keep=buf)

    def all_to_all(self, send: Any, recv: Any) -> Work:
        """Send block ``r`` of ``send`` to rank ``r``; block ``r`` of ``recv`` comes from r."""
        self._check2("all_to_all", send, recv, self.size, self.size)
        seq = self._next()
        if send.size == 0:
            return DONE
        if self.size == 1:
            recv.reshape(-1)[...] = send.reshape(-1)
            return DONE
        t = self._types
        dt = t.move[send.dtype]
        req = self._comm.Ialltoall([t.view(send), dt], [t.view(recv), dt])
        return MPIWork(req, self, "all_to_all", seq, keep=(send, recv))

    def barrier(self) -> Work:
        """Complete once every rank of the group has entered the barrier."""
        seq = self._next()
        if self.size == 1:
            return DONE
        return MPIWork(self._comm.Ibarrier(), self, "barrier", seq)

    # -- point to point ------------------------------------------------------------------

    def _check_p2p(self, op: str, buf: Any, peer: int, tag: int) -> None:
        check_peer(op, peer, self.size)
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= self._tag_ub:
            raise ConfigError(f"{op}: tag {tag!r} is outside 0..{self._tag_ub}, the tags this "
                              f"MPI library allows; use a smaller non-negative tag")
        if not _plain(buf, self._move):
            check_buffers(op, self.size, buf)
            _on_host(op, buf)

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        """Send ``buf`` to ``peer`` (a rank of this group) with ``tag``."""
        self._check_p2p("send", buf, peer, tag)
        t = self._types
        req = self._comm.Isend([t.view(buf), t.move[buf.dtype]], dest=int(peer), tag=int(tag))
        return MPIWork(req, self, ("send", int(peer), int(tag)), self._next(), keep=buf)

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        """Receive into ``buf`` from ``peer`` with ``tag``; the sender's size must match."""
        self._check_p2p("recv", buf, peer, tag)
        t = self._types
        req = self._comm.Irecv([t.view(buf), t.move[buf.dtype]], source=int(peer), tag=int(tag))
        return MPIWork(req, self, ("recv", int(peer), int(tag)), self._next(), keep=buf)

    # -- groups and teardown -------------------------------------------------------------

    def split(self, color: int, key: int) -> MPITransport:
        """Return the transport of the ranks that pass the same ``color``, ordered by ``key``.

        ``MPI_Comm_split`` blocks until every rank of the group calls it, so the colors are
        first all-gathered under the deadline: a rank that never calls split gives
        CommTimeoutError here instead of a hang inside MPI.
        """
        for name, v, lo in (("color", color, 0), ("key", key, -(2**31))):
            if not isinstance(v, (int, np.integer)) or not lo <= v < 2**31:
                raise ConfigError(f"split: {name} must be an integer in {lo}..2**31-1, "
                                  f"got {v!r}")
        mine = np.array([color, key], np.int64)
        every = np.empty(2 * self.size, np.int64)
        self.all_gather(mine, every).wait()
        comm = self._comm.Split(int(color), int(key))
        return MPITransport(comm, MPI=self._MPI, timeout=self.timeout, types=self._types,
                            label=f"split(color={color}) of {self.label}")

    def finalize(self) -> None:
        """Release this transport: shared windows and a split's communicator are freed.

        Collective over the group when either is held.

        The world's MPI stays initialised until the process exits (mpi4py calls
        MPI_Finalize then), since MPI cannot be initialised twice: a later ``fs.init()``
        builds a fresh transport over the same COMM_WORLD.
        """
        self._free_shm()
        MPI = self._MPI
        comm = self._comm
        if comm != MPI.COMM_NULL and comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF:
            comm.Free()

    def abort(self, code: int = 1) -> NoReturn:
        """Flush stdio and end every rank of the job with ``code`` (``MPI_Abort``)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(int(code))
        # MPICH's MPI_Abort can return once it has told the process manager, which then
        # kills the job; this rank must not run on meanwhile (nor print a second report).
        os._exit(int(code) or 1)
