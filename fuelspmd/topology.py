"""Where the devices of a job are and how fast they reach each other.

Layer 5, pure policy: this module touches no tensor and no transport. A :class:`Topology`
is a list of nodes; each node holds ``devices`` devices joined by one intra-node
``fabric`` (NVLink through NVSwitch, PCIe, or shared memory between CPU processes), and
``nics`` network interfaces to the other nodes. Every link is two numbers, the alpha and
beta of the cost model (:mod:`fuelspmd.cost`): a latency in seconds per message and a
bandwidth in bytes per second, one direction, that *one device* can push through it.

Why a fabric per node and not a link per pair: on the machines that matter (DGX/HGX with
NVSwitch, CPU processes over shared memory) every device of a node reaches every other at
the same rate, and what limits a collective is how fast each device injects into the
fabric. Machines whose GPUs are wired pair by pair (no switch) list those pairs in
``Node.pairs``; a pair's link then overrides the fabric.

Devices are numbered node-major: node 0's devices first, in local order. A device uses
NIC ``local * nics // devices`` of its node (rail-aligned, as on DGX systems where each
GPU has its own NIC).

A topology is built three ways: :func:`detect` from a running world (host names gathered
by ``fs.init()``, GPUs queried through nvidia-ml-py when present), :meth:`Topology.load`
from a declaration file (JSON; the ones shipped live in ``fuelspmd/topologies/``), or
:meth:`Topology.uniform` in code.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fuelspmd.errors import ConfigError

__all__ = [
    "Accelerator",
    "Link",
    "Node",
    "Topology",
    "WorldLike",
    "cpu_cores",
    "declared",
    "detect",
]

KINDS = ("nvlink", "pcie", "shm", "net")
_DECLARED = Path(__file__).resolve().parent / "topologies"

# Shared memory between CPU processes when nothing was calibrated: MPICH's 2-rank
# Allreduce on a small CPU node, a bus bandwidth of a few GB/s and a latency of a couple
# of microseconds; one process sums two buffers at about half its copy rate
# (``fuelspmd bench calibrate`` replaces all three; docs/performance.md gives a run).
SHM_DEFAULT = {"bandwidth": 2.2e9, "latency": 1.2e-6, "reduce_bandwidth": 6.0e9}
# Between nodes when nothing is declared: one 100 Gb/s Ethernet port, a few microseconds.
NET_DEFAULT = {"bandwidth": 100e9 / 8 * 0.95, "latency": 5e-6}
# PCIe 4.0 x16 between GPUs without NVLink: NCCL's topology code counts 24 GB/s.
PCIE_DEFAULT = {"bandwidth": 24e9, "latency": 3e-6}


@dataclass(frozen=True, slots=True)
class Link:
    """One class of link: ``latency`` seconds per message (alpha), ``bandwidth`` bytes/s
    one direction per device (1 / beta). Moving ``n`` bytes costs ``latency + n / bandwidth``.
    """

    kind: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"link kind {self.kind!r} is not one of {list(KINDS)}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ConfigError(f"{self.kind} link bandwidth must be a positive number of "
                              f"bytes/s, got {self.bandwidth}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ConfigError(f"{self.kind} link latency must be >= 0 seconds, "
                              f"got {self.latency}")

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link once: alpha + n * beta."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, slots=True)
class Accelerator:
    """What the planner needs of a device: peak FLOP/s, memory bytes and memory bandwidth."""

    model: str
    peak_flops: float
    memory: float
    memory_bandwidth: float


@dataclass(frozen=True)
class Node:
    """A host: ``devices`` devices on one ``fabric``, ``nics`` network interfaces of ``nic``.

    ``reduce_bandwidth`` is how many bytes per second one device folds into a buffer when a
    reduction adds two of them (gamma = 1 / reduce_bandwidth); ``None`` when the reduction is
    fused into the copy, as in NCCL's kernels, and costs nothing extra.

    ``cores`` (CPU nodes): when more ranks are busy than there are cores, they share them, so
    each rank's copy and reduce rates shrink by ``cores / busy`` and every message waits for
    the peer to be scheduled, ``oversubscribed_latency`` seconds instead of the fabric's.
    """

    name: str
    devices: int
    fabric: Link
    nics: int = 0
    nic: Link | None = None
    accelerator: Accelerator | None = None
    reduce_bandwidth: float | None = None
    pairs: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    cores: int | None = None
    oversubscribed_latency: float | None = None

    def crowding(self, busy: int) -> tuple[float, float | None]:
        """(slowdown of copy and reduce rates, latency override) with ``busy`` ranks."""
        if self.cores is None or busy <= self.cores:
            return 1.0, None
        return busy / self.cores, self.oversubscribed_latency

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"node {self.name!r} needs at least 1 device, got {self.devices}")
        if self.nics < 0 or (self.nics > 0 and self.nic is None):
            raise ConfigError(f"node {self.name!r}: {self.nics} NICs need a nic Link")

    def nic_of(self, local: int) -> int:
        """The NIC local device ``local`` sends through (rail-aligned round robin)."""
        return local * self.nics // self.devices if self.nics else -1


class WorldLike(Protocol):
    """The part of ``fs.init()``'s World that :func:`detect` reads."""

    rank: int
    size: int
    nodes: list[str]


