"""``PipelineExecutor``: run any :class:`Schedule` for real over a pipeline Communicator.

Layer 7. One executor per rank of the pipeline group; each holds the stage functions and
parameters of its chunks (virtual stage ``j * p + rank`` is chunk ``j``). A stage is a
callable ``(params, x) -> y`` built from lazy Tensors; the last virtual stage's output goes
into ``loss(y, target) -> scalar``. :meth:`PipelineExecutor.step` walks
``schedule.steps(rank)`` and returns the mean loss over the micro-batches and the gradients
of that mean, accumulated over micro-batches (and averaged over ``dp`` when given).

Saved activations. The backward of a micro-batch is built at its forward, while the lazy
history is still there: ``fs.vjp(y, [x, *params], ct)`` with the cotangent ``ct`` a leaf
whose buffer arrives at the backward (the gradient received from the next stage). The
forward realises the output together with every forward value the backward graph reads
(the *residuals*), so those are the saved activations; the backward realises the
gradients from them without recomputing anything, then drops them. ``recompute=True``
saves only the stage input and runs the forward again at the backward (activation
recomputation), which is also what a stage with collectives inside (tensor parallelism)
needs: its backward collectives must be created at the backward, in the same order on
every rank of its group.

Transfers. Activations and input gradients go point to point over a private channel split
off the pipeline Communicator once (so its tags, ``Message.tag``, meet nothing else).
They use the transport directly rather than lazy send/recv nodes because the schedule's
discipline needs several transfers posted at once: with ``schedule.sends == "blocking"``
the sends of an action are posted with the receives of the next one and waited for as one
batch (Megatron's ``send_forward_recv_backward``), with ``"nonblocking"`` each send is
posted right after its action and waited for at the end of the step. A blocking step with
no receives waits for nothing: its sends are carried to the next step that receives (or
the end). Waiting there only stalled the sender: MPI moves a large message only while the
receiver is inside MPI, so the last GPipe stage sat 3-27 ms before B actions whose inputs
were ready until the previous stage next waited. Every wait still comes at or after the
point the blocking model puts it, with at least as much posted, so no deadlock is added.
The receives of each step are posted one step early, and after every action the transfers
in flight are tested (MPI progress happens only inside MPI calls, so a message that
arrived during the action is taken in then, not at the wait; a send too large to go out
eagerly moves on). Every wait has the Communicator's deadline. The activation shapes are
found once, at the first step, by passing (shape, dtype) along the virtual stages.

The state of one step (saved activations, the backward, accumulation) is
:class:`~fuelspmd.pipeline_parallel.microbatch.StepRun`.

Data parallelism. With ``dp``, each chunk's gradients are averaged over it in buckets
whose all-reduces start inside the chunk's last backward, as soon as the bucket's
gradients are final (:mod:`~fuelspmd.pipeline_parallel.buckets`); only the loss is
averaged after the step.

Timing. After a barrier on the channel, each action's compute (receives done, sends not
started) is timed with ``time.perf_counter``; :meth:`timeline` gathers every rank's times
into a :class:`~fuelspmd.pipeline_parallel.simulate.Timeline` (``Timeline.measured``), which
:func:`~fuelspmd.pipeline_parallel.render.chrome_trace` turns into a Chrome trace. When every
rank runs on one machine (same host name, checked at construction), the times are placed on
that machine's one monotonic clock, so ranks leaving the barrier at different moments (ms
apart on a loaded machine) do not shift them against each other; across machines each
rank's times count from its own barrier exit.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fuelspmd.backend import get_backend, to_host
from fuelspmd.comm import Communicator
from fuelspmd.dtypes import DType, Shape
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.pipeline_parallel.actions import Schedule
from fuelspmd.pipeline_parallel.buckets import DP_BUCKET_BYTES, GradReducer, check_bucket_bytes
from fuelspmd.pipeline_parallel.microbatch import StepResult, StepRun
from fuelspmd.pipeline_parallel.simulate import Timeline
from fuelspmd.pipeline_parallel.validate import validate
from fuelspmd.tensor import Tensor, tensor, zeros
from fuelspmd.transport import Work

__all__ = ["PipelineExecutor", "StepResult"]

StageFn = Callable[[Sequence[Tensor], Tensor], Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
_META = 32  # int64 words of a shape message: ndim, up to 15 dims, dtype name


class PipelineExecutor:
    """Runs ``schedule`` on this rank of ``comm`` (the pipeline group); see the module docs.

    ``stages[j]`` and ``params[j]`` are chunk ``j`` of this rank (``schedule.chunks`` of
    each), parameters in forward order. With ``dp`` (size > 1) the gradients are averaged
    over it in buckets of at most ``bucket_bytes`` started inside each chunk's last
    backward (:mod:`~fuelspmd.pipeline_parallel.buckets`). Collective: every rank of
    ``comm`` (and of ``dp``) constructs its executor at the same point.
    """

    def __init__(self, schedule: Schedule, *, comm: Communicator, stages: Sequence[StageFn],
                 params: Sequence[Sequence[Any]], loss: LossFn,
                 dp: Communicator | None = None, recompute: bool = False,
                 bucket_bytes: int = DP_BUCKET_BYTES) -> None:
        validate(schedule)
        check_bucket_bytes(bucket_bytes)
        if comm.size != schedule.stages:
            raise ConfigError(
                f"PipelineExecutor: the schedule has {schedule.stages} stages but the "
                f"pipeline Communicator has {comm.size} ranks; build the schedule with "
                f"stages={comm.size} (e.g. mesh.comm('pp').size)")
        for name, items in (("stages", stages), ("params", params)):
            if len(items) != schedule.chunks:
                raise ConfigError(
                    f"PipelineExecutor: {len(items)} {name} given but the schedule has "
                    f"{schedule.chunks} chunk(s) per rank; give one per chunk")
        self.schedule = schedule
        self.comm = comm
        self.dp = dp
        self.loss = loss
        self.recompute = bool(recompute)
        self.stages = list(stages)
        self.params: list[list[Tensor]] = [[self._leaf(p) for p in ps] for ps in params]
        self._backend = get_backend(comm.device.kind)
        self._p2p = comm.split(0, comm.rank).transport  # collective: a private channel
        host = np.array([zlib.crc32(socket.gethostname().encode())], np.int64)
        hosts = np.zeros(comm.size, np.int64)
        self._wait([self._p2p.all_gather(host, hosts)])
        self._one_clock = bool((hosts == hosts[0]).all())  # perf_counter: one per machine
        self._t0 = 0.0
        self._reducer = (GradReducer(dp, self.params, bucket_bytes=bucket_bytes)
                         if dp is not None and dp.size > 1 else None)
        self._steps = schedule.steps(comm.rank)
        self._io: list[tuple[Shape, DType] | None] | None = None  # (shape, dtype) of each
        # virtual stage's input as far as this rank needs to know it (found at step 1)
        self._last: StepResult | None = None

    # ---- helpers ----------------------------------------------------------------------
    def _leaf(self, x: Any) -> Tensor:
        t = x if isinstance(x, Tensor) else tensor(x, device=self.comm.device)
        if t.device != self.comm.device:
            raise ConfigError(f"PipelineExecutor: a tensor is on {t.device} but the "
                              f"pipeline runs on {self.comm.device}; move it with .to()")
        return t.realize()

    def _wait(self, works: list[Work]) -> None:
        for w in works:
            w.wait(self.comm.timeout)

    def _outgoing(self, arr: Any) -> Any:
        """A buffer the transport can send (strict arrays are staged through the host)."""
        return np.ascontiguousarray(to_host(arr)) if self.comm.device.kind == "strict" else arr

    def _incoming(self, shape: Shape, dt: DType) -> Any:
        if self.comm.device.kind == "cuda":
            return self._backend.empty(shape, dt)
        return np.empty(shape, np.dtype(dt.name))

    def _on_device(self, buf: Any) -> Any:
        return self._backend.asarray(buf) if self.comm.device.kind == "strict" else buf

    # ---- shapes -----------------------------------------------------------------------
    def _discover(self, x0: Tensor | None) -> list[tuple[Shape, DType] | None]:
        """Pass (shape, dtype) of each virtual stage's input along the pipeline, building
        each stage lazily on a constant (shape rules only, nothing runs)."""
        s, rank = self.schedule, self.comm.rank
        V, base = s.virtual_stages, 2 * s.virtual_stages * s.microbatches
        io: list[tuple[Shape, DType] | None] = [None] * (V + 1)
        sends: list[Work] = []
        keep: list[np.ndarray] = []
        for v in range(V):
            if s.rank_of(v) != rank:
                continue
            if v == 0:
                assert x0 is not None
                io[0] = (x0.shape, x0.dtype)
            elif io[v] is None:
                meta = np.zeros(_META, np.int64)
                self._wait([self._p2p.recv(meta, s.rank_of(v - 1), base + v)])
                io[v] = _decode(meta)
            shape, dt = io[v]  # type: ignore[misc]
            y = self.stages[v // s.stages](self.params[v // s.stages],
                                           zeros(shape, device=self.comm.device, dtype=dt))
            io[v + 1] = (y.shape, y.dtype)
            if v + 1 < V and s.rank_of(v + 1) != rank:
                keep.append(_encode(y.shape, y.dtype))
                sends.append(self._p2p.send(keep[-1], s.rank_of(v + 1), base + v + 1))
        self._wait(sends)
        return io

    def _boundary(self, index: int) -> tuple[Shape, DType]:
        """(shape, dtype) of virtual stage ``index``'s input, known to this rank."""
        assert self._io is not None
        found = self._io[index]
        if found is None:
            raise RuntimeError(f"rank {self.comm.rank} has no shape for the input of virtual "
                               f"stage {index}, which it should have received")
        return found

    # ---- one step ---------------------------------------------------------------------
    def step(self, inputs: Sequence[Any] | None = None,
             targets: Sequence[Any] | None = None) -> StepResult:
        """Run the schedule once over ``microbatches`` micro-batches and return the mean
        loss and its gradients on every rank of the pipeline.

        ``inputs`` (one per micro-batch) are needed on the rank of virtual stage 0,
        ``targets`` on the rank of the last virtual stage; other ranks may pass None.
        """
        s, rank = self.schedule, self.comm.rank
        V = s.virtual_stages
        xs = self._batch("inputs", inputs) if rank == s.rank_of(0) else None
        ts = self._batch("targets", targets) if rank == s.rank_of(V - 1) else None
        if self._io is None:
            self._io = self._discover(xs[0] if xs else None)
        elif xs and (xs[0].shape, xs[0].dtype) != self._boundary(0):
            shape, dt = self._boundary(0)
            raise ShapeError(f"PipelineExecutor.step: micro-batch input {xs[0].shape} "
                             f"{xs[0].dtype}, but the first step had {shape} {dt}; keep "
                             "the micro-batch shape fixed")
        run = StepRun(self, xs, ts)
        if self._reducer is not None:
            self._reducer.new_step()
        self._wait([self._p2p.barrier()])
        t0 = run.t0 = self._t0 = time.perf_counter()
        blocking = s.sends == "blocking"
        pending: list[Work] = []
        posted = self._post(run, 0)
        for k, st in enumerate(self._steps):
            works = posted
            if blocking and st.recvs:  # a step without receives carries the sends on
                works, pending = pending + works, []
            self._wait(works)
            start = time.perf_counter()
            out = run.action(st.action)
            run.times[st.action] = (start - t0, time.perf_counter() - t0)
            for msg in st.sends:
                buf = self._outgoing(out.pop((msg.what, msg.vstage, msg.microbatch)))
                pending.append(self._p2p.send(buf, msg.dst, msg.tag))
            run.outbox.update(out)  # for a stage on this rank
            posted = self._post(run, k + 1)
            for w in (*pending, *posted):  # progress: a transfer moves only inside MPI
                w.test()
        self._wait(pending)
        if run.saved or run.inbox or run.outbox:
            raise RuntimeError(f"pipeline step left {len(run.saved)} saved activations and "
                               f"{len(run.inbox) + len(run.outbox)} transfers unused")
        self._last = run.finish()
        return self._last

    def _post(self, run: StepRun, k: int) -> list[Work]:
        """Post the receives of step ``k`` (none past the end) into ``run.inbox``.

        They are posted one step early, right after step ``k - 1``'s action, with its
        sends (Megatron's batched isend/irecv): a message that arrives while this rank
        computes is then matched at the next progress call rather than at the wait. One
        step's receive buffers more are alive at a time; what is waited for, and when, is
        unchanged, so the schedule's deadlock proof still holds.
        """
        if k >= len(self._steps):
            return []
        works = []
        for msg in self._steps[k].recvs:
            shape, dt = self._boundary(msg.vstage + (msg.what == "act"))
            buf = self._incoming(shape, dt)
            run.inbox[(msg.what, msg.vstage, msg.microbatch)] = buf
            works.append(self._p2p.recv(buf, msg.src, msg.tag))
        return works

    def _batch(self, name: str, items: Sequence[Any] | None) -> list[Tensor]:
        m = self.schedule.microbatches
        if items is None or len(items) != m:
            got = "None" if items is None else f"{len(items)}"
            raise ConfigError(f"PipelineExecutor.step: rank {self.comm.rank} needs {name}, "
                              f"one per micro-batch: {m}, got {got}")
        return [self._leaf(x) for x in items]

    def timeline(self) -> Timeline:
        """Gather every rank's measured action times of the last step into a Timeline
        (collective over the pipeline group)."""
        if self._last is None:
            raise ConfigError("PipelineExecutor.timeline: run step() first")
        s = self.schedule
        n = max(len(acts) for acts in s.actions)
        mine = np.zeros((n, 2), np.float64)
        for k, a in enumerate(s.actions[self.comm.rank]):
            mine[k] = self._last.times[a]
        if self._one_clock:  # the machine's clock: no skew from leaving the barrier
            mine += self._t0
        every = np.zeros((s.stages, n, 2), np.float64)
        self._wait([self._p2p.all_gather(mine, every)])
        start = {a: float(every[r, k, 0]) for r, acts in enumerate(s.actions)
                 for k, a in enumerate(acts)}
        end = {a: float(every[r, k, 1]) for r, acts in enumerate(s.actions)
               for k, a in enumerate(acts)}
        return Timeline.measured(s, start, end)


def _encode(shape: Shape, dt: DType) -> np.ndarray:
    name = dt.name.encode()
    if len(shape) > 15 or len(name) > _META - 16:
        raise ShapeError(f"PipelineExecutor: activation {shape} {dt} has {len(shape)} axes; "
                         "reshape it to at most 15")
    meta = np.zeros(_META, np.int64)
    meta[0] = len(shape)
    meta[1:1 + len(shape)] = shape
    meta[16:16 + len(name)] = list(name)
    return meta


def _decode(meta: np.ndarray) -> tuple[Shape, DType]:
    ndim = int(meta[0])
    name = bytes(int(c) for c in meta[16:] if c).decode()
    return tuple(int(d) for d in meta[1:1 + ndim]), as_dtype(name)
