"""PipelineExecutor in a DeviceGroup: every schedule gives the single-process loss and
gradients; transfers, saved activations, timing and errors.

The program and its numpy reference are in tests/pipeline_programs.py;
tests/mpi/test_pipeline_executor.py runs the same program under mpiexec.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import nn
from fuelspmd.device_group import DeviceGroup
from fuelspmd.device_group.transport import LocalTransport
from fuelspmd.errors import CollectiveMismatchError, ConfigError, ShapeError
from fuelspmd.mesh import Mesh
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule, simulate
from fuelspmd.pipeline_parallel.render import chrome_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pipeline_programs as P
from budget import long_only

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 20.0
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_every_schedule_matches_one_process(n: int, kind: str, chunks: int) -> None:
    m = 6 if n == 3 else 4
    outs = DeviceGroup.cpu(n, timeout=TIMEOUT).run(lambda c: P.run(c, kind, m, chunks))
    for got in outs:
        P.check(got, n * chunks, m)


@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_dp_by_pp_averages_over_replicas(kind: str, chunks: int) -> None:
    outs = DeviceGroup.cpu(4, timeout=TIMEOUT).run(lambda c: P.run(c, kind, 4, chunks, dp=2))
    for got in outs:
        P.check(got, 2 * chunks, 4, dp=2)
    assert outs[0]["loss"] == outs[1]["loss"] == outs[2]["loss"]


@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_dp_buckets_start_in_the_last_backward_and_give_the_same_numbers(
        kind: str, chunks: int) -> None:
    """bucket_bytes=1: each parameter (W, b) its own dp all-reduce, bias first."""
    outs = DeviceGroup.cpu(4, timeout=TIMEOUT).run(
        lambda c: P.run(c, kind, 4, chunks, dp=2, bucket_bytes=1))
    sched = schedule(kind, 2, 4, chunks)
    for rank, got in enumerate(outs):
        P.check(got, 2 * chunks, 4, dp=2)
        P.check_buckets(got["result"], sched, rank % 2, buckets=2)


def test_reduce_replaces_the_dp_average() -> None:
    """``reduce=`` (here the identity) replaces the dp all-reduce: each replica's own
    gradients, whose dp mean is the averaged step's; the loss is still the dp mean."""
    outs = DeviceGroup.cpu(4, timeout=TIMEOUT).run(
        lambda c: P.run(c, "1f1b", 4, 1, dp=2, own_grads=True))
    for pp_rank in (0, 1):
        a, b = outs[pp_rank], outs[2 + pp_rank]  # dp 0 and dp 1 of that stage
        assert a["loss"] == b["loss"]
        mean = {v: [(x + y) / 2 for x, y in zip(a["grads"][v], b["grads"][v])]
                for v in a["grads"]}
        assert not np.allclose(a["grads"][pp_rank][0], b["grads"][pp_rank][0])
        P.check({"loss": a["loss"], "grads": mean}, 2, 4, dp=2)


class _Dropped(nn.Module):
    """``dropout(x) @ W``: a stage whose masks the executor keys by micro-batch."""

    def __init__(self, w: np.ndarray, rng: nn.DropoutRNG, device: Any) -> None:
        self.drop = nn.Dropout(0.5, rng=rng, layer=0)
        self.weight = nn.Parameter(w, device=device)

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        return self.drop(x) @ self.weight


