"""Invariant 10, a replay reads what a run would: after any number of ``fs.compile``
replays, every state a step carries reads its latest value, through every way a user or a
checkpoint reads it (``opt.state``, ``opt.master``, ``state_dict``, ``shard_state``, the
scaler's numbers, a user's own Parameter), equal bit for bit to the uncompiled run read at
the same points. Reads are taken after steps at which the compiled step is tracing and at
which it replays, and read again later (a value read early must not be what a later read
returns)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import nn, optim
from fuelspmd.comm import Communicator
from fuelspmd.transport import SelfTransport

pytestmark = pytest.mark.timeout(120)

STEPS = 7
READS = (1, 3, 4, 6)  # 0-based steps after which everything is read: traced and replayed


def _params(dtype: str) -> list[nn.Parameter]:
    """Two small parameters (one flat group) and one larger than ``FLAT_ELEMENTS`` (alone)."""
    rng = np.random.default_rng(0)
    shapes = [(8, 4), (4,), (300, 240)]
    return [nn.Parameter(fs.tensor(rng.standard_normal(s).astype(np.float32)).astype(dtype))
            for s in shapes]


def _loss(ps: list[nn.Parameter], k: fs.Tensor) -> fs.Tensor:
    a, b, c = (p.astype("float32") for p in ps)
    return ((a.sum(axis=1) + b.sum()) ** 2).sum() * k + (c * c * k).mean()


def _host(x: Any) -> Any:
    """A copy of everything in a state structure, Tensors read to numpy."""
    if isinstance(x, fs.Tensor):
        return np.array(x.numpy())
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_host(v) for v in x]
    return x


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


Make = Callable[[], tuple[Callable[..., Any], Callable[[], Any]]]


def _run(make: Make, compiled: bool, ks: list[float] | None = None) -> list[Any]:
    """``make()`` gives (step, read); ``step(k)`` for each ``k`` of ``ks``; the reads after
    each step of ``READS``."""
    step, read = make()
    fn = fs.compile(step) if compiled else step
    reads = []
    for i, k in enumerate(ks or [1.0 + 0.25 * i for i in range(STEPS)]):
        with np.errstate(over="ignore", invalid="ignore"):
            fn(fs.tensor(np.float32(k)))
        if i in READS:
            reads.append(_host(read()))
    if compiled:
        assert fn.replays >= 3, fn
    return reads


def _compare(make: Make, ks: list[float] | None = None) -> list[Any]:
    want = _run(make, compiled=False, ks=ks)
    got = _run(make, compiled=True, ks=ks)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same(g, w, f"read after step {READS[i]}")
    # the state changed between reads (a test that compared a frozen state would pass)
    assert not all(np.array_equal(a, b) for a, b in zip(_flat(got[-2]), _flat(got[-1])))
    return want


def _flat(x: Any) -> list[np.ndarray]:
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, dict):
        return [a for v in x.values() for a in _flat(v)]
    if isinstance(x, list):
        return [a for v in x for a in _flat(v)]
    return []


def _optimiser_reads(opt: Any, ps: list[nn.Parameter]) -> Callable[[], Any]:
    def read() -> Any:
        out = {"params": list(ps), "state_dict": opt.state_dict(),
               "shard_state": [{k: list(v) for k, v in d.items()} for d in opt.shard_state()]}
        if isinstance(opt, optim.Optimizer):
            out["state"] = opt.state
            out["master"] = [m for m in opt.master if m is not None]
        return out
    return read


@pytest.mark.parametrize("kind", ["AdamW", "SGD", "AdamW-bfloat16", "SGD-float16",
                                  "ZeRO1", "ZeRO1-bfloat16"])
def test_optimiser_state_reads_its_latest_value_after_replays(kind: str) -> None:
    name, _, dtype = kind.partition("-")

    def make() -> tuple[Callable[..., Any], Callable[[], Any]]:
        ps = _params(dtype or "float32")
        inner: Any = (optim.AdamW(ps, lr=optim.cosine(1e-2, STEPS, warmup=2))
                      if name != "SGD" else optim.SGD(ps, lr=1e-2, momentum=0.9))
        opt = inner if name != "ZeRO1" else optim.ZeRO1(
            inner, dp=Communicator(SelfTransport(), device="cpu"), bucket_bytes=4096)

        def step(k: fs.Tensor) -> fs.Tensor:
            loss = _loss(ps, k)
            opt.step(fs.grad(loss, ps))
            return loss
        return step, _optimiser_reads(opt, ps)

    _compare(make)


def test_loss_scaler_and_skipped_steps_read_their_latest_value_after_replays() -> None:
    """The scale, good and skipped counts, and the optimiser skipping in the graph: the
    scale grows every step, and the step at k = 1e30 overflows, is skipped and backs the
    scale off."""
    def make() -> tuple[Callable[..., Any], Callable[[], Any]]:
        ps = _params("float16")
        opt = optim.AdamW(ps, lr=1e-2)
        scaler = optim.LossScaler(2.0 ** 4, interval=1)

        def step(k: fs.Tensor) -> fs.Tensor:
            loss = _loss(ps, k)
            grads, finite = scaler.unscale(fs.grad(scaler.scale(loss), ps))
            opt.step(grads, apply=finite)
            scaler.update(finite)
            return loss

        read_opt = _optimiser_reads(opt, ps)
        return step, lambda: {**read_opt(), "scaler": scaler.state_dict()}

    ks = [1.0, 1.0, 1.0, 1e30, 1.0, 1.0, 1.0]
    want = _compare(make, ks)
    assert [r["scaler"]["skipped"] for r in want] == [0, 1, 1, 1]


def test_a_users_parameter_updated_in_the_step_reads_its_latest_value() -> None:
    """A running mean kept in a user's own Parameter, assigned and realised in the step."""
    def make() -> tuple[Callable[..., Any], Callable[[], Any]]:
        ps = _params("float32")
        opt = optim.AdamW(ps, lr=1e-2)
        mean = nn.Parameter(fs.zeros((), dtype="float32"))

        def step(k: fs.Tensor) -> fs.Tensor:
            loss = _loss(ps, k)
            opt.step(fs.grad(loss, ps))
            mean.assign(mean * 0.9 + loss * 0.1)
            fs.realize(mean)
            return loss
        return step, lambda: {"mean": mean, "w": ps[0]}

    _compare(make)


