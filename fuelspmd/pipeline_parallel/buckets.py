"""Data-parallel gradient buckets for :class:`~fuelspmd.pipeline_parallel.PipelineExecutor`.

Layer 7. A rank's gradients of chunk ``j`` are final at the last backward (``B``, or ``W``
in a split schedule) of its last micro-batch; their average over ``dp`` goes into that
action's graph, one lazy ``all_reduce`` per gradient, last parameter first (the backward
finishes the last layer's gradients first). The executor's dp Communicator buckets
(``bucket_bytes``): the planner's one bucket rule packs consecutive all-reduces into one
transport call and starts each bucket as soon as its last gradient is computed, so bucket
``k`` travels while bucket ``k + 1``'s gradients (and the input gradient) are computed.

Why ``DP_BUCKET_BYTES = 1 MiB`` rather than DDP's 25 MiB: DDP's size fits GPUs, where
25 MiB is a fraction of a millisecond at NCCL bandwidths. Over host shared memory, at a
few GB/s, 1 MiB already costs several times the fixed cost of one lazy collective (tens
of microseconds of Python and latency), and it still cuts a few-MiB stage into several
buckets that can overlap its backward.
"""

from __future__ import annotations

from fuelspmd.errors import ConfigError

__all__ = ["DP_BUCKET_BYTES", "check_bucket_bytes"]

DP_BUCKET_BYTES = 1 << 20


def check_bucket_bytes(bucket_bytes: object) -> None:
    """Refuse a bucket size that is not a positive int (whether or not dp is used)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ConfigError(f"PipelineExecutor(bucket_bytes={bucket_bytes!r}): give a "
                          f"positive byte count, e.g. {DP_BUCKET_BYTES} (1 MiB)")
