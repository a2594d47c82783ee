"""Elementwise primitives, leaves and constants.

Every elementwise op is fusable except ``erf`` (no numpy ufunc; its kernel is fdlibm's
piecewise rational approximation written against the Array API, see :func:`_erf`).
Binary ops take inputs of one dtype: promotion happened in :mod:`.build`, as explicit
``astype`` nodes.
"""

from __future__ import annotations

import math
from typing import Any

from fuelspmd.dtypes import DType, Shape, bool_, broadcast_shapes
from fuelspmd.errors import DTypeError

from . import build as B
from .node import Node
from .op import Attrs, Fill, Op, register

_ALL = tuple(range(3))


# ---- leaves and constants -------------------------------------------------------------

def _no_rule(inputs: tuple[Node, ...], attrs: Attrs) -> Any:
    raise RuntimeError("a leaf is made by graph.leaf(), not by make()")


def _const_rule(inputs: tuple[Node, ...], attrs: Fill) -> tuple[Shape, DType, Any]:
    return attrs.shape, attrs.dtype, attrs.device


def _const_kernel(be: Any, attrs: Fill) -> Any:
    return be.xp.full(attrs.shape, attrs.value, dtype=be.dtype(attrs.dtype))


register(Op("leaf", _no_rule, None, kind="leaf"))
register(Op("donated", _no_rule, None, kind="donated"))  # a consumed donated leaf
register(Op("posted", _no_rule, None, kind="posted"))  # issued early: graph.node.post
register(Op("const", _const_rule, _const_kernel, kind="const"))


# ---- unary ----------------------------------------------------------------------------

def _float_rule(name: str) -> Any:
    def rule(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Shape, DType, Any]:
        (x,) = inputs
        if not x.dtype.is_floating:
            raise DTypeError(f"{name}: needs a floating tensor, got {x.dtype} {x.shape}; "
                             f"cast first with .astype(fs.float32)")
        return x.shape, x.dtype, x.device
    return rule


def _same_rule(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Shape, DType, Any]:
    (x,) = inputs
    return x.shape, x.dtype, x.device


def _bool_rule(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Shape, DType, Any]:
    (x,) = inputs
    if not x.dtype.is_bool:
        raise DTypeError(f"logical_not needs a bool tensor, got {x.dtype}")
    return x.shape, bool_, x.device


def _unary(name: str, xp_name: str, ufunc: str | None, cexpr: str, vjp: Any,
           rule: Any = None) -> None:
    def kernel(be: Any, attrs: Attrs, x: Any) -> Any:
        return getattr(be.xp, xp_name)(x)
    register(Op(name, rule or _float_rule(name), kernel, vjp, "elementwise", ufunc, cexpr,
                _ALL))


_unary("neg", "negative", "negative", "-(a)", lambda g, n, w: (B.unary("neg", g),),
       rule=_same_rule)
_unary("exp", "exp", "exp", "exp(a)", lambda g, n, w: (B.binary("mul", g, n),))
_unary("log", "log", "log", "log(a)", lambda g, n, w: (B.binary("div", g, n.inputs[0]),))
_unary("tanh", "tanh", "tanh", "tanh(a)", lambda g, n, w: (
    B.binary("mul", g, B.binary("sub", 1.0, B.binary("mul", n, n))),))
_unary("sqrt", "sqrt", "sqrt", "sqrt(a)", lambda g, n, w: (
    B.binary("div", g, B.binary("mul", n, 2.0)),))
_unary("sin", "sin", "sin", "sin(a)", lambda g, n, w: (
    B.binary("mul", g, B.unary("cos", n.inputs[0])),))
_unary("cos", "cos", "cos", "cos(a)", lambda g, n, w: (
    B.unary("neg", B.binary("mul", g, B.unary("sin", n.inputs[0]))),))
_unary("abs", "abs", "absolute", "fabs(a)", lambda g, n, w: (
    B.where(B.binary("lt", n.inputs[0], 0), B.unary("neg", g), g),), rule=_same_rule)
_unary("logical_not", "logical_not", "logical_not", "!(a)", None, rule=_bool_rule)


# erf: the Array API has none. fdlibm's s_erf.c (Sun Microsystems, 1993, freely
# distributable): rational approximations on |x| < 0.84375, < 1.25, < 1/0.35, < 6, each
# under one ulp in float64, written with where() so it runs on numpy, cupy and
# array-api-strict alike. Coefficients lowest degree first.
_ERX = 8.45062911510467529297e-01
_PP = (1.28379167095512558561e-01, -3.25042107247001499370e-01, -2.84817495755985104766e-02,
       -5.77027029648944159157e-03, -2.37630166566501626084e-05)
_QQ = (1.0, 3.97917223959155352819e-01, 6.50222499887672944485e-02,
       5.08130628187576562776e-03, 1.32494738004321644526e-04, -3.96022827877536812320e-06)
