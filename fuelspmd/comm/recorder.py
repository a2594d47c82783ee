"""The flight recorder: each rank's last operations, dumped to a file when something fails.

A :class:`Recorder` is a ring buffer (default the last 1024 operations) of
:class:`Record` s: the operation's fingerprint fields, its state (``issued`` once the guard
let it through, then ``completed``, ``failed``, ``mismatch`` or ``timeout``) and its
timestamps (``time.time()``, so ranks' records can be lined up by wall clock as well as by
sequence number). The guard records into it; :meth:`Recorder.dump` writes
``DIR/rank<R>.json``, one file per rank, and ``fuelspmd trace DIR`` lines the ranks up.
Recording an operation costs one small object and a deque append; nothing is written
until a dump.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuelspmd.comm.fingerprint import Fingerprint
from fuelspmd.errors import ConfigError

__all__ = ["STATES", "Record", "Recorder", "load_dump"]

STATES = ("issued", "completed", "failed", "mismatch", "timeout")
FORMAT = 1


@dataclass(slots=True)
class Record:
    """One operation: its fingerprint, state and the times it was issued and settled.

    ``seq``/``cseq`` override the fingerprint's: a caller that issues many alike operations
    records one shared Fingerprint with each operation's numbers (no object per op).
    """

    fp: Fingerprint
    seq: int
    cseq: int
    state: str = "issued"
    t_issued: float = field(default_factory=time.time)
    t_done: float | None = None
    note: str = ""

    def settle(self, state: str, note: str = "") -> None:
        """Mark the operation ``state`` (one of STATES) now, with an optional reason."""
        self.state = state
        self.t_done = time.time()
        if note:
            self.note = note

    def as_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready values."""
        d = self.fp.as_dict()
        d.update(seq=self.seq, cseq=self.cseq, state=self.state, t_issued=self.t_issued,
                 t_done=self.t_done, note=self.note)
        return d


class Recorder:
    """A ring buffer of this rank's last ``capacity`` operations."""

    def __init__(self, *, capacity: int = 1024) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"Recorder(capacity={capacity!r}): keep at least 1 record; "
                              f"the default is 1024")
        self.capacity = capacity
        self._ring: deque[Record] = deque(maxlen=capacity)

    def record(self, fp: Fingerprint, seq: int | None = None,
               cseq: int | None = None) -> Record:
        """Append ``fp`` as issued (dropping the oldest record when full) and return it."""
        if seq is None:
            seq = fp.seq
        if cseq is None:
            cseq = fp.seq if fp.cseq is None else fp.cseq
        rec = Record(fp, seq, cseq)
        self._ring.append(rec)
        return rec

    def records(self) -> list[Record]:
        """Return the kept records, oldest first."""
        return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def dump(self, directory: str | os.PathLike[str], rank: int, *, reason: str = "") -> Path:
        """Write ``directory/rank<rank>.json`` (the directory is created) and return its path.

        The file is written to a temporary name and renamed, so a reader never sees half a
        file even if the rank is killed while dumping.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{int(rank)}.json"
        doc = {"format": FORMAT, "rank": int(rank), "reason": reason, "time": time.time(),
               "capacity": self.capacity, "records": [r.as_dict() for r in self._ring]}
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
