"""Fused elementwise groups: one step computes a whole chain of elementwise ops.

The planner hands over a group (members in topological order, the last one the root; each
member has the root's shape) and the group's external inputs. :func:`encode` writes it in
its own registers (:class:`Group`), so equal groups of a plan are compiled once
(:func:`build_program`) and share the program and its runner. Three runners:

- numpy: the members run as ufuncs with ``out=`` into a few preallocated buffers of the
  root's shape, in cache-sized row chunks (:class:`NumpyFused`). Registers are assigned
  like a register allocator: a member writes into one of its operands' buffers once that
  operand is dead, so a chain runs in ONE buffer; an external input that dies here (a
  "donor") may lend its buffer too; an exported member keeps a buffer no other member
  writes (its own, or a donor's it took over).
- cupy: one generated ``ElementwiseKernel`` per group (:func:`cupy_source`).
- any other Array API library: the members' own kernels, one after another.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from fuelspmd.dtypes import DType, Shape, to_numpy

from .op import Attrs, Op
from .passes import Instr

__all__ = ["CHUNK_ELEMENTS", "CupySource", "Group", "Member", "NumpyFused", "Program",
           "build_program", "c_literal", "cupy_kernel", "cupy_source", "encode"]


def _where(c: Any, a: Any, b: Any, out: Any) -> None:
    np.copyto(out, b)
    np.copyto(out, a, where=c)


def _astype(x: Any, out: Any) -> None:
    np.copyto(out, x, casting="unsafe")


def numpy_fn(name: str, ufunc: str) -> Callable[..., Any]:
    if name == "where":
        return _where
    if name == "astype":
        return _astype
    return getattr(np, ufunc)


class Member(NamedTuple):
    """A member as its program computes it; where its operands live is the program's."""

    op: Op
    attrs: Attrs
    dtype: DType


class Group(NamedTuple):
    """A fused group in its own coordinates, with no IR index in it.

    A member reads registers: external input ``k`` is ``k``, the ``j``-th scalar (a const
    fill read by a member) is ``len(ext) + j``, and the member at position ``p`` is
    ``-1 - p``. Groups that are equal compute the same function of their registers, so
    they share one compiled :class:`Program` (a model's repeated layers, an optimiser's
    update of every parameter of one shape): :func:`encode` is the cheap half of
    compiling, :func:`build_program` the rest.
    """

    rows: tuple[tuple[Op, Attrs, DType, tuple[int, ...]], ...]  # (op, attrs, dtype, args)
    ext: tuple[tuple[Shape, DType], ...]  # each external input's shape and dtype
    scalars: tuple[DType, ...]
    donors: tuple[int, ...]  # the external inputs whose buffers the program may write
    exports: tuple[int, ...]  # positions of the members that later steps read too
    shape: Shape  # the root's, which is every member's


def encode(ir: list[Instr], members: list[int], ext: list[int], donors: set[int],
           exports: set[int] | None = None) -> tuple[Group, list[int]]:
    """The :class:`Group` of ``members`` (topological, root last) reading the external
    values ``ext``, and the IR indices of its scalars in register order.

    ``donors`` are external values that die at this step and whose buffers may be
    overwritten (given on numpy only); ``exports`` are members that later steps read too.
    """
    exports = exports or set()
    reg = {v: k for k, v in enumerate(ext)}
    for p, m in enumerate(members):
        reg[m] = -1 - p
    consts: list[int] = []
    rows = []
    n_ext = len(ext)
    for m in members:
        ins = ir[m]
        args = []
        for u in ins.ins:
            r = reg.get(u)
            if r is None:  # a const fill: a scalar register
                r = reg[u] = n_ext + len(consts)
                consts.append(u)
            args.append(r)
        rows.append((ins.op, ins.attrs, ins.dtype, tuple(args)))
    group = Group(tuple(rows), tuple((ir[v].shape, ir[v].dtype) for v in ext),
                  tuple(ir[u].dtype for u in consts),
                  tuple(k for k, v in enumerate(ext) if v in donors),
                  tuple(p for p, m in enumerate(members) if m in exports),
                  ir[members[-1]].shape)
    return group, consts


