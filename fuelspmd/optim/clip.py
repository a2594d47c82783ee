"""Gradient clipping by the global norm of a sharded model.

Layer 7. The norm is the 2-norm of the *unsharded* model's gradient, what
``torch.nn.utils.clip_grad_norm_`` gives on one device:

* a parameter split over a mesh axis (``p.spec.dim`` set) contributes the squares of its
  shard, summed over that axis's communicator (the shards partition the full tensor);
* a replicated parameter holds the whole gradient on every rank of that axis, so its
  squares count once, unreduced;
* pipeline stages hold disjoint parameters: the stage totals are summed over ``pp``; a
  stage's copy of a weight another stage owns (``p.spec.mirror``: a tied embedding table
  on the last stage) is left out, its gradient being the owner's;
* over ``dp`` the gradients are already averaged, equal on every replica, so nothing is
  summed (ZeRO-1 holds dp *shards* instead, and sums them: :func:`global_norm`'s ``dp``).

Squares accumulate in float64, and every rank of the mesh gets the same norm (it is made
from all-reduced partial sums), so every rank clips alike. The norm and the clip
coefficient stay lazy 0-d tensors (nothing is read to the host), so a step that clips
compiles (``fs.compile``): every replay clips by its own norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fuelspmd.comm import Communicator
from fuelspmd.dtypes import float64
from fuelspmd.errors import ConfigError
from fuelspmd.mesh import Mesh
from fuelspmd.nn import Parameter
from fuelspmd.optim.optimizer import check_grads
from fuelspmd.tensor import Tensor, concat, where, zeros

__all__ = ["clip_by", "clip_grad_norm", "global_norm", "scale_by", "spread_over", "squares"]

_EPS = 1e-6  # torch's clip_grad_norm_: coefficient max_norm / (norm + 1e-6)


def spread_over(p: Parameter, mesh: Mesh | None) -> Communicator | None:
    """The communicator a parameter's shards are spread over (None: replicated)."""
    spec = p.spec
    if spec.dim is None:
        return None
    if spec.comm is not None:
        return spec.comm
    if mesh is None or spec.axis is None:
        raise ConfigError(f"clip_grad_norm: a parameter is split along dim {spec.dim} over "
                          f"axis {spec.axis!r} but its spec has no communicator; pass "
                          "mesh= so the axis can be found")
    return mesh.comm(spec.axis)


def squares(parts: Iterable[tuple[Tensor, Communicator | None]], device: Any,
            comms: Sequence[Communicator | None] = ()
            ) -> tuple[Tensor, list[tuple[Communicator, Tensor]]]:
    """Float64 sums of squares of ``(gradient, comm)`` pairs: the replicated total and one
    per communicator the sharded ones are spread over, in first-seen order after those of
    ``comms`` (each of which gets a sum, zero if no part is spread over it: ranks whose
    parts differ still reduce the same list)."""
    rep = zeros((), device=device, dtype=float64)
    by: dict[int, tuple[Communicator, Tensor]] = {
        id(c): (c, zeros((), device=device, dtype=float64))
        for c in comms if c is not None and c.size > 1}
    for g, comm in parts:
        g64 = g.astype(float64)
        s = (g64 * g64).sum()
        if comm is None or comm.size == 1:
            rep = rep + s
        else:
            c, acc = by.get(id(comm), (comm, zeros((), device=device, dtype=float64)))
            by[id(comm)] = (c, acc + s)
    return rep, list(by.values())


def global_norm(rep: Tensor, sharded: Sequence[tuple[Communicator, Tensor]], *,
                mesh: Mesh | None = None, dp: Communicator | None = None) -> Tensor:
    """The 2-norm from :func:`squares`' sums: each (over ``dp`` first, when the values are
    dp shards) summed over its communicator, then the stages' totals over the mesh's
    ``pp``. Collective over every communicator named; a lazy float64 0-d tensor, the same
    on every rank."""
    if dp is not None and dp.size > 1:
        both = dp.all_reduce(concat([rep.reshape(1), *(s.reshape(1) for _, s in sharded)]))
        rep = both[0]
        sharded = [(c, both[1 + k]) for k, (c, _) in enumerate(sharded)]
    total = rep
    for comm, s in sharded:
        total = total + comm.all_reduce(s)
    if mesh is not None and mesh.shape["pp"] > 1:
        total = mesh.comm("pp").all_reduce(total)
    return total.sqrt()


def clip_grad_norm(params: Sequence[Parameter], grads: Sequence[Tensor], max_norm: float, *,
                   mesh: Mesh | None = None) -> tuple[list[Tensor], Tensor]:
    """Scale ``grads`` by ``max_norm / (norm + 1e-6)`` when that is below 1, where ``norm``
    is the global 2-norm of the unsharded gradient (see the module docs); return the
    gradients and the norm before clipping (a lazy float64 0-d tensor: ``float(norm)``
    reads it).

    Without ``mesh`` the sums go over the communicators in the parameters' specs only (a
    plain TP model); with it, over the stages too. Collective over those communicators.
    """
    check_grads("clip_grad_norm", params, grads)
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ConfigError(f"clip_grad_norm: max_norm={max_norm!r} must be a number > 0")
    device = params[0].device if params else None
    spreads = [spread_over(p, mesh) for p in params]
    rep, sharded = squares(((g, c) for p, g, c in zip(params, grads, spreads)
                            if not p.spec.mirror), device, spreads)
    norm = global_norm(rep, sharded, mesh=mesh)
    return clip_by(grads, max_norm, norm), norm


def clip_by(grads: Sequence[Tensor], max_norm: float, norm: Tensor) -> list[Tensor]:
    """``grads`` times ``min(1, max_norm / (norm + 1e-6))`` (torch's rule, which multiplies
    by the clamped coefficient always: times 1.0 changes no value). The coefficient is a
    graph value, cast once per gradient dtype, so no step's number is baked into a plan."""
    coef = max_norm / (norm + _EPS)
    return scale_by(grads, where(coef < 1.0, coef, 1.0))


def scale_by(grads: Sequence[Tensor], coef: Tensor) -> list[Tensor]:
    """Each gradient times the 0-d ``coef``, cast once per gradient dtype (as a Python
    number would be: rounded to that dtype, then multiplied)."""
    cast: dict[Any, Tensor] = {}
    out = []
    for g in grads:
        c = cast.get(g.dtype)
        if c is None:
            c = cast[g.dtype] = coef.astype(g.dtype)
        out.append(g * c)
    return out
