"""fuelspmd.nn: parameters found by name, sharding specs, state dicts in full and in shards
(one error naming every bad key), parameters without data, in-place assignment, dropout's
masks across ranks and meshes, and activation recomputation's memory (measured bytes)."""

from __future__ import annotations

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import nn
from fuelspmd import tensor_parallel as tp
from fuelspmd.device_group import DeviceGroup
from fuelspmd.graph import default_executor

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 20.0


class Block(nn.Module):
    def __init__(self, comm: fs.Communicator, i: int, *, empty: bool = False) -> None:
        seed = None if empty else i
        self.norm = nn.LayerNorm(8, dtype="float64", empty=empty, device=comm.device)
        self.mlp = tp.ParallelMLP(8, 16, comm=comm, seed=seed, empty=empty, dtype="float64")

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, comm: fs.Communicator, *, empty: bool = False) -> None:
        self.emb = tp.VocabParallelEmbedding(12, 8, comm=comm, seed=None if empty else 3,
                                             empty=empty, dtype="float64")
        self.blocks = [Block(comm, i, empty=empty) for i in range(2)]
        self.head = tp.ParallelLMHead(8, 12, comm=comm, tie=self.emb)

    def forward(self, ids: fs.Tensor) -> fs.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


NAMES = ["emb.weight", "blocks.0.norm.weight", "blocks.0.norm.bias",
         "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight",
         "blocks.0.mlp.fc2.bias", "blocks.1.norm.weight", "blocks.1.norm.bias",
         "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc1.bias", "blocks.1.mlp.fc2.weight",
         "blocks.1.mlp.fc2.bias"]


def test_parameters_by_name_tied_once_with_their_specs() -> None:
    comm = DeviceGroup.cpu(1).comms[0]
    m = Model(comm)
    assert [n for n, _ in m.named_parameters()] == NAMES  # the head's tied weight: once
    assert m.head.weight is m.emb.weight
    assert all(isinstance(p, nn.Parameter) and isinstance(p, fs.Tensor)
               for p in m.parameters())
    specs = {n: p.spec for n, p in m.named_parameters()}
    assert (specs["emb.weight"].dim, specs["emb.weight"].axis) == (0, "tp")
    assert specs["blocks.0.mlp.fc1.weight"].dim == 1
    assert specs["blocks.0.mlp.fc2.weight"].dim == 0
    assert specs["blocks.0.mlp.fc2.bias"].replicated
    assert specs["blocks.0.norm.weight"].replicated
    assert len(m.modules()) == 1 + 1 + 2 * (1 + 1 + 1 + 2) + 1
    m.eval()
    assert not any(x.training for x in m.modules())
    m.train()
    assert all(x.training for x in m.modules())


def test_a_dict_of_blocks_names_them_by_key_as_the_whole_model_does() -> None:
    """A pipeline stage holding blocks 1 of a 2-block model keeps the whole model's names."""
    comm = DeviceGroup.cpu(1).comms[0]
    whole = Model(comm)

    class Stage(nn.Module):
        def __init__(self) -> None:
            self.blocks = {"1": whole.blocks[1]}

    assert [n for n, _ in Stage().named_parameters()] == \
        [n for n in NAMES if n.startswith("blocks.1.")]


def _full_state() -> dict[str, np.ndarray]:
    comm = DeviceGroup.cpu(1).comms[0]
    return Model(comm).state_dict()


@pytest.mark.parametrize("n", [2, 4])
def test_state_dict_round_trips_in_full_and_in_shards(n: int) -> None:
    """A model built empty (no rank ever holds more than its shards) loads the full arrays
    (each rank keeps its block) or every rank's own shards, and computes the same."""
    full = _full_state()
    ids = np.array([[0, 5, 11, 7]])

    def program(comm: fs.Communicator) -> tuple[dict, dict, np.ndarray, np.ndarray]:
        seeded = Model(comm)
        shards = seeded.state_dict()
        shapes = seeded.shapes()
        a = Model(comm, empty=True)
        assert not any(p.filled for p in a.parameters())
        a.load_state_dict(full)
        b = Model(comm, empty=True)
        b.load_state_dict(shards)
        x = fs.tensor(ids, device=comm.device)
        return shards, shapes, a(x).numpy(), b(x).numpy()

    outs = DeviceGroup.cpu(n, timeout=TIMEOUT).run(program)
    for r, (shards, shapes, ya, yb) in enumerate(outs):
        assert shapes == {k: v.shape for k, v in full.items()}
        np.testing.assert_array_equal(shards["emb.weight"], np.split(full["emb.weight"], n)[r])
        np.testing.assert_array_equal(shards["blocks.1.mlp.fc1.weight"],
                                      np.split(full["blocks.1.mlp.fc1.weight"], n, 1)[r])
        np.testing.assert_array_equal(shards["blocks.1.mlp.fc2.bias"],
                                      full["blocks.1.mlp.fc2.bias"])
        np.testing.assert_array_equal(ya, yb)
    whole = np.concatenate([o[2] for o in outs], -1)
    ref = Model(DeviceGroup.cpu(1).comms[0])(fs.tensor(ids)).numpy()
    np.testing.assert_allclose(whole, ref, rtol=1e-13, atol=1e-14)


