"""A fused multiply-add, ``fma(a, b, c) = a * b + c`` rounded once, from standard ONNX ops.

ONNX has no FMA operator, and ``Mul`` then ``Add`` rounds twice. The kernels fuse where
PyTorch does (AdamW's ``lerp_`` and ``addcmul_``), so the portable AdamW emits these:

- float32 (:func:`fma32`): exact, for every input. The product of two floats is exact in
  double; the double sum ``s = p + c`` is rounded, and rounding it again to float is a
  double rounding, wrong only when ``s`` lands exactly halfway between two floats while
  the exact sum does not. TwoSum gives the exact error ``err = (p + c) - s``; a halfway
  ``s`` is recognised as ``s + (s - r)`` being a float (``r`` the float ``s`` rounded to),
  and then ``err``'s sign says which neighbour the exact sum is nearer to.
- float64 (:func:`fma64`): Dekker's product (Veltkamp split) gives ``a * b = ph + pl``
  exactly, then ``ph + pl + c`` is rounded once the same way (two TwoSums, the halfway
  case decided by the last error). Exact wherever Dekker's product is: ``a * b`` zero or
  at least ``2^-969`` in magnitude (a gradient of 1e-146 is still exact) and below
  ``2^1023`` (operands from ``2^995`` up are split scaled, exactly). Products that
  underflow are within 2 ulps of the fma in measurements (up to 4% of such cases differ;
  tests/test_portable.py, README); where ``a * b`` overflows in double: ``c`` if that is
  infinite, else ``a * b + c`` (the fma's value unless ``c`` cancels the overflow).

- float32 without float64 (:func:`fma_split` on floats, for EPs that have no float64):
  the float64 algorithm in float32, Veltkamp's splitter 2^12 + 1. Exact (the correctly
  rounded fma) wherever Dekker's product is: ``a * b`` zero or at least ``2^-102`` in
  magnitude and below ``2^127`` (a factor from 2^114 up is first traded against the other
  by 2^13, exactly); where a partial product underflows, within a few ulps
  of the subnormal result (tests/test_portable_float32.py measures it).

A zero product that underflowed keeps its sign against a zero ``c`` (``fma(-tiny, tiny,
+0) = -0``) in both. Every node is a ``Mul``/``Add``/``Sub``/``Cast``/comparison/``Where``
on doubles: nothing is relied on beyond IEEE rounding of double arithmetic, correctly
rounded ``Cast`` from double to float, and onnxruntime's ``Where`` keeping every bit of its
second operand (of its first but a -0; the selections are arranged for that).
"""

from __future__ import annotations

from .emit import DOUBLE, FLOAT, Emitter

__all__ = ["fma", "fma32", "fma64", "fma_split", "two_prod", "two_sum"]

# 2^128: what a double beyond float's range is measured against (Cast gives +-Inf there).
_FLOAT_LIMIT = 2.0 ** 128
# Veltkamp's splitter for doubles: 2^27 + 1.
_SPLITTER = 134217729.0


def two_sum(e: Emitter, a: str, b: str) -> tuple[str, str]:
    """``(s, err)``: ``s = a + b`` rounded and its exact error ``err = (a + b) - s``
    (Knuth's TwoSum, any order of magnitudes; exact unless ``s`` overflows)."""
    s = e.op("Add", a, b, hint="s")
    bb = e.op("Sub", s, a)
    err = e.op("Add", e.op("Sub", a, e.op("Sub", s, bb)), e.op("Sub", b, bb), hint="err")
    return s, err


def _same_sign(e: Emitter, x: str, y: str, elem: int) -> str:
    """Both ``x`` and ``y`` nonzero and of one sign (False for a NaN)."""
    zero = e.const(0.0, elem)
    pos = e.op("And", e.op("Greater", x, zero), e.op("Greater", y, zero))
    neg = e.op("And", e.op("Less", x, zero), e.op("Less", y, zero))
    return e.or_(pos, neg)