_PA = (-2.36211856075265944077e-03, 4.14856118683748331666e-01, -3.72207876035701323847e-01,
       3.18346619901161753674e-01, -1.10894694282396677476e-01, 3.54783043256182359371e-02,
       -2.16637559486879084300e-03)
_QA = (1.0, 1.06420880400844228286e-01, 5.40397917702171048937e-01,
       7.18286544141962662868e-02, 1.26171219808761642112e-01, 1.36370839120290507362e-02,
       1.19844998467991074170e-02)
_RA = (-9.86494403484714822705e-03, -6.93858572707181764372e-01, -1.05586262253232909814e+01,
       -6.23753324503260060396e+01, -1.62396669462573470355e+02, -1.84605092906711035994e+02,
       -8.12874355063065934246e+01, -9.81432934416914548592e+00)
_SA = (1.0, 1.96512716674392571292e+01, 1.37657754143519042600e+02, 4.34565877475229228821e+02,
       6.45387271733267880336e+02, 4.29008140027567833386e+02, 1.08635005541779435134e+02,
       6.57024977031928170135e+00, -6.04244152148580987438e-02)
_RB = (-9.86494292470009928597e-03, -7.99283237680523006574e-01, -1.77579549177547519889e+01,
       -1.60636384855821916062e+02, -6.37566443368389627722e+02, -1.02509513161107724954e+03,
       -4.83519191608651397019e+02)
_SB = (1.0, 3.03380607434824582924e+01, 3.25792512996573918826e+02, 1.53672958608443695994e+03,
       3.19985821950859553908e+03, 2.55305040643316442583e+03, 4.74528541206955367215e+02,
       -2.24409524465858183362e+01)


def _poly(xp: Any, c: tuple[float, ...], z: Any) -> Any:
    out = xp.full_like(z, c[-1])
    for a in reversed(c[:-1]):
        out = a + z * out
    return out


def _erf(be: Any, attrs: Attrs, x: Any) -> Any:
    """Each branch sees only its own range (others get a harmless stand-in), so no
    branch overflows into a warning."""
    xp = be.xp
    ax = xp.abs(x)
    small, mid, tail = ax < 0.84375, ax < 1.25, ax < 6.0
    zero = xp.zeros_like(x)
    sign = xp.where(x < 0, xp.full_like(x, -1.0), xp.ones_like(x))
    xa = xp.where(small, x, zero)
    za = xa * xa
    a = xa + xa * (_poly(xp, _PP, za) / _poly(xp, _QQ, za))
    sb = xp.where(small | ~mid, zero, ax - 1.0)
    b = sign * (_ERX + _poly(xp, _PA, sb) / _poly(xp, _QA, sb))
    xc = xp.where(mid | ~tail, xp.full_like(x, 2.0), ax)
    s = 1.0 / (xc * xc)
    near = xc < 1 / 0.35
    rs = xp.where(near, _poly(xp, _RA, s) / _poly(xp, _SA, s),
                  _poly(xp, _RB, s) / _poly(xp, _SB, s))
    # exp(-x^2) as exp(-z^2) exp((z-x)(z+x)) with z = x rounded to 24 bits: z^2 is exact
    z = xp.astype(xp.astype(xc, xp.float32), x.dtype) if x.dtype == xp.float64 else xc
    r = xp.exp(-z * z - 0.5625) * xp.exp((z - xc) * (z + xc) + rs)
    c = sign * (1.0 - r / xc)
    out = xp.where(small, a, xp.where(mid, b, xp.where(tail, c, sign)))
    return xp.where(xp.isnan(x), x, out)


register(Op("erf", _float_rule("erf"), _erf, lambda g, n, w: (B.binary(
    "mul", g, B.binary("mul", B.unary("exp", B.unary("neg", B.binary(
        "mul", n.inputs[0], n.inputs[0]))), 2.0 / math.sqrt(math.pi))),), "elementwise",
    None, "erf(a)", _ALL))


# ---- binary ---------------------------------------------------------------------------

def _binary_rule(name: str, out: DType | None, need: str | None) -> Any:
    def rule(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Shape, DType, Any]:
        a, b = inputs
        if a.dtype is not b.dtype:
            raise DTypeError(f"{name}: operands are {a.dtype} and {b.dtype}; build binary "
                             "ops with graph.build.binary, which promotes")
        if need == "bool" and not a.dtype.is_bool:
            raise DTypeError(f"{name}: needs bool tensors, got {a.dtype}; compare first")
        if need == "num" and a.dtype.is_bool:
            raise DTypeError(f"{name}: bool tensors have no arithmetic; use "
                             ".astype(fs.float32) or logical ops")
        shape = a.shape if a.shape == b.shape else broadcast_shapes(a.shape, b.shape, op=name)
        return shape, out or a.dtype, a.device
    return rule


