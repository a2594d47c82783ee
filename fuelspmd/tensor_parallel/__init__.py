"""Tensor parallelism (layer 7): Megatron-style layers over any Communicator.

The same layer objects run with ``world.comm`` (processes under mpiexec or srun) and with
a ``DeviceGroup``'s communicators (devices of one process); at size 1 every mapping is
free. Parts: :mod:`.mappings` (the conjugate pairs), :mod:`.layers` (column/row linear,
MLP), :mod:`.attention`, :mod:`.vocab` (embedding and cross-entropy).
"""

from __future__ import annotations

from .attention import ParallelAttention, causal_mask
from .layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    check_divides,
    seeded_weight,
)
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "ParallelAttention",
    "ParallelMLP",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "causal_mask",
    "check_divides",
    "copy_to_tp",
    "gather_from_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "seeded_weight",
    "vocab_parallel_cross_entropy",
]
