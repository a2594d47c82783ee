"""Who is stuck where: a hung job's flight records, read by ``fuelspmd trace`` (issue 41).

``hang_job.py`` runs 4 ranks under a real launcher with ``trace_dir``: rank 2 gets stuck
in Python (``time.sleep``) while ranks 0, 1 and 3 wait in collective #20. Before, the
collective a rank was blocked in was not in its record (records were pushed after the
meeting), SIGINT wrote no record under some launchers, and ``fuelspmd trace`` said
"collectives #0..#19 line up" and exited 0. Now each way a hung job ends or is looked at
must leave records from which the trace names the operation where the ranks part, the rank
that never arrived and where it was instead, each with its source line, and exits 1:

- SIGUSR1 to every rank: each says where it is and dumps, and the job goes on; then
  SIGTERM to every rank (a scheduler's time limit, ``timeout``, ``scancel``) ends it;
- SIGINT to the launcher (Ctrl-C), with rank 3 stuck and rank 2 waiting in a recv of its
  message: the trace gives each its own place;
- the deadline: ``fs.init(timeout=3)``, the waiting ranks' CommTimeoutError says what the
  stuck rank was last seen doing (it said "nothing").

CI runs them under MPICH's ``mpiexec``; the long run (``python tests/run.py --long``) also
under Open MPI's ``mpiexec`` and ``srun``.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget import long_only
from hung import Background, launcher_for, line_of

from fuelspmd.cli.trace import main as trace_main

JOB = Path(__file__).with_name("hang_job.py")
STUCK, WAIT = line_of(JOB, "<- STUCK"), line_of(JOB, "<- WAIT")
IN_RECV = line_of(JOB, "<- IN RECV")
pytestmark = pytest.mark.timeout(180)


LAUNCHERS = [pytest.param("mpich"), pytest.param("openmpi", marks=long_only),
             pytest.param("srun", marks=[long_only, pytest.mark.slurm])]


def _trace(where: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict]:
    capsys.readouterr()
    code = trace_main([str(where)])
    text = capsys.readouterr().out
    trace_main([str(where), "--json"])
    return code, text, json.loads(capsys.readouterr().out)


def _names_the_stuck_rank(text: str, doc: dict, *, final: bool) -> None:
    """The trace's verdict on hang_job.py's records: collective #20, rank 2 missing, at
    its time.sleep; the others in the all_reduce at their line."""
    assert "FIRST DIFFERENCE at collective #20" in text, text
    assert re.search(rf"ranks 0, 1, 3: op #20 all_reduce .*\[(waiting|timeout)\] at "
                     rf"\S*hang_job\.py:{WAIT} in main", text), text
    assert re.search(rf"rank 2 never issued collective #20 .*: it was at \S*hang_job\.py:"
                     rf"{STUCK} in main, in no operation", text), text
    (d,) = doc["differences"]
    assert d["cseq"] == 20 and d["missing"] == [2], d
    assert f"hang_job.py:{STUCK}" in d["instead"]["2"], d
    assert (doc["ended_badly"] == [0, 1, 2, 3]) == final, doc


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigusr1_shows_where_every_rank_is_and_sigterm_ends_the_job(
        launcher: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str],
        fault_time: Callable[[str, str, float], None]) -> None:
    """SIGUSR1 to every rank: each says where it is and dumps, and the job goes on; then
    SIGTERM to every rank (a scheduler's time limit) ends it, and the dumps say so."""
    with Background(launcher_for(launcher, request), 4, [str(JOB), str(tmp_path / "trace")],
                    tmp_path) as job:
        pids = job.ready(4)
        time.sleep(0.5)  # the waiting ranks are past their first slice
        start = time.monotonic()
        job.signal_ranks(pids, signal.SIGUSR1)
        said = job.wait_for(r"\[rank (\d)\] SIGUSR1: at .*", 4)
        fault_time("hung, SIGUSR1 to every rank: all four lines", launcher,
                   time.monotonic() - start)
        assert job.running(), job.output()
        code, text, doc = _trace(tmp_path / "trace", capsys)
        assert code == 1, text  # the ranks part at #20: a hang, whatever the dumps' reason
        _names_the_stuck_rank(text, doc, final=False)
        start = time.monotonic()
        job.signal_ranks(pids, signal.SIGTERM)
        ended, output = job.wait(60)
        took = time.monotonic() - start
    fault_time("hung, SIGTERM to every rank", launcher, took)
    by_rank = {int(m[1]): m[0] for m in said}
    assert f"hang_job.py:{STUCK} in main, in no operation" in by_rank[2], by_rank
    for r in (0, 1, 3):
        assert re.search(rf"hang_job\.py:{WAIT} in main; in all_reduce op #20 \(collective "
                         r"#20\) .*; flight record \S*rank\d\.json", by_rank[r]), by_rank
    assert ended != 0 and took < 20, f"{ended}, {took:.1f} s\n{output}"
    code, text, doc = _trace(tmp_path / "trace", capsys)
    assert code == 1, text
    _names_the_stuck_rank(text, doc, final=True)
    assert "the job did not end cleanly" in text and "dump reason: crash handler: SIGTERM" in text


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ctrl_c_leaves_records_naming_each_rank_that_never_arrived(
        launcher: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str],
        fault_time: Callable[[str, str, float], None]) -> None:
    """SIGINT to the launcher, which forwards it; rank 3 is stuck in Python and rank 2 waits
    in a recv of its next message: the trace says where each of the two was."""
    with Background(launcher_for(launcher, request), 4,
                    [str(JOB), str(tmp_path / "trace"), "--in-recv"], tmp_path) as job:
        job.ready(4)
        time.sleep(0.5)
        start = time.monotonic()
        job.signal_launcher(signal.SIGINT)
        if launcher == "srun":  # srun's first Ctrl-C reports; a second within 1 s ends it
            time.sleep(0.3)
            job.signal_launcher(signal.SIGINT)
        ended, output = job.wait(60)
        took = time.monotonic() - start
    fault_time("hung, Ctrl-C to the launcher", launcher, took)
    assert ended != 0 and took < 20, f"{ended}, {took:.1f} s\n{output}"
    dumped = sorted(int(p.name[4:-5]) for p in (tmp_path / "trace").iterdir())
    if launcher == "srun":  # its second Ctrl-C kills the step: some ranks may not dump
        assert dumped, output
    else:
        assert dumped == [0, 1, 2, 3], output
    code, text, doc = _trace(tmp_path / "trace", capsys)
    assert code == 1, text
    assert doc["ended_badly"] == dumped, doc
    absent = [r for r in range(4) if r not in dumped]
    if absent:  # srun's second Ctrl-C: the trace names who left no record, and that is all
        assert re.search(rf"{'ranks' if len(absent) > 1 else 'rank'} "
                         rf"{', '.join(map(str, absent))} left no dump", text), text
        return
    assert re.search(rf"ranks 0, 1: op #20 all_reduce .*\[waiting\] at \S*hang_job\.py:"
                     rf"{WAIT} in main", text), text
    assert re.search(rf"rank 2 never issued collective #20 .*: it was in op #20 recv .*src=3 "
                     rf"dst=2 .*\[waiting\] at \S*hang_job\.py:{IN_RECV} in main", text), text
    assert re.search(rf"rank 3 never issued collective #20 .*: it was at \S*hang_job\.py:"
                     rf"{STUCK} in main, in no operation", text), text
    # MPICH and srun forward the SIGINT; Open MPI's mpirun sends SIGTERM to every rank
    said = "SIGTERM" if launcher == "openmpi" else "SIGINT"
    assert f"dump reason: crash handler: {said}" in text, text


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_deadline_says_what_the_stuck_rank_was_last_seen_doing(
        launcher: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str],
        fault_time: Callable[[str, str, float], None]) -> None:
    with Background(launcher_for(launcher, request), 4,
                    [str(JOB), str(tmp_path / "trace"), "--timeout", "3"], tmp_path) as job:
        job.ready(4)
        start = time.monotonic()
        code, output = job.wait(60)
        fault_time("hung, timeout=3 passes (from the last READY)", launcher,
                   time.monotonic() - start)
    assert code != 0, output
    seen = re.findall(r"rank\(s\) \[2\] did not reach it within 3 s \(last seen from rank 2: "
                      r"([^;]*)", output)
    assert seen, output
    assert all("it joined collective #19 (all_reduce (8,) float32, completed here" in s
               and "has not waited in an operation of this group since" in s
               for s in seen), seen
    assert "last seen from rank 2: nothing" not in output
    code, text, doc = _trace(tmp_path / "trace", capsys)
    assert code == 1, text
    # rank 2, asleep, was killed by the abort and wrote nothing (MPICH, srun), or the
    # launcher sent it SIGTERM first (Open MPI) and it dumped, saying where it was
    assert ("rank 2 left no dump (killed, or ended by the job's abort before it could "
            "write), so never reported reaching collective #20, which ranks 0, 1, 3 "
            "reached" in text) or re.search(rf"rank 2 never issued collective #20 .*: it was "
                                            rf"at \S*hang_job\.py:{STUCK} in main, in no "
                                            "operation", text), text
    assert re.search(rf"rank 0: op #20 all_reduce .*\[timeout\] at \S*hang_job\.py:{WAIT} "
                     r"in main: .*rank\(s\) \[2\] did not reach it", text), text
    assert doc["differences"][0]["missing"] == [2], doc
