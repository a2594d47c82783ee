"""Optimisers on lazy tensors: ``opt.step(grads)`` replaces every parameter's value in place.

Layer 7. An :class:`Optimizer` holds the :class:`~fuelspmd.nn.Parameter` objects (local
shards: a TP-sharded parameter's update needs only its own shard, the math is
elementwise) and per-parameter state. One step builds every parameter's update as one
lazy graph, realises it, and :meth:`~fuelspmd.nn.Parameter.assign` s the results, so every
module holding a parameter sees the new value and the next ``fs.grad`` differentiates at
it.

The math is written per tensor (:meth:`Optimizer.init_state`, :meth:`Optimizer.update`),
in the operation order of torch's single-tensor CPU kernels, so a float64 run follows
``torch.optim`` to float64 rounding; ZeRO-1 (:mod:`fuelspmd.optim.zero`) runs the same
two methods on flat shards.

Mixed precision: a parameter stored in a 16-bit float (bfloat16, float16) gets a float32
*master* copy; the update reads the gradient in float32, runs on the master and the state
(both float32), and the parameter receives the master rounded to its own dtype. Small
updates that the 16-bit parameter would round away accumulate in the master.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fuelspmd.dtypes import DType, float32, float64
from fuelspmd.errors import CheckpointMismatchError, ConfigError, ShapeError
from fuelspmd.nn import Parameter
from fuelspmd.optim.schedules import Schedule, as_schedule
from fuelspmd.tensor import Tensor, concat, host, realize, tensor, where, zeros

__all__ = ["SGD", "AdamW", "Optimizer", "applied", "check_grads", "master_dtype", "per_dtype"]

State = dict[str, Tensor]
# (parameter index, state name, flat start, flat stop) -> those values of the saved state
Reader = Callable[[int, str, int, int], np.ndarray]
MASTER = "master"  # the state name of a 16-bit parameter's float32 master copy


def master_dtype(dt: DType) -> DType:
    """The dtype an optimiser updates a parameter of dtype ``dt`` in: float32 for 16-bit
    floats (their master weights), else ``dt`` itself."""
    return float32 if dt.is_floating and dt.itemsize < 4 else dt


def check_grads(owner: str, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """One gradient per parameter, of its shape: else ShapeError naming each mismatch."""
    if len(grads) != len(params):
        raise ShapeError(f"{owner}: {len(grads)} gradients for {len(params)} parameters; "
                         "pass fs.grad(loss, params) for the same params, in order")
    bad = [f"#{i}: grad {tuple(g.shape)} for parameter {tuple(p.shape)}"
           for i, (p, g) in enumerate(zip(params, grads)) if tuple(g.shape) != p.shape]
    if bad:
        raise ShapeError(f"{owner}: gradients of the wrong shape ({'; '.join(bad)}); give "
                         "the gradient of each local shard")


def per_dtype(coefs: Tensor) -> Callable[[DType], list[Tensor]]:
    """``dtype -> [0-d tensors]``: the float64 coefficients cast to a dtype once each."""
    cast: dict[DType, list[Tensor]] = {}

    def get(dt: DType) -> list[Tensor]:
        found = cast.get(dt)
        if found is None:
            c = coefs.astype(dt)
            found = cast[dt] = [c[j] for j in range(c.shape[0])]
        return found
    return get


def applied(apply: Tensor, w: Tensor, st: State, w0: Tensor, st0: State
            ) -> tuple[Tensor, State]:
    """The step's new value and state where ``apply`` holds, else the old ones (zeros
    for a state the step creates)."""
    return where(apply, w, w0), {
        k: where(apply, v, st0[k] if k in st0 else zeros(v.shape, device=v.device,
                                                          dtype=v.dtype))
        for k, v in st.items()}


class _Group:
    """The parameters of one dtype and device (by index), updated as one flat tensor:
    ``master`` the dtype of the update, each parameter's slice at its offset."""

    def __init__(self, params: Sequence[Parameter], index: list[int]) -> None:
        self.index = index
        p = params[index[0]]
        self.dtype, self.master = p.dtype, master_dtype(p.dtype)
        self.shapes = [params[i].shape for i in index]
        sizes = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]

    def concat(self, parts: Sequence[Tensor]) -> Tensor:
        """The flat concatenation of one tensor per parameter (in ``index`` order)."""
        flat = [t.reshape(-1) for t in parts]
        return flat[0] if len(flat) == 1 else concat(flat)

    def pieces(self) -> list[tuple[int, Callable[[Tensor], Tensor]]]:
        """(parameter index, flat tensor -> that parameter's slice in its shape)."""
        out: list[tuple[int, Callable[[Tensor], Tensor]]] = []
        for k, (i, shape) in enumerate(zip(self.index, self.shapes)):
            lo, hi = self.offsets[k], self.offsets[k + 1]
            if len(self.index) == 1:
                out.append((i, lambda t, shape=shape: t.reshape(shape)))
            else:
                out.append((i, lambda t, lo=lo, hi=hi, shape=shape: t[lo:hi].reshape(shape)))
        return out


