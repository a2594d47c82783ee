#!/usr/bin/env bash
# The prepared GPU check of issue 11: step 2 of two, run on the machine with the GPU.
#
#   bash tests/gpu/fetch_wheels.sh      here, with PyPI: the wheels the GPU image lacks -> .whl/
#   bash tests/gpu/run.sh               there (the device tool's run, carry [".whl"]), or on
#                                       any machine with an NVIDIA GPU, from the repo root
#
# The GPU machine reaches no network. So nothing is installed from an index when .whl/ holds
# wheels: the machine's own Python (PYTHON, else /opt/torch/.venv/bin/python3 where that
# exists, else python3) keeps its cupy (any cupy-cudaXXx), NCCL wheel, numpy, pytest...,
# the carried wheels go with `pip install --no-index --no-deps --target` into a site folder
# (FUELSPMD_GPU_SITE, default build/gpu-site, made anew each run) on PYTHONPATH, mpiexec and
# libmpi come from the mpich wheel there (bin/ on PATH, lib/ on LD_LIBRARY_PATH), and
# fuelspmd runs from this tree (PYTHONPATH=.:transports) with a generated dist-info that
# registers its entry points (the fuelspmd.transports plugins). Without .whl/ the same
# packages are fetched by name from the index pip is configured with (and cupy-cuda12x +
# nvidia-nccl-cu12 when the Python has no cupy).
#
# Then, under one global deadline of 7.5 minutes:
#   env        what is installed and where from; exit 1 naming any missing package
#   nccl-1rank the NCCL transport bootstrapped over MPI at one rank (mpiexec -n 1), and the
#              MPI transport with GPU buffers; at N ranks too when there are N >= 2 GPUs
#   bench      fused elementwise chain vs eager cupy, TP layer matmul vs cuBLAS
#   gpu-tests  the op table on cupy vs numpy, fused kernels, DeviceGroup cuda:0 + cpu:0
# A step that would start after the deadline is skipped and reported, so the whole run ends
# within about 8 minutes whatever happens. Without a GPU every step still runs as far as it
# can (the tests skip, the benchmarks are skipped) and the exit status is 3.
# Results: build/gpu-check/ holds summary.txt, gpu_figures.json, machine.log (nvidia-smi,
# the Python), one log and JUnit XML per step. When $OUT is set (the device tool), $OUT
# receives summary.txt, gpu_figures.json, all.log (machine.log, then every step's log in
# the order the steps ran) and logs.tar.gz (everything): 4 files, since the tool brings
# back at most 8. Exit status: 0 all passed, 1 a step failed or ran out of
# time, 2 not started from a fuelspmd tree, 3 no GPU (nothing on a GPU was checked).
set -euo pipefail

START=$(date +%s)
BUDGET_S=${FUELSPMD_GPU_BUDGET_S:-450}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$(pwd)
[[ -f pyproject.toml && -d transports/fuelspmd_nccl ]] || { echo "not a fuelspmd tree: $REPO"; exit 2; }
RESULTS=$REPO/build/gpu-check
SITE=${FUELSPMD_GPU_SITE:-$REPO/build/gpu-site}
rm -rf "$RESULTS"
mkdir -p "$RESULTS"
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x /opt/torch/.venv/bin/python3 ]]; then PY=/opt/torch/.venv/bin/python3
else PY=python3; fi
export PYTHONUNBUFFERED=1
declare -a STEPS=()
declare -a LOGS=(machine)  # the logs in the order they were written, for all.log
FAILED=0
NGPU=0

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME CAP_SECONDS COMMAND...: run with the smaller of CAP and the time left; record it
step() {
  local name=$1 cap=$2 status=0 limit
  shift 2
  limit=$(left)
  (( limit > cap )) && limit=$cap
  if (( limit < 10 )); then
    STEPS+=("$name: SKIPPED (global deadline reached)"); FAILED=1; return 0
  fi
  echo "== $name (limit ${limit}s)"
  LOGS+=("$name")
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log" || status=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t0 ))
  if (( status == 0 && NGPU >= 1 )) && [[ " $* " == *" pytest "* ]] \
       && ! grep -qE '[0-9]+ passed' "$RESULTS/$name.log"; then
    STEPS+=("$name: FAILED (no test passed on a machine with a GPU: see its log, ${took}s)")
    FAILED=1
  elif (( status == 0 )); then
    STEPS+=("$name: ok (${took}s)")
  elif [[ $status == 5 && $1 == "$PY" || $status == 5 && $1 == mpiexec ]] && (( NGPU == 0 )); then
    STEPS+=("$name: no test ran, every module skipped itself (no GPU) (${took}s)")
  else
    [[ $status == 124 || $status == 137 ]] && status="timeout after ${limit}s"
    STEPS+=("$name: FAILED ($status, ${took}s)"); FAILED=1
  fi
}