def test_a_state_read_before_a_replay_keeps_the_value_it_had() -> None:
    """As uncompiled: a state tensor realised before a step holds that step's input, and
    reading ``opt.state`` again gives the new one (never the old read)."""
    ps = _params("float32")
    opt = optim.AdamW(ps, lr=1e-2)

    def step(k: fs.Tensor) -> fs.Tensor:
        loss = _loss(ps, k)
        opt.step(fs.grad(loss, ps))
        return loss
    fn = fs.compile(step)
    held = []
    for i in range(6):
        fn(fs.tensor(np.float32(1.0 + i)))
        m = opt.state[0]["exp_avg"]
        held.append((m, m.numpy().copy()))
    assert fn.replays >= 3
    for (t, v), (_, nxt) in itertools.pairwise(held):
        np.testing.assert_array_equal(t.numpy(), v)
        assert not np.array_equal(v, nxt)


def test_kv_pages_after_compiled_decode_steps_equal_the_uncompiled_ones() -> None:
    """The paged store's pages, read after every step of greedy generation (prefills,
    replayed decode steps, preemption and recompute in a small pool), equal an uncompiled
    run's bit for bit."""
    from fuelspmd import models

    cfg = models.GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7, 8, 9]]

    class Recorded:
        """The model, with the store's pages copied after each step."""

        def __init__(self, model: Any) -> None:
            self.model, self.comm, self.pages = model, model.comm, []

        def kv_layout(self) -> Any:
            return self.model.kv_layout()

        def step(self, tokens: np.ndarray, **kw: Any) -> fs.Tensor:
            out = self.model.step(tokens, **kw)
            fs.realize(out, *kw["store"].tensors())
            self.pages.append([np.array(p.numpy()) for p in kw["store"].tensors()])
            return out

    runs = []
    for compiled in (True, False):
        rec = Recorded(models.GPT2(cfg, seed=0).eval())
        gen = models.greedy(rec, prompts, 6, block_size=4, num_blocks=5, compiled=compiled)
        assert gen.preemptions > 0
        runs.append((gen.tokens, rec.pages))
    (tokens, pages), (want_tokens, want_pages) = runs
    assert tokens == want_tokens and len(pages) == len(want_pages) > 6
    for got, want in zip(pages, want_pages):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
