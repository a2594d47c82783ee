"""One configuration of the equivalence matrix, as every rank runs it, and its comparison
with the reference run.

A run trains a GPT-2 (tied head) or a Llama (grouped-query attention, untied head) of
width 128 and 4 layers, with the user's whole loop: the pipeline executor over the mesh's
``pp`` (micro-batches, the case's schedule), tensor parallelism over ``tp``, data
parallelism over ``dp`` (gradients averaged in buckets, or ZeRO-1), the config's dropout,
recomputed blocks, AdamW with a warm-up and cosine learning rate, the gradient clipped by
its global norm, float16 with a dynamic loss scale, ``fs.compile`` over the whole step.
The global batch of every step is the same whatever the layout (``M`` micro-batches, a
dp replica taking its share in order), and so are the dropout masks (keyed by the global
micro-batch and layer), so every layout computes the same function as one process.

After steps ``SAVES`` it saves a checkpoint (the middle one with ``async_save``, written
while the next steps run); a second run on another layout loads the one of step
``RESUME_AT`` and trains on to the end. Run under ``mpiexec`` this file is the
program (``--case``, ``--layout``, ``--start``, ``--dir``); ``tests/matrix/test_matrix.py``
runs it, the DeviceGroup runs in process, and the reference, and compares.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from matrix_cases import Case
from threadpoolctl import threadpool_limits

import fuelspmd as fs
from fuelspmd import checkpoint, models, optim
from fuelspmd.functional import cross_entropy
from fuelspmd.pipeline_parallel import PipelineExecutor, schedule

SEED = 0
STEPS = 6
SAVES = (2, 4, 6)  # steps after which a checkpoint is saved
RESUME_AT = 2  # the checkpoint the second run resumes from
M, B, T = 4, 2, 16  # micro-batches of the global batch, sequences each, tokens each
VOCAB = 256
CLIP = 1.0
LR = 3e-3  # AdamW's peak learning rate (a warm-up step, then a cosine)
# float16: the loss scale starts at 2^10 and doubles after 3 finite steps, and step SPIKE's
# loss is multiplied by SPIKE_BY, so its gradients overflow on every layout and the step is
# skipped. (Whether a gradient overflows at the edge depends on the layout: a micro-batch's
# share of the loss is 1/M of the replica's, so its backward values are larger with fewer
# micro-batches per replica. The scale stays well below that edge; the skip is forced.)
SPIKE, SPIKE_BY = 3, 1e4
TIMEOUT = 60.0


def config(case: Case) -> Any:
    """The model's config: width 128, 4 layers (4 virtual stages when interleaved)."""
    p = 0.1 if case.dropout else 0.0
    if case.model == "gpt2":
        return models.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=4, n_head=4,
                                 n_positions=T, embd_pdrop=p, attn_pdrop=p, resid_pdrop=p)
    return models.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=2, attention_dropout=p)


def model_class(case: Case) -> type[models.Decoder]:
    return models.GPT2 if case.model == "gpt2" else models.Llama


