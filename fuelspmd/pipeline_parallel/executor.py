"""``PipelineExecutor``: run any :class:`Schedule` for real over a pipeline Communicator.

Layer 7. One executor per rank of the pipeline group; each holds the stages of its chunks
(virtual stage ``j * p + rank`` is chunk ``j``). A stage is an :class:`~fuelspmd.nn.Module`,
``stage(x) -> y`` built from lazy Tensors; the last virtual stage's output goes into
``loss(y, target) -> scalar``. :meth:`PipelineExecutor.step` walks ``schedule.steps(rank)``
and returns the mean loss over the micro-batches and the gradients of that mean with
respect to each chunk's ``stage.parameters()``, accumulated over micro-batches (and
averaged over ``dp`` when given). The parameters are read from the stages at every step:
an optimiser replaces their values in place between steps
(:meth:`~fuelspmd.nn.Parameter.assign`), and the next step differentiates at the new ones.

Saved activations. The backward of a micro-batch is built at its forward, while the lazy
history is still there: ``fs.vjp(y, [x, *params], ct)`` with the cotangent ``ct`` a leaf
whose buffer arrives at the backward (the gradient received from the next stage). The
forward realises the output together with every forward value the backward graph reads
(the *residuals*), so those are the saved activations; the backward realises the
gradients from them without recomputing anything, then drops them. ``recompute=True``
saves only the stage input and runs the forward again at the backward (activation
recomputation), which is also what a stage with collectives inside (tensor parallelism)
needs: its backward collectives must be created at the backward, in the same order on
every rank of its group. (:class:`~fuelspmd.pipeline_parallel.microbatch.StepRun` holds
that state.)

Transfers go through a private Communicator split off the pipeline one (so its messages
meet nothing else): lazy ``send``/``recv`` whose tags are the schedule's (``Message.tag``,
folded into the transport's ``tag_bound``: each pair of ranks issues its messages in the
same order on both sides, the guard checks it, so two messages that fold to one tag still
meet in order). The receives of each step are posted one step early (``Communicator.post``)
and the sends right after their action: with ``schedule.sends == "blocking"`` a step's
receives are waited for together with the sends still in flight (Megatron's
``send_forward_recv_backward``; a step with no receives carries the sends on, since waiting
there would only stall the sender until the receiver next enters MPI), with
``"nonblocking"`` every send is waited for at the end of the step. Every wait has the
Communicator's deadline; after every action the transfers in flight are polled (MPI
progresses only inside MPI calls). The activation shapes are found once, at the first
step, by passing (shape, dtype) along the virtual stages.

Data parallelism. With ``dp``, each gradient's average over it is an all_reduce in the
graph of its chunk's last backward, on a communicator that buckets (``bucket_bytes``):
the planner's one bucket rule packs them, and starts each bucket as soon as its last
gradient is computed, so it travels while the rest of the backward runs. ``reduce=``
replaces that averaging: ``reduce(chunk, grads)`` is built into the same graph instead,
and the step returns what it gives (ZeRO-1's reduce-scatters,
:meth:`~fuelspmd.optim.ZeRO1.reduce`, overlap the backward the same way); the loss is
still averaged over dp.

Timing. After a barrier, each action's compute (receives done, sends not started) is timed
with ``time.perf_counter``; :meth:`timeline` gathers every rank's times into a
:class:`~fuelspmd.pipeline_parallel.simulate.Timeline` (``Timeline.measured``). When every
rank runs on one machine (same host name, checked at construction), the times are placed on
that machine's one monotonic clock; across machines each rank's times count from its own
barrier exit.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from fuelspmd.comm import Communicator
from fuelspmd.dtypes import DType, Shape, float64
from fuelspmd.dtypes import dtype as as_dtype
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.graph import default_executor
from fuelspmd.graph.executor import recording
from fuelspmd.nn import DropoutRNG, Module, Parameter
from fuelspmd.pipeline_parallel.actions import Message, Schedule
from fuelspmd.pipeline_parallel.buckets import DP_BUCKET_BYTES, check_bucket_bytes
from fuelspmd.pipeline_parallel.microbatch import (
    Key,
    LossFn,
    ReduceFn,
    StepResult,
    StepRun,
)
from fuelspmd.pipeline_parallel.simulate import Timeline
from fuelspmd.pipeline_parallel.validate import validate
from fuelspmd.tensor import Tensor, realize, tensor, zeros
from fuelspmd.transport import agree

__all__ = ["PipelineExecutor", "StepResult"]

_META = 32  # int64 words of a shape message: ndim, up to 15 dims, dtype name


class PipelineExecutor:
    """Runs ``schedule`` on this rank of ``comm`` (the pipeline group); see the module docs.

    ``stages[j]`` is chunk ``j`` of this rank (``schedule.chunks`` of them), a Module.
    With ``dp`` (size > 1) the loss is averaged over it, and the gradients too, in buckets
    of at most ``bucket_bytes``, started inside each chunk's last backward; or, given
    ``reduce``, ``reduce(chunk, grads)`` there instead. ``dropout``: the stages' Dropout
    key, set to micro-batch ``i`` (``rng.set_step(rng.step, i)``) before each forward of
    micro-batch ``i``, recomputed ones included, so every micro-batch draws its own masks
    and a recomputed forward the same ones (the caller sets the step). Collective: every
    rank of ``comm`` (and of ``dp``) constructs its executor at the same point, with the
    same schedule.
    """

    def __init__(self, schedule: Schedule, *, comm: Communicator, stages: Sequence[Module],
                 loss: LossFn, dp: Communicator | None = None, recompute: bool = False,
                 reduce: ReduceFn | None = None, bucket_bytes: int = DP_BUCKET_BYTES,
                 dropout: DropoutRNG | None = None) -> None:
        validate(schedule)
        check_bucket_bytes(bucket_bytes)
        if comm.size != schedule.stages:
            raise ConfigError(
                f"PipelineExecutor: the schedule has {schedule.stages} stages but the "
                f"pipeline Communicator has {comm.size} ranks; build the schedule with "
                f"stages={comm.size} (e.g. mesh.comm('pp').size)")
        if len(stages) != schedule.chunks:
            raise ConfigError(
                f"PipelineExecutor: {len(stages)} stages given but the schedule has "
                f"{schedule.chunks} chunk(s) per rank; give one per chunk")
        for j, st in enumerate(stages):
            if not isinstance(st, Module):
                raise TypeError(f"PipelineExecutor: stage {j} is a {type(st).__name__}, not "
                                "an nn.Module; write the stage as a Module whose forward(x) "
                                "uses its Parameters")
        self.schedule = schedule
        self.comm = comm
        self.dp = dp
        self.loss = loss
        self.recompute = bool(recompute)
        self.reduce = reduce
        self.dropout = dropout
        self.stages = list(stages)
        self._p2p = comm.split(0, comm.rank)  # collective: a private channel
        agree(self._p2p.transport, "PipelineExecutor", timeout=comm.timeout,
              schedule=(schedule.kind, schedule.stages, schedule.microbatches,
                        schedule.chunks, schedule.sends), recompute=self.recompute)
        host = zlib.crc32(socket.gethostname().encode())
        hosts = self._p2p.all_gather(tensor(np.array([host], np.int64),
                                            device=comm.device)).numpy()
        self._one_clock = bool((hosts == hosts[0]).all())  # perf_counter: one per machine
        self._t0 = 0.0
        self._dp = (Communicator(dp.split(0, dp.rank).transport, device=dp.device,
                                 timeout=dp.timeout, bucket_bytes=bucket_bytes,
                                 record_times=True)
                    if dp is not None and dp.size > 1 else None)
        self._steps = schedule.steps(comm.rank)
        self._bound = self._p2p.transport.tag_bound + 1
        self._io: list[tuple[Shape, DType] | None] | None = None  # (shape, dtype) of each
        # virtual stage's input as far as this rank needs to know it (found at step 1)
        self._last: StepResult | None = None

    # ---- helpers ----------------------------------------------------------------------
    def _params(self) -> list[list[Parameter]]:
        """Each chunk's parameters now, realised, on the pipeline's device."""
        out = [st.parameters() for st in self.stages]
        for j, ps in enumerate(out):
            for p in ps:
                if p.device != self.comm.device:
                    raise ConfigError(f"PipelineExecutor: a parameter of stage {j} is on "
                                      f"{p.device} but the pipeline runs on "
                                      f"{self.comm.device}; build the stage on that device")
        realize(*(p for ps in out for p in ps))
        return out

    def _leaf(self, x: Any) -> Tensor:
        t = x if isinstance(x, Tensor) else tensor(x, device=self.comm.device)
        if t.device != self.comm.device:
            raise ConfigError(f"PipelineExecutor: a tensor is on {t.device} but the "
                              f"pipeline runs on {self.comm.device}; move it with .to()")
        return t.realize()

    def _tag(self, msg: Message) -> int:
        return msg.tag % self._bound

    # ---- shapes -----------------------------------------------------------------------
    def _discover(self, x0: Tensor | None) -> list[tuple[Shape, DType] | None]:
        """Pass (shape, dtype) of each virtual stage's input along the pipeline, building
        each stage lazily on a constant (shape rules only, nothing runs). Once per
        executor, at its first step, and untraced when that step is a compiled step's
        first call: what it leaves is Python state (the shapes), which no replay redoes."""
        previous = recording(None)
        try:
            return self._pass_shapes(x0)
        finally:
            recording(previous)

    def _pass_shapes(self, x0: Tensor | None) -> list[tuple[Shape, DType] | None]:
        s, rank, p2p = self.schedule, self.comm.rank, self._p2p
        V, base = s.virtual_stages, 2 * s.virtual_stages * s.microbatches
        io: list[tuple[Shape, DType] | None] = [None] * (V + 1)
        sends = []
        for v in range(V):
            if s.rank_of(v) != rank:
                continue
            if v == 0:
                assert x0 is not None
                io[0] = (x0.shape, x0.dtype)
            elif io[v] is None:
                meta = p2p.recv((_META,), "int64", s.rank_of(v - 1), tag=(base + v) % self._bound)
                io[v] = _decode(meta.numpy())
            shape, dt = io[v]  # type: ignore[misc]
            y = self.stages[v // s.stages](zeros(shape, device=self.comm.device, dtype=dt))
            io[v + 1] = (y.shape, y.dtype)
            if v + 1 < V and s.rank_of(v + 1) != rank:
                sends.append(p2p.send(tensor(_encode(y.shape, y.dtype), device=p2p.device),
                                      s.rank_of(v + 1), tag=(base + v + 1) % self._bound))
                p2p.post(sends[-1])
        realize(*sends)
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
        s, rank, p2p = self.schedule, self.comm.rank, self._p2p
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
        if self._dp is not None:
            self._dp.times = []
        run = StepRun(s, self.stages, self._params(), self.loss, recompute=self.recompute,
                      dp=self._dp, reduce=self.reduce, xs=xs, ts=ts, dropout=self.dropout)
        p2p.barrier()
        t0 = self._t0 = time.perf_counter()
        times: dict[Any, tuple[float, float]] = {}
        blocking = s.sends == "blocking"
        values: dict[Key, Tensor] = {}  # received or made here, not yet used
        sent: list[Tensor] = []  # send tokens in flight
        posted = self._post(0)
        for k, st in enumerate(self._steps):
            if blocking and st.recvs:  # a step without receives carries the sends on
                realize(*sent, *posted.values())
                sent = []
            else:
                realize(*posted.values())
            values.update(posted)
            start = time.perf_counter()
            out = run.action(st.action, {key: values.pop(key) for key in _needs(s, st)
                                         if key in values})
            times[st.action] = (start - t0, time.perf_counter() - t0)
            run.peak_run = max(run.peak_run, default_executor().peak_bytes)
            for msg in st.sends:
                tok = p2p.send(out.pop((msg.what, msg.vstage, msg.microbatch)), msg.dst,
                               tag=self._tag(msg))
                p2p.post(tok)
                sent.append(tok)
            values.update(out)  # for a stage on this rank
            posted = self._post(k + 1)
            p2p.poll()  # progress: a transfer moves only inside MPI
        realize(*sent)
        if run.saved or values:
            raise RuntimeError(f"pipeline step left {len(run.saved)} saved activations and "
                               f"{len(values)} transfers unused")
        self._last = run.finish(t0)  # the dp stamps, before the loss's own dp call
        self._last.loss = self._share_loss(run)
        self._last.times = times
        self._last.started = t0
        return self._last

    def _post(self, k: int) -> dict[Key, Tensor]:
        """Post the receives of step ``k`` (none past the end), by key.

        They are posted one step early, right after step ``k - 1``'s action, with its sends
        (Megatron's batched isend/irecv): a message that arrives while this rank computes
        is then matched at the next poll rather than at the wait. What is waited for, and
        when, is unchanged, so the schedule's deadlock proof still holds.
        """
        if k >= len(self._steps):
            return {}
        out = {}
        for msg in self._steps[k].recvs:
            shape, dt = self._boundary(msg.vstage + (msg.what == "act"))
            t = self._p2p.recv(shape, dt, msg.src, tag=self._tag(msg))
            self._p2p.post(t)
            out[(msg.what, msg.vstage, msg.microbatch)] = t
        return out

    def _share_loss(self, run: StepRun) -> Tensor:
        """The mean loss of the step, from the last stage to every rank (and over dp): a
        float64 0-d tensor, realised (never read to the host here, so a step compiles)."""
        s = self.schedule
        dev = self._p2p.device
        total = zeros((1,), device=dev, dtype=float64)
        for t in run.losses:
            total = total + t.astype(float64).reshape(1)
        if run.losses:
            total = total / s.microbatches
        shared = self._p2p.broadcast(total, s.rank_of(s.virtual_stages - 1))
        if self._dp is not None:
            shared = self._dp.all_reduce(shared, "avg")
        return shared.reshape(()).realize()

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
        every = self._p2p.all_gather(tensor(mine[None], device=self._p2p.device)).numpy()
        start = {a: float(every[r, k, 0]) for r, acts in enumerate(s.actions)
                 for k, a in enumerate(acts)}
        end = {a: float(every[r, k, 1]) for r, acts in enumerate(s.actions)
               for k, a in enumerate(acts)}
        return Timeline.measured(s, start, end)


def _needs(s: Schedule, st: Any) -> list[Key]:
    """The transferred values an action reads (received, or made on this rank)."""
    return [key for key in s.needs(st.action) if key[0] in ("act", "grad")]


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