def fma32(e: Emitter, a: str, b: str, c: str) -> str:
    """``a * b + c`` of float32 values (names of float tensors or scalars), rounded once
    to float32 (exact, see the module docstring)."""
    A, B, C = (e.op("Cast", x, to=DOUBLE) for x in (a, b, c))
    s, err = two_sum(e, e.op("Mul", A, B, hint="p"), C)
    r = e.op("Cast", s, to=FLOAT, hint="r")
    # r in double, an overflow to +-Inf taken as +-2^128 (its neighbour is +-FLT_MAX).
    big = e.const(_FLOAT_LIMIT, DOUBLE)
    rd = e.op("Min", e.op("Max", e.op("Cast", r, to=DOUBLE), e.op("Neg", big)), big)
    d = e.op("Sub", s, rd, hint="d")  # exact: s and r are within a float ulp
    t = e.op("Add", s, d, hint="t")   # r + 2d: the other neighbour when s is halfway
    other = e.op("Cast", t, to=FLOAT, hint="o")
    halfway = e.op("Equal", e.op("Cast", other, to=DOUBLE), t)  # t a float: s halfway
    fix = e.op("And", halfway, _same_sign(e, err, d, DOUBLE))
    # other is nonzero where fix holds, so Where keeps every bit (see Emitter.select).
    return e.op("Where", fix, other, r, hint="fma")


# Veltkamp's split per type: (splitter 2^s + 1, the magnitude from which a value is
# split scaled down so that a * splitter cannot overflow, that scale's exponent).
_SPLITS = {DOUBLE: (_SPLITTER, 2.0 ** 995, 28), FLOAT: (4097.0, 2.0 ** 114, 13)}


def _split(e: Emitter, a: str, elem: int = DOUBLE) -> tuple[str, str]:
    """Veltkamp's split: ``a = hi + lo``, each with at most half the significand's bits
    (26 of a double's 53, 12 of a float's 24). Values from 2^995 (a float: 2^114) up are
    split scaled down by 2^-28 (2^-13) exactly, so that ``a * (2^s + 1)`` cannot
    overflow."""
    splitter, limit, shift = _SPLITS[elem]
    big = e.op("Greater", e.op("Abs", a), e.const(limit, elem))
    down = e.op("Where", big, e.const(2.0 ** -shift, elem), e.const(1.0, elem))
    up = e.op("Where", big, e.const(2.0 ** shift, elem), e.const(1.0, elem))
    scaled = e.op("Mul", a, down)
    k = e.op("Mul", scaled, e.const(splitter, elem))
    hi = e.op("Sub", k, e.op("Sub", k, scaled))
    lo = e.op("Sub", scaled, hi)
    return e.op("Mul", hi, up, hint="hi"), e.op("Mul", lo, up, hint="lo")


def _balance(e: Emitter, a: str, b: str) -> tuple[str, str]:
    """``(a', b')`` of floats with ``a' * b' = a * b`` exactly, neither from 2^114 up unless
    the product overflows: a factor that large is scaled by 2^-13 and the other by 2^13
    (a split of a value near FLT_MAX rounds its high half up to 2^128, which is Inf once
    scaled back: FLT_MAX * FLT_MIN + c would lose its exactness)."""
    limit = e.const(2.0 ** 114, FLOAT)
    down, up, one = (e.const(v, FLOAT) for v in (2.0 ** -13, 2.0 ** 13, 1.0))
    for _ in range(2):
        big = e.op("Greater", e.op("Abs", a), limit)
        a, b = (e.op("Mul", a, e.op("Where", big, down, one)),
                e.op("Mul", b, e.op("Where", big, up, one)))
        a, b = b, a
    return a, b


def two_prod(e: Emitter, a: str, b: str, elem: int) -> tuple[str, str]:
    """``(p, err)``: ``p = a * b`` rounded and ``err = a * b - p`` (Dekker's product over
    Veltkamp's split; exact unless a partial product underflows: ``|a * b|`` below
    2^-969 in double, 2^-102 in float, or ``p`` overflows)."""
    p = e.op("Mul", a, b, hint="p")
    if elem == FLOAT:
        a, b = _balance(e, a, b)
    (ah, al), (bh, bl) = _split(e, a, elem), _split(e, b, elem)
    pl = e.op("Sub", e.op("Mul", ah, bh), p)
    for x, y in ((ah, bl), (al, bh), (al, bl)):
        pl = e.op("Add", pl, e.op("Mul", x, y))
    return p, pl


