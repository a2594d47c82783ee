"""NCCLTransport: the Transport seam over one NCCL communicator, with MPI beside it.

Every group has two channels over the same ranks:

- an :class:`~fuelspmd_mpi.MPITransport` (the bootstrap and host channel): it broadcasts
  the ``ncclUniqueId``, splits groups, and carries every operation whose buffers are host
  (numpy) arrays. ``fs.init`` gathers host names that way and the collective guard sends
  its fingerprints over it (``comm`` is its mpi4py communicator), so neither needs a GPU
  buffer or an NCCL communicator;
- one NCCL communicator: rank 0 of the group calls ``ncclGetUniqueId``, the id is
  broadcast over the group's MPI channel (under the deadline), and every rank calls
  ``ncclCommInitRank``. The world's is made by the plugin, a split's by ``split`` (an
  ``MPI_Comm_split`` and an ``ncclCommInitRank``); a transport built without one (as the
  tests without a GPU do) makes it on its first device operation.

Device operations run on the current cupy stream of the buffer's device (the stream the
code that made the tensor ran on), return an :class:`~fuelspmd_nccl._work.NCCLWork` over a
CUDA event, and are numbered (``seq``) so that a timeout names the one that hung.
all_to_all, send and recv are ``ncclSend``/``ncclRecv`` inside ``ncclGroupStart``/
``ncclGroupEnd``. NCCL has no tags: sends and receives between two ranks match in the
order they are issued (fuelspmd's Communicator numbers them so, and passes the tag only
for MPI); the tag is checked and named in messages. A send or receive to this same rank
is a device copy: a lone ncclSend to oneself waits for its ncclRecv in the same group
call, which a separate ``recv`` call can never be.

There is no size-1 shortcut here: at one rank every collective still goes through NCCL
(cheap, and how a one-GPU machine checks the whole path).
"""

from __future__ import annotations

import faulthandler
from collections import deque
from typing import Any, NoReturn

import numpy as np

from fuelspmd.backend import Device, on_gpu
from fuelspmd.errors import CollectiveMismatchError, CommError, ConfigError, DeviceError
from fuelspmd.transport import DONE, ReduceOp, Work, check_buffers, check_peer
from fuelspmd_nccl._binding import nccl_version, unique_id_format
from fuelspmd_nccl._tables import NCCL_DTYPES, plan_for
from fuelspmd_nccl._work import NCCLWork

__all__ = ["NCCLTransport", "init_rank"]

_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_TAG_MAX = 2**31 - 1


def init_rank(nccl: Any, size: int, uid: Any, rank: int, timeout: float) -> Any:
    """``ncclCommInitRank`` (cupy's ``NcclCommunicator``), or the process ends past
    ``timeout`` seconds with a message.

    The call returns once every rank of the group has joined; a rank that never does, or
    NCCL stuck in its bootstrap, would hang it for good. cupy's binding holds the GIL
    through the call, so no Python thread or signal handler runs until it returns: the
    deadline is faulthandler's watchdog, a C thread that needs no GIL. Past it, it writes
    ``Timeout (H:MM:SS)!`` and every thread's stack (this one in ``init_rank``) to stderr
    and exits with status 1, which the launcher turns into the end of the job. It is one
    timer per process: inside ``fs.init`` this re-arms the startup deadline with the same
    timeout and ends it, and ``ncclCommInitRank`` is the last wait of the startup.
    """
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    finally:
        faulthandler.cancel_dump_traceback_later()


class _SelfRecv:
    """A receive from this same rank, completed when a matching self-send is posted."""

    __slots__ = ("buf", "done", "tag", "transport")

    def __init__(self, transport: NCCLTransport, buf: Any, tag: int) -> None:
        self.transport, self.buf, self.tag, self.done = transport, buf, tag, False

    def test(self) -> bool:
        if not self.done:
            self.done = self.transport._take_self(self.buf, self.tag)
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        if not self.test():
            raise CollectiveMismatchError(
                f"recv from rank {self.transport.rank} (itself) with tag {self.tag}: no "
                f"matching send to itself was posted before the wait, so it can never "
                f"complete; post the send first")