class Program:
    """A compiled :class:`Group`. Registers: external inputs, scalars, then temps (each of
    the root's shape); ``code`` computes each member into its temp's register."""

    def __init__(self, group: Group) -> None:
        self.n_ext = len(group.ext)
        self.ext = group.ext
        self.scalars: tuple[DType, ...] = group.scalars
        self.temps: list[DType] = []          # dtype per temp
        self.donor_of: dict[int, int] = {}    # temp -> external input it starts as
        self.code: list[tuple[Member, tuple[int, ...], int]] = []  # (member, arg regs, dest)
        self.root_temp = -1
        self.exports: list[int] = []  # the temp of each exported member, in member order
        self.outs: list[int] = []  # the temps a step hands out: the root's, then the exports'
        self.shape: Shape = group.shape

    def reg_of_temp(self, t: int) -> int:
        return self.n_ext + len(self.scalars) + t

    def dtype_of(self, reg: int) -> DType:
        """The dtype of register ``reg``."""
        if reg < self.n_ext:
            return self.ext[reg][1]
        j = reg - self.n_ext
        return self.scalars[j] if j < len(self.scalars) else self.temps[j - len(self.scalars)]

    @property
    def new_temps(self) -> list[int]:
        """Temps the runner allocates (not lent by a donor)."""
        return [t for t in range(len(self.temps)) if t not in self.donor_of]


def build_program(group: Group) -> Program:
    """Assign the group's members to temps, like a register allocator.

    A member writes into an operand's temp once that operand is dead (when its op may
    overwrite that operand and the dtype agrees), else into a freed temp of its dtype,
    else a new one. An exported member gets a temp that no other member writes: a new
    one, or a donor's that dies at it (an export keeps a full-size buffer).
    """
    prog = Program(group)
    base = prog.n_ext + len(prog.scalars)
    exported = {-1 - p for p in group.exports}
    last_use: dict[int, int] = {}
    for pos, row in enumerate(group.rows):
        for r in row[3]:
            last_use[r] = pos
    temp_of: dict[int, int] = {}  # external input (a donor) or member -> its temp
    for k in group.donors:
        temp_of[k] = len(prog.temps)
        prog.donor_of[len(prog.temps)] = k
        prog.temps.append(group.ext[k][1])
    free: list[int] = []
    for pos, (op, attrs, dt, args) in enumerate(group.rows):
        me = -1 - pos
        dest = -1
        for i, r in enumerate(args):
            t = temp_of.get(r, -1)
            if (t >= 0 and last_use[r] == pos and i in (op.inplace_ok or ())
                    and prog.temps[t] is dt and r not in exported
                    and (me not in exported or t in prog.donor_of)):
                dest = t
                break
        if dest < 0 and me not in exported:
            dest = next((t for t in free if prog.temps[t] is dt), -1)
            if dest >= 0:
                free.remove(dest)
        if dest < 0:
            dest = len(prog.temps)
            prog.temps.append(dt)
        for r in set(args):
            t = temp_of.get(r, -1)
            if (t >= 0 and last_use[r] == pos and t != dest and t not in free
                    and r not in exported):
                free.append(t)
        regs = tuple(base + temp_of[r] if r in temp_of else r for r in args)
        temp_of[me] = dest
        prog.code.append((Member(op, attrs, dt), regs, base + dest))
    prog.root_temp = temp_of[-len(group.rows)]
    prog.exports = [temp_of[-1 - p] for p in group.exports]
    prog.outs = [prog.root_temp, *prog.exports]
    return prog


CHUNK_ELEMENTS = 32768  # a chunk of every array of a fused step stays in the core's cache


