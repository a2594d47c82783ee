"""The alpha-beta(-gamma) cost of collectives on a :class:`~fuelspmd.topology.Topology`.

Every link class has a latency alpha (seconds per message) and a bandwidth 1/beta (bytes
per second one device pushes); a reduction adds gamma seconds per byte folded (zero on GPUs,
where NCCL fuses it into the copy). For ``n`` ranks on one link class and ``N`` bytes:

==============  ====================  ==================================================
collective      algorithm             time
==============  ====================  ==================================================
all_reduce      ring                  2(n-1) a + 2(n-1)/n N b + (n-1)/n N g
all_reduce      halving_doubling      2 log2(n) a + 2(n-1)/n N b + (n-1)/n N g  (Rabenseifner)
all_reduce      doubling              log2(n) (a + N b + N g)
reduce_scatter  ring                  (n-1) a + (n-1)/n N b + (n-1)/n N g   (N: input bytes)
reduce_scatter  halving               log2(n) a + (n-1)/n N b + (n-1)/n N g
all_gather      ring                  (n-1) a + (n-1)/n N b                 (N: output bytes)
all_gather      doubling              log2(n) a + (n-1)/n N b
broadcast       tree                  ceil(log2 n) (a + N b)                (binomial)
broadcast       scatter_allgather     (log2(n) + n-1) a + 2(n-1)/n N b      (van de Geijn)
all_to_all      pairwise              (n-1) (a + N/n b)                     (N: bytes sent)
send_recv       direct                a + N b
*               hierarchical          intra-node reduce-scatter, inter-node collective of
                                      N/G per rail, intra-node all-gather (G per node)
==============  ====================  ==================================================

On a topology the link classes differ per step, so the model is evaluated on the actual
group:

- **ring** runs as many channels as a node has NICs, each ring leaving every node once, with
  each device the exit of an equal share of channels (as NCCL arranges it). A device of a
  node holding ``G`` of the group's ranks sends ``(G-1)/G`` of the ring volume over the
  fabric and the node sends the whole volume off-node over its NICs, so the bandwidth term
  is ``volume * max((G-1)/(G B_fabric), 1/B_egress)``; every step waits for the slowest
  hop's latency.
- **step algorithms** (halving/doubling, trees, pairwise) are walked step by step: each step
  costs its slowest pair; ranks that leave their node at the same step share the node's
  NICs. Non-powers of two fold the extra ranks in first (one extra exchange each way).
- ``concurrent`` like groups running at once (every data-parallel group of a mesh, say)
  share each node's NICs: a group gets at most ``1/concurrent`` of them.

Ranks are ordered node-major for every algorithm, which is the order fuelspmd's meshes
use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from fuelspmd.cost.regimes import Regime, apply_regime, pick
from fuelspmd.errors import ConfigError
from fuelspmd.topology import Link, Topology

__all__ = ["ALGORITHMS", "COLLECTIVES", "OPT_IN", "Choice", "CostModel", "Estimate", "format_bytes",
           "format_seconds"]

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "halving_doubling", "doubling", "hierarchical"),
    "reduce_scatter": ("ring", "halving", "hierarchical"),
    "all_gather": ("ring", "doubling", "hierarchical"),
    "broadcast": ("tree", "scatter_allgather"),
    "all_to_all": ("pairwise",),
    "send_recv": ("direct",),
}
COLLECTIVES = tuple(ALGORITHMS)
# Priced only when asked for (``opt_in=True``): the MPI transport runs them only once the
# layer above switches them on, so a default prediction (and the calibration fit, which
# models what the transport runs by default) must not assume them.
OPT_IN: dict[str, tuple[str, ...]] = {"all_reduce": ("shm",)}
# Python and bookkeeping of one shared-memory all-reduce beyond its two phase syncs, with
# a core per rank (``fuelspmd bench shm`` at 64 KiB, where the copies are small)
SHM_CALL_OVERHEAD_S = 1e-4

# A step algorithm: per step, the pairs exchanging at once, bytes each way, whether they reduce.
Steps = list[tuple[list[tuple[int, int]], float, bool]]


@dataclass(frozen=True, slots=True)
class Estimate:
    """A predicted time split into its alpha, beta and gamma terms, and what bounds it."""

    algorithm: str
    latency: float
    transfer: float
    reduce: float
    bound: str

    @property
    def seconds(self) -> float:
        """The predicted time: latency + transfer + reduce."""
        return self.latency + self.transfer + self.reduce


@dataclass(frozen=True)
class Choice:
    """The fastest algorithm for one collective, with the others and the reason in words."""

    collective: str
    nbytes: int
    algorithm: str
    seconds: float
    alternatives: dict[str, float] = field(default_factory=dict)
    explanation: str = ""


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


class CostModel:
    """Predicted collective times on one topology (pure: no transport, no tensor).

    ``regimes`` (calibrated, :mod:`fuelspmd.cost.regimes`): the shared-memory link's
    numbers per band of collective sizes. A collective over CPU ranks is then priced with
    the band of its ``nbytes`` in place of the nodes' single shared-memory link.
    """

    def __init__(self, topology: Topology, *, regimes: Sequence[Regime] = ()) -> None:
        self.topology = topology
        self.regimes = tuple(regimes)
        # Predictions are pure functions of their arguments; planners ask the same ones often.
        self._memo: dict[tuple[object, ...], Estimate] = {}
        self._banded: dict[tuple[int, int], CostModel] = {}

    def _band(self, nbytes: float, members: Sequence[int], concurrent: int) -> CostModel | None:
        """The model of ``nbytes``' regime when the group has a shared-memory node."""
        if not self.regimes:
            return None
        topo = self.topology
        parts = topo.by_node(members)
        if all(topo.nodes[k].fabric.kind != "shm" for k in parts):
            return None
        busy = max(len(m) for m in parts.values()) * concurrent
        key = (pick(self.regimes, nbytes), busy)
        model = self._banded.get(key)
        if model is None:
            model = self._banded[key] = CostModel(
                apply_regime(topo, self.regimes[key[0]], busy=busy))
        return model

    # ----- public ------------------------------------------------------------------------

    def algorithms(self, collective: str, group: Sequence[int], *,
                   opt_in: bool = False) -> list[str]:
        """The algorithms that apply to ``collective`` over ``group`` (with ``opt_in``, also
        those in :data:`OPT_IN` that apply: shm for a group on one CPU node)."""
        names = list(self._known(collective))
        parts = self.topology.by_node(group)
        sizes = {len(p) for p in parts.values()}
        if "hierarchical" in names and (len(parts) < 2 or len(sizes) != 1 or sizes == {1}):
            names.remove("hierarchical")
        if opt_in and "shm" in OPT_IN.get(collective, ()) and len(parts) == 1 \
                and self.topology.nodes[next(iter(parts))].fabric.kind == "shm":
            names.append("shm")
        return names

    def estimate(self, collective: str, nbytes: float, group: Sequence[int], *,
                 algorithm: str | None = None, concurrent: int = 1) -> Estimate:
        """Predict one collective: ``nbytes`` as nccl-tests counts it (the buffer for
        all_reduce and broadcast, the whole output of all_gather, the whole input of
        reduce_scatter, what one rank sends in all_to_all and send_recv)."""
        members = self._group(collective, group)
        if nbytes < 0:
            raise ConfigError(f"{collective}: nbytes must be >= 0, got {nbytes}")
        if concurrent < 1:
            raise ConfigError(f"concurrent must be >= 1 group, got {concurrent}")
        key = (collective, float(nbytes), tuple(members), algorithm, concurrent)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        band = self._band(nbytes, members, concurrent)
        if band is not None:
            est = band.estimate(collective, nbytes, members, algorithm=algorithm,
                                concurrent=concurrent)
            self._memo[key] = est
            return est
        if algorithm is None:
            est = min((self._run(collective, a, nbytes, members, concurrent)
                       for a in self.algorithms(collective, members)), key=lambda e: e.seconds)
            self._memo[key] = est
            return est
        known = self._known(collective) + OPT_IN.get(collective, ())
        if algorithm not in known:
            raise ConfigError(f"{collective} has no algorithm {algorithm!r}; use one of "
                              f"{list(known)}")
        if algorithm == "shm" and algorithm not in self.algorithms(collective, members,
                                                                    opt_in=True):
            raise ConfigError(f"shm {collective} needs a group of CPU ranks on one node "
                              f"(a shared-memory fabric); this group spans "
                              f"{len(self.topology.by_node(members))} node(s)")
        if algorithm != "shm" and algorithm not in self.algorithms(collective, members):
            raise ConfigError(f"{algorithm} {collective} needs >= 2 nodes holding the same "
                              f"number (>= 2) of the group's ranks; this group has "
                              f"{[len(p) for p in self.topology.by_node(members).values()]} "
                              "per node")
        est = self._run(collective, algorithm, nbytes, members, concurrent)
        self._memo[key] = est
        return est

    def predict(self, collective: str, nbytes: float, group: Sequence[int], *,
                algorithm: str | None = None, concurrent: int = 1) -> float:
        """Predicted seconds of ``collective`` (fastest algorithm unless one is named)."""
        return self.estimate(collective, nbytes, group, algorithm=algorithm,
                             concurrent=concurrent).seconds

    def best_algorithm(self, collective: str, nbytes: float, group: Sequence[int], *,
                       concurrent: int = 1, opt_in: bool = False) -> Choice:
        """The fastest algorithm, every candidate's time, and why it wins, in words.

        ``opt_in`` also weighs the algorithms of :data:`OPT_IN` (see :meth:`shm_min_bytes`
        for when the shm all-reduce should be switched on)."""
        members = self._group(collective, group)
        ests = [self.estimate(collective, nbytes, members, algorithm=a, concurrent=concurrent)
                for a in self.algorithms(collective, members, opt_in=opt_in)]
        ests.sort(key=lambda e: e.seconds)
        best = ests[0]
        parts = self.topology.by_node(members)
        where = (f"{len(members)} devices on {len(parts)} node(s) "
                 f"({'/'.join(str(len(p)) for p in parts.values())} per node)")
        share = ("latency" if best.latency >= max(best.transfer, best.reduce) else
                 "reduction" if best.reduce > best.transfer else "bandwidth")
        text = (f"{collective} of {format_bytes(nbytes)} over {where}: {best.algorithm} "
                f"{format_seconds(best.seconds)}, {share}-bound ({best.bound}; latency "
                f"{format_seconds(best.latency)}, transfer {format_seconds(best.transfer)}, reduce "
                f"{format_seconds(best.reduce)})")
        if len(ests) > 1:
            text += "; beats " + ", ".join(
                f"{e.algorithm} {format_seconds(e.seconds)} (x{e.seconds / best.seconds:.2f})"
                for e in ests[1:])
        return Choice(collective, int(nbytes), best.algorithm, best.seconds,
                      {e.algorithm: e.seconds for e in ests}, text)

    def bus_bandwidth(self, collective: str, nbytes: float, group: Sequence[int], *,
                      algorithm: str | None = None, concurrent: int = 1) -> float:
        """nccl-tests' bus bandwidth (bytes/s): algbw = N / t times 2(n-1)/n for
        all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 otherwise."""
        n = len(set(group))
        t = self.predict(collective, nbytes, group, algorithm=algorithm, concurrent=concurrent)
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                  "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}.get(collective, 1.0)
        return nbytes / t * factor if t > 0 else math.inf

    # ----- checks ------------------------------------------------------------------------

    @staticmethod
    def _known(collective: str) -> tuple[str, ...]:
        if collective not in ALGORITHMS:
            raise ConfigError(f"unknown collective {collective!r}; use one of {list(COLLECTIVES)}")
        return ALGORITHMS[collective]

    def _group(self, collective: str, group: Sequence[int]) -> list[int]:
        self._known(collective)
        members = list(group)
        if len(set(members)) != len(members) or not members:
            raise ConfigError(f"a group is a non-empty list of distinct device indices, "
                              f"got {members}; name each device once")
        for d in members:
            self.topology.local_index(d)  # raises ConfigError naming the range
        if collective == "send_recv" and len(members) != 2:
            raise ConfigError(f"send_recv takes a group of [src, dst], got {members}; "
                              "give two devices")
        return members if collective == "send_recv" else sorted(members)

    # ----- algorithms --------------------------------------------------------------------

    def _run(self, collective: str, algorithm: str, nbytes: float, g: list[int],
             concurrent: int) -> Estimate:
        n = len(g)
        if n == 1:
            return Estimate(algorithm, 0.0, 0.0, 0.0, "one rank: nothing moves")
        if algorithm == "hierarchical":
            return self._hierarchical(collective, nbytes, g, concurrent)
        if algorithm == "shm":
            return self._shm(nbytes, g, concurrent)
        if algorithm == "ring":
            factor = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[collective]
            reduce = collective != "all_gather"
            return self._ring(factor, nbytes, g, concurrent, reduce)
        table: dict[tuple[str, str], Callable[[], Steps]] = {
            ("all_reduce", "halving_doubling"):
                lambda: _halving(g, nbytes) + _doubling_gather(g, nbytes),
            ("all_reduce", "doubling"): lambda: _doubling_full(g, nbytes),
            ("reduce_scatter", "halving"): lambda: _halving(g, nbytes),
            ("all_gather", "doubling"): lambda: _doubling_gather(g, nbytes),
            ("broadcast", "tree"): lambda: _binomial(g, nbytes),
            ("broadcast", "scatter_allgather"):
                lambda: _binomial_scatter(g, nbytes) + _ring_steps(g, nbytes),
            ("all_to_all", "pairwise"): lambda: _pairwise(g, nbytes),
            ("send_recv", "direct"): lambda: [([(g[0], g[1])], nbytes, False)],
        }
        return self._steps(algorithm, table[collective, algorithm](), g, concurrent)

    def _crowding(self, g: Sequence[int], concurrent: int) -> dict[int, tuple[float, float | None]]:
        """Per node of the group: CPU slowdown and latency override when ranks outnumber
        cores (see :meth:`fuelspmd.topology.Node.crowding`)."""
        topo = self.topology
        return {k: topo.nodes[k].crowding(len(m) * concurrent)
                for k, m in topo.by_node(g).items()}

    def _gamma(self, g: Sequence[int], concurrent: int) -> float:
        """Seconds per byte reduced on the slowest node of the group (0 when fused)."""
        topo = self.topology
        worst = 0.0
        for k, (slow, _) in self._crowding(g, concurrent).items():
            rate = topo.nodes[k].reduce_bandwidth
            if rate:
                worst = max(worst, slow / rate)
        return worst

    def _ring(self, factor: int, nbytes: float, g: list[int], concurrent: int,
              reduce: bool) -> Estimate:
        topo, n = self.topology, len(g)
        parts = topo.by_node(g)
        volume = factor * (n - 1) / n * nbytes
        per_byte, bound, alpha = 0.0, "", 0.0
        crowd = self._crowding(g, concurrent)
        for node, members in parts.items():
            if len(members) > 1:
                ring = members + members[:1]
                links = [topo.link(a, b) for a, b in pairwise(ring)]
                slow, late = crowd[node]
                bw = min(lk.bandwidth for lk in links) / slow
                share = (len(members) - 1) / len(members) if len(parts) > 1 else 1.0
                alpha = max(alpha, *(late if late is not None else lk.latency for lk in links))
                if share / bw > per_byte:
                    per_byte = share / bw
                    bound = f"{links[0].kind} at {bw / 1e9:.1f} GB/s per device"
            if len(parts) > 1:
                egress = topo.node_egress(node, members, concurrent=concurrent)
                alpha = max(alpha, topo.link(members[0], next(
                    d for d in g if topo.node_of(d) is not topo.nodes[node])).latency)
                if 1 / egress > per_byte:
                    per_byte = 1 / egress
                    bound = f"network at {egress / 1e9:.1f} GB/s out of node " \
                            f"{topo.nodes[node].name}"
        steps = factor * (n - 1)
        gamma = (n - 1) / n * nbytes * self._gamma(g, concurrent)
        return Estimate("ring", steps * alpha, volume * per_byte,
                        gamma if reduce else 0.0, bound)

    def _steps(self, algorithm: str, steps: Steps, g: list[int],
               concurrent: int) -> Estimate:
        """Walk a step algorithm: each step's pairs exchange ``nbytes`` at once; the step
        lasts as long as its slowest pair, and the ranks leaving a node share its NICs."""
        topo = self.topology
        gamma = self._gamma(g, concurrent)
        crowd = self._crowding(g, concurrent)
        node = {d: topo.node_index(d) for d in g}
        lat = xfer = red = 0.0
        worst, bound = 0.0, ""
        for pairs, nbytes, reduces in steps:
            leaving: dict[int, set[int]] = {}
            for a, b in pairs:
                if node[a] != node[b]:
                    leaving.setdefault(node[a], set()).add(a)
                    leaving.setdefault(node[b], set()).add(b)
            rate = {k: topo.node_egress(k, sorted(out), concurrent=concurrent) / len(out)
                    for k, out in leaving.items()}
            step_lat = step_x = 0.0
            kind = ""
            seen: set[tuple[int, int, int, int]] = set()
            for a, b in pairs:
                same = node[a] == node[b]
                key = (node[a], node[b], -1, -1) if not same else (
                    node[a], node[a], topo.local_index(a), topo.local_index(b))
                if key in seen:
                    continue
                seen.add(key)
                if not same:
                    lk = topo.net_link(topo.nodes[node[a]], topo.nodes[node[b]])
                    bw = min(lk.bandwidth, rate[node[a]], rate[node[b]])
                else:
                    lk = topo.link(a, b)
                    slow, late = crowd[node[a]]
                    bw = lk.bandwidth / slow
                    if late is not None:
                        lk = Link(lk.kind, lk.bandwidth, late)
                step_lat = max(step_lat, lk.latency)
                if nbytes / bw >= step_x:
                    step_x, kind = nbytes / bw, f"{lk.kind} at {bw / 1e9:.1f} GB/s per device"
            lat += step_lat
            xfer += step_x
            red += nbytes * gamma if reduces else 0.0
            if step_x > worst:
                worst, bound = step_x, kind
        return Estimate(algorithm, lat, xfer, red, bound or "latency")

    def _shm(self, nbytes: float, g: list[int], concurrent: int) -> Estimate:
        """The shared-memory all-reduce of ``fuelspmd_mpi``, with the input placed in a
        lent area of the shared window, as the lazy graph places it (the ``lend``
        capability).

        Two phase syncs (``ceil(log2 n)`` latencies each) and a fixed per-call overhead;
        each rank writes its reduced ``N/n`` once and copies ``(n-1)/n N`` out, ``N`` of
        copies, at twice the fabric's bandwidth (an MPI byte sent through shared memory is
        copied twice, into the shared queue and out); the fold of ``(n-1)/n N`` bytes costs
        what the ring's does. The overhead is the ranks' own CPU work, so ranks that
        outnumber the cores stretch it as they stretch the copies (``Node.crowding``).
        An input the caller keeps in its own buffer is copied in first, ``(n-1)/n N``
        more; the graph places every all_reduce input and bucket it can, so the plan
        prices the placed path.
        """
        n = len(g)
        node = self.topology.nodes[self.topology.node_index(g[0])]
        slow, late = node.crowding(n * concurrent)
        alpha = late if late is not None else node.fabric.latency
        latency = 2 * math.ceil(math.log2(n)) * alpha + SHM_CALL_OVERHEAD_S * slow
        transfer = nbytes * slow / (2 * node.fabric.bandwidth)
        reduce = (n - 1) / n * nbytes * self._gamma(g, concurrent)
        return Estimate("shm", latency, transfer, reduce,
                        f"memory copies at {2 * node.fabric.bandwidth / slow / 1e9:.1f} GB/s")

    def shm_min_bytes(self, group: Sequence[int], *, concurrent: int = 1,
                      largest: int = 1 << 34) -> int | None:
        """The smallest power-of-two all-reduce size at which to switch the shm path on:
        where the alpha-beta estimate of shm first beats every default algorithm.

        The MPI transport's ``set_all_reduce_policy(algorithm="shm", min_bytes=...)`` takes
        it; None when shm never wins up to ``largest`` (or the group is not one CPU node).
        """
        members = self._group("all_reduce", group)
        if "shm" not in self.algorithms("all_reduce", members, opt_in=True):
            return None
        nbytes = 1
        while nbytes <= largest:
            if self.best_algorithm("all_reduce", nbytes, members, concurrent=concurrent,
                                   opt_in=True).algorithm == "shm":
                return nbytes
            nbytes *= 2
        return None

    def _hierarchical(self, collective: str, nbytes: float, g: list[int],
                      concurrent: int) -> Estimate:
        """Intra-node reduce-scatter, inter-node ``collective`` per rail, intra all-gather."""
        parts = list(self.topology.by_node(g).values())
        per_node = len(parts[0])
        rails = [[p[i] for p in parts] for i in range(per_node)]
        inner = concurrent * per_node  # the rails of this group share each node's NICs
        stages: list[Estimate] = []
        if collective in ("all_reduce", "reduce_scatter"):
            stages.append(self.estimate("reduce_scatter", nbytes, parts[0], algorithm="ring",
                                        concurrent=concurrent))
        inter = "all_reduce" if collective == "all_reduce" else collective
        stages.append(self.estimate(inter, nbytes / per_node, rails[0], concurrent=inner))
        if collective in ("all_reduce", "all_gather"):
            stages.append(self.estimate("all_gather", nbytes, parts[0], algorithm="ring",
                                        concurrent=concurrent))
        slowest = max(stages, key=lambda e: e.seconds)
        return Estimate("hierarchical", sum(e.latency for e in stages),
                        sum(e.transfer for e in stages), sum(e.reduce for e in stages),
                        f"{slowest.algorithm} stage: {slowest.bound}")


