"""The flight recorder: each rank's last operations, dumped to a file when something fails.

A :class:`Recorder` is a ring (default the last 1024 operations): per operation its
fingerprint, numbers, state (``issued`` before the rank can block in it, ``waiting`` once
a wait in it passed a slice, then ``completed``, ``failed``, ``mismatch`` or ``timeout``),
timestamps (``time.time()``, so ranks' records line up by wall clock as well as by
number) and, for an operation a rank waited in, the caller's source line (:func:`caller`:
taken on the slow path only, when the wait passes its first slice, at a failure, or from
a signal's frame). The guard records into it; :meth:`Recorder.dump` writes
``DIR/rank<R>.json`` (with the members of each group, and where the rank was when the dump
was taken) and ``fuelspmd trace DIR`` lines the ranks up.

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
from types import FrameType
from typing import Any

from fuelspmd.comm.fingerprint import Fingerprint
from fuelspmd.errors import ConfigError

__all__ = ["IN_FLIGHT", "STATES", "Record", "Recorder", "caller", "load_dump"]

STATES = ("issued", "waiting", "completed", "failed", "mismatch", "timeout")
IN_FLIGHT = ("issued", "waiting")  # an operation the rank had not left when it dumped
FORMAT = 1
_OURS = ("fuelspmd.", "fuelspmd_")  # the runtime's modules and its transport plugins


def caller(frame: FrameType | None) -> str:
    """``FILE:LINE in FUNCTION`` of the first frame from ``frame`` outwards that is not the
    runtime's (fuelspmd's or a transport plugin's): the line of the program that issued
    the operation, or where it was. The innermost frame when every frame is the runtime's;
    "" without a frame."""
    first = frame
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != "fuelspmd" and not name.startswith(_OURS):
            break
        frame = frame.f_back
    frame = frame or first
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


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
    where: str = ""  # the caller's source line, for an operation the rank waited in

    def as_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready values: the fingerprint's fields, then its own."""
        return {**asdict(self.fp), "seq": self.seq, "cseq": self.cseq, "state": self.state,
                "t_issued": self.t_issued, "t_done": self.t_done, "note": self.note,
                "where": self.where}


