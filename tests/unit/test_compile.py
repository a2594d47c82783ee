"""``fs.compile`` in one process and in a DeviceGroup: compiled steps give the uncompiled
steps' losses bit for bit, replays build no graph, and what cannot be replayed raises."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import nn, optim
from fuelspmd.comm import Communicator
from fuelspmd.errors import CollectiveMismatchError, ConfigError
from fuelspmd.graph import node as graph_node
from fuelspmd.transport import SelfTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compile_programs as P

pytestmark = pytest.mark.timeout(300)


def solo() -> Communicator:
    return Communicator(SelfTransport(), device="cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_gpt_steps_equal_uncompiled_bit_for_bit(dtype: str) -> None:
    want, wparams, _ = P.train(solo(), compiled=False, dtype=dtype)
    got, gparams, step = P.train(solo(), compiled=True, dtype=dtype)
    assert got == want
    for a, b in zip(gparams, wparams):
        np.testing.assert_array_equal(a, b)
    assert step.replays >= P.STEPS - 3 and step.traces <= 3


def test_device_group_tp_compiled_equals_uncompiled() -> None:
    group = fs.DeviceGroup.cpu(2)
    want = group.run(lambda comm: P.train(comm, compiled=False)[0])
    got = group.run(lambda comm: P.train(comm, compiled=True)[0])
    assert got == want
    assert got[0] == got[1]  # the loss is replicated over tp


def _linear() -> tuple[nn.Parameter, optim.AdamW, fs.Tensor, fs.Tensor]:
    rng = np.random.default_rng(0)
    w = nn.Parameter(fs.tensor(rng.standard_normal((8, 4)).astype(np.float32)))
    x = fs.tensor(rng.standard_normal((16, 8)).astype(np.float32))
    y = fs.tensor(rng.standard_normal((16, 4)).astype(np.float32))
    return w, optim.AdamW([w], lr=1e-2), x, y


def _sgd_step(w: nn.Parameter, opt: optim.Optimizer) -> object:
    def step(x: fs.Tensor, y: fs.Tensor) -> fs.Tensor:
        loss = ((x @ w - y) ** 2).mean()
        opt.step(fs.grad(loss, [w]))
        return loss
    return step


def test_a_replay_builds_no_node_per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    w, opt, x, y = _linear()
    step = fs.compile(_sgd_step(w, opt))
    for _ in range(4):
        step(x, y)
    assert step.replays == 1
    made = []
    init = graph_node.Node.__init__

    def counting(self: object, *a: object, **k: object) -> None:
        made.append(a[0])
        init(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(graph_node.Node, "__init__", counting)
    step(x, y)
    assert step.replays == 2
    assert [op.name for op in made] == ["leaf"]  # the returned loss, nothing else


def test_a_new_shape_traces_again_and_matches() -> None:
    def run(compiled: bool) -> list[float]:
        w, opt, x, y = _linear()
        fn = _sgd_step(w, opt)
        step = fs.compile(fn) if compiled else fn
        out = [float(step(x, y).numpy()) for _ in range(5)]
        out += [float(step(x[:8], y[:8]).numpy()) for _ in range(5)]
        out += [float(step(x, y).numpy()) for _ in range(2)]
        return out
    assert run(True) == run(False)


def test_a_trace_never_replayed_keeps_no_value_it_made_alive() -> None:
    """The last trace of a signature is kept to compare the next call with, but what it
    made is the caller's: dropped by the caller, it is freed (a decode bucket of one step
    would otherwise hold that step's pages)."""
    double = fs.compile(lambda x: x * 2.0)
    y = double(fs.tensor(np.ones(1024)))
    gone = weakref.ref(y.node)
    del y
    gc.collect()
    assert gone() is None
    w, opt, x, t = _linear()  # and carried state is still found through the weak record
    step = fs.compile(_sgd_step(w, opt))
    losses = [float(step(x, t).numpy()) for _ in range(6)]
    assert (step.traces, step.replays) == (3, 3)  # the first call makes the state
    w2, opt2, _, _ = _linear()
    plain = _sgd_step(w2, opt2)
    assert losses == [float(plain(x, t).numpy()) for _ in range(6)]


