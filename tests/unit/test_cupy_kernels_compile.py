"""Every fused kernel the GPU suite builds, checked and compiled here, without a GPU.

The GPU suite's graphs come from one registry (``tests/gpu/workloads.py``), with the
graphs users build beside them in the other dtypes. Each workload is built on ``cpu:0``
and optimised; its IR, moved to ``cuda:0``, is the IR the same workload gives there (no
graph builder looks at the device kind, and folding computes the same constants), and
the planner turns it into the plan a GPU would run: each fused group becomes a
``cupy.ElementwiseKernel`` made by ``fused.cupy_kernel``, as on a GPU. For each kernel:

- cupy's own parser has read its parameter lists (``ElementwiseKernel()``), and cupy's
  own type check runs with the dtypes the executor passes (``_decide_params_type``: a
  ``float`` parameter is float64 and mismatches a float32 array, as on the GPU);
- cupy's own generator writes the CUDA source it would compile
  (``_get_elementwise_kernel_code``), and NVRTC, a library that needs no device,
  compiles it for ``compute_90`` with the options cupy passes, its headers prepended.

NVRTC reads cupy's headers again for every program, most of a compile's time, so the
kernels that include the same headers are compiled as one program first, each in a
namespace of its own under a name of its own (no function, type or kernel name of one is
seen by another; their bodies hold no macro); a kernel of a group that fails, or one that
does not fit this mould, is compiled alone, and its own log is what a failure shows.

The [test] extra installs cupy-cuda13x and NVRTC wheels; the module skips only where
they are missing or NVRTC does not load.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import fuelspmd as fs
from fuelspmd import graph
from fuelspmd.backend import Device
from fuelspmd.dtypes import DType, to_numpy

cupy = pytest.importorskip("cupy", reason="needs cupy: the [test] extra installs cupy-cuda13x")
nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="cupy without NVRTC")
try:
    NVRTC_VERSION = nvrtc.getVersion()
except Exception as e:  # the wheel's libnvrtc is missing or does not load
    pytest.skip(f"NVRTC does not load ({type(e).__name__}: {e}); the [test] extra installs "
                "nvidia-cuda-nvrtc", allow_module_level=True)
from cupy._core import _carray, _kernel, core  # noqa: E402  (after the skips)

ARCH = "compute_90"
CUDA = Device("cuda", 0)
_NDARRAY, _INDEXER = 1, 2  # cupy's _ArgKind values


def _load_workloads() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "gpu" / "workloads.py"
    spec = importlib.util.spec_from_file_location("_gpu_workloads", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WL = _load_workloads()
WORKLOADS = {**WL.GPU_SUITE, **WL.MORE_DTYPES}


@dataclass(frozen=True)
class Kernel:
    """One fused step of a CUDA plan: cupy's kernel and the dtypes the executor passes."""

    kernel: Any
    ins: tuple[DType, ...]
    outs: tuple[DType, ...]
    ops: tuple[tuple[str, str], ...]  # each member's op and its last operand's dtype kind


def cuda_kernels(targets: list[fs.Tensor]) -> list[Kernel]:
    """The fused kernels of the plan of ``targets`` (built on cpu:0) for cuda:0."""
    sigs, _, outs = graph.lower([t.node for t in targets])
    ir, outs, slots = graph.optimise(sigs, outs)
    moved = [graph.Instr(i.op, i.ins, tuple(CUDA if isinstance(a, Device) else a
                                            for a in i.attrs), i.shape, i.dtype, CUDA, i.value)
             for i in ir]
    plan = graph.make_plan(moved, outs, slots)
    return [Kernel(s.cuda_kernel, tuple(moved[u].dtype for u in s.ins),
                   tuple(s.prog.temps[t] for t in s.prog.outs),
                   tuple((m.op.name, s.prog.dtype_of(args[-1]).kind)
                         for m, args, _ in s.prog.code))
            for s in plan.steps if s.kind == "fused_cupy"]


def cuda_source(k: Kernel) -> str:
    """The CUDA source cupy compiles for ``k`` called on contiguous 1-d arrays (its
    reduced view of same-shape inputs), after its type check of those arrays' dtypes."""
    ins = tuple(to_numpy(d) for d in k.ins)
    outs = tuple(to_numpy(d) for d in k.outs)
    in_types, out_types, type_map = k.kernel._decide_params_type(ins, outs)
    infos = tuple(_kernel._ArgInfo(_NDARRAY, cupy.ndarray, np.dtype(t), 1, True, True)
                  for t in (*in_types, *out_types))
    infos += (_kernel._ArgInfo(_INDEXER, _carray.Indexer, None, 1, True, True),)
    body = _kernel._get_elementwise_kernel_code(infos, type_map, k.kernel.params,
                                                k.kernel.operation, k.kernel.name,
                                                k.kernel.preamble)
    headers = "".join(f"#include <{h}>\n" for h in core._cupy_header_list)
    return headers + body