def test_load_state_dict_names_every_bad_key_at_once() -> None:
    comm = DeviceGroup.cpu(1).comms[0]
    m = Model(comm, empty=True)
    state = _full_state()
    del state["blocks.0.norm.bias"]
    state["blocks.1.mlp.fc1.weight"] = np.zeros((3, 3))
    state["decoder.weight"] = np.zeros(2)
    with pytest.raises(fs.ConfigError) as info:
        m.load_state_dict(state)
    msg = str(info.value)
    for part in ("blocks.1.mlp.fc1.weight: (3, 3)", "(8, 16)", "missing: ['blocks.0.norm.bias']",
                 "unexpected: ['decoder.weight']"):
        assert part in msg, msg
    assert not any(p.filled for p in m.parameters())  # nothing assigned on failure
    del state["decoder.weight"]
    state["blocks.1.mlp.fc1.weight"] = _full_state()["blocks.1.mlp.fc1.weight"]
    m.load_state_dict(state, strict=False)  # the missing bias stays empty
    assert not m.blocks[0].norm.bias.filled and m.blocks[1].norm.bias.filled


def test_parameter_assign_is_in_place_and_typed() -> None:
    p = nn.Parameter(fs.tensor(np.ones((2, 3))))
    holder_a, holder_b = nn.Module(), nn.Module()
    holder_a.w = holder_b.w = p
    loss = (p * p).sum()
    (g,) = fs.grad(loss, [p])
    p.assign((p - 0.25 * g).realize())
    np.testing.assert_array_equal(holder_b.w.numpy(), np.full((2, 3), 0.5))
    (g2,) = fs.grad((holder_a.w * 3.0).sum(), [p])  # with respect to the current value
    np.testing.assert_array_equal(g2.numpy(), np.full((2, 3), 3.0))
    with pytest.raises(fs.ShapeError, match="local shape"):
        p.assign(fs.zeros((3, 2), dtype="float64"))
    with pytest.raises(fs.DTypeError, match="float32"):
        p.assign(fs.zeros((2, 3)))
    empty = nn.Parameter(shape=(4,))
    with pytest.raises(fs.ConfigError, match="no value yet"):
        empty + 1.0
    empty.assign(np.arange(4.0))  # an array is converted to the parameter's dtype
    assert empty.dtype is fs.float32 and empty.numpy().tolist() == [0, 1, 2, 3]


def test_spec_checks() -> None:
    comm = DeviceGroup.cpu(2).comms[0]
    with pytest.raises(fs.ConfigError, match="not divisible by the tp size 2"):
        nn.Spec((3, 4), 0, "tp", comm)
    with pytest.raises(fs.ConfigError, match="axis name and its communicator"):
        nn.Spec((4, 4), 1)
    spec = nn.Spec((4, 6), -1, "tp", comm)
    assert spec.dim == 1 and spec.local_shape == (4, 3) and not spec.replicated


def _masks(n: int, *, sharded: bool, step: int) -> list[np.ndarray]:
    def program(comm: fs.Communicator) -> np.ndarray:
        rng = nn.DropoutRNG(7)
        rng.set_step(step)
        drop = nn.Dropout(0.5, rng=rng, layer=3, comm=comm if sharded else None)
        width = 8 // comm.size if sharded else 8
        return drop(fs.tensor(np.ones((4, width)), device=comm.device)).numpy()

    return DeviceGroup.cpu(n, timeout=TIMEOUT).run(program)


def test_dropout_masks_follow_the_activation_layout() -> None:
    one = _masks(1, sharded=False, step=2)[0]
    assert set(np.unique(one)) == {0.0, 2.0}
    replicated = _masks(2, sharded=False, step=2)
    assert all(np.array_equal(m, one) for m in replicated)  # same mask on every TP rank
    sharded = _masks(2, sharded=True, step=2)
    assert not np.array_equal(sharded[0], sharded[1])  # each rank its own block
    np.testing.assert_array_equal(np.concatenate(sharded, 1), one)  # the same on any mesh
    np.testing.assert_array_equal(np.concatenate(_masks(4, sharded=True, step=2), 1), one)
    assert not np.array_equal(_masks(1, sharded=False, step=3)[0], one)  # a new step
    comm = DeviceGroup.cpu(1).comms[0]
    drop = nn.Dropout(0.5, comm=comm)
    drop.eval()
    x = fs.tensor(np.ones(3))
    assert drop(x) is x


class Wide(nn.Module):
    def __init__(self, i: int) -> None:
        self.a = nn.Linear(32, 512, seed=[i, 0], dtype="float64")
        self.b = nn.Linear(512, 32, seed=[i, 1], dtype="float64")
        self.drop = nn.Dropout(0.1, layer=i)

    def forward(self, x: fs.Tensor) -> fs.Tensor:
        return x + self.drop(self.b(self.a(x).tanh()))