def test_retrace_false_names_both_signatures() -> None:
    w, opt, x, y = _linear()
    step = fs.compile(_sgd_step(w, opt), retrace=False)
    step(x, y)
    with pytest.raises(ConfigError, match=r"called with args \(\(8, 8\) float32 cpu:0.*"
                                          r"compiled for args \(\(16, 8\) float32 cpu:0"):
        step(x[:8], y[:8])


def test_state_assigned_from_outside_is_seen() -> None:
    def run(compiled: bool) -> list[float]:
        w, opt, x, y = _linear()
        fn = _sgd_step(w, opt)
        step = fs.compile(fn) if compiled else fn
        out = [float(step(x, y).numpy()) for _ in range(5)]
        w.assign(np.zeros((8, 4), np.float32))  # a checkpoint loaded between steps
        return out + [float(step(x, y).numpy()) for _ in range(3)]
    assert run(True) == run(False)


def test_a_host_read_inside_raises() -> None:
    w, _, x, _ = _linear()

    def bad(x: fs.Tensor) -> fs.Tensor:
        s = float((x @ w).sum().numpy())
        return x * s
    with pytest.raises(ConfigError, match=r"read a .* tensor's value to the host"):
        fs.compile(bad)(x)


def test_per_call_data_made_inside_raises() -> None:
    w, _, x, _ = _linear()
    rng = np.random.default_rng(0)

    def noisy(x: fs.Tensor) -> fs.Tensor:
        return x @ w + fs.tensor(rng.standard_normal((16, 4)).astype(np.float32))
    step = fs.compile(noisy)
    with pytest.raises(ConfigError, match="made inside the function from host data differs"):
        for _ in range(4):
            step(x)


def test_a_python_number_changing_per_call_raises() -> None:
    _, _, x, _ = _linear()
    count = [0]

    def drifting(x: fs.Tensor) -> fs.Tensor:
        count[0] += 1
        return x * float(count[0])
    step = fs.compile(drifting)
    with pytest.raises(ConfigError, match="ran different graphs each time"):
        for _ in range(8):
            step(x)


def test_a_collective_built_before_a_replay_is_issued_first() -> None:
    """Device 0 builds an all_reduce before calling the replayed step, device 1 after it:
    uncompiled, device 0 issues it first and the group raises the mismatch; a replay
    must too (issuing the step's collectives first would hide the bug and reorder)."""
    group = fs.DeviceGroup.cpu(2, timeout=10.0)

    def program(comm: Communicator, compiled: bool) -> None:
        w = nn.Parameter(fs.tensor(np.ones((4, 3), np.float32), device=comm.device))
        opt = optim.SGD([w], lr=0.1)

        def step(x: fs.Tensor) -> fs.Tensor:
            loss = (comm.all_reduce(x @ w) ** 2).mean()
            opt.step(fs.grad(loss, [w]))
            return loss
        fn = fs.compile(step) if compiled else step
        x = fs.tensor(np.ones((2, 4), np.float32), device=comm.device)
        for _ in range(4):
            fn(x)
        y = fs.tensor(np.ones(5, np.float32), device=comm.device)
        early = comm.all_reduce(y) if comm.rank == 0 else None
        fn(x)
        late = comm.all_reduce(y) if comm.rank == 1 else early
        assert late is not None
        late.numpy()

    for compiled in (False, True):
        with pytest.raises(CollectiveMismatchError):
            group.run(program, [compiled] * 2)


def test_a_donated_argument_is_written_in_place_and_spent() -> None:
    """A donated argument is given to the plan, which writes it in place (``put``) on the
    trace and on every replay; the caller's tensor is spent, an undonated call a new
    signature."""
    def write(pages: fs.Tensor, slots: fs.Tensor, rows: fs.Tensor) -> fs.Tensor:
        return fs.Tensor(fs.graph.make("put", (pages.node, slots.node, rows.node), (0,)))

    step = fs.compile(write)
    pages = fs.tensor(np.zeros((8, 2), np.float32))
    for i in range(4):
        before = pages
        buf = before.node.buffer
        pages = step(pages.donate(), fs.tensor(np.array([i], np.int64)),
                     fs.tensor(np.full((1, 2), i + 1, np.float32)))
        assert pages.node.buffer is buf  # written in place, no copy of the pages
        with pytest.raises(ConfigError, match="donated"):
            before.numpy()
    assert (step.traces, step.replays) == (2, 2)
    want = np.zeros((8, 2), np.float32)
    want[:4] = np.arange(1, 5)[:, None]
    np.testing.assert_array_equal(pages.numpy(), want)
    kept = step(pages, fs.tensor(np.array([5], np.int64)), fs.tensor(np.ones((1, 2), np.float32)))
    assert step.traces == 3 and kept.node.buffer is not pages.node.buffer
    np.testing.assert_array_equal(pages.numpy(), want)  # undonated: left as it was


