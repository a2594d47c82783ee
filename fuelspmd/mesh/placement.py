"""Mesh placement by predicted communication time: which axis lies inside a node.

Pure policy: a function of the mesh sizes, the topology and the traffic, touching no
tensor and no transport, so every rank reaches the same answer and a test checks it in
one process.

An **order** names the axes from slowest to fastest varying; rank ``r`` of the mesh sits
at the mixed-radix coordinates of ``r`` in that order, and mesh rank ``r`` is device ``r`` of
the topology (node-major, as launchers number ranks). The fastest axis's groups are
consecutive ranks, so they stay within a node when the node holds whole groups; the
slowest axis's groups stride across the job. The convention ``("dp", "pp", "tp")`` (tp
fastest) is right for a transformer whose tensor-parallel all-reduces dominate; a model
with few layers and many parameters moves more over dp, and then dp belongs inside.

**Traffic** is what each axis moves per training step, per rank: ``count`` collectives of
``nbytes`` (:class:`Traffic`), given as a mapping or derived from a transformer's shape
(:func:`transformer_traffic`).

**Prediction.** For an order, the time of an axis is ``sum(count * t)`` over its traffic,
where ``t`` is the cost model's prediction for the slowest of the axis's groups; all groups
of an axis run at once, so a group shares each node's NICs with the other groups that
touch the node (``concurrent``). ``send_recv`` traffic (pipeline activations) is priced
per stage boundary and the slowest boundary counts. The step's communication is the sum
over axes (nothing overlapped, as in Megatron). :func:`place` prices every distinct
layout and keeps the cheapest; exact ties (every group inside one node, say) keep the
convention, so "auto" changes nothing unless the model predicts a gain.
"""

from __future__ import annotations

import itertools
import math
import numbers
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fuelspmd.cost import COLLECTIVES, CostModel
from fuelspmd.cost.collectives import format_bytes, format_seconds
from fuelspmd.cost.transformer import Assumptions, Transformer
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Topology

__all__ = ["AXES", "CONVENTION", "AxisCost", "Candidate", "Placement", "Traffic", "groups",
           "layout", "normalize_traffic", "place", "transformer_traffic"]

AXES: tuple[str, ...] = ("dp", "pp", "tp")
CONVENTION: tuple[str, str, str] = ("dp", "pp", "tp")
# Every order, nearest the convention first (tp as fast as it can be, then pp): ties keep
# the earliest, so the convention wins them.
_ORDERS: tuple[tuple[str, ...], ...] = tuple(sorted(
    itertools.permutations(AXES), key=lambda o: (-o.index("tp"), -o.index("pp"))))
_TIE = 1e-9  # relative: predictions this close are the same prediction


@dataclass(frozen=True)
class Traffic:
    """What one axis moves per step on each rank: ``count`` x ``collective`` of ``nbytes``
    (counted as the cost model counts them: the buffer of an all_reduce, what one rank
    sends in a send_recv)."""

    collective: str
    nbytes: float
    count: int = 1

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ConfigError(f"Traffic: unknown collective {self.collective!r}; use one of "
                              f"{list(COLLECTIVES)}")
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, numbers.Real) \
                or not math.isfinite(self.nbytes) or self.nbytes < 0:
            raise ConfigError(f"Traffic({self.collective}): nbytes must be a finite number "
                              f">= 0, got {self.nbytes!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, numbers.Integral) \
                or self.count < 0:
            raise ConfigError(f"Traffic({self.collective}): count must be an int >= 0, got "
                              f"{self.count!r}")

    def __str__(self) -> str:
        name = _NOUNS.get(self.collective, self.collective)
        return f"{self.count} {name}{'' if self.count == 1 else 's'} of {format_bytes(self.nbytes)}"


_NOUNS = {"all_reduce": "all-reduce", "all_gather": "all-gather",
          "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all",
          "send_recv": "send", "broadcast": "broadcast"}

def normalize_traffic(traffic: Mapping[str, object]) -> dict[str, tuple[Traffic, ...]]:
    """Check a traffic mapping: axis -> a :class:`Traffic`, a ``(collective, nbytes[,
    count])`` tuple, or a list of them; returns axis -> tuple of Traffic for every axis."""
    if not isinstance(traffic, Mapping):
        raise ConfigError(f"traffic must map axes {list(AXES)} to Traffic entries, got "
                          f"{type(traffic).__name__}")
    out: dict[str, tuple[Traffic, ...]] = {a: () for a in AXES}
    for axis, spec in traffic.items():
        if axis not in AXES:
            raise ConfigError(f"traffic: unknown axis {axis!r}; the axes are "
                              f"{', '.join(AXES)}")
        items = [spec] if isinstance(spec, Traffic) or (
            isinstance(spec, tuple) and spec and isinstance(spec[0], str)) else spec
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"traffic[{axis!r}] = {spec!r}: give a Traffic, a (collective, "
                              "nbytes, count) tuple, or a list of them")
        entries = []
        for item in items:
            if isinstance(item, Traffic):
                entries.append(item)
            elif isinstance(item, tuple) and 2 <= len(item) <= 3:
                entries.append(Traffic(*item))
            else:
                raise ConfigError(f"traffic[{axis!r}]: {item!r} is not a Traffic; give a "
                                  "Traffic or a (collective, nbytes, count) tuple")
        out[axis] = tuple(entries)
    return out