def _binary(name: str, xp_name: str, ufunc: str, cexpr: str, vjp: Any,
            out: DType | None = None, need: str | None = "num") -> None:
    def kernel(be: Any, attrs: Attrs, a: Any, b: Any) -> Any:
        return getattr(be.xp, xp_name)(a, b)
    register(Op(name, _binary_rule(name, out, need), kernel, vjp, "elementwise", ufunc,
                cexpr, _ALL))


def _ub(g: Node | None, x: Node) -> Node | None:
    return None if g is None else B.unbroadcast(g, x.shape)


def _vjp_sub(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    a, b = n.inputs
    return _ub(g, a), _ub(B.unary("neg", g), b) if w[1] else None


def _vjp_mul(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    a, b = n.inputs
    return (_ub(B.binary("mul", g, b), a) if w[0] else None,
            _ub(B.binary("mul", g, a), b) if w[1] else None)


def _vjp_div(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    a, b = n.inputs
    return (_ub(B.binary("div", g, b), a) if w[0] else None,
            _ub(B.unary("neg", B.binary("div", B.binary("mul", g, n), b)), b) if w[1] else None)


def _vjp_pow(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    a, b = n.inputs
    ga = gb = None
    if w[0]:
        ga = _ub(B.binary("mul", g, B.binary("mul", b, B.binary(
            "pow", a, B.binary("sub", b, 1)))), a)
    if w[1]:
        gb = _ub(B.binary("mul", g, B.binary("mul", n, B.unary("log", a))), b)
    return ga, gb


def _vjp_pick(first: bool) -> Any:
    def vjp(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
        a, b = n.inputs
        mask = B.binary("ge" if first else "le", a, b)  # ties go to the first operand
        zero = 0.0 if g.dtype.is_floating else 0
        return (_ub(B.where(mask, g, zero), a) if w[0] else None,
                _ub(B.where(mask, zero, g), b) if w[1] else None)
    return vjp


_binary("add", "add", "add", "a + b", lambda g, n, w: (_ub(g, n.inputs[0]), _ub(g, n.inputs[1])))
_binary("sub", "subtract", "subtract", "a - b", _vjp_sub)
_binary("mul", "multiply", "multiply", "a * b", _vjp_mul)
_binary("div", "divide", "divide", "a / b", _vjp_div)
_binary("pow", "pow", "power", "pow(a, b)", _vjp_pow)
_binary("maximum", "maximum", "maximum", "max(a, b)", _vjp_pick(True))
_binary("minimum", "minimum", "minimum", "min(a, b)", _vjp_pick(False))
for _name, _xp, _uf, _c in (("eq", "equal", "equal", "a == b"),
                            ("ne", "not_equal", "not_equal", "a != b"),
                            ("lt", "less", "less", "a < b"),
                            ("le", "less_equal", "less_equal", "a <= b"),
                            ("gt", "greater", "greater", "a > b"),
                            ("ge", "greater_equal", "greater_equal", "a >= b")):
    _binary(_name, _xp, _uf, _c, None, out=bool_, need=None)
_binary("logical_and", "logical_and", "logical_and", "a && b", None, out=bool_, need="bool")
_binary("logical_or", "logical_or", "logical_or", "a || b", None, out=bool_, need="bool")


# ---- where and astype -----------------------------------------------------------------

def _where_rule(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Shape, DType, Any]:
    c, a, b = inputs
    if not c.dtype.is_bool or a.dtype is not b.dtype:
        raise DTypeError(f"where: needs a bool condition and equal branch dtypes, got "
                         f"{c.dtype}, {a.dtype}, {b.dtype}")
    shape = broadcast_shapes(broadcast_shapes(c.shape, a.shape, op="where"), b.shape,
                             op="where")
    return shape, a.dtype, a.device


def _vjp_where(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    c, a, b = n.inputs
    return (None, _ub(B.where(c, g, 0.0), a) if w[1] else None,
            _ub(B.where(c, 0.0, g), b) if w[2] else None)


register(Op("where", _where_rule, lambda be, attrs, c, a, b: be.xp.where(c, a, b), _vjp_where,
            "elementwise", "where", "c ? a : b", (2,)))


def _astype_rule(inputs: tuple[Node, ...], attrs: Attrs) -> tuple[Shape, DType, Any]:
    (x,) = inputs
    return x.shape, attrs[0], x.device


def _vjp_astype(g: Node, n: Node, w: tuple[bool, ...]) -> tuple[Node | None, ...]:
    src = n.inputs[0].dtype
    return (B.astype(g, src) if src.is_floating and g.dtype.is_floating else None,)


register(Op("astype", _astype_rule, lambda be, attrs, x: be.xp.astype(x, be.dtype(attrs[0])),
            _vjp_astype, "elementwise", "astype", "(T)(a)", ()))