def fma64(e: Emitter, a: str, b: str, c: str) -> str:
    """``a * b + c`` of float64 values rounded once to float64: exact in Dekker's range,
    see the module docstring."""
    return fma_split(e, a, b, c, DOUBLE)


def fma_split(e: Emitter, a: str, b: str, c: str, elem: int) -> str:
    """``a * b + c`` rounded once to ``elem`` (DOUBLE or FLOAT) with arithmetic of that
    type only: Dekker's product, then TwoSums deciding the halfway case (the module
    docstring's float64 paragraph; for float32 the same argument with 24-bit halves:
    exact for ``|a * b|`` from 2^-102 up or zero)."""
    p, pl = two_prod(e, a, b, elem)
    s, err = two_sum(e, p, c)         # a*b + c = s + err + pl
    t, terr = two_sum(e, err, pl)     #         = s + t + terr
    z, f = two_sum(e, s, t)           #         = z + f + terr, z = RN(s + t)
    # t = 0: the sum is s itself, a -0 included (s + +0 would be +0). z is not -0 when
    # t != 0 (x + -x is +0), so Where keeps every bit. (No Not before a Where anywhere:
    # onnxruntime fuses the two into a Where with its operands swapped.)
    zero = e.const(0.0, elem)
    nonzero = lambda x: e.or_(e.op("Less", x, zero), e.op("Greater", x, zero))  # noqa: E731
    z = e.op("Where", nonzero(t), z, s)
    two_f = e.op("Add", f, f)
    other = e.op("Add", z, two_f)     # the neighbour beyond s + t when that is halfway
    halfway = e.op("And", e.op("Equal", e.op("Sub", other, z), two_f), nonzero(f))
    fixed = e.op("Where", e.op("And", halfway, _same_sign(e, terr, f, elem)), other, z)
    # An infinite product gives NaN above: a*b + c instead, or c where only the product of
    # finite a, b overflowed and c is infinite (Where drops the sign of a selected -0,
    # which a*b + c is only for a finite product).
    naive = e.op("Add", p, c, hint="naive")
    finite = lambda x: e.op("Equal", e.op("Sub", x, x), zero)  # noqa: E731
    c_wins = e.op("And", e.op("And", e.is_inf(c, elem), e.is_inf(p, elem)),
                  e.op("And", finite(a), finite(b)))
    out = e.op("Where", e.is_nan(fixed), e.op("Where", c_wins, c, naive), fixed)
    # A product that underflowed to zero, with a zero c: the zero of the product's sign
    # (Where keeps the bits of its second operand, out; the sign comes from a product).
    is_zero = lambda x: e.op("Equal", x, zero)  # noqa: E731
    underflow = e.op("And", e.op("And", is_zero(p), is_zero(c)),
                     e.op("Not", e.or_(is_zero(a), is_zero(b))))
    negative = e.xor(e.op("Less", a, zero), e.op("Less", b, zero))
    sign = e.op("Where", e.op("And", underflow, negative), e.const(-1.0, elem),
                e.const(1.0, elem))
    return e.op("Mul", e.op("Where", underflow, zero, out), sign, hint="fma")


def fma(e: Emitter, a: str, b: str, c: str, elem: int) -> str:
    """:func:`fma32` for ``elem`` FLOAT (:func:`fma_split` in float32 when the emitter may
    not use float64), :func:`fma64` for DOUBLE."""
    if elem == FLOAT:
        return fma32(e, a, b, c) if e.float64 else fma_split(e, a, b, c, FLOAT)
    if elem == DOUBLE:
        return fma64(e, a, b, c)
    raise ValueError(f"fma: compute type {elem} is neither float nor double")

