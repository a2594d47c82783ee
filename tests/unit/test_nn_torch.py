"""The losses, GELU, RMSNorm, RoPE and grouped-query attention against torch itself (and
Hugging Face's rotary embedding), in float64, to float64 rounding; the TP versions at TP 1,
2 and 4 in a DeviceGroup, every rank's output and gradient shards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelspmd as fs
from fuelspmd import functional as F
from fuelspmd import nn
from fuelspmd import tensor_parallel as tp
from fuelspmd.device_group import DeviceGroup

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 20.0
ROUND = dict(rtol=1e-13, atol=1e-14)  # float64 rounding of sums of a few dozen terms


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_ignore_index_matches_torch(smoothing: float) -> None:
    g = np.random.default_rng(0)
    z = g.standard_normal((3, 5, 11)) * 3
    t = g.integers(0, 11, (3, 5))
    t[0, 1] = t[2, 4] = t[1, 0] = -100
    logits = fs.tensor(z)
    loss = F.cross_entropy(logits, fs.tensor(t), label_smoothing=smoothing)
    (dz,) = fs.grad(loss, [logits])
    zt = _t(z)
    want = TF.cross_entropy(zt.reshape(15, 11), torch.tensor(t).reshape(15),
                            ignore_index=-100, label_smoothing=smoothing)
    want.backward()
    np.testing.assert_allclose(loss.numpy(), want.item(), **ROUND)
    np.testing.assert_allclose(dz.numpy(), zt.grad.numpy(), **ROUND)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_vocab_parallel_cross_entropy_matches_torch(n: int, smoothing: float) -> None:
    """The -100 label of the issue (2.2055 against 2.5572 before): the same as torch."""
    g = np.random.default_rng(1)
    z = g.standard_normal((6, 12)) * 2
    t = np.array([3, -100, 11, 0, -100, 7])

    def program(comm: fs.Communicator) -> tuple[np.ndarray, np.ndarray]:
        k = 12 // comm.size
        zl = fs.tensor(z[:, comm.rank * k:(comm.rank + 1) * k], device=comm.device)
        loss = tp.vocab_parallel_cross_entropy(zl, fs.tensor(t, device=comm.device),
                                               comm=comm, label_smoothing=smoothing)
        (dz,) = fs.grad(loss, [zl])
        fs.realize(loss, dz)
        return loss.numpy(), dz.numpy()

    zt = _t(z)
    want = TF.cross_entropy(zt, torch.tensor(t), label_smoothing=smoothing)
    want.backward()
    for r, (loss, dz) in enumerate(DeviceGroup.cpu(n, timeout=TIMEOUT).run(program)):
        np.testing.assert_allclose(loss, want.item(), **ROUND)
        np.testing.assert_allclose(dz, np.split(zt.grad.numpy(), n, 1)[r], **ROUND)


def test_exact_gelu_matches_torch() -> None:
    x = np.concatenate([np.linspace(-9, 9, 4001), [0.0, 1e-8, -1e-8, 30.0, -30.0]])
    xt = _t(x)
    want = TF.gelu(xt)
    want.sum().backward()
    a = fs.tensor(x)
    got = F.gelu(a, approximate="none")
    (dx,) = fs.grad(got.sum(), [a])
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=4e-16, atol=4e-16)
    np.testing.assert_allclose(dx.numpy(), xt.grad.numpy(), rtol=1e-15, atol=1e-15)


def test_rms_norm_matches_torch() -> None:
    g = np.random.default_rng(2)
    x, w = g.standard_normal((4, 3, 16)), g.standard_normal(16)
    norm = nn.RMSNorm(16, eps=1e-6, full=(w,), dtype="float64")
    a = fs.tensor(x)
    y = norm(a)
    cot = g.standard_normal(x.shape)
    grads = fs.grad((y * fs.tensor(cot)).sum(), [a, norm.weight])
    ref = torch.nn.RMSNorm(16, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(w))
    xt = _t(x)
    yt = ref(xt)
    (yt * torch.tensor(cot)).sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), **ROUND)
    np.testing.assert_allclose(grads[0].numpy(), xt.grad.numpy(), **ROUND)
    np.testing.assert_allclose(grads[1].numpy(), ref.weight.grad.numpy(), **ROUND)


def _torch_rope_tables(pos: np.ndarray, d: int, base: float) -> tuple[torch.Tensor, ...]:
    """Hugging Face's formula for cos and sin, in float64 (its module computes in float32)."""
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.tensor(pos, dtype=torch.float64)[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def test_rope_matches_hugging_face() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    g = np.random.default_rng(3)
    b, t, h, d, base = 2, 7, 3, 8, 500.0
    x = g.standard_normal((b, t, h, d))
    pos = np.stack([np.arange(t), np.arange(t) + 5])
    cos, sin = _torch_rope_tables(pos, d, base)
    xt = torch.tensor(x).transpose(1, 2)  # HF rotates (b, heads, t, d)
    want, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    got = F.rope(fs.tensor(x), pos, base=base).numpy()
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), **ROUND)
    # our tables are Hugging Face's module's (which computes the angles in float32)
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, rope_theta=base)
    hc, hs = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float64),
                                       torch.tensor(pos))
    ours = F.rope_tables(pos, d, base=base)
    np.testing.assert_allclose(ours[0], hc.numpy(), atol=2e-5)
    np.testing.assert_allclose(ours[1], hs.numpy(), atol=2e-5)


