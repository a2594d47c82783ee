"""KVCacheCoordinator: keep the block tables of tensor-parallel ranks identical.

Every TP rank (and pipeline stage) writes its share of a token's keys and values into the
same slots, so all of them must hold the same block tables. Two ways to get there:

* ``mode="check"``: every rank runs the same deterministic :class:`KVCacheManager` on the
  same calls (the normal SPMD case). Every ``every`` steps (``every=1`` to debug) the
  ranks all_gather :meth:`KVCacheManager.digest` as four int64s through the lazy
  :class:`~fuelspmd.comm.Communicator`: one small collective. When the digests differ the
  ranks exchange a per-sequence digest table and raise :class:`CacheDivergenceError` on
  every rank, naming the ranks that disagree with rank 0 and the first sequence that
  differs (or the orders, when every table agrees but the order of free blocks or of the
  sequences' ages does not, which decides the next allocation or preemption). A
  :meth:`make_room` that preempted checks at once, so ranks that would preempt different
  sequences are stopped at that decision (a rank that did not preempt is at another
  collective, which the communicator's guard reports as a mismatch).
* ``mode="leader"``: ranks may be fed different inputs (a rank that read its own request
  queue). The ranks all_gather a fixed 8-int64 header of their call (so a rank that made
  another *kind* of call is caught on every rank, as :class:`CacheUsageError`), then rank
  0's sequence ids and tokens are broadcast as int64s and every rank replays rank 0's call
  on its own manager, so every manager makes rank 0's decisions. The digest check runs in
  this mode too, as a guard.

All methods are collective over ``comm`` in leader mode, and :meth:`step`/:meth:`check`
are in both: every rank calls them in the same order (invariant 1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from fuelspmd.distributed_cache.manager import BlockCopy, KVCacheManager, SeqId
from fuelspmd.distributed_cache.prefix import ExtraKey
from fuelspmd.errors import CacheDivergenceError, CacheUsageError, ConfigError
from fuelspmd.tensor import Tensor, tensor
from fuelspmd.transport import disagreement

__all__ = ["CacheDivergenceError", "KVCacheCoordinator"]

_ALLOCATE, _APPEND, _FORK, _FREE, _EVICT, _PREEMPT, _RESUME, _MAKE_ROOM = range(1, 9)
_CALLS = {_ALLOCATE: "allocate", _APPEND: "append", _FORK: "fork", _FREE: "free",
          _EVICT: "evict", _PREEMPT: "preempt", _RESUME: "resume", _MAKE_ROOM: "make_room"}
_INT, _STR, _NONE, _POOL = 0, 1, 2, 3
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_HEADER = 8  # op, id kind, id value/len, child kind, child value/len, n tokens, is count, 0


def _digest_ints(hexdigest: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hexdigest), dtype="<i8").astype(np.int64)


def _seq_key(seq_id: SeqId) -> tuple[int, int]:
    """(kind, value): an int id is itself; a str id is named by 63 bits of its SHA-256."""
    if isinstance(seq_id, str) or not _I64_MIN <= seq_id <= _I64_MAX:
        h = hashlib.sha256(str(seq_id).encode()).digest()
        return _STR, int.from_bytes(h[:8], "little") >> 1
    return _INT, int(seq_id)


class KVCacheCoordinator:
    """Agreement of one manager's decisions across ``comm``; see the module docstring."""

    def __init__(self, manager: KVCacheManager, *, comm: Any, every: int = 16,
                 mode: Literal["check", "leader"] = "check") -> None:
        if mode not in ("check", "leader"):
            raise ConfigError(f"KVCacheCoordinator(mode={mode!r}): give 'check' (same calls "
                              "on every rank) or 'leader' (rank 0 decides and broadcasts)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"KVCacheCoordinator(every={every!r}): give a step count >= 1 "
                              "(1 checks every step, for debugging; 16 is cheap)")
        self.manager, self.comm, self.every, self.mode = manager, comm, every, mode
        self.steps = 0
        self.checks = 0

    # ---- agreement --------------------------------------------------------------------
    def step(self) -> bool:
        """Count one step; on every ``every``-th, check agreement. Return whether it did."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self.check()
        return True

    def check(self) -> None:
        """Raise :class:`CacheDivergenceError` on every rank unless all digests agree."""
        self.checks += 1
        if self.comm.size == 1:
            return
        mine = _digest_ints(self.manager.digest())
        every = self._gather(mine.reshape(1, 4))
        if (every == every[0]).all():
            return
        self._explain(every)

    def _gather(self, rows: np.ndarray) -> np.ndarray:
        t = tensor(rows, device=self.comm.device)
        return np.asarray(self.comm.all_gather(t, 0).numpy())

    def _explain(self, digests: np.ndarray) -> None:
        size = self.comm.size
        odd = [r for r in range(size) if not (digests[r] == digests[0]).all()]
        m = self.manager
        digests = m.sequence_digests()
        seqs = sorted(digests, key=lambda s: (isinstance(s, str), s))
        names = {_seq_key(s): s for s in seqs}
        rows = [[*_seq_key(s), *_digest_ints(digests[s])] for s in seqs]
        rows.append([_POOL, 0, *_digest_ints(m.order_digest())])
        counts = self._gather(np.array([[len(rows)]], dtype=np.int64)).reshape(-1)
        width = int(counts.max())
        mine = np.full((width, 6), -1, dtype=np.int64)
        mine[:len(rows)] = np.asarray(rows, dtype=np.int64)
        table = self._gather(mine).reshape(size, width, 6)
        per_rank = [{(int(r[0]), int(r[1])): tuple(r[2:]) for r in table[k, :counts[k]]}
                    for k in range(size)]
        order: list[tuple[int, int]] = []
        for k in range(size):
            for r in table[k, :counts[k]]:
                key = (int(r[0]), int(r[1]))
                if key not in order:
                    order.append(key)
        first = next((key for key in order if len({d.get(key) for d in per_rank}) > 1), None)
        if first is None:
            raise RuntimeError(f"KV cache digests differ (ranks {odd} against rank 0) but no "
                               "block table or queue order does: the digest and this report "
                               "encode the manager differently")
        holders = [k for k in range(size) if first in per_rank[k]]
        if first[0] == _POOL:
            what = "every sequence agrees but an order differs: the pool's free/evictable " \
                   "queues, the running sequences' ages or the resumption order (the next " \
                   "allocation or preemption would diverge)"
        else:
            name = names.get(first, f"<str id with hash {first[1]:#x}>" if first[0] == _STR
                             else first[1])
            what = (f"the first differing sequence is {name!r}, held by ranks {holders}")
        raise CacheDivergenceError(
            f"KV cache block tables diverged at step {self.steps} (check {self.checks}): "
            f"ranks {odd} disagree with rank 0 of {size}; {what}. Every rank must make the "
            "same allocate/append/fork/free calls in the same order; if ranks see different "
            "inputs, use KVCacheCoordinator(mode='leader')")

    # ---- manager calls (broadcast from rank 0 in leader mode) -------------------------
    def allocate(self, seq_id: SeqId, tokens: Sequence[int] | int, *,
                 extra_keys: tuple[ExtraKey, ...] = ()) -> int:
        """:meth:`KVCacheManager.allocate`, rank 0's call in leader mode."""
        if self.mode == "leader":
            if extra_keys:
                raise CacheUsageError("leader mode broadcasts token ids only: allocate with "
                                      "extra_keys=() or use mode='check'")
            _, seq_id, _, tokens = self._agree(_ALLOCATE, seq_id, None, tokens)
        return self.manager.allocate(seq_id, tokens, extra_keys=extra_keys)

    def append(self, seq_id: SeqId, tokens: Sequence[int] | int) -> list[BlockCopy]:
        """:meth:`KVCacheManager.append`; the returned copies are the same on every rank."""
        if self.mode == "leader":
            _, seq_id, _, tokens = self._agree(_APPEND, seq_id, None, tokens)
        return self.manager.append(seq_id, tokens)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """:meth:`KVCacheManager.fork`."""
        if self.mode == "leader":
            _, parent, got, _ = self._agree(_FORK, parent, child, 0)
            assert got is not None
            child = got
        self.manager.fork(parent, child)

    def free(self, seq_id: SeqId) -> None:
        """:meth:`KVCacheManager.free`."""
        if self.mode == "leader":
            _, seq_id, _, _ = self._agree(_FREE, seq_id, None, 0)
        self.manager.free(seq_id)

    def preempt(self, seq_id: SeqId) -> None:
        """:meth:`KVCacheManager.preempt`."""
        if self.mode == "leader":
            _, seq_id, _, _ = self._agree(_PREEMPT, seq_id, None, 0)
        self.manager.preempt(seq_id)

    def resume(self, seq_id: SeqId, tokens: Sequence[int] | int = ()) -> int:
        """:meth:`KVCacheManager.resume`, rank 0's call in leader mode."""
        if self.mode == "leader":
            _, seq_id, _, tokens = self._agree(_RESUME, seq_id, None, tokens)
        return self.manager.resume(seq_id, tokens)

    def make_room(self, seq_id: SeqId, n_tokens: int) -> list[SeqId]:
        """:meth:`KVCacheManager.make_room`; when it preempted, :meth:`check` at once."""
        if self.mode == "leader":
            _, seq_id, _, got = self._agree(_MAKE_ROOM, seq_id, None, int(n_tokens))
            assert isinstance(got, int)
            n_tokens = got
        out = self.manager.make_room(seq_id, n_tokens)
        if out:
            self.check()
        return out

    def evict(self, n: int) -> int:
        """:meth:`KVCacheManager.evict`."""
        if self.mode == "leader":
            _, _, _, got = self._agree(_EVICT, 0, None, int(n))
            assert isinstance(got, int)
            n = got
        return self.manager.evict(n)

    def _agree(self, op: int, seq_id: SeqId, child: SeqId | None, tokens: Sequence[int] | int
               ) -> tuple[int, SeqId, SeqId | None, Sequence[int] | int]:
        """Broadcast rank 0's call; return it as every rank must make it."""
        comm = self.comm
        if comm.size == 1:
            return op, seq_id, child, tokens
        is_count = not hasattr(tokens, "__len__")
        ids = [] if is_count else [int(t) for t in tokens]  # type: ignore[union-attr]
        head = np.zeros(_HEADER, dtype=np.int64)
        payload: list[int] = []
        for slot, sid in ((1, seq_id), (3, child)):
            if sid is None:
                head[slot] = _NONE
            elif isinstance(sid, str):
                raw = list(sid.encode())
                head[slot], head[slot + 1] = _STR, len(raw)
                payload += raw
            elif not _I64_MIN <= sid <= _I64_MAX:
                raise CacheUsageError(f"leader mode sends int sequence ids as int64; {sid} is "
                                      "out of range: use a smaller int or a str id")
            else:
                head[slot], head[slot + 1] = _INT, int(sid)
        head[0], head[5], head[6] = op, (int(tokens) if is_count else len(ids)), is_count  # type: ignore[arg-type]
        payload += ids
        # every rank's call: the check, and rank 0's lengths for the broadcast (so not
        # agree(), which would cost a collective more and be eager on the transport)
        heads = self._gather(head.reshape(1, _HEADER))
        got = heads[0]
        wrong = disagreement("KVCacheCoordinator(mode='leader') (the arguments may differ)",
                             [{"call": _CALLS[int(h[0])]} for h in heads])
        if wrong:
            raise CacheUsageError(wrong)
        length = self._body_len(got)
        body = np.zeros(0, dtype=np.int64)
        if length:
            mine = np.asarray(payload, dtype=np.int64) if comm.rank == 0 else \
                np.zeros(length, dtype=np.int64)
            body = self._broadcast(mine)
        pos = 0
        out: list[SeqId | None] = []
        for slot in (1, 3):
            kind, val = int(got[slot]), int(got[slot + 1])
            if kind == _STR:
                out.append(bytes(int(c) for c in body[pos:pos + val]).decode())
                pos += val
            else:
                out.append(None if kind == _NONE else val)
        n, count = int(got[5]), bool(got[6])
        toks: Sequence[int] | int = n if count else [int(x) for x in body[pos:pos + n]]
        sid0 = out[0]
        assert sid0 is not None
        return op, sid0, out[1], toks

    @staticmethod
    def _body_len(head: np.ndarray) -> int:
        n = 0 if head[6] else int(head[5])
        return n + sum(int(head[s + 1]) for s in (1, 3) if head[s] == _STR)

    def _broadcast(self, arr: np.ndarray) -> np.ndarray:
        """Rank 0's ``arr``; other ranks pass any array of the same shape."""
        if self.comm.rank != 0:
            arr = np.zeros_like(arr)
        t: Tensor = tensor(arr, device=self.comm.device)
        return np.asarray(self.comm.broadcast(t, 0).numpy())