@pytest.mark.parametrize("recompute", [False, True])
def test_dropout_is_keyed_by_micro_batch_at_the_forward_and_its_recompute(
        recompute: bool) -> None:
    """The gradient equals one process's with ``rng.set_step(step, i)`` before micro-batch
    i's forward: each micro-batch its own masks, the recomputed forward the same ones."""
    rng_w = np.random.default_rng(4)
    w, xs = rng_w.standard_normal((6, 3)), [rng_w.standard_normal((5, 6)) for _ in range(3)]
    ts = [np.zeros((5, 3))] * 3

    def body(comm: fs.Communicator) -> np.ndarray:
        rng = nn.DropoutRNG(7)
        stage = _Dropped(w, rng, comm.device)
        ex = PipelineExecutor(schedule("1f1b", 1, 3), comm=comm, stages=[stage], loss=P.mse,
                              recompute=recompute, dropout=rng)
        rng.set_step(5)
        return ex.step(xs, ts).grads[0][0].numpy()

    (got,) = DeviceGroup.cpu(1, timeout=TIMEOUT).run(body)
    rng = nn.DropoutRNG(7)
    ref = _Dropped(w, rng, "cpu:0")
    total = None
    for i, (x, t) in enumerate(zip(xs, ts)):
        rng.set_step(5, i)
        term = P.mse(ref(fs.tensor(x)), fs.tensor(t)) * (1 / 3)
        total = term if total is None else total + term
    assert total is not None
    np.testing.assert_allclose(got, fs.grad(total, [ref.weight])[0].numpy(), rtol=1e-12)
    rng.set_step(5, 0)
    one = ref.drop(fs.tensor(np.ones((5, 6)))).numpy()
    rng.set_step(5, 1)
    assert not np.array_equal(one, ref.drop(fs.tensor(np.ones((5, 6)))).numpy())


def test_bucket_bytes_must_be_positive() -> None:
    def body(comm: fs.Communicator) -> None:
        with pytest.raises(ConfigError, match="bucket_bytes=0"):
            P.run(comm, "1f1b", 2, 1, dp=2, bucket_bytes=0)
    DeviceGroup.cpu(2, timeout=TIMEOUT).run(body)


@pytest.mark.parametrize(("kind", "chunks"), KINDS)
def test_recompute_and_nonblocking_sends_give_the_same_numbers(kind: str, chunks: int) -> None:
    outs = DeviceGroup.cpu(2, timeout=TIMEOUT).run(
        lambda c: P.run(c, kind, 4, chunks, recompute=True, sends="nonblocking"))
    for got in outs:
        P.check(got, 2 * chunks, 4)


def test_1f1b_saves_p_over_m_of_gpipe_activations() -> None:
    """Rank 0 holds m micro-batches under GPipe and p under 1F1B; saved bytes follow."""
    p, m = 2, 8
    peaks = {}
    for kind in ("gpipe", "1f1b"):
        outs = DeviceGroup.cpu(p, timeout=TIMEOUT).run(lambda c, kind=kind: P.run(c, kind, m, 1))
        peaks[kind] = [o["result"].peak_saved_bytes for o in outs]
    assert all(b > 0 for b in peaks["gpipe"])
    assert peaks["1f1b"][0] * m == peaks["gpipe"][0] * p
    assert all(a <= b for a, b in zip(peaks["1f1b"], peaks["gpipe"]))


def test_measured_timeline_covers_the_schedule_in_order() -> None:
    p, m = 2, 4
    outs = DeviceGroup.cpu(p, timeout=TIMEOUT).run(lambda c: P.run(c, "1f1b", m, 1))
    tl = outs[0]["timeline"]
    sched = schedule("1f1b", p, m)
    assert set(tl.start) == {a for acts in sched.actions for a in acts}
    for acts in sched.actions:  # each rank ran its actions in its order, one at a time
        for a, b in itertools.pairwise(acts):
            assert tl.start[a] <= tl.end[a] <= tl.start[b]
    for a in tl.start:  # an action starts after what it needs was made
        for key in sched.needs(a):
            src = sched.action_at("F" if key[0] == "act" else "B", key[1], key[2])
            assert tl.end[src] <= tl.start[a] + 1e-3  # clocks of one process
    assert 0 < tl.makespan and 0 <= tl.bubble < 1
    sim = simulate(sched, {a: tl.end[a] - tl.start[a] for a in tl.start})
    assert sim.makespan <= tl.makespan * 1.5 + 1e-3
    trace = json.loads(json.dumps(chrome_trace(tl)))
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 2 * p * m


