"""Per-call scalars in float-float arithmetic, for graphs without float64 (EPs that have no
float64: WebGPU, DirectML, WebNN, ...).

The optimizers' per-call coefficients (``lr / (1 - beta1^T)``, ``(1 - beta2^T) ** 0.5``,
``1 - lr * wd``, ...) are computed by the fused kernels in float64 and rounded once to
float32. Computed in float32 instead, ``1 - beta^T`` cancels (``beta2 = 0.999`` itself is
1.3e-8 off in float32: 1.3e-5 of ``1 - beta2``), and an EP's float32 ``Pow`` is no better
(WGSL's ``pow`` is ``exp2(y * log2(x))``, ``log2`` to 2^-21 absolute). Here a scalar is a
pair of float32 scalars ``(hi, lo)`` standing for ``hi + lo`` (about 44 bits): sums by
TwoSum, products by Dekker's TwoProduct (:func:`~.fma.two_prod`), quotients and square
roots by one correction step of the float32 ``Div`` / ``Sqrt`` with an exact residual (so
an EP's division or square root a few ulps off does not matter), and ``beta^T`` (``T`` an
int64 step count) as a product of entries of small float-float tables of
``beta^(i * 256^j)`` computed here in 50-digit decimal arithmetic, picked by ``Gather``: no
transcendental function on the EP. The result, ``hi``, is the float64 computation rounded
to float32 but where the exact value lies within about 2^-40 (relative) of a midpoint
between two floats: then it may be the other neighbour, 1 ulp off
(tests/test_portable_float32.py counts such cases over a range of ``T``).

``T`` is converted to float32 for the tables' indices: exact below 2^24 steps; beyond, only
for ``beta`` so close to 1 that ``beta^(2^24)`` exceeds 2^-60 does the conversion's rounding
matter, and then by less than 2^-24 relative of ``beta^T``.
"""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np

from .emit import FLOAT, Emitter
from .fma import two_prod, two_sum

__all__ = ["FF", "pow_tables"]

INT32 = 6  # onnx.TensorProto.INT32
# beta^T below this is 0 for 1 - beta^T rounded to float64 or float32.
_NEGLIGIBLE = Decimal(2) ** -60
# Table entries below this are stored as 0 (their products only matter past _NEGLIGIBLE).
_FLUSH = Decimal(2) ** -100
_CHUNK = 8  # bits of T per table


def _split_const(value: Decimal) -> tuple[float, float]:
    """``value`` as float32 ``(hi, lo)``: hi nearest, lo the nearest float32 to the rest."""
    hi = np.float32(float(value))
    lo = np.float32(float(value - Decimal(float(hi))))
    return float(hi), float(lo)


def pow_tables(beta: float) -> tuple[int, list[list[tuple[float, float]]]]:
    """``(K, tables)`` for ``beta^T``: ``K`` the first ``k`` with ``beta^(2^k) < 2^-60``
    (``T`` is clamped to ``2^K``: beyond, ``1 - beta^T`` is 1 in either precision);
    ``tables[j][i] = beta^(i * 256^j)`` as float-float pairs, one table per 8 bits of
    ``T`` up to bit ``K``."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"pow_tables: beta must be in [0, 1), got {beta}")
    with localcontext() as ctx:
        ctx.prec = 50
        b = Decimal(beta)
        k = 0
        while b ** (2 ** k) >= _NEGLIGIBLE:
            k += 1
        tables = []
        for j in range(k // _CHUNK + 1):
            row = []
            for i in range(2 ** _CHUNK):
                v = b ** (i * 2 ** (_CHUNK * j)) if b else Decimal(1 if i == 0 else 0)
                row.append(_split_const(v) if v >= _FLUSH else (0.0, 0.0))
            tables.append(row)
    return k, tables


class FF:
    """Float-float scalars of one expansion (``e``): pairs ``(hi, lo)`` of float32 scalar
    names with ``hi = RN(hi + lo)``."""

    def __init__(self, e: Emitter):
        self.e = e

    def const(self, value: float) -> tuple[str, str]:
        """The double ``value`` as a pair of float32 constants."""
        with localcontext() as ctx:
            ctx.prec = 50
            hi, lo = _split_const(Decimal(value))
        return self.e.const(hi, FLOAT), self.e.const(lo, FLOAT)

    def of(self, name: str) -> tuple[str, str]:
        """A float32 scalar as a pair (``lo = 0``)."""
        return name, self.e.const(0.0, FLOAT)

    def _fast(self, a: str, b: str) -> tuple[str, str]:
        """Dekker's FastTwoSum (``|a| >= |b|``): the pair ``RN(a + b)``, the rest."""
        e = self.e
        s = e.op("Add", a, b, hint="ff")
        return s, e.op("Sub", b, e.op("Sub", s, a), hint="ff_lo")

    def add(self, x, y) -> tuple[str, str]:
        e = self.e
        s, err = two_sum(e, x[0], y[0])
        return self._fast(s, e.op("Add", err, e.op("Add", x[1], y[1])))

    def neg(self, x) -> tuple[str, str]:
        return self.e.op("Neg", x[0]), self.e.op("Neg", x[1])

    def sub(self, x, y) -> tuple[str, str]:
        return self.add(x, self.neg(y))

    def mul(self, x, y) -> tuple[str, str]:
        e = self.e
        p, err = two_prod(e, x[0], y[0], FLOAT)
        cross = e.op("Add", e.op("Mul", x[0], y[1]), e.op("Mul", x[1], y[0]))
        return self._fast(p, e.op("Add", err, cross))

    def div(self, x, y) -> tuple[str, str]:
        """``x / y``: the float32 quotient, corrected by the exact residual over ``y``."""
        e = self.e
        q = e.op("Div", x[0], y[0], hint="q")
        r = self.sub(x, self.mul(self.of(q), y))
        return self._fast(q, e.op("Div", r[0], y[0]))

    def sqrt(self, x) -> tuple[str, str]:
        """``sqrt(x)`` of a positive ``x``: the float32 root, corrected by one Newton step
        with the exact residual ``x - s * s``."""
        e = self.e
        s = e.op("Sqrt", x[0], hint="root")
        r = self.sub(x, self.mul(self.of(s), self.of(s)))
        return self._fast(s, e.op("Div", r[0], e.op("Add", s, s)))

    def pow(self, beta: float, t: str) -> tuple[str, str]:
        """``beta^t`` for the float32 scalar ``t`` holding a step count (negative counts
        are taken as 0), from :func:`pow_tables`."""
        from onnx import numpy_helper

        e = self.e
        k, tables = pow_tables(beta)
        t = e.op("Min", e.op("Max", t, e.const(0.0, FLOAT)), e.const(2.0 ** k, FLOAT))
        out = None
        for j, row in enumerate(tables):
            upper = e.op("Floor", e.op("Mul", t, e.const(2.0 ** -_CHUNK, FLOAT)))
            digit = e.op("Sub", t, e.op("Mul", upper, e.const(2.0 ** _CHUNK, FLOAT)))
            index = e.op("Cast", digit, to=INT32, hint="digit")
            pair = []
            for part in range(2):
                name = e.fresh(f"pow_table_{j}")
                e.initializers.append(numpy_helper.from_array(
                    np.array([p[part] for p in row], np.float32), name))
                pair.append(e.op("Gather", name, index, axis=0, hint="power"))
            out = tuple(pair) if out is None else self.mul(out, tuple(pair))
            t = upper
        return out
