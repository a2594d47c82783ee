"""The shared-memory all-reduce's fold, in one process: the left fold in rank order, into
a rank's own input (the aliasing the scratch buffer exists for), piece by piece."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from fuelspmd.transport import ReduceOp
from fuelspmd_mpi._shm import fold, fold_piece
from fuelspmd_mpi._work import UFUNCS


def _left_fold(xs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    out = functools.reduce(UFUNCS[op], [x.copy() for x in xs])
    if op is ReduceOp.AVG:
        out = out // len(xs) if out.dtype.kind == "i" else out / len(xs)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("dt", ["float32", "int64"])
def test_fold_piece_into_a_ranks_own_input_is_the_left_fold(n: int, op: ReduceOp,
                                                             dt: str) -> None:
    rng = np.random.default_rng(n)
    xs = [rng.integers(-50, 50, 1001).astype(dt) for _ in range(n)]
    want = _left_fold(xs, op)
    for r in range(n):  # the result lands in rank r's input, which the fold also reads
        srcs = [x.copy() for x in xs]
        tmp = np.empty(1001, dt) if n > 2 else None
        got = fold_piece(srcs, UFUNCS[op], op is ReduceOp.AVG, srcs[r], tmp)
        np.testing.assert_array_equal(srcs[r], want)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [2, 3])
def test_fold_of_a_slice_in_pieces_writes_also_and_every_dest(n: int) -> None:
    count = (1 << 17) + 77  # float32: several cache-sized pieces and a short one
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    want = _left_fold(xs, ReduceOp.SUM)
    lo, hi, r = 5, count - 3, n - 1
    srcs = [x.copy() for x in xs]
    dests = [np.zeros(hi - lo, np.float32) for _ in range(2)]
    fold(srcs, lo, hi, ReduceOp.SUM, dests, srcs[r][lo:hi])
    for d in (*dests, srcs[r][lo:hi]):
        np.testing.assert_array_equal(d, want[lo:hi])
    np.testing.assert_array_equal(srcs[r][:lo], xs[r][:lo])  # outside [lo, hi): untouched
