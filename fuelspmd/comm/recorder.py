"""The flight recorder: each rank's last operations, dumped to a file when something fails.

A :class:`Recorder` is a ring (default the last 1024 operations): per operation its
fingerprint, numbers, state (``issued``, then ``completed``, ``failed``, ``mismatch`` or
``timeout``) and timestamps (``time.time()``, so ranks' records line up by wall clock as
well as by number). The guard records into it; :meth:`Recorder.dump` writes
``DIR/rank<R>.json`` and ``fuelspmd trace DIR`` lines the ranks up.

Recording runs on every guarded operation, on the path a peer waits on, so a push stores
one tuple in a preallocated slot and returns a ticket (``slot = ticket % capacity``); a
mark stores another. :class:`Record` objects are built only when someone reads the ring. A
mark of a slot overwritten since is ignored.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fuelspmd.comm.fingerprint import Fingerprint
from fuelspmd.errors import ConfigError

__all__ = ["STATES", "Record", "Recorder", "load_dump"]

STATES = ("issued", "completed", "failed", "mismatch", "timeout")
FORMAT = 1


@dataclass(slots=True)
class Record:
    """One operation as the ring holds it (a copy). ``seq``/``cseq`` override the
    fingerprint's: a caller records one shared Fingerprint with each operation's numbers."""

    fp: Fingerprint
    seq: int
    cseq: int
    state: str = "issued"
    t_issued: float = 0.0
    t_done: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready values: the fingerprint's fields, then its own."""
        return {**asdict(self.fp), "seq": self.seq, "cseq": self.cseq, "state": self.state,
                "t_issued": self.t_issued, "t_done": self.t_done, "note": self.note}


class Recorder:
    """A ring of this rank's last ``capacity`` operations."""

    def __init__(self, *, capacity: int = 1024) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"Recorder(capacity={capacity!r}): keep at least 1 record; "
                              f"the default is 1024")
        self.capacity = capacity
        self._n = 0  # tickets handed out
        self._ops: list[tuple[int, Fingerprint, int, int, float] | None] = [None] * capacity
        self._end: list[tuple[str, float, str] | None] = [None] * capacity

    def push(self, fp: Fingerprint, seq: int | None = None, cseq: int | None = None) -> int:
        """Record ``fp`` as issued now, with these numbers (default: its own); return the
        ticket that :meth:`mark` settles."""
        seq = fp.seq if seq is None else seq
        cseq = (fp.seq if fp.cseq is None else fp.cseq) if cseq is None else cseq
        n = self._n
        self._n = n + 1
        i = n % self.capacity
        self._ops[i] = (n, fp, seq, cseq, time.time())
        self._end[i] = None
        return n

    def mark(self, ticket: int, state: str, note: str = "") -> None:
        """Settle the operation of ``ticket`` as ``state`` now (ignored once overwritten)."""
        i = ticket % self.capacity
        op = self._ops[i]
        if op is None or op[0] != ticket:
            return
        end = self._end[i]
        self._end[i] = (state, time.time(), note or (end[2] if end is not None else ""))

    def records(self) -> list[Record]:
        """Return copies of the kept records, oldest first."""
        cap, n = self.capacity, self._n
        out = []
        for t in range(max(0, n - cap), n):
            op, end = self._ops[t % cap], self._end[t % cap]
            assert op is not None
            _, fp, seq, cseq, t0 = op
            state, t1, note = end if end is not None else ("issued", None, "")
            out.append(Record(fp, seq, cseq, state, t0, t1, note))
        return out

    def __len__(self) -> int:
        return min(self._n, self.capacity)

    def dump(self, directory: str | os.PathLike[str], rank: int, *, reason: str = "") -> Path:
        """Write ``directory/rank<rank>.json`` (the directory is created) and return its path.

        Written to a temporary name and renamed, so a reader never sees half a file even if
        the rank is killed while dumping.
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