@cache
def _options() -> tuple[str, ...]:
    # cupy's compile_with_cache and _compile_using_nvrtc, with the arch given, not read
    # off a device
    return (*core.assemble_cupy_compiler_options(()), "-ftz=true", f"-arch={ARCH}",
            "--device-as-default-execution-space")


@cache
def compile_error(source: str) -> str | None:
    """NVRTC's log when ``source`` does not compile for ``ARCH``, else None (once each)."""
    prog = nvrtc.createProgram(source, "fuelspmd_fused.cu", (), ())
    try:
        nvrtc.compileProgram(prog, _options())
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return None


@cache
def kernels_of(key: str) -> tuple[Kernel, ...]:
    return tuple(cuda_kernels(WORKLOADS[key]("cpu:0")))


_HEADERS = "".join(f"#include <{h}>\n" for h in core._cupy_header_list)
_INCLUDE = re.compile(r'\s*#include "[\w/.]+"\s*')
_KERNEL = 'extern "C" __global__ void fuelspmd_fused('


def _parts(source: str) -> tuple[frozenset[str], str] | None:
    """(the include lines at the head of its body, the rest of the body) of a kernel's
    source; None when it cannot be compiled in a group: no cupy headers first, another
    preprocessor line, or not one kernel named fuelspmd_fused."""
    if not source.startswith(_HEADERS):
        return None
    lines = source[len(_HEADERS):].splitlines()
    head = 0
    while head < len(lines) and (not lines[head].strip() or _INCLUDE.fullmatch(lines[head])):
        head += 1
    body = "\n".join(lines[head:])
    if re.search(r"^\s*#(?!pragma)", body, re.M) or body.count(_KERNEL) != 1:
        return None
    return frozenset(ln.strip() for ln in lines[:head] if ln.strip()), body


@cache
def compiled_in_groups() -> frozenset[str]:
    """The sources of every workload's kernels that compiled as part of one NVRTC
    program per set of includes (the others are compiled alone by compile_error)."""
    groups: dict[frozenset[str], list[tuple[str, str]]] = {}
    for source in sorted({cuda_source(k) for key in WORKLOADS for k in kernels_of(key)}):
        parts = _parts(source)
        if parts is not None:
            groups.setdefault(parts[0], []).append((source, parts[1]))
    ok: set[str] = set()
    for includes, members in groups.items():
        program = _HEADERS + "".join(f"{i}\n" for i in sorted(includes)) + "".join(
            f"namespace fuelspmd_k{n} {{\n"
            f"{body.replace(_KERNEL, _KERNEL[:-1] + f'_{n}(')}\n}}\n"
            for n, (_, body) in enumerate(members))
        if compile_error(program) is None:
            ok.update(source for source, _ in members)
    return frozenset(ok)


@pytest.mark.parametrize("key", sorted(WORKLOADS))
def test_every_fused_kernel_parses_and_compiles(key: str) -> None:
    for k in kernels_of(key):
        try:
            source = cuda_source(k)
        except TypeError as e:  # what the kernel's call raises on a GPU
            params = [", ".join(f"{p.dtype} {p.name}" for p in ps)
                      for ps in (k.kernel.in_params, k.kernel.out_params)]
            pytest.fail(f"{key}: arrays {[str(d) for d in k.ins]} -> "
                        f"{[str(d) for d in k.outs]} do not fit the parameters as cupy reads "
                        f"them, ({params[0]}) -> ({params[1]}): {e}")
        log = None if source in compiled_in_groups() else compile_error(source)
        assert log is None, f"{key}: NVRTC {NVRTC_VERSION} ({ARCH}):\n{log}\n{source}"


def test_the_workloads_reach_every_fusable_op_in_every_dtype() -> None:
    """The check above is only as good as its kernels: every fusable op of the table, in
    each dtype family it takes, is a member of some kernel, and every dtype is a kernel's
    parameter (so each was compiled)."""
    seen: set[tuple[str, str]] = set()
    dtypes: set[DType] = set()
    for key in WORKLOADS:
        for k in kernels_of(key):
            seen.update(k.ops)
            dtypes.update(k.ins + k.outs)
    fusable = {name for name, op in graph.OPS.items() if op.fusable}
    floats = fusable - {"logical_not", "logical_and", "logical_or"}
    integers = floats - {"exp", "log", "tanh", "sqrt", "sin", "cos", "div"}  # div: a float
    want = {(op, "f") for op in floats} | {(op, "i") for op in integers}
    want |= {(op, "b") for op in ("logical_not", "logical_and", "logical_or", "where")}
    assert want - seen == set()
    assert {d.name for d in dtypes} == {"float16", "bfloat16", "float32", "float64", "int32",
                                        "int64", "bool"}