skip() { echo "== $1: skipped, $2"; STEPS+=("$1: SKIPPED ($2)"); }

# summary.txt, and the 4 files for $OUT; on every exit, also one cut short by an error
finish() {
  local rc=$?
  (( rc != 0 && FAILED == 0 )) && FAILED=1 && STEPS+=("run.sh itself stopped with status $rc")
  local verdict=$FAILED
  (( verdict == 0 && NGPU == 0 )) && verdict=3
  {
    echo "GPU check of $(git rev-parse --short HEAD 2>/dev/null || echo 'a tree without git')" \
         "on $(uname -n), $(date -u +%FT%TZ), ${NGPU} GPU(s), $(( $(date +%s) - START ))s," \
         "exit status $verdict"
    if (( NGPU == 0 )); then
      echo "  NO GPU ($(cat "$RESULTS/no-gpu.txt" 2>/dev/null || echo 'nvidia-smi lists none')):" \
           "nothing ran on a GPU; the GPU tests skipped"
    fi
    for s in "${STEPS[@]}"; do echo "  $s"; done
    for f in nccl-1rank "nccl-${NGPU}ranks" gpu-tests; do
      if [[ -f "$RESULTS/$f.log" ]]; then
        echo "  $f: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$RESULTS/$f.log" | tail -1 || true)"
      fi
    done
    if [[ -f "$RESULTS/bench.log" ]]; then sed -n '/^GPU figures/,$p' "$RESULTS/bench.log"; fi
  } | tee "$RESULTS/summary.txt"
  if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    cp "$RESULTS/summary.txt" "$OUT/"
    [[ -f "$RESULTS/gpu_figures.json" ]] && cp "$RESULTS/gpu_figures.json" "$OUT/"
    for f in "${LOGS[@]}"; do
      [[ -f "$RESULTS/$f.log" ]] && { echo "######## $f.log"; cat "$RESULTS/$f.log"; }
    done > "$OUT/all.log"
    tar czf "$OUT/logs.tar.gz" -C "$REPO/build" gpu-check
  fi
  exit "$verdict"
}
trap finish EXIT

# the machine section: its own log (the first of all.log), NGPU from nvidia-smi
machine() {
  echo "== machine: $(uname -n), $(uname -sr), $(nproc) cores"
  if nvidia-smi -L 2>/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
      || true
    nvidia-smi | grep -m1 'CUDA Version' || true  # the driver's CUDA version
  else
    echo "NO GPU: nvidia-smi is missing or found no NVIDIA driver. Every step still runs as far"
    echo "as it can (the GPU tests skip); the exit status is 3, since nothing ran on a GPU."
  fi
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
}
machine 2>&1 | tee "$RESULTS/machine.log"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)

