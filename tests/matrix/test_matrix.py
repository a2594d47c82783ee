"""The equivalence matrix: every combination a user can reach gives the one-process answer.

Each case (``matrix_cases``: model, dtype, ``fs.compile``, tp, pp and schedule, dp mode,
recompute, dropout, processes or devices, the layout a checkpoint is resumed on) trains
six steps with checkpoints after steps 2, 4 and 6, then resumes the step-2 checkpoint on
another layout and trains to the end; every loss, and every parameter, optimiser moment,
master copy, step count and loss scale of every checkpoint (loaded in one process) is
compared with the reference run (one process, uncompiled, the same dtype) within
``matrix_check.TOLERANCE``, bit for bit where the arithmetic is the same.

CI runs the all-pairs covering set (every pair of values of every two axes in some case);
``python tests/run.py --matrix full`` runs every runnable case (the full product).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import matrix_check as C
import matrix_run as R
import pytest
from matrix_cases import Case, all_pairs, full_product, uncovered

pytestmark = pytest.mark.timeout(600)

FULL = os.environ.get("FUELSPMD_MATRIX") == "full"
CASES = full_product() if FULL else all_pairs()
# The first runs in a seeded random order, so that the shards get alike shares and the
# cases run before a stop are a sample of the whole product, not its first models and
# dtypes. "i/n": this process runs every n-th first run from the i-th (tests/run.py
# --matrix full runs the shards side by side); the cases that differ only in where they
# resume are one shard's, one after the other, and share their first run
_i, _, _n = os.environ.get("FUELSPMD_MATRIX_SHARD", "0/1").partition("/")
_bases = list(dict.fromkeys(replace(c, resume="") for c in CASES))
random.Random(0).shuffle(_bases)
_base = {b: k for k, b in enumerate(_bases)}
CASES = sorted((c for c in CASES if _base[replace(c, resume="")] % int(_n) == int(_i)),
               key=lambda c: (_base[replace(c, resume="")], c.resume))


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The reference of a case (run once per session): its result and a function from
    a step to its checkpoint there, loaded once."""
    done: dict[Case, tuple[dict[str, Any], Any]] = {}

    def get(case: Case) -> tuple[dict[str, Any], Any]:
        ref = R.reference_case(case)
        if ref not in done:
            out = tmp_path_factory.mktemp("reference")
            loaded: dict[int, dict[str, Any]] = {}

            def state(k: int, ref: Case = ref, out: Path = out) -> dict[str, Any]:
                if k not in loaded:
                    loaded[k] = R.saved(ref, out / f"step-{k}")
                return loaded[k]
            done[ref] = (R.run(ref, (1, 1, 1), out), state)
        return done[ref]
    return get


def test_the_covering_set_covers_every_pair() -> None:
    """Generated, not hand-picked: every runnable pair of axis values is in the CI set."""
    assert uncovered(all_pairs()) == []
    assert len(all_pairs()) < len(full_product()) // 100


@pytest.fixture(scope="session")
def first_runs() -> dict[Case, tuple[dict[str, Any], Path]]:
    """The first run of each case kept for the next case that differs only in where it
    resumes (only the previous one: they are consecutive)."""
    return {}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_configuration_gives_the_one_process_answer(case: Case, references: Any,
                                                      first_runs: dict[Case, Any],
                                                      tmp_path: Path) -> None:
    ref, ref_state = references(case)
    base = replace(case, resume="")
    got = C.execute(case, tmp_path, first_runs.get(base))
    # a case writes some 20-60 MB of checkpoints, the full product about 100 GB: a first
    # run's go when the next first run starts, a passed case's resumed run at once
    for kept, (_, folder) in first_runs.items():
        if kept != base:
            shutil.rmtree(folder, ignore_errors=True)
    first_runs.clear()
    first_runs[base] = (got.first, got.first_dir)
    errs = C.differences(case, got, ref, ref_state)
    bad = C.failures(case, errs)
    assert not bad, (f"{case.name} ({case.layout()} resumed on {case.resumed_layout()}) "
                     f"differs from one process:\n  " + "\n  ".join(bad[:20]))
    if case.compiled:
        assert got.first["replays"] >= R.STEPS - 3, got.first
    shutil.rmtree(got.resumed_dir, ignore_errors=True)
