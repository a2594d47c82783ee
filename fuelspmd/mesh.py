"""``Mesh``: the ranks of a group as a named ``dp x pp x tp`` grid (layer 6).

Layout. Rank ``r`` of the group sits at ``(dp, pp, tp)`` with ``tp`` varying fastest::

    r = (dp * PP + pp) * TP + tp

Launchers number the ranks of one node consecutively, so with ``tp`` fastest a TP group
(the axis with a collective in every layer) is ``TP`` consecutive ranks and stays within a
node whenever ``TP`` divides the ranks per node; the once-per-step ``dp`` all-reduce is the
axis that crosses nodes. Over a World that knows its ranks per node, a ``tp`` that would
split a TP group across nodes is refused.

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

from typing import Any

from fuelspmd.comm import Communicator
from fuelspmd.errors import ConfigError

__all__ = ["AXES", "Mesh"]

AXES: tuple[str, ...] = ("dp", "pp", "tp")


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
    defaults to ``size // (tp * pp)``.
    """

    def __init__(self, comm_or_world: Any, *, tp: int = 1, pp: int = 1,
                 dp: int | None = None) -> None:
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
        local = getattr(comm_or_world, "local_size", None)
        if isinstance(local, int) and local < size and tp > 1 and local % tp:
            ok = _divisors(local)
            raise ConfigError(
                f"Mesh: tp={tp} does not divide the {local} ranks per node, so a TP group "
                f"would span nodes; use tp in {ok}")
        self.comm_group = comm
        self.rank = comm.rank
        self.size = size
        self.shape: dict[str, int] = {"dp": dp, "pp": pp, "tp": tp}
        r = comm.rank
        self._coord = {"tp": r % tp, "pp": (r // tp) % pp, "dp": r // (tp * pp)}
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
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not 0 <= value < self.shape[name]:
                raise ConfigError(f"Mesh.rank_of: {name}={value} is outside "
                                  f"0..{self.shape[name] - 1}")
        return (dp * self.shape["pp"] + pp) * self.shape["tp"] + tp


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