class _Linear(nn.Module):
    """``x @ W``, its collective-free stage; ``tp`` given: the mean over tp of identical
    replicas, an all_reduce inside the stage."""

    def __init__(self, w: np.ndarray, device: Any, tp: fs.Communicator | None = None) -> None:
        self.weight = nn.Parameter(w, device=device)
        self.tp = tp

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        y = x @ self.weight
        return y if self.tp is None else self.tp.all_reduce(y) * (1.0 / self.tp.size)


def test_bad_configuration_is_refused() -> None:
    def body(comm: fs.Communicator) -> None:
        lin = _Linear(np.eye(3), comm.device)
        with pytest.raises(ConfigError, match=r"schedule has 3 stages but .* 2 ranks"):
            PipelineExecutor(schedule("gpipe", 3, 2), comm=comm, stages=[lin], loss=P.mse)
        with pytest.raises(ConfigError, match="1 stages given but the schedule has 2 chunk"):
            PipelineExecutor(schedule("interleaved", 2, 2, 2), comm=comm, stages=[lin],
                             loss=P.mse)
        with pytest.raises(TypeError, match=r"stage 0 is a function, not an nn\.Module"):
            PipelineExecutor(schedule("gpipe", 2, 2), comm=comm,
                             stages=[lambda x: x], loss=P.mse)  # type: ignore[list-item]
        ex = PipelineExecutor(schedule("gpipe", 2, 2), comm=comm, stages=[lin],
                              loss=lambda y, t: y - t)
        if comm.rank == 0:
            with pytest.raises(ConfigError, match="rank 0 needs inputs, one per micro-batch: "
                                                  "2, got 1"):
                ex.step([np.ones((1, 3))])
        with pytest.raises(ConfigError, match="run step"):
            ex.timeline()

    DeviceGroup.cpu(2, timeout=TIMEOUT).run(body)


def test_ranks_that_build_different_executors_are_named() -> None:
    def body(comm: fs.Communicator) -> str:
        with pytest.raises(CollectiveMismatchError) as e:
            PipelineExecutor(schedule("gpipe", 2, 2), comm=comm,
                             stages=[_Linear(np.eye(3), comm.device)], loss=P.mse,
                             recompute=comm.rank == 1)
        return str(e.value)

    for text in DeviceGroup.cpu(2, timeout=TIMEOUT).run(body):
        assert "PipelineExecutor: the ranks disagree (recompute: rank 0 has False, rank 1 " \
               "has True)" in text, text


def test_a_loss_that_is_not_scalar_is_refused() -> None:
    def body(comm: fs.Communicator) -> None:
        ex = PipelineExecutor(schedule("gpipe", 1, 1), comm=comm,
                              stages=[_Linear(np.eye(3), comm.device)], loss=lambda y, t: y - t)
        with pytest.raises(ShapeError, match=r"loss gave shape \(1, 3\)"):
            ex.step([np.ones((1, 3))], [np.ones((1, 3))])

    DeviceGroup.cpu(1, timeout=TIMEOUT).run(body)


def test_a_collective_in_a_stage_needs_recompute() -> None:
    """A tp all_reduce inside a stage: saved-activation mode refuses (its backward
    collectives would be created out of order); recompute mode matches numpy."""
    x, t = np.arange(6.0).reshape(2, 3) / 6, np.ones((2, 3))
    w = np.random.default_rng(1).standard_normal((3, 3))

    def body(comm: fs.Communicator, recompute: bool) -> float:
        mesh = Mesh(comm, tp=2)
        stage = _Linear(w, comm.device, tp=mesh.comm("tp"))
        ex = PipelineExecutor(schedule("1f1b", 1, 2), comm=mesh.comm("pp"), stages=[stage],
                              loss=P.mse, recompute=recompute)
        out = ex.step([x, 2 * x], [t, t])
        return float(out.loss), out.grads[0][0].numpy()

    group = DeviceGroup.cpu(2, timeout=TIMEOUT)
    with pytest.raises(ConfigError, match=r"collective .*recompute=True"):
        group.run(lambda c: body(c, False))
    group = DeviceGroup.cpu(2, timeout=TIMEOUT)
    for loss, gw in group.run(lambda c: body(c, True)):
        xs = [x, 2 * x]
        want_loss = np.mean([np.mean((xi @ w - t) ** 2) for xi in xs])
        want_gw = sum(xi.T @ (2 * (xi @ w - t) / t.size) for xi in xs) / 2
        np.testing.assert_allclose(loss, want_loss, rtol=1e-10)
        np.testing.assert_allclose(gw, want_gw, rtol=1e-9)


