"""fuelspmd.optim against torch itself: SGD and AdamW trajectories over 20 steps, the
schedules, clip_grad_norm on one process, mixed-precision master weights, loss scaling,
ZeRO-1 in a DeviceGroup (dp 2 and 4) against the unsharded optimiser, and state_dict."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fuelspmd as fs
from fuelspmd import nn, optim
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import ConfigError, ShapeError
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optim_programs as OP
import pipeline_programs as PP

pytestmark = pytest.mark.timeout(120)
SHAPES = [(4, 3), (3,), (3, 2)]
STEPS = 20


def _init(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in SHAPES]


def _x(step: int, replica: int = 0) -> np.ndarray:
    return np.random.default_rng([1, step, replica]).standard_normal((6, 4))


def _loss_fs(ps: list[Any], step: int, replica: int = 0, device: Any = None) -> fs.Tensor:
    """A smooth non-quadratic loss of the parameters whose gradient changes every step."""
    x = fs.tensor(_x(step, replica), device=device, dtype=ps[0].dtype)
    h = (x @ ps[0] + ps[1]).tanh()
    return (h @ ps[2]).sum() * 0.1 + (h * h).mean()


def _loss_torch(ps: list[torch.Tensor], step: int) -> torch.Tensor:
    x = torch.from_numpy(_x(step))
    h = torch.tanh(x @ ps[0] + ps[1])
    return (h @ ps[2]).sum() * 0.1 + (h * h).mean()


def _trajectory_fs(make: Any, steps: int = STEPS) -> list[list[np.ndarray]]:
    params = [nn.Parameter(fs.tensor(a.copy())) for a in _init()]
    opt = make(params)
    out = []
    for step in range(steps):
        grads = fs.grad(_loss_fs(params, step), params)
        opt.step(grads)
        out.append([p.numpy().copy() for p in params])
    return out


def _trajectory_torch(make: Any, steps: int = STEPS) -> list[list[np.ndarray]]:
    params = [torch.tensor(a.copy(), requires_grad=True) for a in _init()]
    opt = make(params)
    out = []
    for step in range(steps):
        opt.zero_grad()
        _loss_torch(params, step).backward()
        opt.step()
        out.append([p.detach().numpy().copy() for p in params])
    return out


def _same(a: list[list[np.ndarray]], b: list[list[np.ndarray]], rtol: float = 1e-13) -> None:
    for step, (xs, ys) in enumerate(zip(a, b)):
        for k, (x, y) in enumerate(zip(xs, ys)):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-15,
                                       err_msg=f"step {step + 1} parameter {k}")


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.05, momentum=0.9),
                                dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
                                dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)])
def test_sgd_follows_torch_for_20_steps(kw: dict[str, Any]) -> None:
    _same(_trajectory_fs(lambda ps: optim.SGD(ps, **kw)),
          _trajectory_torch(lambda ps: torch.optim.SGD(ps, **kw)))


@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6,
                                                    weight_decay=0.1),
                                dict(lr=1e-2, betas=(0.3, 0.9), weight_decay=0.0)])
def test_adamw_follows_torch_for_20_steps(kw: dict[str, Any]) -> None:
    _same(_trajectory_fs(lambda ps: optim.AdamW(ps, **kw)),
          _trajectory_torch(lambda ps: torch.optim.AdamW(ps, **kw)))


def test_schedules_follow_torch() -> None:
    """optim.cosine(warmup=w) is torch's LinearLR(1/w) then CosineAnnealingLR, and
    linear_warmup is LinearLR then constant, at every step of the run and past its end."""
    lr, total, w, low = 0.1, 30, 5, 0.01
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / w, total_iters=w - 1)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - w, eta_min=low)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[w])
    ours = optim.cosine(lr, total, warmup=w, min_lr=low)
    for step in range(total + 1):
        assert ours(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12), step
        opt.step()
        seq.step()
    assert ours(total + 10) == pytest.approx(low)
    opt2 = torch.optim.SGD([p], lr=lr)
    warm2 = torch.optim.lr_scheduler.LinearLR(opt2, start_factor=1 / w, total_iters=w - 1)
    lin = optim.linear_warmup(lr, w)
    for step in range(2 * w):
        assert lin(step) == pytest.approx(opt2.param_groups[0]["lr"], rel=1e-12), step
        opt2.step()
        warm2.step()
    assert optim.constant(0.3)(7) == 0.3


def test_a_schedule_drives_the_optimiser() -> None:
    sched = optim.cosine(0.05, STEPS, warmup=3)
    ours = _trajectory_fs(lambda ps: optim.SGD(ps, lr=sched, momentum=0.9))

    def make(ps: list[torch.Tensor]) -> Any:
        return _Scheduled(torch.optim.SGD(ps, lr=0.05, momentum=0.9), sched)

    _same(ours, _trajectory_torch(make))


class _Scheduled:
    """A torch optimiser whose lr is set from our schedule before each step."""

    def __init__(self, opt: Any, sched: Any) -> None:
        self.opt, self.sched, self.t = opt, sched, 0

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.sched(self.t)
        self.opt.step()
        self.t += 1


def test_bad_schedules_and_hyperparameters_are_config_errors() -> None:
    params = [nn.Parameter(fs.tensor(np.ones(3)))]
    with pytest.raises(ConfigError, match="warmup < total"):
        optim.cosine(0.1, 10, warmup=10)
    with pytest.raises(ConfigError, match="warmup=0"):
        optim.linear_warmup(0.1, 0)
    with pytest.raises(ConfigError, match="betas"):
        optim.AdamW(params, betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match="nesterov"):
        optim.SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match=r"nn\.Parameter"):
        optim.SGD([fs.tensor(np.ones(3))], lr=0.1)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="same Parameter"):
        optim.SGD(params * 2, lr=0.1)
    opt = optim.SGD(params, lr=0.1)
    with pytest.raises(ShapeError, match=r"#0: grad \(4,\) for parameter \(3,\)"):
        opt.step([fs.tensor(np.ones(4))])
    with pytest.raises(ShapeError, match="2 gradients for 1 parameters"):
        opt.step([fs.tensor(np.ones(3))] * 2)


def test_clip_grad_norm_is_torchs_on_one_process() -> None:
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s) for s in SHAPES]
    params = [nn.Parameter(fs.tensor(np.zeros(s))) for s in SHAPES]
    for max_norm in (0.5, 1e3):
        grads, norm = optim.clip_grad_norm(params, [fs.tensor(a) for a in arrays], max_norm)
        ts = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
        for t, a in zip(ts, arrays):
            t.grad = torch.from_numpy(a.copy())
        want = torch.nn.utils.clip_grad_norm_(ts, max_norm)
        assert float(norm) == pytest.approx(float(want), rel=1e-14)
        for g, t in zip(grads, ts):
            np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=1e-14)


def test_state_dict_resumes_the_same_trajectory() -> None:
    """10 steps, state_dict, a fresh optimiser over fresh parameters loaded from it, 10
    more: the 20-step run, bit for bit."""
    def make(ps: list[nn.Parameter]) -> optim.AdamW:
        return optim.AdamW(ps, lr=optim.cosine(0.02, STEPS, warmup=2), weight_decay=0.1)

    whole = _trajectory_fs(make)
    params = [nn.Parameter(fs.tensor(a.copy())) for a in _init()]
    opt = make(params)
    for step in range(10):
        opt.step(fs.grad(_loss_fs(params, step), params))
    saved = opt.state_dict()
    assert opt.state_bytes() == 2 * sum(int(np.prod(s)) for s in SHAPES) * 8
    fresh = [nn.Parameter(fs.tensor(p.numpy().copy())) for p in params]
    opt2 = make(fresh)
    opt2.load_state_dict(saved)
    for step in range(10, STEPS):
        opt2.step(fs.grad(_loss_fs(fresh, step), fresh))
    for p, want in zip(fresh, whole[-1]):
        np.testing.assert_array_equal(p.numpy(), want)
    bad = dict(saved, state=saved["state"][:1] + [{"exp_avg": np.zeros((9,))}] * 2)
    with pytest.raises(ShapeError, match=r"state\[1\]\['exp_avg'\] \(9,\)"):
        opt2.load_state_dict(bad)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_parameters_keep_float32_master_weights(dtype: str) -> None:
    """The master follows torch's float32 AdamW fed the same (16-bit) gradients; the
    parameter is the master rounded to its dtype; the state is float32."""
    rng = np.random.default_rng(2)
    init = rng.standard_normal((4, 3)).astype(np.float32)
    p = nn.Parameter(fs.tensor(init, dtype=dtype))
    opt = optim.AdamW([p], lr=1e-3)
    t = torch.tensor(p.numpy().astype(np.float32), requires_grad=True)
    ref = torch.optim.AdamW([t], lr=1e-3)
    for _ in range(STEPS):
        g = fs.tensor(rng.standard_normal((4, 3)) * 1e-3, dtype=dtype)
        opt.step([g])
        t.grad = torch.from_numpy(g.numpy().astype(np.float32))
        ref.step()
    master = opt.master[0]
    assert master is not None and master.dtype == fs.float32 and p.dtype.name == dtype
    np.testing.assert_allclose(master.numpy(), t.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(p.numpy(), master.astype(dtype).numpy())
    assert all(v.dtype == fs.float32 for v in opt.state[0].values())
    # lr 1e-3 steps are below bfloat16's resolution near 1: the master moved, and the
    # parameter moved only by what its dtype can hold
    assert not np.array_equal(master.numpy(), init)


def _zero_run(comm: fs.Communicator, bucket_bytes: int, steps: int = STEPS,
              max_norm: float | None = None) -> tuple[list[np.ndarray], int, list[Any]]:
    """One dp rank: replica ``rank``'s own gradients into ZeRO1(AdamW)."""
    params = [nn.Parameter(fs.tensor(a.copy(), device=comm.device)) for a in _init()]
    opt = optim.ZeRO1(optim.AdamW(params, lr=2e-2, weight_decay=0.1), dp=comm,
                      bucket_bytes=bucket_bytes)
    norms = []
    for step in range(steps):
        grads = fs.grad(_loss_fs(params, step, comm.rank, comm.device), params)
        norm = opt.step(grads, max_norm=max_norm)
        norms.append(None if norm is None else float(norm))
    return [p.numpy() for p in params], opt.state_bytes(), norms


