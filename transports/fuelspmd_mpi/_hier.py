"""The hierarchical all-reduce: through the nodes' own ranks first, then across nodes.

For a group of ``m`` nodes holding ``G`` of its ranks each (``n = m G``), split once into

- ``intra``: the ranks of one node (``G``), in group rank order, and
- ``inter``: the ranks with the same index within their node (``m``, one "rail"),

an all-reduce of ``N`` bytes is an intra-node reduce-scatter (each rank gets the sum over
its node of one ``N/G`` slice), an inter-node all-reduce of that slice over its rail, and
an intra-node all-gather of the slices. Each byte crosses the network once per rail,
``N/G`` per rank instead of the ring's ``2 (n-1)/n N`` through every rank, which is what
wins when the network is much slower than the node (:mod:`fuelspmd.cost`, hierarchical).

The three steps are MPI's own non-blocking collectives, each waited under the transport's
deadline (a rank that never joins gives CommTimeoutError naming the step); the slices are
:func:`~fuelspmd_mpi._work.slices` of ``count`` over ``G``. Results: the association
differs from MPI's single all-reduce, so floats agree to rounding, integers exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fuelspmd_mpi._work import MPIWork, ReducePlan, divide, slices

__all__ = ["Hierarchical"]


class Hierarchical:
    """The split communicators of one group and its hierarchical all-reduce."""

    def __init__(self, intra: Any, inter: Any, *, MPI: Any, owner: Any) -> None:
        self._MPI, self._owner = MPI, owner
        self.intra, self.inter = intra, inter

    @classmethod
    def create(cls, comm: Any, *, MPI: Any, owner: Any,
               nodes: Sequence[int] | None = None) -> Hierarchical | None:
        """Split ``comm`` by node (``nodes[rank]``, else MPI's shared-memory split); None, on
        every rank alike, when the group is on one node or its nodes hold different numbers
        of its ranks. Collective over ``comm``."""
        rank = comm.Get_rank()
        if nodes is None:
            intra = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            intra = comm.Split(int(nodes[rank]), rank)
        inter = comm.Split(intra.Get_rank(), rank)
        sizes = np.array([intra.Get_size(), -intra.Get_size(), inter.Get_size()], np.int64)
        comm.Allreduce(MPI.IN_PLACE, sizes, MPI.MAX)
        if sizes[0] != -sizes[1] or sizes[2] < 2 or sizes[0] < 2:
            intra.Free()
            inter.Free()
            return None
        return cls(intra, inter, MPI=MPI, owner=owner)

    def all_reduce(self, buf: np.ndarray, plan: ReducePlan, seq: int,
                   watch: Callable[[], None] | None = None) -> None:
        """Reduce the C-contiguous ``buf`` over the group in place; blocking, each step's
        wait calling ``watch`` every slice (see ``MPITransport.all_reduce``)."""
        flat = buf.reshape(-1)
        g, r = self.intra.Get_size(), self.intra.Get_rank()
        displs = slices(flat.size, g)
        counts = [displs[k + 1] - displs[k] for k in range(g)]
        dt = plan.datatype
        piece = np.empty(counts[r], flat.dtype)
        owner = self._owner
        MPIWork(self.intra.Ireduce_scatter([flat, dt], [piece, dt], counts, plan.mpi_op),
                owner, "all_reduce (hierarchical: intra-node reduce_scatter)", seq,
                keep=(flat, piece)).wait(watch=watch)
        if piece.size:
            MPIWork(self.inter.Iallreduce(self._MPI.IN_PLACE, [piece, dt], plan.mpi_op),
                    owner, "all_reduce (hierarchical: inter-node all_reduce)", seq,
                    keep=piece).wait(watch=watch)
        MPIWork(self.intra.Iallgatherv([piece, dt], [flat, (counts, displs[:g]), dt]),
                owner, "all_reduce (hierarchical: intra-node all_gather)", seq,
                keep=(flat, piece)).wait(watch=watch)
        if plan.avg:
            divide(buf, owner.size)

    def free(self) -> None:
        """Free both communicators (collective over the group)."""
        self.intra.Free()
        self.inter.Free()