def _realised_step(w: nn.Parameter, opt: optim.Optimizer) -> Any:
    """As :func:`_sgd_step`, the loss realised with the gradients (as the bench's step):
    else the returned loss is computed again, after the update, from the old weight."""
    def step(x: fs.Tensor, y: fs.Tensor) -> fs.Tensor:
        loss = ((x @ w - y) ** 2).mean()
        grads = fs.grad(loss, [w])
        fs.realize(loss, *grads)
        opt.step(grads)
        return loss
    return step


def _adamw_run(calls: int, between: Any = None) -> tuple[list[float], np.ndarray, Any]:
    """``calls`` compiled AdamW steps of the linear model; ``between(w, i)`` runs before
    call ``i``. The losses, the final weight and the step."""
    w, opt, x, y = _linear()
    step = fs.compile(_realised_step(w, opt))
    losses = []
    for i in range(calls):
        if between is not None:
            between(w, i)
        losses.append(float(step(x, y).numpy()))
    return losses, w.numpy().copy(), step


def _buffers(w: nn.Parameter, opt: optim.Optimizer) -> list[Any]:
    """The arrays holding the weight and the optimiser's moments (read from the nodes:
    nothing handed out, so nothing escapes)."""
    (st, _), = opt._flat  # type: ignore[misc]
    return [w.node.buffer, *(v.node.buffer for v in st.values())]


def test_a_replay_writes_the_carried_state_in_place() -> None:
    """On replay the old value of every carried cell is dead once the step replaces it:
    the plans take the weight's and the moments' buffers as donated and write the new
    values into them; the numbers stay those of the uncompiled step."""
    w, opt, x, y = _linear()
    step = fs.compile(_realised_step(w, opt))
    for _ in range(4):
        step(x, y)
    assert step.replays == 1
    before = _buffers(w, opt)
    for _ in range(3):
        step(x, y)
        after = _buffers(w, opt)
        assert all(np.shares_memory(a, b) for a, b in zip(after, before))
    w2, opt2, _, _ = _linear()
    plain = _realised_step(w2, opt2)
    for _ in range(7):
        plain(x, y)
    np.testing.assert_array_equal(w.numpy(), w2.numpy())


def test_a_value_handed_out_before_a_replay_keeps_its_value() -> None:
    """``w.numpy()`` and a realised view of ``w`` share its buffer: the replay after gives
    the weight a fresh buffer instead of writing that one (the next replays write in
    place again), so a copy taken as the docs say is never changed under the caller."""
    kept: dict[int, tuple[np.ndarray, np.ndarray, fs.Tensor]] = {}

    def hand_out(w: nn.Parameter, i: int) -> None:
        if i in (5, 6):
            host = w.numpy()
            view = fs.Tensor(w.node).T.realize()
            kept[i] = (host, host.copy(), view)

    losses, final, _ = _adamw_run(9, hand_out)
    assert losses == _adamw_run(9)[0]
    for host, copy, view in kept.values():
        np.testing.assert_array_equal(host, copy)
        np.testing.assert_array_equal(view.numpy(), copy.T)
        assert not np.array_equal(host, final)


