"""Running a configuration of the matrix and comparing it with its reference.

:func:`execute` runs a case and its resumption (ranks as ``mpiexec`` processes or as the
devices of a DeviceGroup in this process); :func:`differences` measures every loss, every
saved parameter, optimiser state entry and master copy against the reference run, as the
relative error of each value (a loss) or of each tensor in norm (``|a - b| / |b|``);
:data:`TOLERANCE` says how much rounding each dtype may account for, and why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matrix_run as R
import numpy as np
from matrix_cases import Case

HERE = Path(__file__).resolve().parent
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
    "mpiexec")
DEADLINE_S = 180.0  # one mpiexec run of a case; a hang fails the case instead of CI

# The relative error a value may have against the one-process run, per dtype, and why.
# Layouts sum in other orders (TP partial sums, dp and micro-batch means, pipelined
# gradient accumulation), so values differ by roundoff, which AdamW then carries: its step
# is lr * m / sqrt(v) whatever the gradient's size, so a gradient element whose sign
# rounding flips moves its parameter by twice the learning rate (a parameter's error is
# taken relative to at least the size its updates can have, lr per element and step).
# float32: the roundoff of a sum of n terms grows as sqrt(n) eps (eps 6e-8) and six steps
# carry it; measured over the all-pairs set the largest errors were 1.4e-6 (a loss) and
# 3.6e-4 (a Llama attention weight's first moment, with dropout), the bounds are 7x and 5x
# those. 16-bit: every activation and gradient is rounded to 8 (bfloat16) or 11 (float16)
# bits, and the attention's softmax gradient at these small scores is a difference of
# nearly equal terms, so the query/key gradients, and their moments, carry errors of
# 2^-8 / 2^-11 amplified by that cancellation: measured up to 0.11 (bfloat16) and 0.02
# (float16) in norm, losses 7e-4 and 1e-4; the bounds are about 3x and 5x those. A defect
# (a missing reduction, a wrong shard, a stale or lost state, a skipped step) is an error
# of order 1 in a loss or a moment, and makes the step counts or loss scales differ.
TOLERANCE: dict[str, dict[str, float]] = {
    "float32": {"loss": 1e-5, "tensor": 2e-3},
    "bfloat16": {"loss": 5e-3, "tensor": 0.3},
    "float16": {"loss": 1e-3, "tensor": 0.1},
}
# Attention key biases: their exact gradient is zero (a constant added to every score of
# a row cancels in the softmax), so their values and moments after AdamW steps are
# rounding noise raised to the learning rate's size; they are held to that bound instead.
NOISE = ("attn.k.bias",)


@dataclass
class Outcome:
    """A case's runs: the first (steps 1..STEPS, checkpoints in ``first_dir``) and the
    resumed one (RESUME_AT+1.., in ``resumed_dir``)."""

    first: dict[str, Any]
    resumed: dict[str, Any]
    first_dir: Path
    resumed_dir: Path
    seconds: float


def _mpi(case: Case, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``runs`` of ``case`` (layout, dir, start, load) in one ``mpiexec`` job of as many
    ranks as the largest needs; their results."""
    if MPIEXEC is None:
        raise RuntimeError("no mpiexec beside this Python: pip install -e '.[test]'")
    n = max(r["layout"][0] * r["layout"][1] * r["layout"][2] for r in runs)
    for r in runs:
        r["result"] = str(Path(r["dir"]).with_suffix(".json"))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, str(HERE / "matrix_run.py"),
           "--case", json.dumps(case.as_json()), "--runs", json.dumps(runs)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPI_", "OMPI_", "SLURM_", "HYDRA",
                                "FUELSPMD_"))}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"{case.name}: past its {DEADLINE_S} s deadline:\n"
                             f"{log[-4000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{case.name}: exit {proc.returncode}:\n{log[-8000:]}")
    return [json.loads(Path(r["result"]).read_text()) for r in runs]