@dataclass(frozen=True, slots=True)
class _Place:
    node: int
    local: int


class Topology:
    """Nodes, their devices and links; devices are numbered node-major from 0."""

    def __init__(self, nodes: Sequence[Node], *, network: Link | None = None,
                 name: str = "") -> None:
        if not nodes:
            raise ConfigError("a topology needs at least one node")
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ConfigError(f"node names must be distinct, got {names}")
        if len(nodes) > 1 and network is None and any(n.nic is None for n in nodes):
            raise ConfigError(f"{len(nodes)} nodes need a network: give network= or a nic "
                              "on every node")
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.network = network
        self.name = name
        self._places = [_Place(i, j) for i, n in enumerate(nodes) for j in range(n.devices)]

    @property
    def size(self) -> int:
        """Count the devices."""
        return len(self._places)

    def node_of(self, device: int) -> Node:
        """The node that holds ``device``."""
        return self.nodes[self._place(device).node]

    def local_index(self, device: int) -> int:
        """``device``'s index within its node."""
        return self._place(device).local

    def node_index(self, device: int) -> int:
        """The index in ``nodes`` of the node that holds ``device``."""
        return self._place(device).node

    def _place(self, device: int) -> _Place:
        if not 0 <= device < self.size:
            raise ConfigError(f"device {device} is not in this topology of {self.size} "
                              f"devices (0..{self.size - 1})")
        return self._places[device]

    def link(self, a: int, b: int) -> Link:
        """The link ``a`` sends to ``b`` through: a node's pair link or fabric, or the
        network (the slower of the NIC and the declared network) between nodes."""
        pa, pb = self._place(a), self._place(b)
        if pa.node == pb.node:
            node = self.nodes[pa.node]
            pair = node.pairs.get((min(pa.local, pb.local), max(pa.local, pb.local)))
            return pair if pair is not None else node.fabric
        return self.net_link(self.nodes[pa.node], self.nodes[pb.node])

    def net_link(self, a: Node, b: Node) -> Link:
        """The link between nodes ``a`` and ``b``: the slower of their NICs and the network."""
        links = [x for x in (a.nic, b.nic, self.network) if x is not None]
        if not links:
            raise ConfigError(f"nodes {a.name!r} and {b.name!r} have no network between them; "
                              "declare network= or a nic on both")
        return Link("net", min(x.bandwidth for x in links), max(x.latency for x in links))

    def by_node(self, group: Sequence[int]) -> dict[int, list[int]]:
        """Split ``group`` by node index, each part in device order (node-major overall)."""
        parts: dict[int, list[int]] = {}
        for d in sorted(group):
            parts.setdefault(self._place(d).node, []).append(d)
        return parts

    def node_egress(self, node: int, members: Sequence[int], *, concurrent: int = 1) -> float:
        """Bytes/s ``members`` (devices of node ``node``) can send off the node together.

        Each member sends through its own NIC (rail-aligned); members sharing a NIC share
        it. ``concurrent`` like groups running at once on the same node split the node's
        NICs between them, so a group never gets more than ``nics * nic / concurrent``.
        """
        n = self.nodes[node]
        net = self.net_link(n, n) if (n.nic or self.network) else None
        if net is None:
            raise ConfigError(f"node {n.name!r} has no NIC and no network is declared; give it "
                              "a nic Link or declare network=")
        if n.nics == 0:
            return net.bandwidth / concurrent
        used = {n.nic_of(self._place(d).local) for d in members}
        return min(len(used) * net.bandwidth, n.nics * net.bandwidth / concurrent)

    # ----- building ------------------------------------------------------------------------

    @classmethod
    def uniform(cls, *, nodes: int, devices_per_node: int, fabric: Link, nics: int = 0,
                nic: Link | None = None, network: Link | None = None,
                accelerator: Accelerator | None = None, reduce_bandwidth: float | None = None,
                name: str = "", node_names: Sequence[str] | None = None) -> Topology:
        """``nodes`` identical nodes of ``devices_per_node`` devices each."""
        if nodes < 1 or devices_per_node < 1:
            raise ConfigError(f"a uniform topology needs nodes >= 1 and devices_per_node >= 1, "
                              f"got {nodes} and {devices_per_node}")
        names = list(node_names) if node_names is not None else [f"node{i}" for i in range(nodes)]
        if len(names) != nodes:
            raise ConfigError(f"{len(names)} node names given for {nodes} nodes; give one name "
                              "per node")
        return cls([Node(nm, devices_per_node, fabric, nics, nic, accelerator, reduce_bandwidth)
                    for nm in names], network=network, name=name)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Topology:
        """Build a uniform topology from a declaration (the JSON format of ``load``)."""
        try:
            nodes = int(spec.get("nodes", 1))
            per_node = int(spec["devices_per_node"])
            fabric = _link(spec["fabric"])
            nic_spec = spec.get("nic")
            acc = spec.get("accelerator")
        except KeyError as e:
            raise ConfigError(f"topology declaration lacks {e.args[0]!r}; it needs "
                              "'devices_per_node' and 'fabric' (see docs/topology.md)") from None
        return cls.uniform(
            nodes=nodes, devices_per_node=per_node, fabric=fabric,
            nics=int(nic_spec.get("count", 1)) if nic_spec else 0,
            nic=_link(nic_spec, "net") if nic_spec else None,
            network=_link(spec["network"], "net") if "network" in spec else None,
            accelerator=Accelerator(acc["model"], float(acc["peak_tflops"]) * 1e12,
                                    float(acc["memory_gib"]) * 2**30,
                                    float(acc["memory_bandwidth_gbs"]) * 1e9) if acc else None,
            reduce_bandwidth=(float(spec["reduce_bandwidth_gbs"]) * 1e9
                              if "reduce_bandwidth_gbs" in spec else None),
            name=str(spec.get("name", "")))

    @classmethod
    def load(cls, source: str | Path, *, nodes: int | None = None) -> Topology:
        """Load a declaration: a JSON file's path, or the name of a shipped one
        (``declared()`` lists them). ``nodes`` overrides the declared node count, so one
        file describes a cluster of any size."""
        path = Path(source)
        if not path.suffix:
            path = _DECLARED / f"{source}.json"
        if not path.is_file():
            raise ConfigError(f"no topology declaration at {str(path)!r}; give a JSON file or "
                              f"one of the shipped names {declared()}")
        try:
            spec = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if nodes is not None:
            spec = {**spec, "nodes": nodes}
        return cls.from_dict(spec)

    # ----- printing ------------------------------------------------------------------------

    def table(self) -> str:
        """A text table of nodes, devices and link classes (what ``fuelspmd info
        --topology`` prints)."""
        head = f"topology {self.name or '(detected)'}: {len(self.nodes)} node(s), " \
               f"{self.size} device(s)"
        rows = [("nodes", "devices", "fabric", "GB/s/dev", "lat us", "NICs", "GB/s/NIC", "device")]
        first = 0
        runs: list[list[Node]] = []  # consecutive alike nodes print as one row
        for n in self.nodes:
            if runs and _alike(runs[-1][0], n):
                runs[-1].append(n)
            else:
                runs.append([n])
        for run in runs:
            n, count = run[0], sum(x.devices for x in run)
            nic = n.nic or self.network
            label = n.name if len(run) == 1 else f"{n.name}..{run[-1].name} ({len(run)} nodes)"
            rows.append((label, f"{first}-{first + count - 1}", n.fabric.kind,
                         f"{n.fabric.bandwidth / 1e9:.1f}", f"{n.fabric.latency * 1e6:.2f}",
                         str(n.nics), f"{nic.bandwidth / 1e9:.1f}" if nic else "-",
                         n.accelerator.model if n.accelerator else "-"))
            first += count
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                          for r in rows]
        if len(self.nodes) > 1:
            net = self.net_link(self.nodes[0], self.nodes[1])
            lines.append(f"between nodes: {net.bandwidth / 1e9:.1f} GB/s per NIC, "
                         f"{net.latency * 1e6:.2f} us")
        for n in self.nodes:
            for (i, j), lk in sorted(n.pairs.items()):
                lines.append(f"{n.name}: local {i}<->{j} {lk.kind} {lk.bandwidth / 1e9:.1f} GB/s")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, nodes={len(self.nodes)}, devices={self.size})"


