#!/usr/bin/env bash
# Step 1 of the GPU check (issue 11), run HERE, on a machine that reaches PyPI:
#
#   bash tests/gpu/fetch_wheels.sh          (from the repository root)
#
# The GPU machine reaches no network, not even PyPI. Its image (/opt/torch/.venv/bin/python3,
# CPython 3.12, x86-64) already has cupy-cuda13x, nvidia-nccl-cu13, cuda-pathfinder, numpy,
# ml-dtypes, threadpoolctl, pytest, pytest-timeout, hypothesis and nvidia-ml-py (the device
# tool's KINDS.md lists them). This downloads into .whl/ the wheels of our dependencies that
# the image lacks, for cp312 manylinux x86_64, one version of each:
#   mpich             the MPI library and mpiexec (the image has no MPI library)
#   mpi4py            the image has one, but of an unknown build; ours is the one built for
#                     the PyPI mpich ABI, so the pair is the pair tested on the CPU machines
#   array-api-compat  fuelspmd's backend layer (cupy, numpy through one namespace)
#   array-api-strict  the 'strict' device the tests use beside cpu and cuda
#   pytest-mpi        the mpi marker of tests run under mpiexec
# fuelspmd itself travels as the working tree: tests/gpu/run.sh puts the tree on PYTHONPATH
# and writes a dist-info with our entry points (the fuelspmd.transports plugins), so the
# code that runs is always the code in the tree, never a wheel built before an edit.
#
# Versions: the ones installed in the Python that runs this script (PYTHON, default
# python3; the project's venv when it is active), so the GPU run uses what the CPU tests
# used; a package not installed there gets PyPI's newest. Override one with NAME_VERSION,
# e.g. MPICH_VERSION=4.3.2, and the target Python with FUELSPMD_WHEEL_PYTHON (default 3.12,
# the image's; 3.11 makes wheels for this machine's venv, to try run.sh here). Then it checks there is one wheel per package and that the
# total is under 50 MiB (a device call carries at most 64 MiB with the working tree), and
# prints the device `run` call to make.
set -euo pipefail

cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
[[ -f pyproject.toml && -d tests/gpu ]] || { echo "run me from the fuelspmd repository root"; exit 2; }
PY=${PYTHON:-python3}
DEST=.whl
LIMIT_MIB=50
PYVER=${FUELSPMD_WHEEL_PYTHON:-3.12}
ABI=cp${PYVER/./}
PACKAGES=(mpich mpi4py array-api-compat array-api-strict pytest-mpi)

# .whl/ must never be committed nor travel unasked: ignored by the clone's exclude file
# (what the device tool reads) and by .gitignore (what every other clone reads).
if [[ -d .git ]]; then  # a worktree's .git is a file; the check below still holds there
  mkdir -p .git/info
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
fi
if [[ -n $(git status --porcelain --untracked-files=all -- "$DEST" 2>/dev/null) ]]; then
  echo "fetch_wheels: git does not ignore $DEST/; add '/.whl/' to .gitignore"; exit 2
fi

installed_version() {  # the version of distribution $1 in $PY, or nothing
  "$PY" - "$1" <<'PYEOF' 2>/dev/null || true
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PYEOF
}

rm -rf "$DEST"
mkdir -p "$DEST"
# the platforms pip must name one by one (it matches manylinux_2_N exactly); 2_17 to 2_39
# cover what these packages publish, and the image (glibc 2.39, Ubuntu 24.04) runs them all
PLATFORMS=()
for n in 39 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

specs=()
for name in "${PACKAGES[@]}"; do
  var=$(echo "$name" | tr 'a-z-' 'A-Z_')_VERSION
  ver=${!var:-$(installed_version "$name")}
  specs+=("$name${ver:+==$ver}")
done
echo "fetch_wheels: downloading ${specs[*]} ($ABI, manylinux x86_64) into $DEST/"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  "${PLATFORMS[@]}" --platform any -d "$DEST" "${specs[@]}"

# one wheel per package: two versions of one stop the install on the GPU machine
"$PY" - "$DEST" "$LIMIT_MIB" "${PACKAGES[@]}" <<'PYEOF'
import re
import sys
from pathlib import Path

dest, limit_mib, wanted = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
wheels = sorted(dest.glob("*.whl"))
by_name: dict[str, list[str]] = {}
for w in wheels:
    by_name.setdefault(re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower(), []).append(w.name)
bad = [f"{n}: {', '.join(v)}" for n, v in by_name.items() if len(v) > 1]
missing = [n for n in wanted if n not in by_name]
extra = [n for n in by_name if n not in wanted]
total = sum(w.stat().st_size for w in wheels) / 2**20
for w in wheels:
    print(f"  {w.stat().st_size / 2**20:6.1f} MiB  {w.name}")
print(f"  {total:6.1f} MiB  in all ({limit_mib:.0f} MiB allowed)")
problems = []
if bad:
    problems.append("more than one wheel of: " + "; ".join(bad))
if missing or extra:
    problems.append(f"wanted {wanted}, missing {missing}, unexpected {extra}")
if total > limit_mib:
    problems.append(f"{total:.1f} MiB of wheels is over {limit_mib:.0f} MiB: with the working "
                    "tree it must stay under the 64 MiB a device call carries")
if problems:
    sys.exit("fetch_wheels: " + " | ".join(problems))
PYEOF

tree_mib=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "fetch_wheels: the working tree that travels beside them is $(( tree_mib / 1048576 )) MiB"
cat <<'EOF'

Now make the device call (the device tool's `run`), nothing else on that machine:
  command:   bash tests/gpu/run.sh
  carry:     [".whl"]
  timeout_s: 540
It installs the wheels with pip --no-index --target into a site folder, runs the GPU tests
and benchmarks under a 7.5-minute deadline, and leaves summary.txt, gpu_figures.json, the
JUnit XML and one log per step in $OUT. Then delete .whl/ (rm -rf .whl).
EOF
