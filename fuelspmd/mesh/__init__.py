"""``Mesh``: the ranks of a group as a named ``dp x pp x tp`` grid (layer 6).

Layout. ``order`` names the axes slowest first; rank ``r`` sits at the mixed-radix
coordinates of ``r`` in that order. The default, ``("dp", "pp", "tp")``, puts ``tp`` fastest::

    r = (dp * PP + pp) * TP + tp

Launchers number the ranks of one node consecutively, so with ``tp`` fastest a TP group
(the axis with a collective in every layer) is ``TP`` consecutive ranks and stays within a
node whenever ``TP`` divides the ranks per node; the once-per-step ``dp`` all-reduce is the
axis that crosses nodes. Over a World that knows its ranks per node, a ``tp`` that would
split a TP group across nodes is refused under that order.

``order="auto"`` lets the cost model choose instead (:mod:`fuelspmd.mesh.placement`): from
the per-axis ``traffic`` of a step (a mapping, or a :class:`~fuelspmd.cost.transformer.
Transformer` whose traffic is derived) it predicts every order's communication time on the
``topology`` (the World's detected one by default) and keeps the cheapest; ties keep the
convention. :meth:`Mesh.explain` says why, in words. The decision is a pure function of
those inputs; the constructor all-gathers it with digests of the inputs and raises
:class:`~fuelspmd.errors.ConfigError` on every rank if the ranks disagree, before any
sub-communicator is made.

Communicators. Each axis's Communicator is the group's ``split`` by the coordinates of the
other two axes, keyed by the coordinate on the axis (so the axis's rank is the coordinate).
The three splits are collective; they are made once, in the constructor, in the fixed
order ``dp``, ``pp``, ``tp`` on every rank, so no rank can ask for them in another order.
An axis that spans the whole group reuses the group's Communicator.

Works over processes (``Mesh(world, ...)``, using ``world.comm``) and over the devices of a
DeviceGroup, where each device's program builds its own mesh from its Communicator::

    group.run(lambda comm: step(Mesh(comm, pp=2)))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fuelspmd.comm import Communicator
from fuelspmd.cost import load_calibration
from fuelspmd.cost.transformer import Transformer
from fuelspmd.errors import ConfigError
from fuelspmd.mesh.placement import (
    AXES,
    CONVENTION,
    Placement,
    Traffic,
    check_order,
    place,
    transformer_traffic,
)
from fuelspmd.topology import Topology, detect
from fuelspmd.transport import agree

__all__ = ["AXES", "CONVENTION", "Mesh", "Placement", "Traffic", "place",
           "transformer_traffic"]


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"Mesh({name}={value!r}): give an int >= 1")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Mesh:
    """The group ``comm_or_world`` as a ``dp x pp x tp`` grid; see the module docstring.

    ``comm_or_world`` is a :class:`~fuelspmd.comm.Communicator` (a DeviceGroup device's, or
    any sub-communicator) or anything with a ``.comm`` Communicator (a ``World``). ``dp``
    defaults to ``size // (tp * pp)``. ``order``: the axes slowest first, or ``"auto"``
    (needs ``traffic``). ``traffic``: per-axis :class:`Traffic` of one step, or a
    ``Transformer``. ``topology``: where group rank ``r`` is device ``r``; by default the
    World's, detected (a bare Communicator needs one given).
    """

    def __init__(self, comm_or_world: Any, *, tp: int = 1, pp: int = 1,
                 dp: int | None = None, order: str | Sequence[str] = CONVENTION,
                 traffic: Mapping[str, Any] | Transformer | None = None,
                 topology: Topology | None = None) -> None:
        comm = _communicator(comm_or_world)
        size = comm.size
        tp, pp = _positive("tp", tp), _positive("pp", pp)
        if dp is None:
            if size % (tp * pp):
                fits = [(t, p) for t in _divisors(size) for p in _divisors(size // t)]
                raise ConfigError(
                    f"Mesh: tp={tp} x pp={pp} = {tp * pp} does not divide the {size} ranks; "
                    f"(tp, pp) pairs that do: {', '.join(f'({t}, {p})' for t, p in fits)}")
            dp = size // (tp * pp)
        dp = _positive("dp", dp)
        if dp * pp * tp != size:
            raise ConfigError(
                f"Mesh: dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but the group has "
                f"{size}; leave dp=None to infer it, or make the product {size}")
        shape = {"dp": dp, "pp": pp, "tp": tp}
        fixed = check_order(order)
        if fixed is None and traffic is None:
            raise ConfigError(
                "Mesh(order='auto') needs traffic=: a mapping such as {'tp': ('all_reduce', "
                "8 << 20, 48), 'dp': ('all_reduce', 1 << 30, 1)} or a cost.transformer."
                "Transformer; without traffic the convention order=('dp', 'pp', 'tp') applies")
        local = getattr(comm_or_world, "local_size", None)
        if fixed is not None and fixed[-1] == "tp" and isinstance(local, int) \
                and local < size and tp > 1 and local % tp:
            ok = _divisors(local)
            raise ConfigError(
                f"Mesh: tp={tp} does not divide the {local} ranks per node, so a TP group "
                f"would span nodes; use tp in {ok}")
        self.placement: Placement | None = None
        self.topology: Topology | None = topology
        """Where group rank ``r`` is device ``r`` (given, or detected when traffic is given):
        ``stage_links(mesh.topology, mesh.group("pp"))`` prices this rank's pipeline."""
        if traffic is not None:
            if isinstance(traffic, Transformer):
                traffic = transformer_traffic(traffic, tp=tp, pp=pp, dp=dp)
            if self.topology is None:
                self.topology = _topology(comm_or_world, size)
            self.placement = place(shape, self.topology, traffic, order=order)
            _agree(comm, self.placement, self.topology)
        self.order: tuple[str, ...] = self.placement.order if self.placement else fixed  # type: ignore[assignment]
        self.comm_group = comm
        self.rank = comm.rank
        self.size = size
        self.shape: dict[str, int] = shape
        self._coord = _coords(self.order, shape, comm.rank)
        c = self._coord
        colors = {  # same color = same coordinates on the other two axes
            "dp": c["pp"] * tp + c["tp"],
            "pp": c["dp"] * tp + c["tp"],
            "tp": c["dp"] * pp + c["pp"],
        }
        self._comms: dict[str, Communicator] = {}
        for axis in AXES:  # fixed order on every rank: the splits are collective
            n = self.shape[axis]
            self._comms[axis] = comm if n == size else comm.split(colors[axis], c[axis])

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={self.shape[a]}" for a in AXES)
        coords = ", ".join(f"{a}={self._coord[a]}" for a in AXES)
        return f"Mesh({dims}; rank {self.rank} at {coords})"

    def _axis(self, axis: str) -> str:
        if axis not in AXES:
            raise ConfigError(f"Mesh: unknown axis {axis!r}; the axes are {', '.join(AXES)}")
        return axis

    def comm(self, axis: str) -> Communicator:
        """Return the Communicator of this rank's group along ``axis`` (its rank there is
        :meth:`coord` of ``axis``)."""
        return self._comms[self._axis(axis)]

    def coord(self, axis: str) -> int:
        """Return this rank's coordinate along ``axis``."""
        return self._coord[self._axis(axis)]

    def rank_of(self, *, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """Return the group rank at coordinates ``(dp, pp, tp)``."""
        want = {"dp": dp, "pp": pp, "tp": tp}
        for name in AXES:
            if not 0 <= want[name] < self.shape[name]:
                raise ConfigError(f"Mesh.rank_of: {name}={want[name]} is outside "
                                  f"0..{self.shape[name] - 1}")
        r = 0
        for a in self.order:
            r = r * self.shape[a] + want[a]
        return r

    def group(self, axis: str) -> list[int]:
        """Return the group ranks of this rank's ``axis`` group, by coordinate on ``axis``
        (for example the ranks holding the pipeline stages, to price their links)."""
        self._axis(axis)
        return [self.rank_of(**{**self._coord, axis: k}) for k in range(self.shape[axis])]

    def explain(self) -> str:
        """Say, in words, which order the mesh uses and why (each candidate order's
        predicted communication per axis when traffic was given)."""
        if self.placement is not None:
            return self.placement.explain()
        dims = " x ".join(f"{a}={self.shape[a]}" for a in AXES)
        return (f"Mesh {dims}: order {', '.join(self.order)} (slowest to fastest) "
                + ("by convention: tp fastest, so tensor-parallel groups are consecutive "
                   "ranks and stay inside a node; nothing was predicted (pass traffic= and "
                   "order='auto' to choose by predicted communication time)"
                   if self.order == CONVENTION else "as given; no traffic, so nothing was "
                   "predicted"))


def _coords(order: Sequence[str], shape: Mapping[str, int], rank: int) -> dict[str, int]:
    c, rest = {}, rank
    for a in reversed(order):
        c[a], rest = rest % shape[a], rest // shape[a]
    return c


def _topology(comm_or_world: Any, size: int) -> Topology:
    """The World's topology, detected from the host names it gathered."""
    nodes = getattr(comm_or_world, "nodes", None)
    if isinstance(nodes, list) and len(nodes) == size:
        return detect(comm_or_world, calibration=load_calibration())
    raise ConfigError(
        "Mesh(traffic=...) prices the orders on a topology: pass topology= (e.g. "
        "Topology.load('two-node-h100-ib')), or build the mesh from fs.init()'s World, whose "
        "topology is detected")


def _agree(comm: Communicator, placement: Placement, topo: Topology) -> None:
    """Raise the same ConfigError on every rank if any rank chose another order, naming
    the inputs that differ and the ranks. The inputs may differ in detail (a core count)
    where every rank chose the same order: only then are they compared."""
    comm.flush()  # an eager exchange on the transport, after what this communicator issued
    what, t = "Mesh(order='auto') (give every rank the same traffic= and topology=)", comm.transport
    try:
        agree(t, what, timeout=comm.timeout, error=ConfigError, order=placement.order)
    except ConfigError as e:  # every rank is here: name the inputs that differ too
        agree(t, f"{e}. Its inputs", timeout=comm.timeout, error=ConfigError,
              traffic=placement.traffic, topology=topo.table())
        raise


def _communicator(comm_or_world: Any) -> Communicator:
    if isinstance(comm_or_world, Communicator):
        return comm_or_world
    if hasattr(comm_or_world, "comms") and hasattr(comm_or_world, "run"):
        raise ConfigError(
            "Mesh(DeviceGroup): a mesh belongs to one device's program; build it inside "
            "group.run from that device's Communicator, e.g. "
            "group.run(lambda comm: train(Mesh(comm, pp=2)))")
    comm = getattr(comm_or_world, "comm", None)
    if isinstance(comm, Communicator):
        return comm
    raise ConfigError(
        f"Mesh: expected a World (fs.init()) or a Communicator, got "
        f"{type(comm_or_world).__name__}")