def _alike(a: Node, b: Node) -> bool:
    return (a.devices, a.fabric, a.nics, a.nic, a.accelerator, dict(a.pairs)) == (
        b.devices, b.fabric, b.nics, b.nic, b.accelerator, dict(b.pairs))


def _link(spec: Mapping[str, Any], kind: str | None = None) -> Link:
    """A Link from a declaration: bandwidth from ``bandwidth_gbs`` (GB/s) or ``rate_gbps``
    (Gbit/s line rate), times ``links`` parallel links, times ``efficiency`` (payload per
    wire byte); ``latency_us`` in microseconds."""
    if "bandwidth_gbs" in spec:
        per_link = float(spec["bandwidth_gbs"]) * 1e9
    elif "rate_gbps" in spec:
        per_link = float(spec["rate_gbps"]) * 1e9 / 8
    else:
        raise ConfigError(f"link {dict(spec)} needs 'bandwidth_gbs' or 'rate_gbps'")
    bw = per_link * float(spec.get("links", 1)) * float(spec.get("efficiency", 1.0))
    return Link(kind or str(spec.get("kind", "net")), bw, float(spec.get("latency_us", 0)) * 1e-6)


def declared() -> list[str]:
    """Names of the topology declarations shipped with fuelspmd."""
    return sorted(p.stem for p in _DECLARED.glob("*.json"))


