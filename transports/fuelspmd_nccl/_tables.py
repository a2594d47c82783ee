"""How fuelspmd dtypes and reduce ops map onto NCCL, as plain data (no cupy, no NCCL).

The codes are NCCL's own ``ncclDataType_t`` and ``ncclRedOp_t`` values from ``nccl.h``,
fixed ABI since NCCL 2.10 (bfloat16 and avg arrived in 2.10). cupy's ``cupy.cuda.nccl``
takes them as plain ints, so the table holds ints; a unit test checks them against
cupy's ``NCCL_*`` constants wherever cupy is installed.

Moving bytes (all_gather, broadcast, all_to_all, send, recv) never looks at values, so
bool travels as uint8. Reductions:

- float16, bfloat16, float32, float64, int32, int64: NCCL's own sum/prod/min/max in the
  buffer's type. Unlike the MPI transport, which reduces 16-bit floats in float32, NCCL
  accumulates 16-bit floats in their own type along its ring or tree: with ``n`` ranks a
  16-bit sum may differ from the float32-accumulated one by up to about ``n`` roundings.
- bool: uint8 max is OR (sum, max), uint8 min is AND (prod, min): bools are 0 or 1.
- avg: floats use ``ncclAvg`` (the sum scaled by 1/size in the reduction, NCCL >= 2.10);
  int32/int64 are summed and then floor-divided by the size on the same stream (numpy's
  ``//``: what the MPI and local transports give); bool is refused (DTypeError).
"""

from __future__ import annotations

from dataclasses import dataclass

from fuelspmd.errors import DTypeError
from fuelspmd.transport import ReduceOp

__all__ = ["AVG_MIN_VERSION", "NCCL_DTYPES", "NCCL_OPS", "NcclPlan", "plan_for"]

# ncclDataType_t (nccl.h): ncclInt8=0 ncclUint8=1 ncclInt32=2 ncclUint32=3 ncclInt64=4
# ncclUint64=5 ncclFloat16=6 ncclFloat32=7 ncclFloat64=8 ncclBfloat16=9
NCCL_DTYPES: dict[str, int] = {
    "bool": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8,
    "bfloat16": 9,
}
# ncclRedOp_t: ncclSum=0 ncclProd=1 ncclMax=2 ncclMin=3 ncclAvg=4
NCCL_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4,
}
_BOOL_OPS = {ReduceOp.SUM: 2, ReduceOp.MAX: 2, ReduceOp.PROD: 3, ReduceOp.MIN: 3}
AVG_MIN_VERSION = (2, 10, 0)  # ncclAvg and ncclBfloat16


@dataclass(frozen=True, slots=True)
class NcclPlan:
    """One (dtype, op) pair on NCCL: the type and op codes, and whether to floor-divide
    the sum by the group size afterwards (integer avg, or avg on an NCCL without ncclAvg)."""

    datatype: int
    op: int
    divide: bool


def plan_for(dtype_name: str, op: ReduceOp, *, version: tuple[int, int, int],
             where: str) -> NcclPlan:
    """Return how ``op`` over a ``dtype_name`` buffer runs on NCCL ``version``.

    DTypeError for a dtype NCCL cannot take, avg over bool, and bfloat16 on an NCCL older
    than 2.10, each with the fix.
    """
    dt = NCCL_DTYPES.get(dtype_name)
    if dt is None:
        raise DTypeError(f"{where}: NCCL takes {sorted(NCCL_DTYPES)}, not {dtype_name}; "
                         f"cast the buffer to one of them")
    if dtype_name == "bfloat16" and version < AVG_MIN_VERSION:
        raise DTypeError(f"{where}: bfloat16 needs NCCL >= 2.10, this one is "
                         f"{'.'.join(map(str, version))}; pip install -U nvidia-nccl-cu12")
    if dtype_name == "bool":
        if op is ReduceOp.AVG:
            raise DTypeError(f"{where}: avg is not defined for bool buffers; use 'sum' "
                             f"(logical or) or 'prod' (logical and), or cast to a number")
        return NcclPlan(dt, _BOOL_OPS[op], False)
    if op is ReduceOp.AVG:
        native = dtype_name.startswith(("float", "bfloat")) and version >= AVG_MIN_VERSION
        if not native:
            return NcclPlan(dt, NCCL_OPS[ReduceOp.SUM], True)
    return NcclPlan(dt, NCCL_OPS[op], False)