def _peak(blocks: list[Wide], x: fs.Tensor, recompute: bool) -> tuple[int, list[np.ndarray]]:
    for b in blocks:
        b.recompute = recompute
    h = x
    for b in blocks:
        h = b(h)
    loss = (h * h).mean()
    params = [p for b in blocks for p in b.parameters()]
    grads = fs.grad(loss, [x, *params])
    fs.realize(loss, *grads)
    return default_executor().peak_bytes, [loss.numpy(), *(g.numpy() for g in grads)]


def test_recompute_gives_the_same_gradients_in_less_memory(capsys: pytest.CaptureFixture
                                                           ) -> None:
    """8 blocks whose (256, 512) float64 hidden activations (1 MiB each) are what a plain
    backward keeps: recomputed, only the blocks' inputs stay."""
    blocks = [Wide(i) for i in range(8)]
    x = fs.tensor(np.random.default_rng(0).standard_normal((256, 32)))
    kept, want = _peak(blocks, x, False)
    recomputed, got = _peak(blocks, x, True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with capsys.disabled():
        print(f"\npeak bytes, 8 blocks: kept {kept}, recomputed {recomputed}")
    grads_bytes = sum(g.nbytes for g in want[1:])  # outputs: alive to the end either way
    assert recomputed - grads_bytes < 0.5 * (kept - grads_bytes), (kept, recomputed)


def test_a_recomputed_block_redraws_its_forward_masks() -> None:
    """The loop moves the dropout key on (the next micro-batch) before this backward is
    built: the recomputed forward still uses the key its forward saw."""
    rng = nn.DropoutRNG(5)

    def grads(recompute: bool) -> list[np.ndarray]:
        block = Wide(0)
        block.drop = nn.Dropout(0.5, rng=rng, layer=1)
        block.recompute = recompute
        x = fs.tensor(np.random.default_rng(1).standard_normal((4, 32)))
        rng.set_step(3, 0)
        loss = (block(x) ** 2).sum()
        rng.set_step(3, 1)
        out = fs.grad(loss, [x, *block.parameters()])
        assert (rng.step, rng.micro) == (3, 1)
        return [g.numpy() for g in out]

    for a, b in zip(grads(True), grads(False)):
        np.testing.assert_array_equal(a, b)


def test_load_state_dict_takes_tensors_and_casts_like_arrays() -> None:
    lin = nn.Linear(2, 3, empty=True)  # float32
    lin.load_state_dict({"weight": fs.tensor(np.ones((2, 3))), "bias": np.arange(3.0)})
    assert lin.weight.dtype is fs.float32 and lin.bias.dtype is fs.float32
    np.testing.assert_array_equal(lin(fs.tensor(np.ones((1, 2), np.float32))).numpy(),
                                  [[2.0, 3.0, 4.0]])


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_dropout_of_a_16_bit_activation_keeps_its_dtype_and_the_float32_mask(dt: str) -> None:
    """Before, a bfloat16 activation raised 'No cast function available' (the mask was
    cast to numpy's name of the dtype, which ml_dtypes' bfloat16 has not)."""
    rng = nn.DropoutRNG(3)
    x = np.random.default_rng(0).standard_normal((4, 6))
    want = nn.Dropout(0.25, rng=rng, layer=2)(fs.tensor(x.astype(np.float32))).numpy()
    got = nn.Dropout(0.25, rng=rng, layer=2)(fs.tensor(x).astype(dt))
    assert got.dtype == fs.dtypes.dtype(dt)
    np.testing.assert_allclose(got.numpy().astype(np.float32), want, rtol=1e-2)


def test_a_compiled_step_of_many_micro_batches_with_dropout_replays() -> None:
    """A pipeline realises each micro-batch's forward on its own. The micro-batch is the
    mask's input, not part of the graph: as an attribute every micro-batch had its own plan,
    more of them than the plan cache keeps under one key, so the step was planned again on
    every call and fs.compile refused it (each call 'ran different graphs')."""
    rng = nn.DropoutRNG(5)
    drop, micros = nn.Dropout(0.5, rng=rng, layer=1), fs.graph.PlanCache.VARIANTS + 4
    arrays = np.random.default_rng(1).standard_normal((micros, 8, 16))
    xs = [fs.tensor(a) for a in arrays]

    def step(xs: list[fs.Tensor]) -> list[fs.Tensor]:
        outs = []
        for k, x in enumerate(xs):
            rng.micro = k
            outs.append(drop(x * 2.0).sum().realize())
        return outs

    fn = fs.compile(step)
    for s in range(4):
        rng.set_step(s)
        got = [float(t.numpy()) for t in fn(xs)]
        want = [float((a * 2.0 * rng.keep(1, (8, 16), 0.5, micro=k) * 2.0).sum())
                for k, a in enumerate(arrays)]
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert fn.replays == 2, fn