def transformer_traffic(model: Transformer, *, tp: int, pp: int, dp: int, microbatch: int = 1,
                        chunks: int = 1, assumptions: Assumptions | None = None
                        ) -> dict[str, tuple[Traffic, ...]]:
    """Per-step traffic of a GPT-style transformer, by the terms of
    :mod:`fuelspmd.cost.transformer` (Megatron's layout, ``T = microbatch * seq`` tokens):

    - tp: ``(4 + 2 recompute)`` all-reduces of ``2 T h`` bytes per layer and micro-batch,
      for the ``layers / pp`` layers of a stage and the ``m = batch / (dp microbatch)``
      micro-batches;
    - pp: one activation forward and one gradient backward per micro-batch and chunk, each
      ``2 T h`` bytes (``/ tp`` with the scatter/gather optimisation);
    - dp: one all-reduce of a rank's gradients, ``params / (tp pp) * grad_bytes``.
    """
    a = assumptions or Assumptions()
    if model.global_batch % (dp * microbatch) or model.layers % (pp * chunks):
        raise ConfigError(f"transformer_traffic: dp={dp} x microbatch={microbatch} must divide "
                          f"the batch {model.global_batch} and pp={pp} x chunks={chunks} the "
                          f"{model.layers} layers")
    m = model.global_batch // (dp * microbatch)
    act = 2 * microbatch * model.seq * model.hidden
    hop = act / tp if a.scatter_gather and tp > 1 else act
    return {
        "tp": (Traffic("all_reduce", act, m * (model.layers // pp) * (4 + 2 * a.recompute)),),
        "pp": (Traffic("send_recv", hop, 2 * m * chunks),),
        "dp": (Traffic("all_reduce", model.params / (tp * pp) * a.grad_bytes, 1),),
    }


def layout(order: Sequence[str], shape: Mapping[str, int]) -> list[dict[str, int]]:
    """Coordinates of every rank: mixed radix in ``order`` (slowest first)."""
    size = math.prod(shape[a] for a in AXES)
    out = []
    for r in range(size):
        c, rest = {}, r
        for a in reversed(order):
            c[a], rest = rest % shape[a], rest // shape[a]
        out.append(c)
    return out


def groups(order: Sequence[str], shape: Mapping[str, int], axis: str) -> list[list[int]]:
    """The ranks of each ``axis`` group (same coordinates on the other axes), each ordered
    by its coordinate on ``axis``."""
    parts: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for r, c in enumerate(layout(order, shape)):
        parts.setdefault(tuple(c[a] for a in AXES if a != axis), []).append((c[axis], r))
    return [[r for _, r in sorted(p)] for p in parts.values()]


@dataclass(frozen=True)
class AxisCost:
    """One axis under one order: predicted seconds per step and where its groups lie."""

    axis: str
    seconds: float
    where: str
    nodes: int


@dataclass(frozen=True)
class Candidate:
    """One order and its predicted communication per step, by axis."""

    order: tuple[str, ...]
    axes: Mapping[str, AxisCost]

    @property
    def seconds(self) -> float:
        """Predicted communication seconds per step: the sum over axes."""
        return sum(c.seconds for c in self.axes.values())

    @property
    def label(self) -> str:
        """The order as written to ``Mesh(order=...)``, slowest first."""
        return ", ".join(self.order)


@dataclass(frozen=True)
class Placement:
    """The chosen order, every distinct candidate (cheapest first) and the inputs."""

    order: tuple[str, ...]
    shape: Mapping[str, int]
    candidates: tuple[Candidate, ...]
    traffic: Mapping[str, tuple[Traffic, ...]]
    topology: str
    auto: bool

    @property
    def chosen(self) -> Candidate:
        """The candidate of :attr:`order`."""
        key = _key(self.order, self.shape)
        return next(c for c in self.candidates if _key(c.order, self.shape) == key)

    def explain(self) -> str:
        """Each candidate's predicted time per axis, and why the chosen order won, in words."""
        dims = " x ".join(f"{a}={self.shape[a]}" for a in AXES)
        how = "chosen by predicted communication per step" if self.auto else \
            "given (order=...); the cost model's view of it"
        lines = [f"Mesh {dims} on {self.topology}: order {', '.join(self.order)} "
                 f"(slowest to fastest; {self.order[-1]} fastest), {how}"]
        busy = [a for a in AXES if self.traffic[a] and self.shape[a] > 1]
        lines.append("traffic per step: " + ("; ".join(
            f"{a} {' + '.join(str(t) for t in self.traffic[a])}" for a in busy) or "none"))
        cells = [["order (slowest..fastest)", *busy, "total", ""]]
        chosen = self.chosen
        for c in self.candidates:
            cells.append([c.label, *(f"{format_seconds(c.axes[a].seconds)} {c.axes[a].where}"
                                     for a in busy), format_seconds(c.seconds),
                          "<- chosen" if c is chosen else ""])
        widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
        lines += ["  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
                  for r in cells]
        lines.append(textwrap.fill("why: " + self._why(), width=100,
                                   subsequent_indent="     "))
        return "\n".join(lines)

    def _why(self) -> str:
        best, chosen = self.candidates[0], self.chosen
        if len(self.candidates) == 1:
            return "with these sizes every order gives the same layout"
        if not self.auto and chosen is not best and not _same(best, chosen):
            return (f"the given order costs {format_seconds(chosen.seconds)} per step, "
                    f"{_ratio(chosen.seconds, best.seconds)} what order='auto' would choose: "
                    f"{best.label} at {format_seconds(best.seconds)}")
        rival = next((c for c in self.candidates if not _same(c, chosen)), None)
        ties = [c.label for c in self.candidates if c is not chosen and _same(c, chosen)]
        tied = (f" ({'; '.join(ties)} predict{'s' if len(ties) == 1 else ''} the same; the "
                f"order nearest the convention {', '.join(CONVENTION)} is kept)") if ties else ""
        if rival is None:
            return (f"every candidate predicts {format_seconds(chosen.seconds)}: no order changes "
                    f"which links the traffic crosses, so the convention "
                    f"({', '.join(CONVENTION)}: tp fastest) stands")
        gain = {a: rival.axes[a].seconds - chosen.axes[a].seconds for a in AXES}
        top = max(AXES, key=lambda a: gain[a])
        text = (f"{top} {chosen.axes[top].where}: "
                f"{' + '.join(str(t) for t in self.traffic[top])} per step, "
                f"{format_seconds(chosen.axes[top].seconds)} there vs "
                f"{format_seconds(rival.axes[top].seconds)} {rival.axes[top].where}")
        lost = [a for a in AXES if gain[a] < 0]
        if lost:
            text += "; that outweighs " + ", ".join(
                f"{a} {chosen.axes[a].where} {format_seconds(chosen.axes[a].seconds)} vs "
                f"{format_seconds(rival.axes[a].seconds)} {rival.axes[a].where}" for a in lost)
        return (f"{text}. Total {format_seconds(chosen.seconds)} per step against "
                f"{format_seconds(rival.seconds)} for the next best order ({rival.label}), "
                f"{_ratio(rival.seconds, chosen.seconds)} as long{tied}")


def place(shape: Mapping[str, int], topology: Topology, traffic: Mapping[str, object], *,
          order: str | Sequence[str] = "auto", cost: CostModel | None = None) -> Placement:
    """Price every distinct order of the ``dp x pp x tp`` mesh ``shape`` on ``topology``
    (mesh rank ``r`` on device ``r``) for ``traffic`` and keep the cheapest (``order="auto"``),
    or price them to explain a given ``order``. See the module docstring for the model."""
    for a in AXES:
        n = shape.get(a)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"place: shape[{a!r}] = {n!r}; give an int >= 1 per axis")
    size = math.prod(shape[a] for a in AXES)
    if size > topology.size:
        raise ConfigError(f"place: the mesh has {size} ranks but the topology "
                          f"{topology.name or '(unnamed)'} has {topology.size} devices; "
                          f"give a topology of at least {size} devices")
    fixed = check_order(order)
    entries = normalize_traffic(traffic)
    model = cost if cost is not None else CostModel(topology)
    seen: dict[tuple[str, ...], Candidate] = {}
    for o in _ORDERS:
        key = _key(o, shape)
        if key not in seen:
            seen[key] = Candidate(o, {a: _axis_cost(model, o, shape, a, entries[a])
                                      for a in AXES})
    ranked = sorted(seen.values(), key=lambda c: c.seconds)  # stable: convention first on ties
    best = ranked[0]
    ties = [c for c in seen.values() if _same(c, best)]  # in _ORDERS order
    ranked.remove(ties[0])
    ranked.insert(0, ties[0])
    chosen = ties[0].order if fixed is None else fixed
    if fixed is not None:  # list the given order under its own name
        key = _key(fixed, shape)
        ranked = [Candidate(fixed, c.axes) if _key(c.order, shape) == key else c
                  for c in ranked]
    name = topology.name or "the topology"
    where = f"{name} ({len(topology.by_node(range(size)))} node(s), {size} devices)"
    return Placement(chosen, dict(shape), tuple(ranked), entries, where, fixed is None)


def check_order(order: str | Sequence[str]) -> tuple[str, ...] | None:
    """None for ``"auto"``, else the order as a tuple of the three axes (ConfigError if not)."""
    if isinstance(order, str):
        if order == "auto":
            return None
        raise ConfigError(f"Mesh(order={order!r}): give 'auto' or the three axes slowest "
                          f"first, e.g. order={CONVENTION}")
    got = tuple(order)
    if sorted(got) != sorted(AXES):
        raise ConfigError(f"Mesh(order={got!r}): name each of {', '.join(AXES)} once, slowest "
                          f"first, e.g. order={CONVENTION}, or order='auto'")
    return got


def _key(order: Sequence[str], shape: Mapping[str, int]) -> tuple[str, ...]:
    """Orders that differ only in where size-1 axes go give the same layout."""
    return tuple(a for a in order if shape[a] > 1)


def _same(a: Candidate, b: Candidate) -> bool:
    return abs(a.seconds - b.seconds) <= _TIE * max(a.seconds, b.seconds)


def _axis_cost(model: CostModel, order: Sequence[str], shape: Mapping[str, int], axis: str,
               entries: Sequence[Traffic]) -> AxisCost:
    """Price ``axis``'s traffic on its slowest group; all its groups run at once."""
    if shape[axis] == 1:
        return AxisCost(axis, 0.0, "(one rank)", 1)
    topo = model.topology
    gs = groups(order, shape, axis)
    touch = Counter(k for g in gs for k in {topo.node_index(d) for d in g})
    worst: AxisCost | None = None
    priced: set[tuple[object, ...]] = set()
    for g in gs:
        nodes = sorted({topo.node_index(d) for d in g})
        conc = max(touch[k] for k in nodes)
        sig = (conc, tuple((topo.node_index(d) - nodes[0], topo.local_index(d)) for d in g),
               tuple(_node_key(topo, k) for k in nodes))
        if sig in priced:
            continue  # the same pattern on alike nodes costs the same
        priced.add(sig)
        seconds = sum(t.count * _price(model, t, g, conc) for t in entries)
        if worst is None or seconds > worst.seconds:
            worst = AxisCost(axis, seconds, _where(topo, g), len(nodes))
    assert worst is not None
    return worst


def _price(model: CostModel, t: Traffic, g: list[int], concurrent: int) -> float:
    if t.collective == "send_recv":  # stage to stage: the slowest boundary
        return max(model.predict("send_recv", t.nbytes, [a, b], concurrent=concurrent)
                   for a, b in itertools.pairwise(g))
    return model.predict(t.collective, t.nbytes, g, concurrent=concurrent)


def _node_key(topo: Topology, k: int) -> tuple[object, ...]:
    n = topo.nodes[k]
    return (n.devices, n.fabric, n.nics, n.nic, n.reduce_bandwidth, n.cores,
            n.oversubscribed_latency, tuple(sorted(n.pairs.items())))


def _where(topo: Topology, g: Sequence[int]) -> str:
    parts = topo.by_node(g)
    if len(parts) == 1:
        return f"inside a node ({topo.node_of(g[0]).fabric.kind})"
    per = sorted({len(p) for p in parts.values()})
    each = "/".join(map(str, per))
    return f"across {len(parts)} nodes ({each} per node)"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "infinitely"