# install: the carried wheels, else the same packages by name from the configured index
install() {
  set -euo pipefail
  rm -rf "$SITE" "$SITE.download"
  mkdir -p "$SITE"
  local pip=("$PY" -m pip install --disable-pip-version-check -q --no-deps --no-compile
             --no-cache-dir --upgrade --target "$SITE")
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  shopt -u nullglob
  if (( ! ${#wheels[@]} )); then
    local names=(mpich mpi4py array-api-compat array-api-strict pytest-mpi)
    "$PY" -c 'import cupy' 2>/dev/null || names+=("cupy-cuda12x>=14" "nvidia-nccl-cu12>=2.18.1" cuda-pathfinder)
    echo "no .whl/: downloading ${names[*]} from the configured index (offline, this fails:"
    echo "run tests/gpu/fetch_wheels.sh where PyPI is reachable and carry .whl)"
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
      --retries 1 --timeout 15 -d "$SITE.download" "${names[@]}"
    wheels=("$SITE".download/*.whl)
  fi
  echo "installing ${#wheels[@]} wheel(s) into $SITE, offline: ${wheels[*]##*/}"
  local dup
  dup=$(printf '%s\n' "${wheels[@]##*/}" | cut -d- -f1 | tr 'A-Z.-' 'a-z__' | sort | uniq -d)
  if [[ -n $dup ]]; then
    echo "two versions of: $dup among the wheels: rerun tests/gpu/fetch_wheels.sh, which keeps one"
    return 1
  fi
  "${pip[@]}" --no-index "${wheels[@]}"
  # pip --target drops a wheel's data files under lib/ (it takes lib/ for its own
  # lib/python...), and that is where the mpich wheel keeps libmpi.so.12: unpack them
  "$PY" - "$SITE" "${wheels[@]}" <<'PYEOF'
import re
import sys
import zipfile
from pathlib import Path

site, wheels = Path(sys.argv[1]), sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            m = re.match(r"[^/]+\.data/data/lib/(.+)", info.filename)
            if m and not info.is_dir():
                dest = site / "lib" / m[1]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(info))
                dest.chmod((info.external_attr >> 16) & 0o777 or 0o644)
PYEOF
  rm -rf "$SITE.download"
  # fuelspmd from the tree: only its metadata and entry points are installed here
  "$PY" - "$SITE" <<'PYEOF'
import re
import sys
from pathlib import Path

site = Path(sys.argv[1])
try:
    import tomllib
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
except ImportError:  # Python 3.10: read the two tables by hand
    text = Path("pyproject.toml").read_text()
    project = {"name": "fuelspmd", "version": re.search(r'^version = "(.+)"', text, re.M)[1],
               "entry-points": {}, "scripts": {}}
    for table, body in re.findall(r'^\[project\.(entry-points\."[^"]+"|scripts)\]\n'
                                  r'((?:[^\[\n].*\n|\n)*)', text, re.M):
        pairs = dict(re.findall(r'^(\w+) = "([^"]+)"', body, re.M))
        if table == "scripts":
            project["scripts"] = pairs
        else:
            project["entry-points"][table.split('"')[1]] = pairs
info = site / f"{project['name']}-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                               f"Version: {project['version']}\n")
groups = dict(project.get("entry-points", {}))
if project.get("scripts"):
    groups["console_scripts"] = project["scripts"]
(info / "entry_points.txt").write_text("".join(
    f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
    for g, eps in groups.items()))
(info / "INSTALLER").write_text("tests/gpu/run.sh\n")
print(f"fuelspmd {project['version']} runs from the tree; entry points in {info}")
PYEOF
}
export -f install
export PY SITE
step install 120 bash -c install

export PYTHONPATH="$REPO:$REPO/transports:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# every rank of this check is on this one machine: NCCL's bootstrap sockets stay on the
# loopback (an interface it would pick otherwise may be down or walled off on a sandboxed
# machine), and NCCL says why when it fails
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_DEBUG=${NCCL_DEBUG:-WARN}

step env 60 "$PY" - "$SITE" "$NGPU" "$RESULTS" <<'PYEOF'
"""Which package came from where; fail naming what is missing."""
import importlib
import os
import shutil
import sys
from importlib.metadata import PackageNotFoundError, version

site = os.path.abspath(sys.argv[1])
missing = []
for mod, dist in [("numpy", "numpy"), ("ml_dtypes", "ml_dtypes"),
                  ("threadpoolctl", "threadpoolctl"), ("array_api_compat", "array-api-compat"),
                  ("array_api_strict", "array-api-strict"), ("mpi4py", "mpi4py"),
                  ("pytest", "pytest"), ("pytest_timeout", "pytest-timeout"),
                  ("pytest_mpi", "pytest-mpi"), ("hypothesis", "hypothesis"),
                  ("cupy", None), ("fuelspmd", "fuelspmd"), ("fuelspmd_mpi", None),
                  ("fuelspmd_nccl", None)]:
    try:
        m = importlib.import_module(mod)
    except Exception as e:
        missing.append(mod)
        print(f"  {mod:18s} MISSING ({type(e).__name__}: {e})")
        continue
    try:
        ver = version(dist) if dist else getattr(m, "__version__", "")
    except PackageNotFoundError:
        ver = getattr(m, "__version__", "?")
    where = os.path.dirname(m.__file__ or "")
    if os.path.basename(m.__file__ or "") == "__init__.py":
        where = os.path.dirname(where)
    src = "carried" if where == site else "tree" if where.startswith(os.getcwd()) else where
    print(f"  {mod:18s} {ver:12s} {src}")
print("  mpiexec:", shutil.which("mpiexec") or "MISSING")
if missing or not shutil.which("mpiexec"):
    sys.exit(f"missing: {missing + ([] if shutil.which('mpiexec') else ['mpiexec'])}. "
             "Run tests/gpu/fetch_wheels.sh where PyPI is reachable and carry .whl "
             "(device tool: carry ['.whl']), or set PYTHON to a Python that has them")

import cupy
import fuelspmd_mpi
import fuelspmd_nccl

from fuelspmd.backend import cuda_device_count, cuda_unavailable_reason
from fuelspmd.transport import find_transports

print("transports:", sorted(find_transports()))
print("MPI:", fuelspmd_mpi.library_version())
nccl_why = fuelspmd_nccl.plugin.unavailable_reason()
print("NCCL:", nccl_why or fuelspmd_nccl.plugin.library_version())
why_none = cuda_unavailable_reason()
print("GPUs cupy sees:", cuda_device_count(), f"({why_none})" if why_none else "")
if why_none:
    with open(os.path.join(sys.argv[3], "no-gpu.txt"), "w") as fh:
        fh.write(why_none)
try:
    print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver",
          cupy.cuda.runtime.driverGetVersion())
except Exception as e:
    print(f"CUDA: not usable here ({type(e).__name__}: {e})")
if int(sys.argv[2]) > 0 and cuda_device_count() == 0:
    sys.exit(f"nvidia-smi lists {sys.argv[2]} GPU(s) but cupy {cupy.__version__} cannot use "
             f"them ({why_none}): a cupy-cudaXXx whose CUDA major version the driver does not "
             "run? Set PYTHON to a Python whose cupy matches the driver")
if not {"mpi", "nccl"} <= set(find_transports()):
    sys.exit(f"the entry points are not registered: found {sorted(find_transports())}")
if nccl_why:
    sys.exit(f"the nccl transport cannot run: {nccl_why}")
PYEOF

if [[ ${STEPS[-1]} != "env: ok"* || ${STEPS[-2]} != "install: ok"* ]]; then
  for s in nccl-1rank bench gpu-tests; do skip "$s" "install or env failed: see above"; done
  FAILED=1
  exit 1
fi

# the short steps and the figures first, the op suite (many kernels to compile) last
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
step nccl-1rank 150 mpiexec -n 1 "${PYTEST[@]}" tests/gpu/test_nccl.py tests/gpu/test_mpi_gpu.py \
  --junitxml="$RESULTS/nccl-1rank.xml"
if (( NGPU >= 2 )); then
  step "nccl-${NGPU}ranks" 150 mpiexec -n "$NGPU" "${PYTEST[@]}" tests/gpu/test_nccl.py
fi
if (( NGPU >= 1 )); then
  step bench 180 "$PY" tests/gpu/bench_gpu.py --json "$RESULTS/gpu_figures.json"
else
  skip bench "no GPU to measure"
fi
step gpu-tests 300 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_nccl.py \
  --ignore=tests/gpu/test_mpi_gpu.py --junitxml="$RESULTS/gpu-tests.xml"