class NCCLTransport:
    """The Transport of one group: NCCL for device buffers, MPI for host buffers."""

    name = "nccl"
    tag_bound = _TAG_MAX
    capabilities = frozenset({"probe", "finalize", "device"})

    def __init__(self, mpi: Any, *, nccl: Any, device_index: int, timeout: float,
                 label: str = "world") -> None:
        if not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._mpi = mpi
        self._nccl = nccl
        self._version = nccl_version(nccl)
        self.device = Device("cuda", int(device_index))
        self.timeout = float(timeout)
        self.rank: int = mpi.rank
        self.size: int = mpi.size
        self.world_ranks: tuple[int, ...] = tuple(mpi.world_ranks)
        self.label = label
        self._comm: Any = None  # the NCCL communicator, made on first device use
        self._aborted: str | None = None
        self._seq = 0
        self._self_mail: deque[tuple[int, Any]] = deque()
        self._barrier_buf: Any = None

    # -- the MPI side ----------------------------------------------------------------------

    @property
    def comm(self) -> Any:
        """The mpi4py communicator of the host channel (for the guard's control messages)."""
        return self._mpi.comm

    @property
    def mpi(self) -> Any:
        """The MPI transport of the same ranks (bootstrap and host buffers)."""
        return self._mpi

    def probe(self, peer: int | None, tag: int) -> int | None:
        """The ``probe`` capability of the host channel (host messages go over MPI)."""
        return self._mpi.probe(peer, tag)  # type: ignore[no-any-return]

    def describe(self) -> str:
        """Name this group for messages: label, size, world ranks and this rank's GPU."""
        ranks = list(self.world_ranks)
        shown = str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}..{ranks[-1]}] ({len(ranks)})"
        return f"NCCL group {self.label} of {self.size} (world ranks {shown}, {self.device})"

    def __repr__(self) -> str:
        return f"NCCLTransport(rank={self.rank}, {self.describe()})"

    def explain(self, op: str, seq: int) -> str:
        """Name device operation ``seq`` for a CommError or CommTimeoutError message."""
        return f"{op} #{seq} on rank {self.rank} of {self.describe()}"

    # -- the NCCL communicator -------------------------------------------------------------

    def connect(self) -> Any:
        """Return the NCCL communicator, making it now if needed; collective over the group.

        Rank 0 draws a fresh ``ncclUniqueId``, the MPI channel broadcasts it under the
        deadline, and every rank joins with ``ncclCommInitRank`` on this rank's GPU
        (:func:`init_rank`: under the deadline too).
        """
        if self._aborted is not None:
            raise CommError(f"{self.describe()}: the NCCL communicator was aborted "
                            f"({self._aborted}); it cannot be used again, end the job")
        if self._comm is not None:
            return self._comm
        import cupy

        nccl = self._nccl
        uid = self.unique_id()
        with cupy.cuda.Device(self.device.index):
            try:
                self._comm = init_rank(nccl, self.size, uid, self.rank, self.timeout)
            except nccl.NcclError as e:
                raise CommError(f"ncclCommInitRank failed on rank {self.rank} of "
                                f"{self.describe()}: {e}; set NCCL_DEBUG=INFO for NCCL's "
                                f"account (two ranks on one GPU are refused)") from e
        return self._comm

    def unique_id(self) -> Any:
        """Draw a fresh ``ncclUniqueId`` on rank 0 and broadcast it over the group's MPI
        channel (under the deadline); return it as this cupy's NcclCommunicator takes it.

        Collective over the group. The 128 bytes travel as 16 int64 (a dtype every
        transport moves); drawing needs no GPU (``ncclGetUniqueId`` only opens NCCL's
        bootstrap socket on rank 0).
        """
        raw = np.zeros(_ID_BYTES // 8, np.int64)
        if self.rank == 0:
            uid = self._nccl.get_unique_id()
            got = (np.frombuffer(uid, np.uint8) if isinstance(uid, (bytes, bytearray))
                   else np.array(uid, np.int64).astype(np.int8).view(np.uint8))
            raw.view(np.uint8)[: got.size] = got
        self._mpi.broadcast(raw, 0).wait()
        if unique_id_format() == "bytes":
            return raw.tobytes()
        return tuple(int(v) for v in raw.view(np.int8))

    def async_error(self) -> str | None:
        """Return NCCL's asynchronous error on this communicator, or None
        (``ncclCommGetAsyncError``)."""
        comm = self._comm
        if comm is None:
            return None
        try:
            comm.check_async_error()
        except self._nccl.NcclError as e:
            return str(e)
        return None

    def abort_communicator(self, reason: str) -> None:
        """``ncclCommAbort`` this group's communicator (stuck kernels end); later device
        operations raise CommError naming ``reason``."""
        comm, self._comm = self._comm, None
        self._aborted = reason
        if comm is not None:
            try:
                comm.abort()
            except self._nccl.NcclError:  # already broken: the abort's aim is met
                pass

    # -- buffers ---------------------------------------------------------------------------

    def _route(self, op: str, *bufs: Any) -> bool:
        """Return True for device buffers (NCCL), False for host ones (MPI); raise for a mix
        or for device buffers that NCCL cannot take here."""
        dev = [on_gpu(b) for b in bufs]
        if not any(dev):
            return False
        if not all(dev):
            kinds = ", ".join(type(b).__module__.split(".")[0] for b in bufs)
            raise DeviceError(f"{op}: buffers on the host and on the GPU in one operation "
                              f"({kinds}); move them to one device first")
        for b in bufs:
            if not b.flags.c_contiguous:
                raise DeviceError(f"{op}: the buffer must be C-contiguous (shape {b.shape}); "
                                  f"pass cupy.ascontiguousarray(buf)")
            if str(b.dtype) not in NCCL_DTYPES:
                plan_for(str(b.dtype), ReduceOp.SUM, version=self._version, where=op)
            if int(b.device.id) != self.device.index:
                raise DeviceError(f"{op}: the buffer is on cuda:{b.device.id} but this rank's "
                                  f"NCCL communicator drives {self.device}; move it there")
        return True

    def _start(self, op: str, keep: Any, enqueue: Any) -> Work:
        """Enqueue ``enqueue(comm, stream_ptr)`` on the current stream; return its Work."""
        import cupy

        comm = self.connect()
        seq = self._seq
        self._seq = seq + 1
        with cupy.cuda.Device(self.device.index):
            stream = cupy.cuda.get_current_stream()
            try:
                enqueue(comm, stream.ptr)
            except self._nccl.NcclError as e:
                what = self.explain(op, seq)
                self.abort_communicator(f"{what}: {e}")
                raise CommError(f"{what}: NCCL refused the operation ({e}); the communicator "
                                f"was aborted, end the job") from e
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
        return NCCLWork(event, self, op, seq, keep)

    @staticmethod
    def _bits(buf: Any) -> Any:
        """The buffer as NCCL moves it: bool as uint8 (same bytes)."""
        return buf.view("uint8") if str(buf.dtype) == "bool" else buf

    # -- collectives -----------------------------------------------------------------------

    def all_reduce(self, buf: Any, op: ReduceOp | str) -> Work:
        """Reduce ``buf`` over the group in place (``ncclAllReduce`` with send == recv)."""
        op = ReduceOp.parse(op)
        if not self._route("all_reduce", buf):
            return self._mpi.all_reduce(buf, op)
        check_buffers("all_reduce", self.size, buf)
        plan = plan_for(str(buf.dtype), op, version=self._version, where="all_reduce")
        if buf.size == 0:
            return DONE
        data = self._bits(buf)
        size = self.size

        def enqueue(comm: Any, stream: int) -> None:
            ptr = data.data.ptr
            comm.allReduce(ptr, ptr, data.size, plan.datatype, plan.op, stream)
            if plan.divide:  # integer avg: floor division, queued behind the sum
                _floor_divide(buf, size)

        return self._start("all_reduce", buf, enqueue)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp | str) -> Work:
        """Reduce ``send`` (``n * size``) over the group; block ``rank`` lands in ``recv``."""
        op = ReduceOp.parse(op)
        if not self._route("reduce_scatter", send, recv):
            return self._mpi.reduce_scatter(send, recv, op)
        check_buffers("reduce_scatter", self.size, send, recv, send_factor=self.size)
        plan = plan_for(str(send.dtype), op, version=self._version, where="reduce_scatter")
        if recv.size == 0:
            return DONE
        s, r = self._bits(send), self._bits(recv)
        size = self.size

        def enqueue(comm: Any, stream: int) -> None:
            comm.reduceScatter(s.data.ptr, r.data.ptr, r.size, plan.datatype, plan.op, stream)
            if plan.divide:
                _floor_divide(recv, size)

        return self._start("reduce_scatter", (send, recv), enqueue)

    def all_gather(self, send: Any, recv: Any) -> Work:
        """Gather every rank's ``send`` (``n``) into ``recv`` (``n * size``), in rank order."""
        if not self._route("all_gather", send, recv):
            return self._mpi.all_gather(send, recv)
        check_buffers("all_gather", self.size, send, recv, recv_factor=self.size)
        if send.size == 0:
            return DONE
        s, r = self._bits(send), self._bits(recv)
        dt = NCCL_DTYPES[str(send.dtype)]
        return self._start("all_gather", (send, recv), lambda comm, stream: comm.allGather(
            s.data.ptr, r.data.ptr, s.size, dt, stream))

    def broadcast(self, buf: Any, root: int) -> Work:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (``ncclBroadcast`` in place)."""
        check_peer("broadcast", root, self.size, what="root")
        if not self._route("broadcast", buf):
            return self._mpi.broadcast(buf, root)
        check_buffers("broadcast", self.size, buf)
        if buf.size == 0:
            return DONE
        b = self._bits(buf)
        dt = NCCL_DTYPES[str(buf.dtype)]
        return self._start(f"broadcast(root={root})", buf, lambda comm, stream: comm.broadcast(
            b.data.ptr, b.data.ptr, b.size, dt, int(root), stream))

    def all_to_all(self, send: Any, recv: Any) -> Work:
        """Send block ``r`` of ``send`` to rank ``r``; block ``r`` of ``recv`` comes from r.

        One ncclSend and one ncclRecv per rank, all inside one NCCL group call.
        """
        if not self._route("all_to_all", send, recv):
            return self._mpi.all_to_all(send, recv)
        check_buffers("all_to_all", self.size, send, recv, send_factor=self.size,
                      recv_factor=self.size)
        if send.size == 0:
            return DONE
        s, r = self._bits(send), self._bits(recv)
        dt = NCCL_DTYPES[str(send.dtype)]
        n = self.size
        step = (s.size // n) * s.itemsize
        nccl = self._nccl

        def enqueue(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                for peer in range(n):
                    comm.send(s.data.ptr + peer * step, s.size // n, dt, peer, stream)
                    comm.recv(r.data.ptr + peer * step, r.size // n, dt, peer, stream)
            finally:
                nccl.groupEnd()

        return self._start("all_to_all", (send, recv), enqueue)

    def barrier(self) -> Work:
        """Complete once every rank has reached it: a 1-element device all-reduce.

        It orders the GPUs' streams; a program that only needs the hosts in step can
        barrier the MPI channel (``transport.mpi.barrier()``).
        """
        import cupy

        if self._barrier_buf is None:
            with cupy.cuda.Device(self.device.index):
                self._barrier_buf = cupy.zeros(1, cupy.int32)
        buf = self._barrier_buf
        return self._start("barrier", buf, lambda comm, stream: comm.allReduce(
            buf.data.ptr, buf.data.ptr, 1, NCCL_DTYPES["int32"], 0, stream))

    # -- point to point --------------------------------------------------------------------

    def _check_p2p(self, op: str, buf: Any, peer: int, tag: int) -> bool:
        check_peer(op, peer, self.size)
        if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= _TAG_MAX:
            raise ConfigError(f"{op}: tag {tag!r} is outside 0..{_TAG_MAX}; use a smaller "
                              f"non-negative tag")
        device = self._route(op, buf)
        if device:
            check_buffers(op, self.size, buf)
        return device

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        """Send ``buf`` to ``peer`` (``ncclSend`` in a group call; a copy to oneself)."""
        if not self._check_p2p("send", buf, peer, tag):
            return self._mpi.send(buf, peer, tag)
        if peer == self.rank:
            import cupy

            with cupy.cuda.Device(self.device.index):
                self._self_mail.append((int(tag), buf.copy()))
            return DONE
        b = self._bits(buf)
        dt = NCCL_DTYPES[str(buf.dtype)]
        return self._start(f"send to peer {peer} (tag {tag})", buf,
                           self._p2p("send", b, dt, int(peer)))

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        """Receive into ``buf`` from ``peer`` (``ncclRecv`` in a group call); sizes must match."""
        if not self._check_p2p("recv", buf, peer, tag):
            return self._mpi.recv(buf, peer, tag)
        if peer == self.rank:
            work = _SelfRecv(self, buf, int(tag))
            work.test()
            return work
        b = self._bits(buf)
        dt = NCCL_DTYPES[str(buf.dtype)]
        return self._start(f"recv from peer {peer} (tag {tag})", buf,
                           self._p2p("recv", b, dt, int(peer)))

    def _p2p(self, kind: str, b: Any, dt: int, peer: int) -> Any:
        nccl = self._nccl

        def enqueue(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                getattr(comm, kind)(b.data.ptr, b.size, dt, peer, stream)
            finally:
                nccl.groupEnd()

        return enqueue

    def _take_self(self, buf: Any, tag: int) -> bool:
        for i, (t, data) in enumerate(self._self_mail):
            if t == tag:
                if data.size != buf.size or data.dtype != buf.dtype:
                    raise CollectiveMismatchError(
                        f"send/recv tag {tag} on rank {self.rank} (to itself): sent "
                        f"{data.size} {data.dtype} but receives {buf.size} {buf.dtype}")
                buf.reshape(-1)[...] = data.reshape(-1)
                del self._self_mail[i]
                return True
        return False

    # -- groups and teardown ---------------------------------------------------------------

    def split(self, color: int, key: int) -> NCCLTransport:
        """Return the transport of the ranks passing the same ``color``, ordered by ``key``.

        The MPI channel splits (under the deadline), then, when this group has its NCCL
        communicator, the new group makes its own at once (a fresh unique id broadcast
        inside it, ``ncclCommInitRank``): that is collective over the new group, and only
        here do all its ranks surely meet. (Left to the first device operation, a send
        between two ranks would wait for the group's other ranks to join the init.)
        """
        sub = self._mpi.split(color, key)
        out = NCCLTransport(sub, nccl=self._nccl, device_index=self.device.index,
                            timeout=self.timeout, label=f"split(color={color}) of {self.label}")
        if self._comm is not None:
            out.connect()
        return out

    def finalize(self) -> None:
        """Destroy the NCCL communicator (after its work ends) and free the MPI channel."""
        comm, self._comm = self._comm, None
        if comm is not None:
            import cupy

            with cupy.cuda.Device(self.device.index):
                cupy.cuda.get_current_stream().synchronize()
                comm.destroy()
        self._mpi.finalize()

    def abort(self, code: int = 1) -> NoReturn:
        """Abort the NCCL communicator (so no GPU stays in a kernel), then every rank (MPI)."""
        self.abort_communicator(f"abort({code})")
        self._mpi.abort(code)


def _floor_divide(buf: Any, size: int) -> None:
    """Finish an integer avg in place on the current stream: numpy's ``//`` semantics."""
    import cupy

    cupy.floor_divide(buf, size, out=buf)
