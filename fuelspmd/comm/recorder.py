"""The flight recorder: each rank's last operations, dumped to a file when something fails.

A :class:`Recorder` is a ring (default the last 1024 operations): per operation its
fingerprint fields, its state (``issued`` once the guard let it through, then
``completed``, ``failed``, ``mismatch`` or ``timeout``) and its timestamps
(``time.time()``, so ranks' records can be lined up by wall clock as well as by sequence
number). The guard records into it; :meth:`Recorder.dump` writes ``DIR/rank<R>.json``, one
file per rank, and ``fuelspmd trace DIR`` lines the ranks up.

Why a preallocated ring of tuples and not a deque of objects: recording runs on every
guarded operation, on the path a peer waits on. :meth:`Recorder.push` stores one tuple and
returns a ticket number, :meth:`Recorder.mark` stores another: no object with attributes
is built per operation.
:class:`Record` objects are built only when someone reads the ring (:meth:`records`,
:meth:`dump`). A slot is overwritten ``capacity`` operations later; marking a slot that
was overwritten since is ignored (each push gets a new ticket number, ``slot = ticket %
capacity``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuelspmd.comm.fingerprint import Fingerprint
from fuelspmd.errors import ConfigError

__all__ = ["STATES", "Entry", "Record", "Recorder", "load_dump"]

STATES = ("issued", "completed", "failed", "mismatch", "timeout")
FORMAT = 1


@dataclass(slots=True)
class Record:
    """One operation as the ring holds it: fingerprint, numbers, state and times (a copy).

    ``seq``/``cseq`` override the fingerprint's: a caller that issues many alike operations
    records one shared Fingerprint with each operation's numbers (no object per op).
    """

    fp: Fingerprint
    seq: int
    cseq: int
    state: str = "issued"
    t_issued: float = 0.0
    t_done: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready values."""
        d = self.fp.as_dict()
        d.update(seq=self.seq, cseq=self.cseq, state=self.state, t_issued=self.t_issued,
                 t_done=self.t_done, note=self.note)
        return d


class Entry:
    """A handle on one pushed operation: :meth:`settle` marks it (see :meth:`Recorder.mark`)."""

    __slots__ = ("_rec", "ticket")

    def __init__(self, rec: Recorder, ticket: int) -> None:
        self._rec, self.ticket = rec, ticket

    def settle(self, state: str, note: str = "") -> None:
        """Mark the operation ``state`` (one of STATES) now, with an optional reason."""
        self._rec.mark(self.ticket, state, note)


class Recorder:
    """A ring of this rank's last ``capacity`` operations."""

    def __init__(self, *, capacity: int = 1024) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"Recorder(capacity={capacity!r}): keep at least 1 record; "
                              f"the default is 1024")
        self.capacity = capacity
        self._n = 0  # tickets handed out: the next push goes to slot _n % capacity
        # per slot: (ticket, fp, seq, cseq, t_issued), and (state, t_done, note) once
        # settled (None while issued): two tuple stores per operation
        self._ops: list[tuple[int, Fingerprint, int, int, float] | None] = [None] * capacity
        self._end: list[tuple[str, float, str] | None] = [None] * capacity
        self._undo: tuple[Any, Any] = (None, None)  # what the last push overwrote

    def push(self, fp: Fingerprint, seq: int, cseq: int) -> int:
        """Record ``fp`` (with these numbers) as issued now; return its ticket for :meth:`mark`."""
        n = self._n
        self._n = n + 1
        i = n % self.capacity
        self._undo = (self._ops[i], self._end[i])
        self._ops[i] = (n, fp, seq, cseq, time.time())
        self._end[i] = None
        return n

    def unpush(self, ticket: int) -> None:
        """Take back the last push (an operation that raised before it was issued)."""
        if ticket != self._n - 1:
            raise RuntimeError(f"recorder: unpush({ticket}) but the last push was {self._n - 1}")
        self._n = ticket
        i = ticket % self.capacity
        self._ops[i], self._end[i] = self._undo

    def mark(self, ticket: int, state: str, note: str = "") -> None:
        """Settle the operation of ``ticket`` as ``state`` now (ignored once overwritten)."""
        i = ticket % self.capacity
        op = self._ops[i]
        if op is None or op[0] != ticket:
            return
        end = self._end[i]
        if not note and end is not None:
            note = end[2]
        self._end[i] = (state, time.time(), note)

    def record(self, fp: Fingerprint, seq: int | None = None,
               cseq: int | None = None) -> Entry:
        """Append ``fp`` as issued (dropping the oldest record when full); return a handle."""
        if seq is None:
            seq = fp.seq
        if cseq is None:
            cseq = fp.seq if fp.cseq is None else fp.cseq
        return Entry(self, self.push(fp, seq, cseq))

    def records(self) -> list[Record]:
        """Return copies of the kept records, oldest first."""
        cap, n = self.capacity, self._n
        out = []
        for t in range(max(0, n - cap), n):
            op, end = self._ops[t % cap], self._end[t % cap]
            if op is None:  # unreachable: every slot below _n was pushed
                raise RuntimeError(f"recorder slot {t % cap} of ticket {t} was never written")
            _, fp, seq, cseq, t0 = op
            state, t1, note = end if end is not None else ("issued", None, "")
            out.append(Record(fp, seq, cseq, state, t0, t1, note))
        return out

    def __len__(self) -> int:
        return min(self._n, self.capacity)

    def dump(self, directory: str | os.PathLike[str], rank: int, *, reason: str = "") -> Path:
        """Write ``directory/rank<rank>.json`` (the directory is created) and return its path.

        The file is written to a temporary name and renamed, so a reader never sees half a
        file even if the rank is killed while dumping.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{int(rank)}.json"
        doc = {"format": FORMAT, "rank": int(rank), "reason": reason, "time": time.time(),
               "capacity": self.capacity, "records": [r.as_dict() for r in self.records()]}
        tmp = path.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
        return path


def load_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one rank's dump; ConfigError for a file that is not a recorder dump."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not a readable flight-recorder dump ({e}); pass a rank<R>.json "
                          "written by Recorder.dump") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "records" not in doc:
        raise ConfigError(f"{p}: not a flight-recorder dump of format {FORMAT} "
                          f"(written by Recorder.dump); pass the directory of such dumps")
    return doc