def _unsharded(dp: int, steps: int = STEPS, max_norm: float | None = None
               ) -> tuple[list[np.ndarray], list[Any]]:
    """The same replicas' gradients averaged, then AdamW (and clipping) in one process."""
    params = [nn.Parameter(fs.tensor(a.copy())) for a in _init()]
    opt = optim.AdamW(params, lr=2e-2, weight_decay=0.1)
    norms = []
    for step in range(steps):
        per = [fs.grad(_loss_fs(params, step, r), params) for r in range(dp)]
        grads = [sum(gs[1:], gs[0]) * (1.0 / dp) for gs in zip(*per)]
        if max_norm is not None:
            grads, norm = optim.clip_grad_norm(params, grads, max_norm)
            norms.append(float(norm))
        opt.step(grads)
    return [p.numpy() for p in params], norms


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_zero1_equals_the_unsharded_optimiser(dp: int, bucket_bytes: int) -> None:
    """20 steps at dp 2 and 4, one bucket per parameter, buckets cutting parameters, one
    bucket: the parameters of the unsharded AdamW on the dp-mean gradient; each rank holds
    about 1/dp of the state."""
    want, _ = _unsharded(dp)
    outs = DeviceGroup.cpu(dp, timeout=30).run(lambda c: _zero_run(c, bucket_bytes))
    n = sum(int(np.prod(s)) for s in SHAPES)
    for got, nbytes, _ in outs:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
        # two float64 moments of ceil(bucket / dp) elements per bucket (float64 parameters
        # hold their own slice: no master copy)
        assert 2 * 8 * n / dp <= nbytes <= 2 * 8 * (n / dp + 3)