@pytest.mark.parametrize("returns", ["new", "old and new"])
def test_outputs_of_a_replay_are_not_changed_by_the_next(returns: str) -> None:
    """A tensor a replay returns that is a carried value (new, old, or a view of one) is
    the caller's: no later replay writes its buffer. (A traced call returns the state's
    own node, which every replay updates, as the module docstring says.)"""
    w, opt, x, y = _linear()
    inner = _realised_step(w, opt)

    def step(x: fs.Tensor, y: fs.Tensor) -> tuple[fs.Tensor, ...]:
        old = fs.Tensor(w.node)
        loss = inner(x, y)
        if returns == "new":
            return loss, fs.Tensor(w.node)
        return loss, old, old.T, fs.Tensor(w.node), fs.Tensor(w.node).reshape(-1)

    compiled = fs.compile(step)
    outs = []
    for _ in range(7):
        replays = compiled.replays
        got = compiled(x, y)
        if compiled.replays > replays:
            outs.append((got, [t.numpy().copy() for t in got]))
    assert len(outs) >= 4
    for got, values in outs:
        for t, v in zip(got, values):
            np.testing.assert_array_equal(t.numpy(), v)
    for k in range(1, len(outs)):  # each call's old value is the call before's new one
        values, earlier = outs[k][1], outs[k - 1][1]
        if returns != "new":
            np.testing.assert_array_equal(values[1], earlier[3])


def test_a_replay_reuses_the_buffers_the_last_one_released() -> None:
    """Every replay of a step takes its intermediates from the buffers the replay before
    released (its pool stays the same size), never from a tensor a replay returned: the
    activations each call returns keep their values through later calls."""
    w, opt, x, y = _linear()

    def step(x: fs.Tensor, y: fs.Tensor) -> tuple[fs.Tensor, ...]:
        h = x @ w
        act = (h * 2.0).tanh()
        loss = ((act - y) ** 2).mean()
        grads = fs.grad(loss, [w])
        fs.realize(loss, h, act, *grads)
        opt.step(grads)
        return loss, h, act, h.T

    compiled = fs.compile(step)
    for _ in range(3):
        compiled(x, y)
    (entry,) = compiled._entries.values()
    memory = entry.replay.memory  # type: ignore[union-attr]
    outs, kept = [], []
    for _ in range(6):
        got = compiled(x, y)
        outs.append((got, [t.numpy().copy() for t in got]))
        kept.append(memory.kept)
    assert compiled.replays == 6
    assert kept[0] > 0 and len(set(kept)) == 1
    for got, values in outs:
        for t, v in zip(got, values):
            np.testing.assert_array_equal(t.numpy(), v)
    assert not np.array_equal(outs[0][1][1], outs[-1][1][1])  # the weight moved


def test_a_compiled_function_inside_another_is_part_of_its_trace() -> None:
    def run(compiled: bool) -> list[float]:
        w, opt, x, y = _linear()
        inner = _sgd_step(w, opt)
        inner = fs.compile(inner) if compiled else inner

        def outer(x: fs.Tensor, y: fs.Tensor) -> fs.Tensor:
            return inner(x, y) * 2.0
        step = fs.compile(outer) if compiled else outer
        return [float(step(x, y).numpy()) for _ in range(6)]
    assert run(True) == run(False)


def test_models_gpt2_over_tp_compiled_equals_uncompiled() -> None:
    """fuelspmd.models.GPT2 (vocabulary-parallel tied embedding, its ids checked through
    fs.host), TP over a DeviceGroup.cpu(2), AdamW: 8 steps bit for bit."""
    from fuelspmd import models
    from fuelspmd.tensor_parallel import vocab_parallel_cross_entropy

    cfg = models.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 32, (2, 9)) for _ in range(8)]

    def program(comm: Communicator, compiled: bool) -> tuple[list[float], int]:
        model = models.GPT2(cfg, comm=comm, seed=0)
        model.head.gather_output = False  # the loss takes the vocabulary-split logits
        params = model.parameters()
        opt = optim.AdamW(params, lr=1e-2)

        def step(ids: fs.Tensor, targets: fs.Tensor) -> fs.Tensor:
            z = model(ids)
            loss = vocab_parallel_cross_entropy(z.reshape(-1, z.shape[-1]), targets,
                                                comm=comm)
            grads = fs.grad(loss, params)
            fs.realize(loss, *grads)
            opt.step(grads)
            return loss
        fn = fs.compile(step) if compiled else step
        losses = [float(fn(fs.tensor(t[:, :-1], device=comm.device),
                           fs.tensor(t[:, 1:].reshape(-1), device=comm.device)).numpy())
                  for t in data]
        return losses, getattr(fn, "replays", 0)

    group = fs.DeviceGroup.cpu(2)
    got, want = group.run(program, [True] * 2), group.run(program, [False] * 2)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(g[1] >= 5 for g in got)


