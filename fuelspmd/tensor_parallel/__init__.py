"""Tensor parallelism (layer 7): Megatron-style layers over any Communicator.

The same layer objects run with ``world.comm`` (processes under mpiexec or srun) and with
a ``DeviceGroup``'s communicators (devices of one process); at size 1 every mapping is
free. Every layer is a :class:`fuelspmd.nn.Module` whose parameters carry their sharding.
Parts: :mod:`.mappings` (the conjugate pairs), :mod:`.layers` (column/row linear, MLP),
:mod:`.attention`, :mod:`.vocab` (embedding, LM head and cross-entropy).
"""

from __future__ import annotations

from fuelspmd.nn import seeded_weight

from .attention import MASKED, KVCache, ParallelAttention, causal_mask
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear, check_divides
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from .vocab import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "MASKED",
    "ColumnParallelLinear",
    "KVCache",
    "ParallelAttention",
    "ParallelLMHead",
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