def test_zero1_clips_by_the_global_norm_of_the_mean_gradient() -> None:
    want, norms = _unsharded(2, steps=6, max_norm=0.05)
    outs = DeviceGroup.cpu(2, timeout=30).run(lambda c: _zero_run(c, 64, 6, 0.05))
    for got, _, got_norms in outs:
        np.testing.assert_allclose(got_norms, norms, rtol=1e-12)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
    assert min(norms) > 0.05  # every step was clipped


def test_zero1_state_dict_round_trip_and_layout_check() -> None:
    def body(comm: fs.Communicator) -> None:
        params = [nn.Parameter(fs.tensor(a.copy(), device=comm.device)) for a in _init()]
        opt = optim.ZeRO1(optim.AdamW(params, lr=1e-2), dp=comm, bucket_bytes=64)
        opt.step(fs.grad(_loss_fs(params, 0, comm.rank, comm.device), params))
        saved = opt.state_dict()
        again = optim.ZeRO1(optim.AdamW(params, lr=1e-2), dp=comm, bucket_bytes=64)
        again.load_state_dict(saved)
        assert again.steps == 1 and again.state_bytes() == opt.state_bytes()
        other = optim.ZeRO1(optim.AdamW(params, lr=1e-2), dp=comm, bucket_bytes=1 << 20)
        with pytest.raises(ShapeError, match="layout"):
            other.load_state_dict(saved)
    DeviceGroup.cpu(2, timeout=30).run(body)


