"""``fma32``: a float32 fused multiply-add in numpy (float64 and TwoSum), independent of the
library's own (``trainops.portable.fma``), for the replicas of torch's fused steps."""

from __future__ import annotations

import numpy as np

F32, F64 = np.float32, np.float64


def fma32(a, b, c):
    """``a * b + c`` on float32 arrays with one rounding: the product is exact in float64,
    the sum is rounded once to float64 and its error kept (TwoSum); only a float64 sum
    exactly halfway between two float32 values can round wrong, and the error decides it."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, F32).astype(F64) for v in (a, b, c)))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        r = s.astype(F32)
        r64 = r.astype(F64)
        other = np.where(s > r64, np.nextafter(r, F32(np.inf)), np.nextafter(r, F32(-np.inf)))
        tie = (s != r64) & (2 * np.abs(s - r64) == np.abs(other.astype(F64) - r64))
        # The exact value lies past the tie, away from r: the other neighbour is nearer
        # (an error toward r leaves r the nearer one).
        beyond = tie & (err != 0) & ((err > 0) == (s > r64))
    return np.where(beyond, other, r).astype(F32)