HID, HEADS, KV, B, T = 32, 8, 2, 2, 6


def _attn_weights() -> list[np.ndarray]:
    g = np.random.default_rng(4)
    d = HID // HEADS
    shapes = [(HID, HEADS * d), (HEADS * d,), (HID, KV * d), (KV * d,), (HID, KV * d),
              (KV * d,), (HEADS * d, HID), (HID,)]
    return [g.standard_normal(s) / 3 for s in shapes]


def _torch_attention(x: np.ndarray, w: list[np.ndarray], keep: np.ndarray, scale: float,
                     base: float, cot: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d = HID // HEADS
    xt, wt = _t(x), [_t(a) for a in w]
    q, k, v = ((xt @ wt[2 * i] + wt[2 * i + 1]).reshape(B, T, -1, d).transpose(1, 2)
               for i in range(3))
    cos, sin = _torch_rope_tables(np.arange(T), d, base)
    q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None] & \
        torch.tensor(keep, dtype=torch.bool)[:, None, None, :]
    ctx = TF.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          enable_gqa=True)
    y = ctx.transpose(1, 2).reshape(B, T, HID) @ wt[6] + wt[7]
    (y * torch.tensor(cot)).sum().backward()
    return y.detach().numpy(), [xt.grad.numpy(), *(a.grad.numpy() for a in wt)]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_gqa_attention_matches_torch(n: int, fused: bool) -> None:
    """8 query heads, 2 key/value heads, RoPE, padding and causal masks, a scale: at TP 4
    the key/value heads are shared (replicated, their gradients summed over the ranks)."""
    g = np.random.default_rng(5)
    x, cot = g.standard_normal((B, T, HID)), g.standard_normal((B, T, HID))
    keep = np.ones((B, T), dtype=bool)
    keep[1, 4:] = False  # the second sequence is padded after 4 tokens
    w = _attn_weights()
    full = ([np.concatenate(w[0:6:2], 1), np.concatenate(w[1:6:2]), w[6], w[7]] if fused
            else w)
    scale, base = 0.3, 1000.0

    def program(comm: fs.Communicator) -> list[np.ndarray]:
        att = tp.ParallelAttention(HID, HEADS, kv_heads=KV, comm=comm, scale=scale,
                                   rope_base=base, full=full, dtype="float64")
        a = fs.tensor(x, device=comm.device)
        y = att(a, mask=keep)
        grads = fs.grad((y * fs.tensor(cot, device=comm.device)).sum(),
                        [a, *att.parameters()])
        fs.realize(y, *grads)
        return [y.numpy(), *(gr.numpy() for gr in grads)]

    y, grads = _torch_attention(x, w, keep, scale, base, cot)
    for r, got in enumerate(DeviceGroup.cpu(n, timeout=TIMEOUT).run(program)):
        want = [y, grads[0]]
        for i, gw in enumerate(grads[1:]):
            sharded = i in (0, 1) or (i in (2, 3, 4, 5) and KV % n == 0) or i == 6
            axis = 0 if i == 6 else gw.ndim - 1
            want.append(np.split(gw, n, axis)[r] if sharded else gw)
        assert len(got) == len(want)
        for j, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, err_msg=f"item {j}")


def test_swiglu_mlp_matches_torch() -> None:
    g = np.random.default_rng(6)
    a, bu, b2, bb, gate, gb = (g.standard_normal(s) / 3 for s in
                               ((8, 16), (16,), (16, 8), (8,), (8, 16), (16,)))
    x, cot = g.standard_normal((5, 8)), g.standard_normal((5, 8))

    def program(comm: fs.Communicator) -> list[np.ndarray]:
        mlp = tp.ParallelMLP(8, 16, comm=comm, gated=True, activation=F.silu,
                             full=(a, bu, b2, bb, gate, gb), dtype="float64")
        xa = fs.tensor(x, device=comm.device)
        y = mlp(xa)
        (dx,) = fs.grad((y * fs.tensor(cot, device=comm.device)).sum(), [xa])
        return [y.numpy(), dx.numpy()]

    xt = _t(x)
    yt = (TF.silu(xt @ torch.tensor(gate) + torch.tensor(gb)) *
          (xt @ torch.tensor(a) + torch.tensor(bu))) @ torch.tensor(b2) + torch.tensor(bb)
    (yt * torch.tensor(cot)).sum().backward()
    for got in DeviceGroup.cpu(2, timeout=TIMEOUT).run(program):
        np.testing.assert_allclose(got[0], yt.detach().numpy(), **ROUND)
        np.testing.assert_allclose(got[1], xt.grad.numpy(), **ROUND)


def test_scale_default_is_inverse_sqrt_head_dim() -> None:
    comm = DeviceGroup.cpu(1).comms[0]
    assert tp.ParallelAttention(32, 8, comm=comm).scale == 1 / math.sqrt(4)
