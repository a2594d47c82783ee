"""What every participant of an operation must agree on, as a small fixed int64 array.

A :class:`Fingerprint` names one operation a rank is about to issue to a Transport: its
sequence number in the group (every op counts, collectives and point-to-point alike, so a
rank that skips one is seen at the next collective), the op, the buffer's shape (element
count, rank and up to four dimensions exactly, all of them through a hash), dtype, reduce
op, root, group id and, for send/recv, (src, dst, tag). It is encoded as ``FP_LEN`` int64s
(no pickling), so the guard sends it with the transport's own buffer ops.

Two counters: ``seq`` numbers every operation of the group (what the recorder and messages
show) and ``cseq`` the group's collectives (for a send/recv: how many collectives the group
issued before it, its *epoch*). Agreement uses ``cseq``: ranks of a pipeline issue
different numbers of sends and receives between two collectives, so their ``seq`` differs
legitimately, but every rank must be at the same collective, and a send must meet its
recv in the same epoch. A rank that skips an operation is seen either way: a skipped
collective shifts ``cseq``, a skipped send or recv leaves its peer unmatched at the fence.
(``cseq`` defaults to ``seq``, right for a group that issues only collectives.)

Agreement (:func:`diff`): the ranks of a collective must agree on every field. A send and
the receive it meets must be complementary (one ``send``, one ``recv``) and agree on src,
dst, tag, shape, dtype and group; their sequence numbers may differ (a pipeline stage
issues more point-to-point ops than its neighbour).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["FIELDS", "FP_LEN", "OPS", "Fingerprint", "diff", "group_id", "render"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier",
       "send", "recv")
P2P_CODES = (OPS.index("send"), OPS.index("recv"))
DTYPES = ("bool", "int32", "int64", "float16", "bfloat16", "float32", "float64")
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
FIELDS = ("seq", "op", "shape", "dtype", "reduce_op", "root", "group", "src", "dst", "tag")
NONE = -1

# slots of the encoded array. SEQ is last and CSEQ next to it: everything before them is
# what two agreeing operations of the same kind share exactly, so the guard compares it as
# one run of bytes, beside CSEQ, and ignores SEQ (which legitimately differs)
OP, COUNT, NDIM, DIM0, SHAPE_HASH, DTYPE, REDUCE, ROOT, GROUP, SRC, DST, TAG, CSEQ, SEQ = (
    0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16)
FP_LEN = 17
_SLOTS = {"seq": (CSEQ,), "op": (OP,), "shape": tuple(range(COUNT, SHAPE_HASH + 1)),
          "dtype": (DTYPE,), "reduce_op": (REDUCE,), "root": (ROOT,), "group": (GROUP,),
          "src": (SRC,), "dst": (DST,), "tag": (TAG,)}
_P2P_FIELDS = ("seq", "op", "shape", "dtype", "group", "src", "dst", "tag")
_MIXED_FIELDS = ("seq", "op", "shape", "dtype", "group")


def _code(table: tuple[str, ...], name: str | None) -> int:
    if name is None:
        return NONE
    try:
        return table.index(name)
    except ValueError:  # a dtype outside the table still compares: by its name's hash
        return 1000 + zlib.crc32(name.encode())


def _name(table: tuple[str, ...], code: int) -> str | None:
    if code == NONE:
        return None
    return table[code] if 0 <= code < len(table) else f"#{code}"


def group_id(members: Iterable[int], color: int = 0) -> int:
    """Return a 31-bit id of a group: a CRC of its members' world ranks and split color."""
    data = np.asarray([color, *members], np.int64).tobytes()
    return zlib.crc32(data) & 0x7FFFFFFF


