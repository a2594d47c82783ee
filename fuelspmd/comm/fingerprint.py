"""What every participant of an operation must agree on, as a small fixed int64 array.

A :class:`Fingerprint` names one operation a rank issues to a Transport: its number in the
group (``seq``: every op counts), the group's collective number (``cseq``: for a send or
recv, how many collectives the group issued before it, its *epoch*), the op, the buffer's
shape (element count, rank and up to four dimensions exactly, all of them through a hash),
dtype, reduce op, root, group id and, for send/recv, (src, dst, tag). It is encoded as
``FP_LEN`` int64s, so it travels with the transport's own buffer operations.

Agreement (:func:`diff`) compares ``cseq``, never ``seq``: the ranks of a pipeline issue
different numbers of sends and receives between two collectives, but every rank must be at
the same collective, and a send must meet its recv in the same epoch. Two collectives agree
on every field; a send and the recv it meets are complementary (one ``send``, one ``recv``)
and agree on src, dst, tag, shape, dtype, group and epoch.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fuelspmd.transport import digest62

__all__ = ["FIELDS", "FP_LEN", "OPS", "Fingerprint", "describe", "diff", "digest", "group_id",
           "peer", "render"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier",
       "send", "recv")
SEND, RECV = OPS.index("send"), OPS.index("recv")
DTYPES = ("bool", "int32", "int64", "float16", "bfloat16", "float32", "float64")
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
FIELDS = ("seq", "op", "shape", "dtype", "reduce_op", "root", "group", "src", "dst", "tag")
NONE = -1

OP, COUNT, NDIM, DIM0, SHAPE_HASH, DTYPE, REDUCE, ROOT, GROUP, SRC, DST, TAG, CSEQ, SEQ = (
    0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16)
FP_LEN = 17
_SLOTS = {"seq": (CSEQ,), "op": (OP,), "shape": tuple(range(COUNT, SHAPE_HASH + 1)),
          "dtype": (DTYPE,), "reduce_op": (REDUCE,), "root": (ROOT,), "group": (GROUP,),
          "src": (SRC,), "dst": (DST,), "tag": (TAG,)}
_P2P_FIELDS = ("seq", "op", "shape", "dtype", "group", "src", "dst", "tag")
_MIXED_FIELDS = ("seq", "op", "shape", "dtype", "group")
_TABLES = {"op": OPS, "dtype": DTYPES, "reduce_op": REDUCE_OPS}  # fields encoded as indices


def _code(table: tuple[str, ...], name: str | None) -> int:
    if name is None:
        return NONE
    try:
        return table.index(name)
    except ValueError:  # a dtype outside the table still compares: by its name's CRC
        return 1000 + zlib.crc32(name.encode())


def group_id(members: Iterable[int], color: int = 0) -> int:
    """A 31-bit id of a group: a CRC of its members (or a parent's id) and split color."""
    return zlib.crc32(np.asarray([color, *members], np.int64).tobytes()) & 0x7FFFFFFF


def digest(encoded: np.ndarray) -> int:
    """62 bits of what two agreeing collectives share byte for byte (the encoding before
    ``CSEQ``): ranks compare it in one word. CRC-32 and Adler-32, alike on every rank (not
    Python's per-process salted ``hash``)."""
    return digest62(encoded[:CSEQ].tobytes())


def peer(encoded: np.ndarray) -> int:
    """The other rank of an encoded send (its dst) or recv (its src); ``NONE`` for a
    collective, whose src is ``NONE``."""
    return int(encoded[DST] if encoded[OP] == SEND else encoded[SRC])


@dataclass(slots=True)
class Fingerprint:
    """One operation as the rank issuing it sees it; ``encode`` gives the wire form."""

    seq: int
    op: str
    shape: tuple[int, ...]
    dtype: str | None = None
    reduce_op: str | None = None
    root: int | None = None
    group: int = 0
    src: int | None = None
    dst: int | None = None
    tag: int | None = None
    cseq: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Fingerprint: unknown op {self.op!r}; use one of {OPS}")

    def encode(self) -> np.ndarray:
        """Return the ``FP_LEN`` int64 wire form (see the slot constants)."""
        a = np.full(FP_LEN, NONE, np.int64)
        shape = tuple(int(d) for d in self.shape)
        a[SEQ] = self.seq
        a[OP] = OPS.index(self.op)
        a[COUNT] = int(np.prod(shape, dtype=np.int64)) if shape else 1
        a[NDIM] = len(shape)
        a[DIM0:DIM0 + min(len(shape), 4)] = shape[:4]
        a[SHAPE_HASH] = zlib.crc32(np.asarray(shape, np.int64).tobytes())
        a[DTYPE] = _code(DTYPES, self.dtype)
        a[REDUCE] = _code(REDUCE_OPS, self.reduce_op)
        for slot, v in ((ROOT, self.root), (SRC, self.src), (DST, self.dst), (TAG, self.tag)):
            a[slot] = NONE if v is None else int(v)
        a[GROUP] = self.group
        a[CSEQ] = self.seq if self.cseq is None else self.cseq
        return a


def render(a: np.ndarray, field: str) -> str:
    """Return ``field`` of the encoded fingerprint ``a`` as text for an error message."""
    if field in _TABLES:
        table, code = _TABLES[field], int(a[_SLOTS[field][0]])
        return "none" if code == NONE else table[code] if 0 <= code < len(table) else f"#{code}"
    if field == "seq":
        return f"op #{int(a[SEQ])} (collective #{int(a[CSEQ])})"
    if field == "shape":
        ndim = int(a[NDIM])
        dims = [str(int(d)) for d in a[DIM0:DIM0 + min(ndim, 4)]] + (["..."] if ndim > 4 else [])
        text = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
        return f"{text} [{int(a[COUNT])} elements]"
    v = int(a[_SLOTS[field][0]])
    return "none" if v == NONE else str(v)


def describe(a: np.ndarray) -> str:
    """Return a one-line summary of an encoded fingerprint: op, numbers, shape, dtype, ..."""
    parts = [render(a, f) for f in ("op", "seq", "shape", "dtype")]
    parts += [f"{f}={render(a, f)}" for f in ("reduce_op", "root", "src", "dst", "tag")
              if render(a, f) != "none"]
    return " ".join(parts)


def diff(mine: np.ndarray, theirs: np.ndarray) -> list[str]:
    """Return the fields on which two encoded fingerprints disagree (empty: they agree), by
    the rules of the module docstring; a p2p op met by a collective reports seq, op and
    whichever of shape, dtype and group also differ."""
    a_p2p, b_p2p = int(mine[OP]) in (SEND, RECV), int(theirs[OP]) in (SEND, RECV)
    if a_p2p and b_p2p:
        return [f for f in _P2P_FIELDS if (mine[OP] == theirs[OP] if f == "op" else
                                           any(mine[s] != theirs[s] for s in _SLOTS[f]))]
    fields = FIELDS if not (a_p2p or b_p2p) else _MIXED_FIELDS
    return [f for f in fields if any(mine[s] != theirs[s] for s in _SLOTS[f])]