@pytest.mark.parametrize("devices", [["strict:0", "strict:1"], ["cpu:0", "strict:0"]])
@pytest.mark.parametrize(("kind", "chunks"), [("1f1b", 1), ("interleaved", 2)])
def test_array_api_strict_and_mixed_devices(devices: list[str], kind: str,
                                            chunks: int) -> None:
    """Activations staged through the host between libraries give the same numbers."""
    outs = DeviceGroup(devices, timeout=TIMEOUT).run(lambda c: P.run(c, kind, 4, chunks))
    for got in outs:
        P.check(got, 2 * chunks, 4)


@pytest.mark.parametrize("devices", [[f"strict:{i}" for i in range(4)],
                                     ["cpu:0", "strict:0", "cpu:1", "strict:1"]])
def test_dp_buckets_on_array_api_strict(devices: list[str]) -> None:
    """Bucket buffers and the gradient views cut from them work in any Array API library."""
    outs = DeviceGroup(devices, timeout=TIMEOUT).run(
        lambda c: P.run(c, "1f1b", 4, 1, dp=2, bucket_bytes=1))
    for got in outs:
        P.check(got, 2, 4, dp=2)


@pytest.mark.parametrize("bound", [1023, pytest.param(LocalTransport.tag_bound,
                                                    marks=long_only)])
def test_tags_past_the_transport_bound_fold_and_still_meet_in_order(
        bound: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """(bound + 1) / 4 + 1 micro-batches over 2 stages give schedule tags past the local
    transport's bound: they fold, and each pair's messages still meet in issue order. CI
    folds at a bound of 1023 (257 micro-batches); the long run at the transport's own,
    32767 (8193 micro-batches)."""
    monkeypatch.setattr(LocalTransport, "tag_bound", bound)
    m = (bound + 1) // 4 + 1
    sched = schedule("1f1b", 2, m)
    assert max(msg.tag for st in sched.steps(0) for msg in (*st.sends, *st.recvs)) > bound
    w = np.array([[2.0]])
    xs = [np.array([[float(i)]]) for i in range(m)]

    def body(comm: fs.Communicator) -> tuple[float, np.ndarray]:
        ex = PipelineExecutor(sched, comm=comm, stages=[_Linear(w, comm.device)],
                              loss=lambda y, t: (y * t).sum())
        out = ex.step(xs if comm.rank == 0 else None, xs if comm.rank == 1 else None)
        return float(out.loss), out.grads[0][0].numpy()

    # y_i = 4 x_i (two stages of x @ 2), loss = mean_i y_i x_i = 4 mean x_i^2;
    # d/dw of each stage = 2 mean x_i^2 (the other stage's factor 2 times x_i^2)
    mean_sq = float(np.mean(np.arange(m, dtype=np.float64) ** 2))
    # a peer's wait spans the other's building of thousands of actions, not one message:
    # the deadline is a hang's, not a speed target
    for loss, gw in DeviceGroup.cpu(2, timeout=6 * TIMEOUT).run(body):
        np.testing.assert_allclose(loss, 4 * mean_sq, rtol=1e-12)
        np.testing.assert_allclose(gw, [[2 * mean_sq]], rtol=1e-12)