def test_a_float16_step_skipped_by_the_loss_scaler_replays_as_uncompiled() -> None:
    """Clip, loss scaling and a skipped step decided in the graph: compiled (replaying
    through the overflow at step 5) and uncompiled give the same parameters, scales and
    skip counts, bit for bit."""
    def run(compiled: bool) -> tuple[list[tuple[float, bool, float]], np.ndarray, int]:
        p = nn.Parameter(fs.tensor(np.linspace(0.5, 1.5, 6).astype(np.float16)))
        opt = optim.AdamW([p], lr=0.05)
        scaler = optim.LossScaler(2.0 ** 10, interval=2)

        def step(x: fs.Tensor, big: fs.Tensor) -> tuple[fs.Tensor, fs.Tensor]:
            w = p.astype(fs.float32)
            loss = (w * w * x * big).sum()
            grads, finite = scaler.unscale(fs.grad(scaler.scale(loss), [p]))
            grads, norm = optim.clip_grad_norm([p], grads, 1.0)
            opt.step(grads, apply=finite)
            scaler.update(finite)
            return norm, finite

        fn = fs.compile(step) if compiled else step
        seen = []
        with np.errstate(over="ignore", invalid="ignore"):
            for k in range(8):
                x = fs.tensor((np.arange(6, dtype=np.float32) + k) / 100)
                big = fs.tensor(np.float32(1e4 if k == 5 else 1.0))  # 1e4 * 2^10 overflows
                norm, finite = fn(x, big)
                seen.append((scaler.value, bool(finite), float(norm)))
        return seen, p.numpy(), fn.replays if compiled else 0

    got, gp, replays = run(True)
    want, wp, _ = run(False)
    assert replays >= 4
    assert got == want and [f for _, f, _ in got].count(False) == 1
    assert [s for s, _, _ in got][4:7] == [2.0 ** 12, 2.0 ** 11, 2.0 ** 11]  # backed off once
    np.testing.assert_array_equal(gp, wp)


def test_posted_transfers_are_posted_again_on_every_replay() -> None:
    """A send and a receive posted inside the function (Communicator.post, as the pipeline
    posts its messages): every replay sends the new value and computes with what it
    received, as uncompiled; none is baked in as a constant of the trace."""
    def program(comm: Communicator) -> list[float]:
        peer = 1 - comm.rank

        def step(x: fs.Tensor) -> fs.Tensor:
            sent = comm.send(x * 2.0, peer, tag=7)
            comm.post(sent)  # a DeviceGroup's receive waits at its post: send first
            got = comm.recv((3,), "float32", peer, tag=7)
            comm.post(got)
            fs.realize(sent)
            return (got + x).sum()

        compiled = fs.compile(step)
        out = []
        for k in range(6):
            x = fs.tensor(np.full(3, 10.0 * k + comm.rank, np.float32), device=comm.device)
            out.append((float(compiled(x)), float(step(x))))
        assert compiled.replays >= 3, compiled
        return out

    for rank, pairs in enumerate(fs.DeviceGroup.cpu(2, timeout=30).run(program)):
        for k, (got, want) in enumerate(pairs):
            assert got == want == 3 * (2 * (10.0 * k + 1 - rank) + 10.0 * k + rank)


def test_a_transfer_posted_before_the_call_and_waited_for_inside_raises() -> None:
    def program(comm: Communicator) -> None:
        peer = 1 - comm.rank
        comm.post(comm.send(fs.ones(2, device=comm.device), peer, tag=1))
        got = comm.recv((2,), "float32", peer, tag=1)
        comm.post(got)
        with pytest.raises(ConfigError, match="posted before it was called"):
            fs.compile(lambda x: got + x)(fs.ones(2, device=comm.device))
        comm.flush()

    fs.DeviceGroup.cpu(2, timeout=30).run(program)