class NumpyFused:
    """A program prepared for numpy: ufuncs with ``out=``, run in cache-sized row chunks.

    Running every member over a block of rows before moving to the next block keeps the
    intermediates in cache, which is the point of fusing on a CPU: a chain of k ops reads
    and writes main memory about once instead of k times. The root's buffer (or a donor's)
    is full-size; scratch temps hold one chunk. Chunks are along axis 0: an input with the
    root's leading size is sliced, any other input broadcasts to every chunk unchanged.
    """

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.np_dtypes = [to_numpy(dt) for dt in prog.temps]
        # each member as (function, getter of its operand registers then its output's):
        # ``fn(*get(regs))`` passes ``out`` by position, which every ufunc and the two
        # helpers above take, and is the cheapest call numpy has for a chunk
        self.calls = [(numpy_fn(ins.op.name, ins.op.ufunc or ""),
                       operator.itemgetter(*args, dest)) for ins, args, dest in prog.code]
        self.base = prog.n_ext + len(prog.scalars)
        shape = prog.shape
        row = math.prod(shape[1:]) if shape else 1
        lead = shape[0] if shape else 1
        rows = max(1, CHUNK_ELEMENTS // max(row, 1))
        self.rows = rows if shape and lead > rows else 0
        self.full_new = [t for t in prog.outs if t not in prog.donor_of]
        self.scratch = [t for t in prog.new_temps if t not in self.full_new]
        self.scratch_shape: Shape = ((min(rows, lead), *shape[1:]) if self.rows else shape)
        full = [*prog.donor_of, *self.full_new]
        self.sliced = [k for k, (sh, _) in enumerate(prog.ext)
                       if len(sh) == len(shape) and shape and sh[0] == lead and lead != 1]
        self.sliced += [self.base + t for t in full]
        self.scratch_regs = [self.base + t for t in self.scratch]

    def run(self, regs: list[Any]) -> Any:
        """Run with ``regs`` filled (inputs, scalars, temps); return the root's array."""
        calls = self.calls
        if not self.rows:
            for fn, get in calls:
                fn(*get(regs))
            return regs[self.base + self.prog.root_temp]
        lead, rows, view = self.prog.shape[0], self.rows, list(regs)
        for r0 in range(0, lead, rows):
            r1 = r0 + rows
            for i in self.sliced:
                view[i] = regs[i][r0:r1]
            if r1 > lead:  # the last chunk is short: so are its scratch temps
                for i in self.scratch_regs:
                    view[i] = regs[i][: lead - r0]
            for fn, get in calls:
                fn(*get(view))
        return regs[self.base + self.prog.root_temp]


def scalar_for(value: Any, dt: DType, be: Any) -> Any:
    """The scalar register of a const fill: a typed numpy scalar on numpy, nothing on cupy
    (its kernel inlines the scalar as a typed literal, :func:`c_literal`), else a 0-d array."""
    if be.kind == "cpu":
        return to_numpy(dt).type(value)
    if be.kind == "cuda":
        return None
    return be.xp.asarray(value, dtype=be.dtype(dt))


def run_generic(prog: Program, be: Any, regs: list[Any]) -> list[Any]:
    """Run a program with each member's own Array API kernel (no out=).

    Returns the root's array, then each export's.
    """
    for ins, args, dest in prog.code:
        regs[dest] = ins.op.kernel(be, ins.attrs, *(regs[i] for i in args))
    outs = []
    for t in prog.outs:
        out = regs[prog.reg_of_temp(t)]
        if tuple(out.shape) != prog.shape:  # a fill read as a scalar narrowed the broadcast
            out = be.xp.broadcast_to(out, prog.shape)
        outs.append(out)
    return outs


# The C type of each dtype inside a kernel body. A kernel's parameter list is another
# language: cupy reads each type there as a numpy dtype name (``float`` is float64, ``long
# long`` is no name at all), so parameters are written with ``DType.name``.
_CTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float",
           "float64": "double", "int32": "int", "int64": "long long", "bool": "bool"}

# cupy includes the header of a half type only for a parameter of that type; a temporary
# or a literal of it needs the header too
_HALF_HEADERS = {"float16": '#include "cupy/float16.cuh"',
                 "bfloat16": '#include "cupy/bfloat16.cuh"'}

# numpy's absolute and power take integers; C's fabs and pow do not (the call is
# ambiguous). These overloads are exact matches for the ``fabs(a)`` and ``pow(a, b)`` of
# the op table. They compute in unsigned arithmetic, which wraps as numpy does (signed
# overflow is undefined in C); a negative exponent gives the truncated power (1 for a
# base of 1, +-1 for -1, else 0), where numpy raises.
_INT_HELPERS = {
    "abs": """__device__ int fabs(int a) { return a < 0 ? (int)(0u - (unsigned int)a) : a; }
__device__ long long fabs(long long a) {
  return a < 0 ? (long long)(0ull - (unsigned long long)a) : a;
}""",
    "pow": """template <typename I, typename U> __device__ I _fuelspmd_ipow(I a, I b) {
  if (b < 0) return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
  U r = 1, x = (U)a;
  for (; b; b >>= 1) { if (b & 1) r *= x; x *= x; }
  return (I)r;
}
__device__ int pow(int a, int b) { return _fuelspmd_ipow<int, unsigned int>(a, b); }
__device__ long long pow(long long a, long long b) {
  return _fuelspmd_ipow<long long, unsigned long long>(a, b);
}""",
}