@dataclass(slots=True)
class Fingerprint:
    """One operation as the rank issuing it sees it; ``encode`` gives the wire form.

    Not frozen, for speed: one is built per guarded operation (a frozen dataclass costs
    several times more to construct); treat it as a value.
    """

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

    @property
    def p2p(self) -> bool:
        """Whether this is a send or a recv (matched pairwise, not by every rank)."""
        return self.op in ("send", "recv")

    def encode(self) -> np.ndarray:
        """Return the ``FP_LEN`` int64 wire form (see the slot constants)."""
        a = np.full(FP_LEN, NONE, np.int64)
        shape = tuple(int(d) for d in self.shape)
        a[SEQ] = self.seq
        a[OP] = OPS.index(self.op)
        a[COUNT] = int(np.prod(shape, dtype=np.int64)) if shape else 1
        a[NDIM] = len(shape)
        for i, d in enumerate(shape[:4]):
            a[DIM0 + i] = d
        a[SHAPE_HASH] = zlib.crc32(np.asarray(shape, np.int64).tobytes())
        a[DTYPE] = _code(DTYPES, self.dtype)
        a[REDUCE] = _code(REDUCE_OPS, self.reduce_op)
        for slot, v in ((ROOT, self.root), (SRC, self.src), (DST, self.dst), (TAG, self.tag)):
            a[slot] = NONE if v is None else int(v)
        a[GROUP] = self.group
        a[CSEQ] = self.seq if self.cseq is None else self.cseq
        return a

    def as_dict(self) -> dict[str, object]:
        """Return the fields as plain JSON-ready values (for the flight recorder)."""
        return {"seq": self.seq, "op": self.op, "shape": list(self.shape), "dtype": self.dtype,
                "reduce_op": self.reduce_op, "root": self.root, "group": self.group,
                "src": self.src, "dst": self.dst, "tag": self.tag,
                "cseq": self.seq if self.cseq is None else self.cseq}


def render(a: np.ndarray, field: str) -> str:
    """Return ``field`` of the encoded fingerprint ``a`` as text for an error message."""
    if field == "op":
        return str(_name(OPS, int(a[OP])))
    if field == "dtype":
        return str(_name(DTYPES, int(a[DTYPE])))
    if field == "reduce_op":
        return str(_name(REDUCE_OPS, int(a[REDUCE])))
    if field == "seq":
        return f"op #{int(a[SEQ])} (collective #{int(a[CSEQ])})"
    if field == "shape":
        ndim = int(a[NDIM])
        dims = [str(int(d)) for d in a[DIM0:DIM0 + min(ndim, 4)]]
        if ndim > 4:
            dims.append("...")
        text = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
        return f"{text} [{int(a[COUNT])} elements]"
    v = int(a[_SLOTS[field][0]])
    return "none" if v == NONE else str(v)


def describe(a: np.ndarray) -> str:
    """Return a one-line summary of an encoded fingerprint: op, numbers, shape, dtype, ...."""
    parts = [f"{render(a, 'op')} op #{int(a[SEQ])} (collective #{int(a[CSEQ])}) "
             f"{render(a, 'shape')} {render(a, 'dtype')}"]
    for field in ("reduce_op", "root", "src", "dst", "tag"):
        text = render(a, field)
        if text not in ("none", "None"):
            parts.append(f"{field}={text}")
    return " ".join(parts)


def diff(mine: np.ndarray, theirs: np.ndarray) -> list[str]:
    """Return the fields on which two encoded fingerprints disagree (empty: they agree).

    Two collectives compare every field (``seq`` compares the collective number ``cseq``).
    A send meets a recv: ops must be complementary and epoch (``cseq``), src, dst, tag,
    shape, dtype and group equal. A p2p op met by a collective
    reports seq, op and whichever of shape, dtype, group also differ.
    """
    a_p2p, b_p2p = int(mine[OP]) in P2P_CODES, int(theirs[OP]) in P2P_CODES
    if a_p2p and b_p2p:
        out = []
        for field in _P2P_FIELDS:
            if field == "op":
                if mine[OP] == theirs[OP]:
                    out.append("op")
            elif any(mine[s] != theirs[s] for s in _SLOTS[field]):
                out.append(field)
        return out
    fields = FIELDS if not (a_p2p or b_p2p) else _MIXED_FIELDS
    return [f for f in fields if any(mine[s] != theirs[s] for s in _SLOTS[f])]