def test_fp16_loss_scaling_skips_the_step_on_every_rank_alike() -> None:
    """The last rank's gradient overflows at step 2: every rank skips it (tests/
    optim_programs.py; tests/mpi/test_optim.py under MPI)."""
    OP.check_scaling(DeviceGroup.cpu(2, timeout=30).run(OP.scaling))


def test_zero1_shards_the_float32_master_weights_of_bfloat16_parameters() -> None:
    """bfloat16 parameters under ZeRO1 at dp 2: the float32 master slices and moments
    follow the unsharded AdamW fed the dp-mean (float32) gradient; the parameters are the
    masters rounded to bfloat16."""
    init = [a.astype(np.float32) for a in _init()]
    grads = [[np.random.default_rng([s, r]).standard_normal((21,)).astype(np.float32) * 1e-2
              for r in range(2)] for s in range(5)]

    def body(comm: fs.Communicator) -> tuple[list[np.ndarray], int]:
        params = [nn.Parameter(fs.tensor(a, device=comm.device, dtype="bfloat16"))
                  for a in init]
        opt = optim.ZeRO1(optim.AdamW(params, lr=1e-2), dp=comm, bucket_bytes=32)
        for gs in grads:
            flat = gs[comm.rank]
            parts, off = [], 0
            for p in params:
                n = int(np.prod(p.shape))
                parts.append(fs.tensor(flat[off:off + n].reshape(p.shape),
                                       device=comm.device, dtype="bfloat16"))
                off += n
            opt.step(parts)
        return [p.numpy().astype(np.float32) for p in params], opt.state_bytes()

    ref = [nn.Parameter(fs.tensor(a, dtype="bfloat16")) for a in init]
    opt = optim.AdamW(ref, lr=1e-2)
    for gs in grads:
        b16 = [fs.tensor(g, dtype="bfloat16").numpy().astype(np.float32) for g in gs]
        mean = (b16[0] + b16[1]) / 2
        parts, off = [], 0
        for p in ref:
            n = int(np.prod(p.shape))
            parts.append(fs.tensor(mean[off:off + n].reshape(p.shape)))
            off += n
        opt.step(parts)
    want = [p.numpy().astype(np.float32) for p in ref]
    for got, nbytes in DeviceGroup.cpu(2, timeout=30).run(body):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert nbytes < opt.state_bytes() * 0.6  # master + moments, about half each


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_over_tp_and_pp_is_torchs_on_the_unsharded_model(
        n: int, max_norm: float) -> None:
    """At 4 devices TP 2 x PP 2: sharded parameters summed over tp, replicated ones once,
    stages summed over pp (tests/optim_programs.py; tests/mpi/test_optim.py under MPI)."""
    for got in DeviceGroup.cpu(n, timeout=30).run(lambda c: OP.clip(c, max_norm)):
        OP.check(got, n, max_norm)


def test_without_a_mesh_the_specs_communicators_are_summed_over() -> None:
    """A plain TP model (tp 2, one stage): mesh=None gives the norm mesh= gives."""
    for with_mesh, without in DeviceGroup.cpu(2, timeout=30).run(
            lambda c: (OP.clip(c, 0.5)["norm"], OP.clip(c, 0.5, mesh=False)["norm"])):
        assert with_mesh == without