class CupySource(NamedTuple):
    """The parts of a cupy ``ElementwiseKernel``."""

    in_params: str
    out_params: str
    body: str
    preamble: str


def c_literal(value: Any, dt: DType) -> str:
    """``value`` as a C expression of type ``dt``, equal to ``dt``'s rounding of it.

    Never a bare double: beside a float16 or bfloat16 operand a double is ambiguous (each
    converts to the other's arithmetic), and beside a float it widens the arithmetic to
    double. Infinities and NaN are bit patterns (C has no literal for them).
    """
    ctype = _CTYPES[dt.name]
    if dt.is_bool:
        return "true" if value else "false"
    if dt.is_integer:
        v, suffix = int(value), "LL" if dt.itemsize == 8 else ""
        low = -(1 << (8 * dt.itemsize - 1))
        text = f"{v}{suffix}" if v != low else f"{low + 1}{suffix} - 1"  # no literal for it
        return f"(({ctype})({text}))"
    with np.errstate(over="ignore"):  # a value past the dtype's range rounds to infinity
        x = to_numpy(dt).type(value)
    if dt.itemsize == 8:
        if np.isfinite(x):
            return repr(float(x))
        return f"__longlong_as_double({int(np.float64(x).view(np.int64))}LL)"
    text = (f"{float(x)!r}f" if np.isfinite(x)
            else f"__int_as_float({int(np.float32(x).view(np.int32))})")
    return text if ctype == "float" else f"(({ctype}){text})"


def cupy_source(prog: Program, values: list[Any]) -> CupySource:
    """Return the parts of a cupy ElementwiseKernel for ``prog`` with its scalars'
    ``values`` (in register order).

    Each member becomes one line ``T r = expr;`` from its op's ``cexpr`` template (``a``,
    ``b``, ``c`` name its operands, ``T`` its C type); constants are inlined as typed
    literals (:func:`c_literal`), so every operand of a member has the member's operand
    type and the template's C call is never ambiguous.
    """
    names = [f"x{k}" for k in range(prog.n_ext)]
    names += [c_literal(v, dt) for v, dt in zip(values, prog.scalars, strict=True)]
    base = len(names)
    names += [f"t{t}" for t in range(len(prog.temps))]
    lines = []
    declared: set[int] = set()
    for t, k in prog.donor_of.items():
        lines.append(f"{_CTYPES[prog.temps[t].name]} t{t} = x{k};")
        declared.add(t)
    helpers: dict[str, None] = {}
    for ins, args, dest in prog.code:
        ctype = _CTYPES[ins.dtype.name]
        expr = ins.op.cexpr or ""
        letters = "cab" if ins.op.name == "where" else "abc"
        ops = {**dict(zip(letters, (f"({names[i]})" for i in args))), "T": ctype}
        expr = re.sub(r"\b([abcT])\b", lambda m, ops=ops: ops[m.group(1)], expr)
        t = dest - base
        decl = "" if t in declared else f"{ctype} "
        declared.add(t)
        lines.append(f"{decl}t{t} = {expr};")
        if ins.dtype.is_integer and ins.op.name in _INT_HELPERS:
            helpers[_INT_HELPERS[ins.op.name]] = None
    lines.append(f"out = t{prog.root_temp};")
    lines += [f"e{k} = t{t};" for k, t in enumerate(prog.exports)]
    ext = [dt for _, dt in prog.ext]
    in_params = ", ".join(f"{dt.name} x{k}" for k, dt in enumerate(ext))
    out_params = ", ".join([f"{prog.temps[prog.root_temp].name} out"] + [
        f"{prog.temps[t].name} e{k}" for k, t in enumerate(prog.exports)])
    used = {dt.name for dt in [*ext, *prog.temps, *prog.scalars]}
    preamble = [h for name, h in _HALF_HEADERS.items() if name in used] + list(helpers)
    return CupySource(in_params, out_params, "\n".join(lines), "\n".join(preamble))
def cupy_kernel(prog: Program, values: list[Any]) -> Any:
    """Build the cupy ElementwiseKernel of ``prog`` with its scalars' ``values`` (cupy
    imported here, on first use)."""
    import cupy

    src = cupy_source(prog, values)
    return cupy.ElementwiseKernel(src.in_params, src.out_params, src.body, "fuelspmd_fused",
                                  preamble=src.preamble)