class Recorder:
    """A ring of this rank's last ``capacity`` operations."""

    def __init__(self, *, capacity: int = 1024) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"Recorder(capacity={capacity!r}): keep at least 1 record; "
                              f"the default is 1024")
        self.capacity = capacity
        self._n = 0  # tickets handed out
        self._ops: list[tuple[int, Fingerprint, int, int, float] | None] = [None] * capacity
        # (state, time, note, where); the time is None while the operation is in flight
        self._end: list[tuple[str, float | None, str, str] | None] = [None] * capacity
        self.groups: dict[int, list[int]] = {}  # group id -> its members' world ranks

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

    def retract(self, ticket: int) -> None:
        """Take back the last push (an operation refused before it was issued: a caller's
        mistake leaves no record)."""
        if ticket == self._n - 1:
            self._n = ticket
            self._ops[ticket % self.capacity] = None

    def mark(self, ticket: int, state: str, note: str = "", where: str = "") -> None:
        """Move the operation of ``ticket`` to ``state`` now (ignored once overwritten):
        ``waiting`` keeps it in flight, any other state settles it. A note and a source
        line given before are kept."""
        i = ticket % self.capacity
        op = self._ops[i]
        if op is None or op[0] != ticket:
            return
        end = self._end[i]
        if end is not None:
            note, where = note or end[2], where or end[3]
        self._end[i] = (state, None if state in IN_FLIGHT else time.time(), note, where)

    def state(self, ticket: int) -> str | None:
        """The state of ``ticket``'s operation (None once overwritten)."""
        i = ticket % self.capacity
        op = self._ops[i]
        if op is None or op[0] != ticket:
            return None
        end = self._end[i]
        return "issued" if end is None else end[0]

    def records(self) -> list[Record]:
        """Return copies of the kept records, oldest first."""
        cap, n = self.capacity, self._n
        out = []
        for t in range(max(0, n - cap), n):
            op, end = self._ops[t % cap], self._end[t % cap]
            assert op is not None
            _, fp, seq, cseq, t0 = op
            state, t1, note, where = end if end is not None else ("issued", None, "", "")
            out.append(Record(fp, seq, cseq, state, t0, t1, note, where))
        return out

    def __len__(self) -> int:
        return min(self._n, self.capacity)

    def dump(self, directory: str | os.PathLike[str], rank: int, *, reason: str = "",
             where: str = "", final: bool = False) -> Path:
        """Write ``directory/rank<rank>.json`` (the directory is created) and return its path.

        ``where``: the rank's source line when the dump was taken (a signal's frame);
        ``final``: whether the rank is ending abnormally (a failure, an abort, a signal that
        ends the job), or the dump is a look at a running job (SIGUSR1, on request).
        Written to a temporary name and renamed, so a reader never sees half a file even if
        the rank is killed while dumping.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{int(rank)}.json"
        doc = {"format": FORMAT, "rank": int(rank), "reason": reason, "where": where,
               "final": bool(final), "time": time.time(), "capacity": self.capacity,
               "groups": {str(g): list(m) for g, m in self.groups.items()},
               "records": [r.as_dict() for r in self.records()]}
        tmp = path.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
        return path


_INT, _TEXT, _NUMBER = (int,), (str,), (int, float)
# what trace reads of each record, and the types it may hold (None where it may be null)
_RECORD = {"op": _TEXT, "seq": _INT, "cseq": _INT, "group": _INT, "state": _TEXT,
           "dtype": (str, type(None)), "reduce_op": (str, type(None)),
           "root": (int, type(None)), "src": (int, type(None)), "dst": (int, type(None)),
           "tag": (int, type(None)), "t_issued": _NUMBER, "t_done": (int, float, type(None))}


def load_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one rank's dump; ConfigError for a file that is not a recorder dump, or one
    whose fields do not hold what a dump writes (a rank that is not a whole number, a
    record without its op), naming the field. Fields a dump of before lacks get defaults."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not a readable flight-recorder dump ({e}); pass a rank<R>.json "
                          "written by Recorder.dump") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "records" not in doc:
        raise ConfigError(f"{p}: not a flight-recorder dump of format {FORMAT} "
                          f"(written by Recorder.dump); pass the directory of such dumps")

    def bad(field: str, value: Any, want: str) -> ConfigError:
        return ConfigError(f"{p}: field {field} is {value!r}, not {want}; pass dumps written "
                           "by Recorder.dump, unedited")

    rank = doc.get("rank")
    if not _is(rank, _INT) or rank < 0:
        raise bad("rank", rank, "a whole number >= 0")
    for field, kinds, want in (("reason", _TEXT, "text"), ("where", _TEXT, "text"),
                               ("final", (bool,), "true or false")):
        if field in doc and not _is(doc[field], kinds):
            raise bad(field, doc[field], want)
    groups = doc.setdefault("groups", {})
    if not isinstance(groups, dict) or not all(
            k.lstrip("-").isdigit() and isinstance(v, list) and all(_is(x, _INT) for x in v)
            for k, v in groups.items()):
        raise bad("groups", groups, "a map of group ids to lists of ranks")
    records = doc["records"]
    if not isinstance(records, list):
        raise bad("records", records, "a list")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise bad(f"records[{i}]", rec, "a record")
        for field, kinds in _RECORD.items():
            if not _is(rec.get(field), kinds):
                raise bad(f"records[{i}].{field}", rec.get(field), "what a dump writes there")
        shape = rec.get("shape")
        if not isinstance(shape, list) or not all(_is(d, _INT) for d in shape):
            raise bad(f"records[{i}].shape", shape, "a list of whole numbers")
        if rec["state"] not in STATES:
            raise bad(f"records[{i}].state", rec["state"], f"one of {list(STATES)}")
        rec.setdefault("note", "")
        rec.setdefault("where", "")
    doc.setdefault("reason", "")
    doc.setdefault("where", "")
    doc.setdefault("final", True)  # dumps of before were written on failures only
    return doc


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    """isinstance, where a bool is no number."""
    return isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)