def detect(world: WorldLike, *, calibration: Mapping[str, Any] | None = None,
           network: Link | None = None) -> Topology:
    """Build the topology of a running job: one device per rank, grouped by host name.

    Every rank computes the same answer from ``world.nodes``. GPUs (when nvidia-ml-py sees
    any) are joined by NVLink when GPU 0 of this host has active links, counted at NCCL's
    per-link payload rate and treated as NVSwitch (every GPU reaches every other), by PCIe
    otherwise; CPU ranks by shared memory, with alpha, beta, gamma and the oversubscribed
    latency from ``calibration`` (the dictionary :func:`fuelspmd.cost.load_calibration`
    returns) or the built-in defaults, and this process's core count. Nodes are assumed
    alike: only this host is queried. Between nodes: ``network``, else one 100 Gb/s NIC per
    node (nothing in a running job says what the network is; declare it to plan with it).
    """
    if len(world.nodes) != world.size:
        raise ConfigError(f"world.nodes has {len(world.nodes)} host names for a world of "
                          f"{world.size}; pass the World from fs.init()")
    counts = {h: world.nodes.count(h) for h in dict.fromkeys(world.nodes)}
    if list(world.nodes) != [h for h in counts for _ in range(counts[h])]:
        raise ConfigError(f"ranks are not grouped by host ({world.nodes}); launch with "
                          "consecutive ranks per host (mpiexec's default block placement)")
    gpu = _nvml_fabric()
    cal = dict(SHM_DEFAULT) | dict((calibration or {}).get("shm", {}))
    net = network or Link("net", NET_DEFAULT["bandwidth"], NET_DEFAULT["latency"])
    if gpu is not None:
        nodes = [Node(h, c, gpu[0], 1, net, gpu[1]) for h, c in counts.items()]
    else:
        fabric = Link("shm", float(cal["bandwidth"]), float(cal["latency"]))
        crowded = cal.get("oversubscribed_latency")
        nodes = [Node(h, c, fabric, 1, net, None, float(cal["reduce_bandwidth"]),
                      cores=cpu_cores(), oversubscribed_latency=(
                          float(crowded) if crowded is not None else None))
                 for h, c in counts.items()]
    return Topology(nodes, network=None, name="detected")


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _nvml_fabric() -> tuple[Link, Accelerator | None] | None:
    """Query this host's GPUs through nvidia-ml-py: (fabric link, accelerator), or None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        model = pynvml.nvmlDeviceGetName(handle)
        model = model.decode() if isinstance(model, bytes) else str(model)
        memory = float(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        links = 0
        for i in range(18):  # NVML_NVLINK_MAX_LINKS
            try:
                links += int(pynvml.nvmlDeviceGetNvLinkState(handle, i) == 1)
            except pynvml.NVMLError:
                break
        # NCCL's per-link figures (src/graph/topo.h): 20.6 GB/s for Hopper, 20 for older.
        per_link = 20.6e9 if "H100" in model or "H200" in model or "H20" in model else 20e9
        fabric = (Link("nvlink", links * per_link, 1e-6) if links
                  else Link("pcie", PCIE_DEFAULT["bandwidth"], PCIE_DEFAULT["latency"]))
        # Peak FLOP/s is not in NVML; the planner takes it from a declaration instead.
        acc = Accelerator(model, float("nan"), memory, float("nan"))
        return fabric, acc
    finally:
        pynvml.nvmlShutdown()