def test_zero1_in_a_pipeline_reduce_scatters_inside_the_last_backward() -> None:
    """dp 2 x pp 2: ``PipelineExecutor(reduce=zero.reduce)`` then ``step(reduced=True)``
    gives the parameters of the executor's dp average then AdamW, over 3 steps; each
    bucket's reduce-scatter (one per parameter here) is issued inside the stage's last
    backward action, as the dp all-reduce buckets are."""
    def body(comm: fs.Communicator) -> dict[str, Any]:
        mesh = fs.Mesh(comm, pp=2, dp=2)
        pp, dpc = mesh.comm("pp"), mesh.comm("dp")
        v, sched = pp.rank, schedule("1f1b", 2, 4)
        full = PP.full_params(2)
        plain, sharded = (PP.Stage(*full[v], last=v == 1, device=pp.device) for _ in "ab")
        ex_a = PipelineExecutor(sched, comm=pp, stages=[plain], loss=PP.mse, dp=dpc)
        opt_a = optim.AdamW(plain.parameters(), lr=1e-2)
        zdp = fs.Communicator(dpc.split(0, dpc.rank).transport, device=dpc.device,
                              record_times=True)
        opt_b = optim.ZeRO1(optim.AdamW(sharded.parameters(), lr=1e-2), dp=zdp,
                            bucket_bytes=1)
        ex_b = PipelineExecutor(sched, comm=pp, stages=[sharded], loss=PP.mse, dp=dpc,
                                reduce=opt_b.reduce)
        xs, ts = PP.batch(4, mesh.coord("dp"))
        ins, outs = (xs if v == 0 else None), (ts if v == 1 else None)
        windows = []
        for _ in range(3):
            opt_a.step(ex_a.step(ins, outs).grads[0])
            assert zdp.times is not None
            zdp.times.clear()
            res = ex_b.step(ins, outs)
            issued = [t - res.started for t, _ in zdp.times]
            last = [a for a in sched.actions[v] if a.kind == "B"][-1]
            windows.append((issued, *res.times[last]))
            opt_b.step(res.grads[0], reduced=True)
        return {"a": [p.numpy() for p in plain.parameters()],
                "b": [p.numpy() for p in sharded.parameters()], "windows": windows}

    for got in DeviceGroup.cpu(4, timeout=30).run(body):
        for x, y in zip(got["a"], got["b"]):
            np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-14)
        for issued, start, end in got["windows"]:
            assert len(issued) == 2 and all(start <= t <= end for t in issued), \
                (issued, start, end)


def test_zero1_clips_a_tp_sharded_model_whose_dp_slices_hold_different_kinds() -> None:
    """dp 2 x tp 2, one bucket: dp rank 0's slice holds only the tp-split weight, rank 1's
    only replicated ones, so their partial sums differ in kind; the norm and the
    parameters equal clip_grad_norm + AdamW on the dp-mean gradient."""
    shapes = [((4, 16), 1), ((8,), None), ((8,), None), ((16,), None)]  # 32 + 32 local

    def body(comm: fs.Communicator) -> tuple[list[float], list[float], list[np.ndarray],
                                             list[np.ndarray]]:
        mesh = fs.Mesh(comm, tp=2, dp=2)
        tpc, r = mesh.comm("tp"), mesh.coord("dp")

        def build() -> list[nn.Parameter]:
            out = []
            for k, (shape, dim) in enumerate(shapes):
                spec = nn.Spec(shape) if dim is None else nn.Spec(shape, dim, axis="tp",
                                                                   comm=tpc)
                full = np.random.default_rng([9, k]).standard_normal(shape)
                out.append(nn.Parameter(np.ascontiguousarray(spec.shard(full)), spec=spec,
                                        device=comm.device))
            return out

        def grads(ps: list[nn.Parameter], step: int, replica: int) -> list[np.ndarray]:
            return [np.ascontiguousarray(p.spec.shard(
                np.random.default_rng([step, replica, k]).standard_normal(p.full_shape)))
                for k, p in enumerate(ps)]

        plain, sharded = build(), build()
        opt_a = optim.AdamW(plain, lr=1e-2)
        opt_b = optim.ZeRO1(optim.AdamW(sharded, lr=1e-2), dp=mesh.comm("dp"))
        norms_a, norms_b = [], []
        for step in range(4):
            mean = [fs.tensor((a + b) / 2, device=comm.device)
                    for a, b in zip(grads(plain, step, 0), grads(plain, step, 1))]
            clipped, norm = optim.clip_grad_norm(plain, mean, 1.0, mesh=mesh)
            opt_a.step(clipped)
            norms_a.append(float(norm))
            own = [fs.tensor(g, device=comm.device) for g in grads(sharded, step, r)]
            norms_b.append(float(opt_b.step(own, max_norm=1.0, mesh=mesh)))
        return norms_a, norms_b, [p.numpy() for p in plain], [p.numpy() for p in sharded]

    for norms_a, norms_b, a, b in DeviceGroup.cpu(4, timeout=30).run(body):
        np.testing.assert_allclose(norms_b, norms_a, rtol=1e-13)
        assert min(norms_a) > 1.0  # clipped every step
        for x, y in zip(a, b):
            np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-14)