FLAT_ELEMENTS = 1 << 16  # parameters up to this size update together (see _groups)


def _groups(params: Sequence[Parameter]) -> list[_Group]:
    """The parameters grouped for the update: those of at most ``FLAT_ELEMENTS`` by
    (dtype, device), each larger one alone. A small parameter's update costs the fixed
    cost of its ops more than their work, so a group shares it; a large one would pay a
    concatenation (a copy of its gradient and value per step) for nothing."""
    by: dict[tuple[Any, ...], list[int]] = {}
    for i, p in enumerate(params):
        key = (p.dtype, p.device) if math.prod(p.shape) <= FLAT_ELEMENTS else (i,)
        by.setdefault(key, []).append(i)
    return [_Group(params, index) for index in by.values()]


def _params(owner: str, params: Sequence[Any]) -> list[Parameter]:
    out = list(params)
    if not out:
        raise ConfigError(f"{owner}: no parameters given; pass model.parameters()")
    for i, p in enumerate(out):
        if not isinstance(p, Parameter):
            raise TypeError(f"{owner}: parameter #{i} is a {type(p).__name__}, not an "
                            "nn.Parameter (whose value the optimiser can replace in place); "
                            "wrap it: nn.Parameter(t)")
        if not p.dtype.is_floating:
            raise ConfigError(f"{owner}: parameter #{i} has dtype {p.dtype}; only floating "
                              "parameters can be optimised")
    seen: dict[int, int] = {}
    for i, p in enumerate(out):
        if id(p) in seen:
            raise ConfigError(f"{owner}: parameters #{seen[id(p)]} and #{i} are the same "
                              "Parameter (a tied weight?); give each once, as "
                              "model.parameters() does")
        seen[id(p)] = i
    return out