def execute(case: Case, out: Path, first: tuple[dict[str, Any], Path] | None = None
            ) -> Outcome:
    """Run ``case`` to the end (unless ``first`` gives that run's result and directory:
    a case that differs only in where it resumes), then resume its step-``RESUME_AT``
    checkpoint on its resumed layout (in ``out/first`` and ``out/resumed``)."""
    start = time.monotonic()
    b_dir, again = out / "resumed", case.resumed_layout()
    runs = []
    if first is None:
        a_dir = out / "first"
        runs.append({"layout": case.layout(), "dir": str(a_dir), "start": 0, "load": None})
    else:
        a, a_dir = first
    runs.append({"layout": again, "dir": str(b_dir), "start": R.RESUME_AT,
                 "load": str(a_dir / f"step-{R.RESUME_AT}")})
    if case.ranks == "processes":
        got = _mpi(case, runs)
    else:
        got = [R.run(case, tuple(r["layout"]), Path(r["dir"]), start=r["start"],
                     load_from=None if r["load"] is None else Path(r["load"]))
               for r in runs]
    if first is None:
        a = got[0]
    b = got[-1]
    return Outcome(a, b, a_dir, b_dir, time.monotonic() - start)


def _rel(a: np.ndarray, b: np.ndarray, floor: float = 0.0) -> float:
    """``|a - b| / max(|b|, floor)`` in norm."""
    scale = max(float(np.linalg.norm(b)), floor)
    return float(np.linalg.norm(a - b)) / scale if scale else float(np.linalg.norm(a))


def differences(case: Case, got: Outcome, ref: dict[str, Any],
                ref_state: Callable[[int], dict[str, Any]]) -> dict[str, float]:
    """Every compared value's error: ``loss k`` per step of each run, ``<checkpoint>
    <tensor>`` per saved tensor (noise tensors as a multiple of their bound), and the
    step counts and loss scales as 0 (equal) or inf (not). ``ref_state(k)``: the
    reference's checkpoint of step ``k`` as :func:`matrix_run.saved` gives it."""
    errs: dict[str, float] = {}
    for k, (a, b) in enumerate(zip(got.first["losses"], ref["losses"])):
        errs[f"loss {k + 1}"] = abs(a - b) / abs(b)
    for k, (a, b) in enumerate(zip(got.resumed["losses"], ref["losses"][R.RESUME_AT:])):
        errs[f"resumed loss {R.RESUME_AT + k + 1}"] = abs(a - b) / abs(b)
    if len(got.first["losses"]) != R.STEPS or \
            len(got.resumed["losses"]) != R.STEPS - R.RESUME_AT:
        errs["step count"] = float("inf")
    errs["loss scales"] = 0.0 if got.first["scales"] == ref["scales"] and \
        got.resumed["scales"] == ref["scales"][R.RESUME_AT:] else float("inf")
    bound = 2 * R.LR * R.STEPS  # what AdamW moves a parameter by at most, twice over
    pairs = [(f"step-{k}", got.first_dir / f"step-{k}") for k in R.SAVES]
    pairs.append((f"resumed step-{R.STEPS}", got.resumed_dir / f"step-{R.STEPS}"))
    for label, path in pairs:
        done = int(label.rsplit("-", 1)[1])
        a, b = R.saved(case, path), ref_state(done)
        if a.keys() != b.keys():
            errs[f"{label} names"] = float("inf")
            continue
        errs[f"{label} steps, scaler"] = 0.0 if (a["steps"], a["scaler"]) == (
            b["steps"], b["scaler"]) else float("inf")
        for name in a.keys() - {"steps", "scaler"}:
            if any(n in name for n in NOISE):
                errs[f"{label} {name} (noise)"] = float(np.abs(a[name] - b[name]).max()) / bound
            elif name.rsplit("/", 1)[-1] in ("exp_avg", "exp_avg_sq"):
                errs[f"{label} {name}"] = _rel(a[name], b[name])
            else:  # a parameter: a zero-initialised bias is only its updates, each of
                # up to the learning rate per element and step
                floor = R.LR * done * np.sqrt(a[name].size)
                errs[f"{label} {name}"] = _rel(a[name], b[name], floor)
    return errs


def exact(case: Case) -> bool:
    """Whether ``case`` runs the reference's arithmetic: one rank, where compiling,
    recomputing and the kind of rank change no operation."""
    return case.size == 1 and case.resumed_layout() == (1, 1, 1)


def failures(case: Case, errs: dict[str, float]) -> list[str]:
    """The compared values past their tolerance (bit equality where :func:`exact`)."""
    tol = TOLERANCE[case.dtype]
    out = []
    for key, e in sorted(errs.items()):
        limit = (0.0 if exact(case) and "(noise)" not in key else
                 1.0 if "(noise)" in key else
                 tol["loss"] if "loss" in key and "scales" not in key else
                 0.0 if key.endswith(("scales", "count", "names", "scaler")) else
                 tol["tensor"])
        if not e <= limit:
            out.append(f"{key}: {e:.3g} > {limit:.3g}")
    return out