def test_the_loss_scale_is_float64_and_follows_torchs_grad_scaler_without_reaching_inf(
        ) -> None:
    """torch's GradScaler rule step by step (grow after ``interval`` finite steps, the count
    restarting then, back off on a non-finite one), with a growth factor float32 cannot
    hold exactly; at growth_interval=1 the scale stops at the largest finite float64 it
    reaches (torch's stops below float32's inf) instead of growing to inf and skipping
    every step after."""
    finite = [True, True, True, False, True, True, True, True, False, True]
    ours = optim.LossScaler(2.0 ** 16, growth=1.7, backoff=0.3, interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_factor=1.7,
                                  backoff_factor=0.3, growth_interval=3)
    theirs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scale, tracker = theirs._scale, theirs._growth_tracker  # torch's scale is float32
    for f in finite:
        ours.update(f)
        torch._amp_update_scale_(scale, tracker, torch.tensor(0.0 if f else 1.0), 1.7, 0.3, 3)
        assert ours.good == tracker.item()
        np.testing.assert_allclose(ours.value, scale.item(), rtol=1e-6)
    assert ours.factor.dtype == fs.float64 and ours.skipped == 2
    assert ours.value == 2.0 ** 16 * 1.7 * 0.3 * 1.7 * 0.3  # in float64

    capped = optim.LossScaler(2.0 ** 16, interval=1)
    with np.errstate(all="raise"):  # nor does the cap compute an overflowing product
        for _ in range(1100):
            capped.update(True)
    assert capped.value == 2.0 ** 1023 and capped.good == 0
    capped.update(False)
    assert capped.value == 2.0 ** 1022 and capped.skipped == 1


@pytest.mark.parametrize("saved_by,loaded_by", [("SGD", "AdamW"), ("AdamW", "SGD"),
                                                ("AdamW", "SGD-plain"), ("SGD-plain", "AdamW"),
                                                ("SGD", "ZeRO1")])
def test_optimiser_state_of_another_kind_is_refused_at_load(tmp_path: Path, saved_by: str,
                                                            loaded_by: str) -> None:
    """A checkpoint saved by one optimiser and loaded into another fails at the load, with
    CheckpointMismatchError naming the entry (before: AdamW's state went into SGD silently,
    SGD's into AdamW failed at the next step with KeyError 'exp_avg')."""
    from fuelspmd import checkpoint
    from fuelspmd.comm import Communicator
    from fuelspmd.errors import CheckpointMismatchError
    from fuelspmd.transport import SelfTransport

    def make(kind: str) -> tuple[nn.Module, Any]:
        model = nn.Linear(4, 3, seed=0)
        ps = model.parameters()
        if kind.startswith("SGD"):
            return model, optim.SGD(ps, lr=0.1, momentum=0.0 if kind == "SGD-plain" else 0.9)
        adam = optim.AdamW(ps, lr=0.1)
        if kind == "ZeRO1":
            return model, optim.ZeRO1(adam, dp=Communicator(SelfTransport(), device="cpu"))
        return model, adam

    model, opt = make(saved_by)
    x = fs.tensor(np.ones((2, 4), np.float32))
    for _ in range(2):
        opt.step(fs.grad((model(x) ** 2).sum(), model.parameters()))
    checkpoint.save(str(tmp_path / "ckpt"), {"model": model, "opt": opt})
    model2, opt2 = make(loaded_by)
    with pytest.raises(CheckpointMismatchError, match=r"parameter #0 .*(exp_avg|momentum)"):
        checkpoint.load(str(tmp_path / "ckpt"), {"model": model2, "opt": opt2})
    assert opt2.steps == 0


def test_a_missing_state_entry_is_refused() -> None:
    """A state_dict that lacks an entry (exp_avg_sq of one parameter) is refused, naming
    it; before, the moment stayed at zero. A negative or non-integer step count too."""
    from fuelspmd.errors import CheckpointMismatchError

    ps = [nn.Parameter(fs.tensor(a.copy())) for a in _init()]
    opt = optim.AdamW(ps, lr=0.01)
    opt.step(fs.grad(_loss_fs(ps, 0), ps))
    saved = opt.state_dict()
    fresh = optim.AdamW([nn.Parameter(fs.tensor(a.copy())) for a in _init()], lr=0.01)
    gone = dict(saved, state=[dict(st) for st in saved["state"]])
    del gone["state"][1]["exp_avg_sq"]
    with pytest.raises(CheckpointMismatchError, match=r"#1 lacks \['exp_avg_sq'\]"):
        fresh.load_state_dict(gone)
    for steps in (-3, 1.5, True, "2"):
        with pytest.raises(CheckpointMismatchError, match="step count"):
            fresh.load_state_dict(dict(saved, steps=steps))
    assert fresh.steps == 0 and not any(fresh.state)
