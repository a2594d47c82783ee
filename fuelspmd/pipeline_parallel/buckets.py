"""Data-parallel gradient buckets for :class:`~fuelspmd.pipeline_parallel.PipelineExecutor`.

Layer 7. A rank's gradients of chunk ``j`` are final at the last backward (``B``, or ``W``
in a split schedule) of its last micro-batch. The all-reduce over ``dp`` goes into that
action's graph, one collective per *bucket*: the parameters in reverse order (the backward
finishes the last layer's gradients first), packed greedily up to ``bucket_bytes``, each
bucket flattened and concatenated into one buffer (one transport call per bucket, as
PyTorch DDP does). The graph lists the buckets' results first, so lowering visits bucket
0's gradients, then its all-reduce, then bucket 1's gradients...; the planner starts each
all-reduce right after its concatenation and waits for it before the next one starts (one
collective in flight per communicator), so bucket ``k`` travels while bucket ``k + 1``'s
gradients (and the input gradient) are computed. The results are realised as the bucket
buffers, so no step of that graph reads them and every wait sits at the latest point;
each gradient is then a view of its bucket's buffer (no copy back).

Why ``DP_BUCKET_BYTES = 1 MiB`` rather than DDP's 25 MiB: DDP's size fits GPUs, where
25 MiB takes about 0.1 ms at NCCL bandwidths. Here (MPICH over shared memory, about
2.2 GB/s bus bandwidth, ``notes/measured.md``) 1 MiB takes about 0.5 ms, roughly ten times
the fixed cost of one lazy collective (Python, guard, latency: tens of microseconds), and
it still cuts a few-MiB stage into several buckets that can overlap its backward.

The buckets go over a channel split off ``dp`` once (so they meet none of the caller's
collectives on ``dp``), through a :class:`ClockedTransport` that records when each
all-reduce was issued and when its wait returned: the executor reports them as
``StepResult.reduces``, the evidence that they start before the backward ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from fuelspmd.backend import get_backend
from fuelspmd.comm import Communicator
from fuelspmd.errors import ConfigError
from fuelspmd.graph.node import leaf
from fuelspmd.tensor import Tensor, concat, realize, tensor
from fuelspmd.transport import ReduceOp, Transport, Work

__all__ = ["DP_BUCKET_BYTES", "Bucket", "ClockedTransport", "GradReducer", "check_bucket_bytes",
           "plan_buckets"]

DP_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """Parameters ``params`` (indices into one chunk's list, reverse order) reduced in one
    all-reduce of ``nbytes`` bytes."""

    params: tuple[int, ...]
    nbytes: int


def plan_buckets(params: Sequence[Tensor], bucket_bytes: int) -> list[Bucket]:
    """Pack ``params`` last-first into buckets of at most ``bucket_bytes`` (a parameter
    larger than that gets a bucket of its own); a dtype change starts a new bucket, as
    one buffer holds one dtype. Pure: every dp rank gets the same buckets."""
    out: list[Bucket] = []
    cur: list[int] = []
    size = 0
    for k in reversed(range(len(params))):
        nb = _nbytes(params[k])
        if cur and (size + nb > bucket_bytes or params[k].dtype != params[cur[0]].dtype):
            out.append(Bucket(tuple(cur), size))
            cur, size = [], 0
        cur.append(k)
        size += nb
    if cur:
        out.append(Bucket(tuple(cur), size))
    return out


class _ClockedWork:
    """A Work that stamps the moment it is first seen complete."""

    __slots__ = ("stamp", "work")

    def __init__(self, work: Work, stamp: list[float]) -> None:
        self.work, self.stamp = work, stamp

    def test(self) -> bool:
        done = self.work.test()
        if done and len(self.stamp) == 1:
            self.stamp.append(time.perf_counter())
        return done

    def wait(self, timeout: float | None = None) -> None:
        self.work.wait(timeout)
        if len(self.stamp) == 1:
            self.stamp.append(time.perf_counter())


class ClockedTransport:
    """``transport`` with every ``all_reduce`` stamped: ``log`` gets ``[issued, done]``
    (``time.perf_counter``) per call, ``done`` filled when its wait returns. Everything else
    is the wrapped transport's own method (it only delegates, so it changes nothing)."""

    def __init__(self, transport: Transport) -> None:
        self.inner = transport
        self.name, self.rank, self.size = transport.name, transport.rank, transport.size
        self.tag_bound = transport.tag_bound
        self.capabilities = transport.capabilities & {"lend"}
        self.log: list[list[float]] = []
        if "lend" in self.capabilities:
            self.lend, self.lent = transport.lend, transport.lent  # type: ignore[attr-defined]

    def all_reduce(self, buf: Any, op: ReduceOp) -> Work:
        stamp = [time.perf_counter()]
        self.log.append(stamp)
        return _ClockedWork(self.inner.all_reduce(buf, op), stamp)

    def all_gather(self, send: Any, recv: Any) -> Work:
        return self.inner.all_gather(send, recv)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> Work:
        return self.inner.reduce_scatter(send, recv, op)

    def broadcast(self, buf: Any, root: int) -> Work:
        return self.inner.broadcast(buf, root)

    def all_to_all(self, send: Any, recv: Any) -> Work:
        return self.inner.all_to_all(send, recv)

    def send(self, buf: Any, peer: int, tag: int) -> Work:
        return self.inner.send(buf, peer, tag)

    def recv(self, buf: Any, peer: int, tag: int) -> Work:
        return self.inner.recv(buf, peer, tag)

    def barrier(self) -> Work:
        return self.inner.barrier()

    def split(self, color: int, key: int) -> Transport:
        return self.inner.split(color, key)

    def abort(self, code: int = 1) -> NoReturn:
        self.inner.abort(code)


class GradReducer:
    """Averages one pipeline rank's gradients over ``dp`` in buckets (see the module docs).

    Collective over ``dp`` at construction (it splits a private channel).
    """

    def __init__(self, dp: Communicator, params: Sequence[Sequence[Tensor]], *,
                 bucket_bytes: int) -> None:
        check_bucket_bytes(bucket_bytes)
        self.clock = ClockedTransport(dp.split(0, dp.rank).transport)
        self.comm = Communicator(self.clock, device=dp.device, timeout=dp.timeout)
        self.xp = get_backend(dp.device.kind).xp
        self.buckets = [plan_buckets(ps, bucket_bytes) for ps in params]
        self.issued: list[tuple[int, int]] = []  # (chunk, bucket) of each bucket all-reduce

    def start(self, chunk: int, grads: Sequence[Tensor]) -> list[Tensor]:
        """The lazy averaged bucket buffers of ``chunk``'s final ``grads``; realise them
        (first among the targets) in the graph that computes the gradients."""
        flats = []
        for b, bucket in enumerate(self.buckets[chunk]):
            parts = [grads[k].reshape((-1,)) for k in bucket.params]
            flat = parts[0] if len(parts) == 1 else concat(parts, 0)
            flats.append(self.comm.all_reduce(flat, "avg"))
            self.issued.append((chunk, b))
        return flats

    def unpack(self, chunk: int, flats: Sequence[Tensor], like: Sequence[Tensor]
               ) -> list[Tensor]:
        """Each gradient as a realised view of its (realised) bucket buffer, shaped ``like``."""
        out: list[Tensor | None] = [None] * len(like)
        for bucket, flat in zip(self.buckets[chunk], flats):
            buf, at = flat.node.buffer, 0
            for k in bucket.params:
                n = _numel(like[k])
                view = self.xp.reshape(buf[at:at + n], like[k].shape)
                out[k] = Tensor(leaf(view, self.comm.device))
                at += n
        if any(g is None for g in out):
            raise RuntimeError(f"chunk {chunk}: a parameter is in no gradient bucket")
        return [g for g in out if g is not None]

    def average(self, value: Any) -> float:
        """``value`` (a float64 host array of one element) averaged over dp, now."""
        (t,) = realize(self.comm.all_reduce(tensor(value, device=self.comm.device), "avg"))
        return float(t.numpy()[0])

    def new_step(self) -> None:
        """Forget the last step's stamps."""
        self.clock.log.clear()
        self.issued.clear()

    def stamps(self, t0: float) -> list[tuple[int, int, float, float]]:
        """``(chunk, bucket, issued, done)`` of this step's bucket all-reduces, seconds
        after ``t0``, in issue order."""
        out = []
        for (chunk, b), stamp in zip(self.issued, self.clock.log):
            done = stamp[1] if len(stamp) > 1 else float("nan")
            out.append((chunk, b, stamp[0] - t0, done - t0))
        return out


def check_bucket_bytes(bucket_bytes: object) -> None:
    """Refuse a bucket size that is not a positive int (whether or not dp is used)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ConfigError(f"PipelineExecutor(bucket_bytes={bucket_bytes!r}): give a "
                          f"positive byte count, e.g. {DP_BUCKET_BYTES} (1 MiB)")


def _numel(t: Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def _nbytes(t: Tensor) -> int:
    return _numel(t) * t.dtype.itemsize
