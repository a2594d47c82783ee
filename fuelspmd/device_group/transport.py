"""``LocalTransport``: the in-process Transport of a :class:`~fuelspmd.DeviceGroup`.

Layer 5, with the group it serves; a transport, so it imports errors, backend and transport
only. Peers are threads of
one process. Matching: the group numbers each member's collectives in issue order (the
Communicator's token chain makes issue order creation order). Collective ``k`` of every
member meets in one slot; the last to arrive checks that all agree on op, shape, dtype,
reduce op and root (else :class:`CollectiveMismatchError` on every member, naming devices
and fields) and computes the result once for all. An all_reduce of host arrays (numpy and
array-api-strict devices share host memory) is reduced chunk by chunk, by all the members'
threads in parallel (numpy releases the GIL), into one array that every member gets
read-only (``all_reduce_shared``): nothing is copied n times. When every member's buffer
is on a GPU (a ``cuda:0, cuda:1`` group) the collective stays on the GPUs: the buffers are
peer-copied to the first member's GPU, combined there with cupy, and each member's result
is copied to its own GPU (:func:`_on_gpus`). A group mixing a GPU with host devices
(``cuda:0, cpu:0``) is staged through host memory. A member whose program returned or
failed without joining a collective the others wait in, or without sending what one
receives, makes them raise PeerAbortedError at once, naming it; otherwise a wait gives up
after ``timeout`` seconds, naming the members that never came.

Send/recv go through per-(src, dst, tag) mailboxes: a send deposits a copy and returns,
a recv waits for its message (GPU buffers pass through host memory).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from fuelspmd.backend import Spares, on_gpu, settle, to_gpu, to_host
from fuelspmd.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    PeerAbortedError,
)
from fuelspmd.transport import DONE, ReduceOp, Work, check_buffers, check_peer, disagreement

__all__ = ["LocalTransport", "local_group"]

CHUNK = 1 << 16  # elements per reduction chunk: 4 inputs and the sum (1.25 MiB) stay in L2

_REDUCE: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


class _Job:
    """A result computed chunk by chunk by every device of a collective, not by the last
    one alone: numpy releases the GIL in its loops, so the devices' threads reduce in
    parallel (each chunk's partial sum stays in cache while the inputs stream by)."""

    __slots__ = ("chunks", "finished", "next", "results", "run")

    def __init__(self, chunks: int, run: Callable[[int], None], results: list[Any]) -> None:
        self.chunks, self.run, self.results = chunks, run, results
        self.next = 0
        self.finished = 0


def _reduce_job(bufs: list[np.ndarray], op: ReduceOp, spare: Spares, *,
                shared: bool) -> _Job:
    """Reduce host arrays of one shape into one array (from the spares); results: that
    array for every rank (``shared``, read-only) or rank r's block of it (reduce_scatter)."""
    ufunc = _REDUCE[op]
    flat = [b.reshape(-1) for b in bufs]
    out = spare.take(flat[0].shape, flat[0].dtype)
    n = len(bufs)
    integer = np.issubdtype(out.dtype, np.integer)
    half = out.dtype.itemsize == 2 and not integer  # float16, bfloat16

    def chunk(i: int) -> None:
        lo, hi = i * CHUNK, (i + 1) * CHUNK
        if half:  # as the MPI transport: in float32, rounded once (an avg cannot overflow)
            o = flat[0][lo:hi].astype(np.float32)
            for f in flat[1:]:
                ufunc(o, f[lo:hi].astype(np.float32), out=o)
        else:
            o = out[lo:hi]
            ufunc(flat[0][lo:hi], flat[1][lo:hi], out=o)
            for f in flat[2:]:
                ufunc(o, f[lo:hi], out=o)
        if op is ReduceOp.AVG:
            if integer:
                o //= n
            else:
                o /= n
        if half:
            out[lo:hi] = o

    full = out.reshape(bufs[0].shape)
    results = [full] * n if shared else list(out.reshape(n, -1))
    if shared:
        full.flags.writeable = False  # views made before this stay writable: chunks use them
    return _Job(max(1, -(-out.size // CHUNK)), chunk, results)


class _Slot:
    __slots__ = ("arrived", "done", "error", "fps", "job", "payloads", "results", "taken")

    def __init__(self, n: int) -> None:
        self.fps: list[dict[str, Any] | None] = [None] * n
        self.payloads: list[Any] = [None] * n
        self.results: list[Any] = []
        self.arrived = 0
        self.taken = 0
        self.done = False
        self.error: BaseException | None = None
        self.job: _Job | None = None


class _Group:
    """What the members of one in-process group share: slots, mailboxes, liveness."""

    def __init__(self, devices: list[str], timeout: float, parent: _Group | None = None,
                 ranks: list[int] | None = None) -> None:
        self.devices = devices
        # a split's parent group and each member's rank there: a device that left the
        # parent (its function failed or returned) has left every split of it too
        self.parent, self.ranks = parent, ranks or []
        self.n = len(devices)
        self.timeout = timeout
        self.cond = threading.Condition()
        self.seq = [0] * self.n
        self.slots: dict[int, _Slot] = {}
        self.mail: dict[tuple[int, int, int], list[np.ndarray]] = {}
        self.gone: dict[int, str] = {}  # rank -> "returned" | "failed"
        self.spare = Spares()  # reduction outputs, reused once unreferenced

    def _missing(self, present: Callable[[int], bool], what: str, seq: int) -> None:
        """Raise when a device we wait for has left; called with the lock held."""
        left = {r: how for r, how in self._left().items() if not present(r)}
        if left:  # as a rank whose peer finished or died (fuelspmd.comm.guard)
            names = ", ".join(f"{self.devices[r]} ({how})" for r, how in sorted(left.items()))
            raise PeerAbortedError(f"{what} #{seq}: device(s) {names} left the group without "
                                   "issuing it, so it will never complete; every device must "
                                   "issue the same collectives in the same order, and every "
                                   "recv needs a send")

    def _left(self) -> dict[int, str]:
        """The members that left, by rank here: this group's own, then its parents'."""
        left = dict(self.gone)
        if self.parent is not None:
            above = self.parent._left()
            for i, r in enumerate(self.ranks):
                if r in above:
                    left.setdefault(i, above[r])
        return left

    def _wait(self, ready: Callable[[], bool], present: Callable[[int], bool], what: str,
              seq: int) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            self._missing(present, what, seq)
            left = deadline - time.monotonic()
            if left <= 0:
                absent = [self.devices[r] for r in range(self.n) if not present(r)]
                raise CommTimeoutError(f"{what} #{seq}: waited {self.timeout:g} s for "
                                       f"device(s) {', '.join(absent)}, which never joined")
            self.cond.wait(min(left, 0.05))

    def collective(self, rank: int, fp: dict[str, Any], payload: Any,
                   compute: Callable[[list[Any]], Any]) -> Any:
        """Join collective number ``seq[rank]``; return this rank's result."""
        with self.cond:
            seq = self.seq[rank]
            self.seq[rank] = seq + 1
            slot = self.slots.get(seq)
            if slot is None:
                slot = self.slots[seq] = _Slot(self.n)
            slot.fps[rank], slot.payloads[rank] = fp, payload
            slot.arrived += 1
            if slot.arrived == self.n:
                slot.error = self._compare(slot.fps, seq)
                if slot.error is None:
                    try:
                        res = compute(slot.payloads)
                        if isinstance(res, _Job):
                            slot.job = res
                        else:
                            slot.results = res
                    except Exception as e:  # every device gets the same failure
                        slot.error = e
                if slot.job is None:
                    slot.done = True
                self.cond.notify_all()
                self._wait(lambda: self._help(slot), lambda r: True, fp["op"], seq)
            else:
                try:
                    self._wait(lambda: slot.done or self._help(slot),
                               lambda r: slot.fps[r] is not None, fp["op"], seq)
                except BaseException:
                    self.gone.setdefault(rank, "failed")
                    raise
            slot.payloads[rank] = None
            slot.taken += 1
            if slot.taken == self.n:
                del self.slots[seq]
            if slot.error is not None:
                raise slot.error
            return slot.results[rank]

    def _help(self, slot: _Slot) -> bool:
        """Compute chunks of the slot's job until none is left (lock held on entry and
        exit, released around each chunk); return whether the slot is done."""
        job = slot.job
        while job is not None and job.next < job.chunks and slot.error is None:
            i = job.next
            job.next = i + 1
            self.cond.release()
            try:
                job.run(i)
            except Exception as e:
                err: Exception | None = e
            else:
                err = None
            finally:
                self.cond.acquire()
            if err is not None:
                slot.error = err
            job.finished += 1
            if job.finished == job.chunks or slot.error is not None:
                slot.results = job.results
                slot.done = True
                self.cond.notify_all()
        return slot.done

    def _compare(self, fps: list[Any], seq: int) -> CollectiveMismatchError | None:
        """The agreement of agree() (fuelspmd.transport), on what the devices brought."""
        text = disagreement(f"collective #{seq}", fps, self.devices)
        return None if text is None else CollectiveMismatchError(text)

    def post(self, key: tuple[int, int, int], data: np.ndarray) -> None:
        with self.cond:
            self.mail.setdefault(key, []).append(data)
            self.cond.notify_all()

    def take(self, key: tuple[int, int, int]) -> np.ndarray:
        src = key[0]
        with self.cond:
            box = self.mail.setdefault(key, [])
            self._wait(lambda: bool(box), lambda r: r != src, f"recv from {self.devices[src]}",
                       key[2])
            return box.pop(0)


def _on_gpus(bufs: list[Any], compute: Callable[[Any, list[Any]], list[Any]]
             ) -> list[Any] | None:
    """Run ``compute(cupy, bufs)`` on the first member's GPU and hand each member its
    result on its own GPU; None when a member's buffer is not on a GPU (host path).

    The results are complete when this returns (every GPU involved is synchronised), so
    a member may read its result from any stream.
    """
    if not all(on_gpu(b) for b in bufs):
        return None
    import cupy

    home = bufs[0].device.id
    with cupy.cuda.Device(home):
        outs = compute(cupy, [to_gpu(b, home) for b in bufs])
        cupy.cuda.get_current_stream().synchronize()
    results = [to_gpu(o, b.device.id) for o, b in zip(outs, bufs)]
    for index in sorted({b.device.id for b in bufs}):
        cupy.cuda.Device(index).synchronize()
    return results


def _gpu_reduce(xp: Any, bufs: list[Any], op: ReduceOp, *, shared: bool) -> list[Any]:
    """Reduce GPU buffers of one shape on one GPU; the same result for every member
    (``shared``) or member r's block of it (reduce_scatter)."""
    ufunc = getattr(xp, _REDUCE[op].__name__)
    dt = bufs[0].dtype
    wide = xp.float32 if dt.kind == "f" and dt.itemsize == 2 else dt  # as on the host
    out = bufs[0].reshape(-1).astype(wide)
    for b in bufs[1:]:
        ufunc(out, b.reshape(-1).astype(wide), out=out)
    n = len(bufs)
    if op is ReduceOp.AVG:
        if out.dtype.kind == "f":
            out /= n
        else:
            xp.floor_divide(out, n, out=out)
    out = out.astype(dt, copy=False)
    return [out] * n if shared else list(out.reshape(n, -1))


def _reduce_any(bufs: list[Any], op: ReduceOp, spare: Spares, *,
                shared: bool) -> Any:
    """The reduction of one collective: on the GPUs when every buffer is on one, else on
    the host (a chunked job, buffers on a GPU staged to the host first)."""
    gpu = _on_gpus(bufs, lambda xp, bs: _gpu_reduce(xp, bs, op, shared=shared))
    if gpu is not None:
        return gpu
    return _reduce_job([to_host(b) for b in bufs], op, spare, shared=shared)


def _gather_any(bufs: list[Any]) -> list[Any]:
    def gather(xp: Any, bs: list[Any]) -> list[Any]:
        return [xp.concatenate([b.reshape(-1) for b in bs])] * len(bs)

    return _on_gpus(bufs, gather) or gather(np, [to_host(b) for b in bufs])


def _all_to_all_any(bufs: list[Any]) -> list[Any]:
    n = len(bufs)

    def exchange(xp: Any, bs: list[Any]) -> list[Any]:
        blocks = [b.reshape(n, -1) for b in bs]
        return [xp.concatenate([blocks[s][r] for s in range(n)]) for r in range(n)]

    return _on_gpus(bufs, exchange) or exchange(np, [to_host(b) for b in bufs])


def _broadcast_any(bufs: list[Any], root: int) -> list[Any]:
    n = len(bufs)
    return (_on_gpus(bufs, lambda xp, bs: [bs[root]] * n)
            or [to_host(bufs[root])] * n)


def _write(buf: Any, out: Any) -> None:
    """Write ``out`` (numpy, or cupy on ``buf``'s GPU) into ``buf``, whatever their shapes."""
    if isinstance(buf, np.ndarray):
        buf.reshape(-1)[...] = out.reshape(-1)
    elif on_gpu(out):
        import cupy

        with cupy.cuda.Device(buf.device.id):
            buf.reshape(-1)[...] = out.reshape(-1)
    else:
        buf.reshape(-1).set(np.ascontiguousarray(out.reshape(-1)))


class LocalTransport:
    """Rank ``rank`` of an in-process group: a Transport whose peers are threads.

    Every method completes before it returns (the last device computes for all), so each
    returns a finished Work.
    """

    name = "local"
    tag_bound = 2**15 - 1  # MPI's least TAG_UB: a program that runs here runs on any MPI
    capabilities = frozenset({"shared"})

    def __init__(self, group: _Group, rank: int) -> None:
        self._g = group
        self.rank, self.size = rank, group.n

    @staticmethod
    def _payload(buf: Any) -> Any:
        """What a member hands the group: a host array, or its GPU buffer once settled
        (converted to the host by the computing member if the group is mixed)."""
        return settle(buf) if on_gpu(buf) else to_host(buf)

    def _fp(self, op: str, buf: Any, **more: Any) -> dict[str, Any]:
        return {"op": op, "shape": tuple(buf.shape), "dtype": str(buf.dtype), **more}

    def all_reduce_shared(self, buf: Any, op: ReduceOp) -> np.ndarray:
        """Reduce once for the whole group; return the one read-only result every rank gets."""
        host = to_host(buf)

        return self._g.collective(self.rank, self._fp("all_reduce", host, reduce_op=op.value),
                                  host,
                                  lambda bufs: _reduce_any(bufs, op, self._g.spare, shared=True))

    def all_reduce(self, buf: Any, op: ReduceOp) -> Work:
        check_buffers("all_reduce", self.size, buf)
        if not on_gpu(buf):
            _write(buf, self.all_reduce_shared(buf, op))
            return DONE
        out = self._g.collective(self.rank, self._fp("all_reduce", buf, reduce_op=op.value),
                                 settle(buf),
                                 lambda bufs: _reduce_any(bufs, op, self._g.spare, shared=True))
        _write(buf, out)
        return DONE

    def all_gather(self, send: Any, recv: Any) -> Work:
        check_buffers("all_gather", self.size, send, recv, recv_factor=self.size)
        out = self._g.collective(self.rank, self._fp("all_gather", send), self._payload(send),
                                 _gather_any)
        _write(recv, out)
        return DONE

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> Work:
        check_buffers("reduce_scatter", self.size, send, recv, send_factor=self.size)

        out = self._g.collective(self.rank, self._fp("reduce_scatter", send,
                                                     reduce_op=op.value), self._payload(send),
                                 lambda bufs: _reduce_any(bufs, op, self._g.spare, shared=False))
        _write(recv, out)
        return DONE

    def broadcast(self, buf: Any, root: int) -> Work:
        check_peer("broadcast", root, self.size, what="root")
        check_buffers("broadcast", self.size, buf)
        out = self._g.collective(self.rank, self._fp("broadcast", buf, root=int(root)),
                                 self._payload(buf), lambda bufs: _broadcast_any(bufs, root))
        if self.rank != root:
            _write(buf, out)
        return DONE

    def all_to_all(self, send: Any, recv: Any) -> Work:
        check_buffers("all_to_all", self.size, send, recv)
        out = self._g.collective(self.rank, self._fp("all_to_all", send), self._payload(send),
                                 _all_to_all_any)
        _write(recv, out)
        return DONE

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        check_peer("send", peer, self.size)
        _check_tag("send", tag, self.tag_bound)
        check_buffers("send", self.size, buf)
        self._g.post((self.rank, int(peer), int(tag)), np.array(to_host(buf), copy=True))
        return DONE

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        check_peer("recv", peer, self.size)
        _check_tag("recv", tag, self.tag_bound)
        check_buffers("recv", self.size, buf)
        data = self._g.take((int(peer), self.rank, int(tag)))
        if data.size != buf.size or data.dtype != (buf if on_gpu(buf) else to_host(buf)).dtype:
            raise CollectiveMismatchError(
                f"send/recv tag {tag}: {self._g.devices[peer]} sent {data.shape} {data.dtype} "
                f"but {self._g.devices[self.rank]} receives {buf.shape} {buf.dtype}")
        _write(buf, data)
        return DONE

    def barrier(self) -> Work:
        self._g.collective(self.rank, {"op": "barrier"}, None, lambda bufs: [None] * len(bufs))
        return DONE

    def split(self, color: int, key: int) -> LocalTransport:
        g = self._g

        def compute(pairs: list[tuple[int, int]]) -> list[LocalTransport]:
            out: list[Any] = [None] * len(pairs)
            for c in sorted({c for c, _ in pairs}):
                members = sorted((k, r) for r, (cc, k) in enumerate(pairs) if cc == c)
                sub = _Group([g.devices[r] for _, r in members], g.timeout, g,
                             [r for _, r in members])
                for i, (_, r) in enumerate(members):
                    out[r] = LocalTransport(sub, i)
            return out

        return g.collective(self.rank, {"op": "split"}, (int(color), int(key)), compute)

    def abort(self, code: int = 1) -> NoReturn:
        raise PeerAbortedError(f"{self._g.devices[self.rank]} aborted the group (code {code})")


def _check_tag(op: str, tag: int, bound: int) -> None:
    if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= bound:
        raise ConfigError(f"{op}: tag {tag!r} is outside 0..{bound}, the tags an in-process "
                          f"group takes; use a smaller non-negative tag")


def local_group(devices: list[str], *, timeout: float) -> tuple[Any, list[LocalTransport]]:
    """Return the shared state of a new in-process group over ``devices`` (names used in
    messages) and one LocalTransport per member, rank i for ``devices[i]``."""
    g = _Group(devices, timeout)
    return g, [LocalTransport(g, i) for i in range(len(devices))]