def batch(step: int, replica: int, dp: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Replica ``replica``'s micro-batches of the global batch of ``step`` (inputs, flat
    next-token targets): micro-batches ``replica * M / dp ..`` of the same ``M``."""
    tokens = np.random.default_rng([SEED, step]).integers(0, VOCAB, (M, B, T + 1))
    mine = tokens[replica * (M // dp):(replica + 1) * (M // dp)]
    return [t[:, :-1].copy() for t in mine], [t[:, 1:].reshape(-1).copy() for t in mine]


def reference_case(case: Case) -> Case:
    """The reference of ``case``: one process, uncompiled, no recompute, same dtype,
    model and dropout."""
    return replace(case, compiled=False, tp=1, pipeline="pp1", dp="dp1", recompute=False,
                   ranks="devices")


def train(comm: Any, case: Case, layout: tuple[int, int, int], out: Path, *, start: int = 0,
          load_from: Path | None = None) -> dict[str, Any]:
    """Train ``case`` on ``layout`` (tp, pp, dp) from step ``start`` (loading
    ``load_from``) to ``STEPS``, saving ``out / step-K`` after each step of ``SAVES``;
    return the losses and norms of the steps run (the same on every rank)."""
    tp, pp, dp = layout
    mesh = fs.Mesh(comm, tp=tp, pp=pp, dp=dp)
    ppc, dpc, world = mesh.comm("pp"), mesh.comm("dp"), mesh.comm_group
    kind = case.schedule if pp > 1 else "1f1b"
    chunks = 2 if kind == "interleaved" else 1
    model = model_class(case)(config(case), mesh=mesh, chunks=chunks, seed=SEED,
                              dtype=case.dtype)
    model.train()
    replica, mine = mesh.coord("dp"), M // dp
    model.rng.seed, model.rng.offset = SEED, replica * mine
    for block in model.blocks.values():
        block.recompute = case.recompute
    scaler = (optim.LossScaler(2.0 ** 10, interval=3) if case.dtype == "float16" else
              None)
    spike: list[fs.Tensor] = []  # the call's loss factor (an argument), for loss_fn

    def loss_fn(y: fs.Tensor, t: fs.Tensor) -> fs.Tensor:
        z = y.reshape(-1, VOCAB)
        value = cross_entropy(z if z.dtype.itemsize >= 4 else z.astype(fs.float32), t)
        return value if scaler is None else scaler.scale(value * spike[0])

    params = model.parameters()
    adam = optim.AdamW(params, lr=optim.cosine(LR, STEPS, warmup=1), weight_decay=0.1)
    zero = case.zero and dp > 1
    opt: Any = optim.ZeRO1(adam, dp=dpc) if zero else adam
    ex = PipelineExecutor(schedule(kind, pp, mine, chunks), comm=ppc, stages=model.stages,
                          loss=loss_fn, dp=None if zero else dpc, recompute=tp > 1,
                          dropout=model.rng)

    def one_step(xs: list[fs.Tensor] | None, ys: list[fs.Tensor] | None, k: fs.Tensor
                 ) -> tuple[fs.Tensor, fs.Tensor]:
        spike[:] = [k]
        res = ex.step(xs, ys)
        grads = model.param_grads(res.grads)
        loss, finite = res.loss, None
        if scaler is not None:
            grads, finite = scaler.unscale(grads, comm=world)
            loss = loss / scaler.factor / k
        if zero:  # ZeRO-1 reduce-scatters each replica's own gradients itself
            norm = opt.step(grads, max_norm=CLIP, mesh=mesh, apply=finite)
            loss = dpc.all_reduce(loss, "avg")
        else:
            grads, norm = optim.clip_grad_norm(params, grads, CLIP, mesh=mesh)
            opt.step(grads, apply=finite)
        if scaler is not None:
            scaler.update(finite)
        return loss, norm

    state: dict[str, Any] = {"model": model, "opt": opt}
    if load_from is not None:
        values = checkpoint.load(load_from, state, mesh=mesh)
        if scaler is not None:
            scaler.load_state_dict(values["scaler"])
    fn: Any = fs.compile(one_step) if case.compiled else one_step
    first, last = 0 in model.virtual, len(model.ranges) - 1 in model.virtual
    losses, norms, scales = [], [], []
    handle = None
    for step in range(start, STEPS):
        model.rng.set_step(step)
        xs, ys = batch(step, replica, dp)
        with np.errstate(over="ignore", invalid="ignore"):  # float16: a skipped step
            loss, norm = fn([fs.tensor(x, device=comm.device) for x in xs] if first else None,
                            [fs.tensor(y, device=comm.device) for y in ys] if last else None,
                            fs.tensor(np.float32(SPIKE_BY if step == SPIKE else 1.0),
                                      device=comm.device))
        losses.append(float(loss))
        norms.append(float(norm))
        scales.append(None if scaler is None else scaler.value)
        if step + 1 in SAVES:  # the middle one in the background, as a long run saves
            save = checkpoint.async_save if step + 1 == SAVES[1] else checkpoint.save
            handle = save(out / f"step-{step + 1}", {
                **state, "scaler": None if scaler is None else scaler.state_dict()},
                mesh=mesh)
    if handle is not None:
        handle.wait()  # a no-op unless the run ended on the background save
    return {"losses": losses, "norms": norms, "scales": scales,
            "replays": fn.replays if case.compiled else 0}


def run(case: Case, layout: tuple[int, int, int], out: Path, *, start: int = 0,
        load_from: Path | None = None) -> dict[str, Any]:
    """``train`` on a DeviceGroup of the layout's size (the case's ``devices`` mode, the
    reference); every device's result must agree."""
    n = layout[0] * layout[1] * layout[2]
    group = fs.DeviceGroup.cpu(n, timeout=TIMEOUT)
    with threadpool_limits(limits=1, user_api="blas"):
        outs = group.run(lambda comm: train(comm, case, layout, out, start=start,
                                            load_from=load_from))
    assert all(o["losses"] == outs[0]["losses"] for o in outs), outs
    return outs[0]


def saved(case: Case, path: Path) -> dict[str, Any]:
    """Checkpoint ``path`` of ``case`` loaded in one process: every parameter, every
    optimiser state entry and master copy by parameter name (float64), the step count and
    the loss scaler's state."""
    model = model_class(case)(config(case), seed=None, dtype=case.dtype)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    values = checkpoint.load(path, {"model": model, "opt": opt})
    out: dict[str, Any] = {"steps": opt.steps, "scaler": values.get("scaler")}
    for (name, p), st, m in zip(model.named_parameters(), opt.state, opt.master):
        out[name] = p.numpy().astype(np.float64)
        for k, v in st.items():
            out[f"{name}/{k}"] = v.numpy().astype(np.float64)
        if m is not None:
            out[f"{name}/master"] = m.numpy().astype(np.float64)
    return out


def main(argv: list[str] | None = None) -> int:
    """The ``mpiexec`` program: the runs of ``--runs`` one after another, each on the first
    ranks its layout needs (a split of the world when it needs fewer; the others wait), rank
    0 of each writing its result as JSON. A resumed run is one of them: its model and
    optimiser are new, its state comes from the checkpoint on disk."""
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True, help="the Case as JSON")
    p.add_argument("--runs", required=True, help="JSON list of {layout: [tp, pp, dp], dir, "
                   "start, load (or null), result}")
    a = p.parse_args(argv)
    case = Case(**json.loads(a.case))
    world = fs.init(timeout=TIMEOUT)
    for run_ in json.loads(a.runs):
        layout = tuple(run_["layout"])
        n = layout[0] * layout[1] * layout[2]
        comm: Any = world
        if n < world.size:
            comm = world.comm.split(0 if world.rank < n else 1, world.rank)
        if world.rank < n:
            load = None if run_["load"] is None else Path(run_["load"])
            with threadpool_limits(limits=1, user_api="blas"):
                got = train(comm, case, layout, Path(run_["dir"]),  # type: ignore[arg-type]
                            start=run_["start"], load_from=load)
            if comm.rank == 0:
                Path(run_["result"]).write_text(json.dumps(got))
        world.comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