def _positive(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not v >= 0:
            raise ConfigError(f"{owner}: {name}={v!r} must be a number >= 0")


class Optimizer:
    """The common part: parameters, learning rate, master weights, state, state_dict.

    A subclass gives :meth:`init_state` and :meth:`update` for one tensor. ``steps`` is the
    number of steps taken; the learning rate of the next step is ``schedule(steps)``.
    """

    def __init__(self, params: Sequence[Parameter], *, lr: float | Schedule) -> None:
        self.params = _params(type(self).__name__, params)
        if not callable(lr):
            _positive(type(self).__name__, lr=lr)
        self.schedule: Schedule = as_schedule(lr)
        self.steps = 0
        # The state and the float32 copies of 16-bit parameters (made at their first
        # step: a parameter may be created without data and filled after the optimiser
        # is built), held one of two ways, the other None: per parameter (fresh or as
        # loaded) until the first step, then per group (flat), as the step wrote them.
        # The flat tensors are the ones a compiled step's replay updates in place, so
        # per-parameter views of them are cut on every read, never kept (invariant 10).
        self._per: tuple[list[State], list[Tensor | None]] | None = (
            [{} for _ in self.params], [None] * len(self.params))
        self._flat: list[tuple[State, Tensor | None]] | None = None
        self._groups = _groups(self.params)

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""
        return float(self.schedule(self.steps))

    # ---- the math of one tensor (subclasses) --------------------------------------------
    def init_state(self, w: Tensor) -> State:
        """The state of a tensor like ``w`` before its first step."""
        return {}

    def state_names(self) -> tuple[str, ...]:
        """The names of the state a step keeps per parameter (what :meth:`update`
        returns), as a checkpoint of this optimiser holds them."""
        return ()

    def coefficients(self, lr: float, step: int) -> tuple[float, ...]:
        """The numbers of step ``step`` (from 1) that change from step to step, computed
        in Python floats; :meth:`update` receives them as 0-d tensors of its dtype."""
        return (-lr,)

    def update(self, w: Tensor, g: Tensor, state: State, *, coef: Sequence[Tensor]
               ) -> tuple[Tensor, State]:
        """The new value of ``w`` and its state after one step (``coef``: the step's
        :meth:`coefficients` as 0-d tensors of ``w``'s dtype)."""
        raise NotImplementedError

    # ---- a step ----------------------------------------------------------------------
    def next_coefficients(self, device: Any, apply: Tensor | None = None) -> Tensor:
        """The next step's :meth:`coefficients` as a float64 tensor on ``device``;
        computing them counts the step (unless ``apply``, a 0-d bool tensor, is false:
        a skipped step). Through ``fs.host``: at once in an uncompiled step, on every
        call of a compiled one (``fs.compile``), which would otherwise bake the first
        step's learning rate and bias corrections into every replay."""
        n = len(self.coefficients(0.0, 1))
        inputs = () if apply is None else (apply,)
        return host(self._advance, *inputs, shape=(n,), dtype=float64, device=device)

    def _advance(self, *apply: np.ndarray) -> np.ndarray:
        t = self.steps + 1
        c = self.coefficients(float(self.schedule(self.steps)), t)
        if not apply or bool(apply[0]):
            self.steps = t
        return np.asarray(c, dtype=np.float64)

    @property
    def state(self) -> list[State]:
        """Per parameter (by index): its state tensors (views of the flat ones)."""
        return self._views()[0]

    @property
    def master(self) -> list[Tensor | None]:
        """Per parameter: its float32 master copy (16-bit parameters after a step)."""
        return self._views()[1]

    def _views(self) -> tuple[list[State], list[Tensor | None]]:
        """Per parameter: its state and master, as held or as lazy views of the flat
        tensors (made anew on each read: a view realised before a replay would keep the
        value of that time)."""
        if self._flat is None:
            assert self._per is not None
            return self._per
        state: list[State] = [{} for _ in self.params]
        master: list[Tensor | None] = [None] * len(self.params)
        for grp, (st, m) in zip(self._groups, self._flat):
            for i, piece in grp.pieces():
                state[i] = {k: piece(v) for k, v in st.items()}
                master[i] = None if m is None else piece(m)
        return state, master

    def step(self, grads: Sequence[Tensor], *, apply: Tensor | None = None) -> None:
        """Update every parameter in place from its gradient (one realised graph).

        The small parameters of one dtype update as one flat tensor (the gradients, the
        values and the state concatenated: the elementwise math is the same, each op runs
        once over all of them instead of once per parameter), their state and master
        weights kept flat between steps; each parameter receives its slice.

        ``apply``: a 0-d bool tensor; where it is false the step changes nothing (values,
        state, step count), decided in the graph (a loss scaler's skipped step). A state
        that the first step creates (SGD's momentum buffer) is zeros after a skipped first
        step, which the next one reads as a buffer of zeros (the same numbers when
        ``dampening`` is 0)."""
        check_grads(f"{type(self).__name__}.step", self.params, grads)
        coefs = per_dtype(self.next_coefficients(self.params[0].device, apply))
        flat = self._flat if self._flat is not None else self._flatten()
        out: list[tuple[State, Tensor | None]] = []
        news: list[Tensor | None] = [None] * len(self.params)
        for grp, (st0, m0) in zip(self._groups, flat):
            mdt = grp.master
            g = grp.concat([g if g.dtype == mdt else g.astype(mdt)
                            for g in (grads[i] for i in grp.index)])
            w0 = m0 if m0 is not None else grp.concat(
                [Tensor(self.params[i].node).astype(mdt) for i in grp.index])
            st0 = st0 or self.init_state(w0)
            w, st = self.update(w0, g, st0, coef=coefs(mdt))
            if apply is not None:
                w, st = applied(apply, w, st, w0, st0)
            out.append((st, w if mdt != grp.dtype else None))
            cast = w if mdt == grp.dtype else w.astype(grp.dtype)
            for i, piece in grp.pieces():
                news[i] = piece(cast)
        realize(*news, *(m for _, m in out if m is not None),  # type: ignore[misc]
                *(v for st, _ in out for v in st.values()))
        self._flat, self._per = out, None
        for p, w in zip(self.params, news):
            p.assign(w)

    def _flatten(self) -> list[tuple[State, Tensor | None]]:
        """The per-parameter state and masters (fresh or loaded) as flat group tensors."""
        state, master = self._views()
        out: list[tuple[State, Tensor | None]] = []
        for grp in self._groups:
            keys = sorted({k for i in grp.index for k in state[i]})
            st = {}
            for k in keys:
                parts = []
                for i in grp.index:
                    v = state[i].get(k)
                    p = self.params[i]
                    parts.append(v if v is not None else
                                 zeros(p.shape, device=p.device, dtype=grp.master))
                st[k] = grp.concat(parts)
            ms = [master[i] for i in grp.index]
            m = None if any(x is None for x in ms) else grp.concat(ms)  # type: ignore[arg-type]
            out.append((st, m))
        return out

    # ---- state -----------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimiser state on this rank: the state tensors and master weights."""
        held = [m for m in self.master if m is not None] + \
            [v for st in self.state for v in st.values()]
        return sum(t.size * t.dtype.itemsize for t in held)  # the views cover the flat

    def state_dict(self) -> dict[str, Any]:
        """``steps``, and per parameter (by index) its state arrays and master weights."""
        return {"steps": self.steps,
                "state": [{k: v.numpy() for k, v in st.items()} for st in self.state],
                "master": [None if m is None else m.numpy() for m in self.master]}

    def shard_state(self) -> list[dict[str, tuple[int, Tensor]]]:
        """Per parameter (by index): state name -> (flat offset into the parameter's local
        shard, the flat values this rank holds from there); ``MASTER`` names the master
        copy. The layout-free view a checkpoint saves and reshards (ZeRO1 gives slices)."""
        out: list[dict[str, tuple[int, Tensor]]] = []
        for st, m in zip(self.state, self.master):
            d = {k: (0, v.reshape(-1)) for k, v in st.items()}
            if m is not None:
                d[MASTER] = (0, m.reshape(-1))
            out.append(d)
        return out

    def check_shard_state(self, steps: Any, names: Sequence[Sequence[str]], *,
                          owner: str = "load", labels: Sequence[str] | None = None) -> None:
        """Raise CheckpointMismatchError unless ``steps`` and the saved state names
        ``names[i]`` of each parameter are what this optimiser keeps: a step count >= 0,
        and per parameter either nothing (never stepped, so only with ``steps`` 0) or
        exactly :meth:`state_names`, with or without a ``MASTER`` (a run of another
        dtype). Reads nothing and changes nothing, so a loader checks before it assigns.
        ``labels``: what to call each parameter (a checkpoint key)."""
        kind = type(self).__name__
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise CheckpointMismatchError(
                f"{owner}: the saved step count of {kind} is {steps!r}; a step count is an "
                "integer >= 0 (the checkpoint's index is damaged or not this format's)")
        if len(names) != len(self.params):
            raise CheckpointMismatchError(
                f"{owner}: saved state for {len(names)} parameters, {kind} has "
                f"{len(self.params)}; load into an optimiser over the same parameters")
        want = set(self.state_names())
        bad = []
        for i, got in enumerate(names):
            have = set(got) - {MASTER}
            label = f"#{i}" if labels is None else f"#{i} {labels[i]!r}"
            if have - want:
                bad.append(f"parameter {label} has saved {sorted(have - want)}, which {kind} "
                           "does not keep")
            elif (have or steps) and want - have:
                bad.append(f"parameter {label} lacks {sorted(want - have)}")
        if bad:
            raise CheckpointMismatchError(
                f"{owner}: the saved optimiser state is not {kind}'s ({kind} keeps "
                f"{sorted(want) or 'no state'} per parameter after {steps} steps): "
                f"{'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; load it into the "
                "optimiser it was saved with (same class and momentum setting)")

    def load_shard_state(self, steps: int, names: Sequence[Sequence[str]], read: Reader
                         ) -> None:
        """Fill the state from ``read`` (see ``Reader``): parameter ``i`` gets the states
        ``names[i]``; a ``MASTER`` is kept only for a 16-bit parameter (else the parameter
        itself is the master). Checked first (:meth:`check_shard_state`)."""
        self.check_shard_state(steps, names, owner=f"{type(self).__name__}.load_shard_state")
        state: list[State] = []
        masters: list[Tensor | None] = []
        for i, p in enumerate(self.params):
            dt, n = master_dtype(p.dtype), math.prod(p.shape)
            got = {k: tensor(np.ascontiguousarray(read(i, k, 0, n)).reshape(p.shape),
                             device=p.device, dtype=dt)
                   for k in names[i] if k != MASTER or dt != p.dtype}
            masters.append(got.pop(MASTER, None))
            state.append(got)
        self._per, self._flat = (state, masters), None
        self.steps = int(steps)

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ShapeError naming every entry that does not
        fit these parameters."""
        owner = f"{type(self).__name__}.load_state_dict"
        state, master = list(d["state"]), list(d["master"])
        if len(state) != len(self.params) or len(master) != len(self.params):
            raise ShapeError(f"{owner}: {len(state)} states for {len(self.params)} "
                             "parameters; load a state_dict of an optimiser over the same "
                             "parameters")
        bad = []
        for i, (p, st, m) in enumerate(zip(self.params, state, master)):
            for k, v in st.items():
                if tuple(np.shape(v)) != p.shape:
                    bad.append(f"state[{i}][{k!r}] {tuple(np.shape(v))} vs {p.shape}")
            if m is not None and (master_dtype(p.dtype) == p.dtype
                                  or tuple(np.shape(m)) != p.shape):
                bad.append(f"master[{i}] {tuple(np.shape(m))} for a {p.dtype} {p.shape}")
        if bad:
            raise ShapeError(f"{owner}: entries that do not fit: {', '.join(bad)}; load a "
                             "state_dict saved by an optimiser over parameters of these "
                             "shapes and dtypes")
        self.check_shard_state(d["steps"], [list(st) for st in state], owner=owner)
        dev = self.params[0].device
        states: list[State] = []
        masters: list[Tensor | None] = []
        for i, p in enumerate(self.params):
            dt = master_dtype(p.dtype)
            states.append({k: tensor(np.asarray(v), device=p.device, dtype=dt)
                           for k, v in state[i].items()})
            masters.append(None if master[i] is None else
                           tensor(np.asarray(master[i]), device=dev, dtype=dt))
        self._per, self._flat = (states, masters), None
        self.steps = int(d["steps"])


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov momentum and (L2) weight decay,
    as ``torch.optim.SGD``: ``g += wd p``; ``b = g`` at the first step, then
    ``b = momentum b + (1 - dampening) g``; ``g = g + momentum b`` (Nesterov) or ``b``;
    ``p -= lr g``."""

    def __init__(self, params: Sequence[Parameter], *, lr: float | Schedule,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        _positive("SGD", momentum=momentum, dampening=dampening, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError(f"SGD: nesterov=True needs momentum > 0 and dampening = 0, "
                              f"got momentum={momentum}, dampening={dampening}")
        super().__init__(params, lr=lr)
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)

    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def update(self, w: Tensor, g: Tensor, state: State, *, coef: Sequence[Tensor]
               ) -> tuple[Tensor, State]:
        (neg_lr,) = coef
        if self.weight_decay:
            g = g + w * self.weight_decay
        if self.momentum:
            buf = state.get("momentum")
            buf = g if buf is None else buf * self.momentum + g * (1 - self.dampening)
            state = {"momentum": buf}
            g = g + buf * self.momentum if self.nesterov else buf
        return w + g * neg_lr, state


class AdamW(Optimizer):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``::

        p *= 1 - lr wd
        m = lerp(m, g, 1 - b1);   v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    def __init__(self, params: Sequence[Parameter], *, lr: float | Schedule = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        b1, b2 = betas
        _positive("AdamW", eps=eps, weight_decay=weight_decay)
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ConfigError(f"AdamW: betas={betas!r} must each be in [0, 1)")
        super().__init__(params, lr=lr)
        self.betas = (float(b1), float(b2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def init_state(self, w: Tensor) -> State:
        z = zeros(w.shape, device=w.device, dtype=w.dtype)
        return {"exp_avg": z, "exp_avg_sq": z}

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def coefficients(self, lr: float, step: int) -> tuple[float, ...]:
        """``1 - lr wd``, ``-lr / (1 - b1^t)``, ``sqrt(1 - b2^t)``: torch's Python floats."""
        b1, b2 = self.betas
        return (1 - lr * self.weight_decay, -(lr / (1 - b1 ** step)), math.sqrt(1 - b2 ** step))

    def update(self, w: Tensor, g: Tensor, state: State, *, coef: Sequence[Tensor]
               ) -> tuple[Tensor, State]:
        b1, b2 = self.betas
        decay, neg_step_size, bias2_sqrt = coef
        if self.weight_decay:
            w = w * decay
        m, v = state["exp_avg"], state["exp_avg_sq"]
        weight = 1 - b1  # torch's lerp, both of its branches
        m = m + (g - m) * weight if abs(weight) < 0.5 else g - (g - m) * (1 - weight)
        v = v * b2 + g * (1 - b2) * g
        denom = v.sqrt() / bias2_sqrt + self.eps
        return w + m * neg_step_size / denom, {"exp_avg": m, "exp_avg_sq": v}
