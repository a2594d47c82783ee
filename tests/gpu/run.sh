#!/usr/bin/env bash
# The prepared GPU check of issue 11: one run on a machine with an NVIDIA GPU.
#
#   bash tests/gpu/run.sh            (from the repository root)
#
# Installs fuelspmd with its [test,gpu] extras into a virtual environment (build/venv-gpu, or
# the one FUELSPMD_GPU_VENV names; an existing one is reused), then runs, under one global
# deadline of 7.5 minutes:
#   1. the NCCL transport bootstrapped over MPI at one rank (mpiexec -n 1), and the MPI
#      transport with GPU buffers (CUDA-aware or staged); at N ranks too when N >= 2 GPUs
#   2. the benchmarks: fused elementwise chain vs eager cupy, TP layer matmul vs cuBLAS
#   3. the GPU test suite (op table on cupy vs numpy, fused kernels, DeviceGroup cuda:0+cpu:0)
# A step that would start after the deadline is skipped and reported, so the whole run
# ends within about 8 minutes whatever happens.
# Logs, JUnit XML, gpu_figures.json and summary.txt go to $OUT when it is set (else
# build/gpu-check). The exit status is non-zero when any step failed or ran out of time.
set -euo pipefail

START=$(date +%s)
BUDGET_S=${FUELSPMD_GPU_BUDGET_S:-450}
RESULTS=${OUT:-build/gpu-check}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
VENV=${FUELSPMD_GPU_VENV:-build/venv-gpu}
PY=${PYTHON:-python3}
declare -a STEPS=()
FAILED=0

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
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log" || status=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t0 ))
  if (( status == 0 )); then
    STEPS+=("$name: ok (${took}s)")
  else
    [[ $status == 124 || $status == 137 ]] && status="timeout after ${limit}s"
    STEPS+=("$name: FAILED ($status, ${took}s)"); FAILED=1
  fi
}

echo "== machine"
nvidia-smi -L || { echo "nvidia-smi failed: this machine has no usable NVIDIA driver"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
NGPU=$(nvidia-smi -L | grep -c '^GPU' || true)

if [[ ! -x "$VENV/bin/python" ]]; then
  # system site packages: a machine that already has cupy or mpi4py lends them. Debian's
  # python3 without python3-venv has no ensurepip: fall back to virtualenv from PyPI.
  if ! "$PY" -m venv --system-site-packages "$VENV"; then
    rm -rf "$VENV"
    "$PY" -m pip install -q --user virtualenv
    "$PY" -m virtualenv -q --system-site-packages "$VENV"
  fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
step install 240 python -m pip install --disable-pip-version-check -q -e ".[test,gpu]"
if [[ ${STEPS[-1]} != "install: ok"* ]]; then  # no index reachable: use what is installed
  step install-offline 60 python -m pip install --disable-pip-version-check -q \
    --no-build-isolation --no-deps --no-index -e .
fi

step versions 60 python - <<'PYEOF'
import cupy, mpi4py, numpy
import fuelspmd_mpi, fuelspmd_nccl
from fuelspmd.backend import cuda_device_count
print("numpy", numpy.__version__, "| cupy", cupy.__version__, "| mpi4py", mpi4py.__version__)
print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver",
      cupy.cuda.runtime.driverGetVersion(), "| GPUs", cuda_device_count())
print(fuelspmd_nccl.plugin.library_version(), "| nccl plugin:",
      fuelspmd_nccl.plugin.unavailable_reason() or "available")
print("MPI:", fuelspmd_mpi.library_version())
PYEOF

# the short steps and the figures first, the op suite (many kernels to compile) last
PYTEST=(python -m pytest -q -p no:cacheprovider -rs)
step nccl-1rank 150 mpiexec -n 1 "${PYTEST[@]}" tests/gpu/test_nccl.py tests/gpu/test_mpi_gpu.py \
  --junitxml="$RESULTS/nccl-1rank.xml"
if (( NGPU >= 2 )); then
  step "nccl-${NGPU}ranks" 150 mpiexec -n "$NGPU" "${PYTEST[@]}" tests/gpu/test_nccl.py
fi
step bench 180 python tests/gpu/bench_gpu.py --json "$RESULTS/gpu_figures.json"
step gpu-tests 300 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_nccl.py \
  --ignore=tests/gpu/test_mpi_gpu.py --junitxml="$RESULTS/gpu-tests.xml"

{
  echo "GPU check of $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname)," \
       "$(date -u +%FT%TZ), ${NGPU} GPU(s), $(( $(date +%s) - START ))s"
  for s in "${STEPS[@]}"; do echo "  $s"; done
  for f in gpu-tests nccl-1rank "nccl-${NGPU}ranks"; do
    if [[ -f "$RESULTS/$f.log" ]]; then
      echo "  $f: $(grep -E '[0-9]+ (passed|failed|skipped)' "$RESULTS/$f.log" | tail -1 || true)"
    fi
  done
  if [[ -f "$RESULTS/bench.log" ]]; then sed -n '/^GPU figures/,$p' "$RESULTS/bench.log"; fi
} | tee "$RESULTS/summary.txt"
exit "$FAILED"
