"""The flight recorder, ``fuelspmd trace``, and the guard's parts that need one process.

The guard's multi-rank behaviour is tested under mpiexec in tests/mpi/test_guard.py; here:
the fingerprint's wire form and agreement rules, the ring buffer and its dumps, the trace
analysis on dumps written by real Recorders, and the size-1 and bad-argument paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fuelspmd.cli.trace import main as trace_main
from fuelspmd.comm import Fingerprint, Guard, GuardedTransport, Recorder, load_dump
from fuelspmd.comm.fingerprint import FP_LEN, describe, diff, group_id, render
from fuelspmd.errors import ConfigError
from fuelspmd.transport import SelfTransport


def fp(seq: int, op: str = "all_reduce", **kw: object) -> Fingerprint:
    base: dict[str, object] = {"shape": (8,), "dtype": "float32", "reduce_op": "sum",
                               "group": 7}
    if op in ("send", "recv", "broadcast", "barrier", "all_gather"):
        base["reduce_op"] = None
    base.update(kw)
    return Fingerprint(seq, op, **base)  # type: ignore[arg-type]



def _log(rec: Recorder, f: Fingerprint, state: str, note: str = "") -> None:
    """Record ``f`` with its own numbers and settle it as ``state``."""
    rec.mark(rec.push(f), state, note)

def test_encode_is_fixed_int64_and_equal_fingerprints_agree() -> None:
    a = fp(3).encode()
    assert a.dtype == np.int64 and a.shape == (FP_LEN,)
    assert diff(a, fp(3).encode()) == []
    # seq (every op) may differ between the ranks of a collective; cseq may not
    assert diff(a, fp(9, cseq=3).encode()) == []
    assert diff(a, fp(4).encode()) == ["seq"]


@pytest.mark.parametrize(("change", "field"), [
    ({"op": "all_gather", "reduce_op": None}, "op"), ({"shape": (9,)}, "shape"),
    ({"shape": (2, 4)}, "shape"), ({"dtype": "float64"}, "dtype"),
    ({"reduce_op": "max"}, "reduce_op"), ({"group": 8}, "group")])
def test_each_collective_field_is_compared(change: dict[str, object], field: str) -> None:
    a, b = fp(5).encode(), fp(5, **change).encode()
    assert field in diff(a, b)
    assert render(a, field) != render(b, field)


def test_root_and_p2p_rules() -> None:
    b0 = fp(1, "broadcast", root=0).encode()
    assert diff(b0, fp(1, "broadcast", root=1).encode()) == ["root"]
    send = fp(4, "send", src=0, dst=1, tag=5, cseq=2).encode()
    recv = fp(9, "recv", src=0, dst=1, tag=5, cseq=2).encode()
    assert diff(send, recv) == []  # op numbers differ, epochs agree
    assert diff(send, fp(9, "recv", src=0, dst=1, tag=6, cseq=2).encode()) == ["tag"]
    assert diff(send, fp(9, "send", src=1, dst=0, tag=5, cseq=2).encode()) == [
        "op", "src", "dst"]
    assert diff(send, fp(9, "recv", src=0, dst=1, tag=5, cseq=3).encode()) == ["seq"]
    assert "op" in diff(send, fp(4, cseq=2).encode())  # a send met by a collective


def test_render_and_describe_give_values() -> None:
    a = fp(12, shape=(2, 3, 4, 5, 6), cseq=4).encode()
    assert render(a, "shape") == "(2, 3, 4, 5, ...) [720 elements]"
    assert render(a, "seq") == "op #12 (collective #4)"
    assert describe(a).startswith("all_reduce op #12 (collective #4)")
    assert render(fp(1, dtype="complex64").encode(), "dtype").startswith("#")


def test_group_id_depends_on_members_and_color() -> None:
    assert group_id([0, 1]) == group_id((0, 1))
    assert len({group_id([0, 1]), group_id([0, 2]), group_id([0, 1], color=1)}) == 3
    assert 0 <= group_id(range(1000)) < 2**31


def test_ring_keeps_the_last_records_and_dumps_json(tmp_path: Path) -> None:
    rec = Recorder(capacity=4)
    for i in range(10):
        _log(rec, fp(i), "completed")
    assert [r.seq for r in rec.records()] == [6, 7, 8, 9]
    path = rec.dump(tmp_path / "d", 3, reason="why")
    assert path.name == "rank3.json"
    doc = load_dump(path)
    assert doc["rank"] == 3 and doc["reason"] == "why" and doc["capacity"] == 4
    assert [r["seq"] for r in doc["records"]] == [6, 7, 8, 9]
    assert doc["records"][0]["state"] == "completed" and doc["records"][0]["t_done"]


def test_ring_tickets_mark() -> None:
    """The guard's calls: a mark of an overwritten slot is ignored, a later mark without a
    note keeps the earlier note."""
    rec = Recorder(capacity=2)
    t0, t1 = rec.push(fp(0), 0, 0), rec.push(fp(1), 1, 1)
    rec.mark(t0, "completed")
    rec.push(fp(2), 2, 2)  # overwrites ticket 0's slot
    rec.mark(t0, "timeout", "stale")
    assert [(r.seq, r.state) for r in rec.records()] == [(1, "issued"), (2, "issued")]
    assert len(rec) == 2
    rec.mark(t1, "mismatch", "why")
    rec.mark(t1, "mismatch")
    (last, _) = rec.records()
    assert last.state == "mismatch" and last.note == "why" and last.t_done is not None


def test_recorder_and_dump_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        Recorder(capacity=0)
    bad = tmp_path / "rank0.json"
    bad.write_text(json.dumps({"x": 1}))
    with pytest.raises(ConfigError, match="not a flight-recorder dump"):
        load_dump(bad)
    assert trace_main([str(tmp_path)]) == 2
    assert trace_main([str(tmp_path / "empty")]) == 2


def _dumps(tmp_path: Path, ranks: int, skip: int | None, n: int = 6,
           change: dict[str, object] | None = None) -> Path:
    """Write what ``ranks`` Recorders would hold after ``n`` collectives, rank ``skip``
    missing the last one (stuck) or, with ``change``, doing it differently."""
    for r in range(ranks):
        rec = Recorder()
        for i in range(n):
            if r == skip and i == n - 1 and change is None:
                break
            kw = change if (r == skip and i == n - 1 and change) else {}
            _log(rec, fp(i, **kw), "completed" if i < n - 1 else "timeout")
        rec.dump(tmp_path, r)
    return tmp_path


def test_trace_names_the_missing_rank_and_number(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_main([str(_dumps(tmp_path, 4, skip=2))]) == 1
    out = capsys.readouterr().out
    assert "FIRST DIFFERENCE at collective #5" in out
    assert "rank 2 never issued collective #5" in out
    assert "ranks 0, 1, 3: op #5 all_reduce" in out


def test_trace_names_differing_fields(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_main([str(_dumps(tmp_path, 3, skip=1, change={"dtype": "float64"})),
                       "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    (d,) = doc["differences"]
    assert d["cseq"] == 5 and d["fields"] == ["dtype"] and d["missing"] == []


def test_trace_aligned_dumps_exit_zero(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    for r in range(2):
        rec = Recorder()
        for i in range(5):
            _log(rec, fp(i), "completed")
        rec.dump(tmp_path, r)
    assert trace_main([str(tmp_path)]) == 0
    assert "collectives #0..#4 line up on every rank" in capsys.readouterr().out


def test_trace_lists_failed_p2p_when_collectives_agree(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in range(2):
        rec = Recorder()
        _log(rec, fp(0), "completed")
        op = "send" if r == 0 else "recv"
        _log(rec, fp(1, op, src=0, dst=1, tag=5 + r, cseq=1), "mismatch", "tag")
        rec.dump(tmp_path, r)
    assert trace_main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "failed operations" in out and "rank 1: op #1 recv" in out and "tag=6" in out


def test_size_one_guard_checks_nothing_and_records(tmp_path: Path) -> None:
    rec = Recorder()
    g = GuardedTransport(SelfTransport(), recorder=rec, trace_dir=tmp_path)
    buf = np.arange(4.0)
    g.all_reduce(buf, "sum").wait()
    out = np.empty(4)
    g.send(buf, 0, 1).wait()
    g.recv(out, 0, 1).wait()
    np.testing.assert_array_equal(out, buf)
    assert [r.fp.op for r in rec.records()] == ["all_reduce", "send", "recv"]
    assert all(r.state == "completed" for r in rec.records())
    assert g.guard.dump(reason="test") == tmp_path / "rank0.json"


def test_guard_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="mode"):
        Guard(SelfTransport(), mode="paranoid")
    with pytest.raises(ConfigError, match="timeout"):
        Guard(SelfTransport(), timeout=0)
    with pytest.raises(ValueError, match="unknown op"):
        Fingerprint(0, "allreduce", (1,))
