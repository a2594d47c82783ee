"""``fs.init(trace_dir=...)``: a real 4-rank ``mpiexec`` job leaves flight-recorder dumps
that ``fuelspmd trace`` reads back.

Two jobs, each started from this one pytest process in its own process group, with a
deadline after which the group is killed:

- *timeout*: rank 2 skips a collective of ``world.comm`` and stays away (stuck in
  compute); ranks 0, 1 and 3 raise CommTimeoutError after ``init(timeout=...)``, the guard
  dumps, the exception is unhandled, and the crash handler dumps again before aborting the
  job (which kills rank 2, so it leaves no dump). ``fuelspmd trace`` names rank 2 and the
  operation and collective numbers from the survivors' dumps.
- *mismatch*: rank 2 skips the collective and goes on to the next one (a barrier): every
  rank raises CollectiveMismatchError and dumps, so all four files are there, and
  ``fuelspmd trace`` points at the collective where rank 2 parted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import mpiexec, needs_mpiexec, run_job

FUELSPMD = shutil.which("fuelspmd", path=str(Path(sys.executable).parent))
pytestmark = needs_mpiexec

GOOD = 40  # good collectives through world.comm before rank 2 skips one
TIMEOUT = 3.0  # long enough for a good collective on 4 ranks sharing 2 busy cores

PROGRAM = """
import os, sys, time
import numpy as np
import ml_dtypes
from mpi4py import MPI
import fuelspmd as fs

MPI.COMM_WORLD.Barrier()  # every rank started and imported: the short timeout is the test's
w = fs.init(timeout={timeout}, trace_dir=sys.argv[1])
comm = w.comm
x = fs.tensor(np.full(8, w.rank + 1, np.float32))
for i in range({good}):
    y = comm.all_reduce(x).numpy()
    assert y[0] == w.size * (w.size + 1) // 2, y
g = comm.transport
os.write(1, f"NEXT {{w.rank}} {{g.seq}} {{g.cseq}}\\n".encode())
if w.rank == 2:
    if sys.argv[2] == "timeout":
        time.sleep(60)  # stuck in compute: never issues the all_reduce below
    comm.barrier()      # skipped the all_reduce: issues the next collective instead
else:
    comm.all_reduce(x).numpy()
os.write(1, f"PASSED {{w.rank}}\\n".encode())
"""


def _job(tmp: Path, case: str, deadline: float = 60.0) -> tuple[int, str, str, float]:
    script = tmp / "skip.py"
    script.write_text(PROGRAM.format(timeout=TIMEOUT, good=GOOD))
    job = run_job(mpiexec(4, sys.executable, str(script), str(tmp / "trace"), case),
                  deadline=deadline)
    return job.code, job.out, job.err, job.seconds


def _trace(where: Path, *extra: str) -> tuple[int, str]:
    cmd = [FUELSPMD] if FUELSPMD else [sys.executable, "-m", "fuelspmd"]
    r = subprocess.run([*cmd, "trace", str(where), *extra], capture_output=True, text=True,
                       timeout=60)
    return r.returncode, r.stdout + r.stderr


def _next_numbers(out: str) -> tuple[int, int]:
    rows = {tuple(int(v) for v in line.split()[2:]) for line in out.splitlines()
            if line.startswith("NEXT ")}
    assert len(rows) == 1, out  # every rank had issued the same operations so far
    seq, cseq = rows.pop()
    return seq, cseq


@pytest.mark.timeout(120)
def test_timeout_dumps_name_the_rank_that_skipped(tmp_path: Path) -> None:
    rc, out, err, took = _job(tmp_path, "timeout")
    assert rc != 0, f"{out}\n{err}"
    assert "PASSED" not in out, out
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "CommTimeoutError" in err and "aborting all 4 ranks" in err, err
    seq, cseq = _next_numbers(out)
    assert cseq == GOOD
    files = sorted(p.name for p in (tmp_path / "trace").glob("rank*.json"))
    # rank 2 was killed by the abort while stuck; each rank that timed out left its dump
    assert {"rank0.json", "rank1.json", "rank3.json"} <= set(files), files
    for r in (0, 1, 3):
        doc = json.loads((tmp_path / "trace" / f"rank{r}.json").read_text())
        last = doc["records"][-1]
        assert (last["op"], last["seq"], last["cseq"], last["state"]) == (
            "all_reduce", seq, cseq, "timeout"), last
        assert all(rec["state"] == "completed" for rec in doc["records"][:-1])
        assert len(doc["records"]) == GOOD + 1
        assert "[2]" in last["note"], last["note"]  # the guard named the missing rank
        assert doc["reason"].startswith("crash handler: unhandled CommTimeoutError"), doc
    code, text = _trace(tmp_path / "trace")
    assert code == 1, text
    assert f"op #{seq} all_reduce" in text and "[timeout]" in text, text
    assert f"collective #{cseq}" in text and "rank(s) [2] did not reach it" in text, text


@pytest.mark.timeout(120)
def test_mismatch_dumps_on_every_rank_point_at_the_skipped_collective(tmp_path: Path) -> None:
    rc, out, err, took = _job(tmp_path, "mismatch")
    assert rc != 0, f"{out}\n{err}"
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "CollectiveMismatchError" in err, err
    seq, cseq = _next_numbers(out)
    files = sorted(p.name for p in (tmp_path / "trace").glob("rank*.json"))
    assert files == [f"rank{r}.json" for r in range(4)], files
    code, text = _trace(tmp_path / "trace")
    assert code == 1, text
    assert f"FIRST DIFFERENCE at collective #{cseq}:" in text, text
    assert f"rank 2: op #{seq} barrier" in text, text
    assert f"ranks 0, 1, 3: op #{seq} all_reduce" in text, text
    assert "differing fields: op, shape, dtype, reduce_op" in text, text
    code, text = _trace(tmp_path / "trace", "--json")
    diffs = json.loads(text)["differences"]
    assert diffs[0]["cseq"] == cseq and diffs[0]["fields"][0] == "op", diffs