# ----- step schedules: (pairs exchanging at once, bytes each way, whether they reduce) ----


def _fold(g: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The largest power-of-two subset and the (extra, partner) pairs folded into it."""
    p = 1 << (len(g).bit_length() - 1)
    extra = len(g) - p
    return g[:p], [(g[p + i], g[i]) for i in range(extra)]


def _halving(g: list[int], nbytes: float) -> Steps:
    core, folds = _fold(g)
    steps: Steps = [(folds, nbytes, True)] if folds else []
    d, size = len(core) // 2, nbytes / 2
    while d >= 1:
        steps.append(([(core[i], core[i ^ d]) for i in range(len(core)) if i < i ^ d],
                      size, True))
        d, size = d // 2, size / 2
    return steps


def _doubling_gather(g: list[int], nbytes: float) -> Steps:
    core, folds = _fold(g)
    steps: Steps = []
    d, size = 1, nbytes / len(core)
    while d < len(core):
        steps.append(([(core[i], core[i ^ d]) for i in range(len(core)) if i < i ^ d],
                      size, False))
        d, size = d * 2, size * 2
    return steps + ([(folds, nbytes, False)] if folds else [])


def _doubling_full(g: list[int], nbytes: float) -> Steps:
    core, folds = _fold(g)
    steps: Steps = [(folds, nbytes, True)] if folds else []
    d = 1
    while d < len(core):
        steps.append(([(core[i], core[i ^ d]) for i in range(len(core)) if i < i ^ d],
                      nbytes, True))
        d *= 2
    return steps + ([(folds, nbytes, False)] if folds else [])


def _binomial(g: list[int], nbytes: float) -> Steps:
    steps: Steps = []
    d = 1
    while d < len(g):
        steps.append(([(g[i], g[i + d]) for i in range(d) if i + d < len(g)], nbytes, False))
        d *= 2
    return steps


def _binomial_scatter(g: list[int], nbytes: float) -> Steps:
    steps: Steps = []
    d = 1 << max(0, (len(g) - 1).bit_length() - 1)
    while d >= 1:
        steps.append(([(g[i], g[i + d]) for i in range(0, len(g), 2 * d) if i + d < len(g)],
                      nbytes * d / len(g), False))
        d //= 2
    return steps


def _ring_steps(g: list[int], nbytes: float) -> Steps:
    n = len(g)
    return [([(g[i], g[(i + 1) % n]) for i in range(n)], nbytes / n, False)] * (n - 1)


def _pairwise(g: list[int], nbytes: float) -> Steps:
    n = len(g)
    return [([(g[i], g[(i + k) % n]) for i in range(n)], nbytes / n, False)
            for k in range(1, n)]
