"""Comparisons: bit equality, tolerances against the float64 references, ulp distances for
16-bit outputs, and the wording of error messages."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from helpers.data import BF16
from helpers.references import adam as adam_ref
from helpers.references import adam16, adam16_slop, wide

# float32 kernel vs the float64 reference: rtol 1e-5, atol 1e-6 scaled by the data.
# float64 kernel vs the float64 reference: a few ulps of rounding-order freedom.
TOLERANCES = {
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float64): (1e-10, 1e-12),
}

# float16 storage (math in float32): about one float16 rounding of each output.
TOLERANCES_16 = (2e-3, 2e-3)


def same_bits(a, b) -> bool:
    """``a`` and ``b`` have the same dtype, shape and bytes; for two lists (or tuples) of
    arrays, the same length and every pair the same bits."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    a = np.asarray(a, order="C")
    b = np.asarray(b, order="C")
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def trainer_snapshot(tr) -> dict:
    """Every state buffer of a one-process trainer (copies) and its counters ``T``, ``lr``
    and ``skipped``: what a failed or refused step must leave as it was."""
    return {"states": {k: v.copy() for k, v in tr._states().items()},
            "T": tr.T, "lr": tr.lr, "skipped": tr.skipped}


def assert_trainer_unchanged(tr, before) -> None:
    """``tr`` holds the states and counters of ``before`` (a :func:`trainer_snapshot`),
    bit for bit."""
    after = trainer_snapshot(tr)
    assert sorted(after["states"]) == sorted(before["states"])
    for k, v in before["states"].items():
        assert same_bits(after["states"][k], v), k
    assert (after["T"], after["lr"], after["skipped"]) == \
        (before["T"], before["lr"], before["skipped"])


def assert_matches_reference(outs, r, t, xs, gs, vs, hs, dtype=None, **attrs):
    """Every output has the input dtype and X's shape, and matches the float64 reference."""
    dtype = np.dtype(dtype or xs[0].dtype)
    refs = adam_ref(r, t, xs, gs, vs, hs, **attrs)
    assert len(outs) == len(refs) == 3 * len(xs)
    rtol, atol = TOLERANCES[dtype]
    names = [f"{p}_{i + 1}_new" for p in "XVH" for i in range(len(xs))]
    for name, out, ref, x in zip(names, outs, refs, xs * 3):
        assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
        assert out.shape == x.shape, f"{name}: shape {out.shape}, expected {x.shape}"
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol * scale,
                                   err_msg=name)
    return refs


def assert_outputs(outs, refs, xs, groups, dtype=None, tolerances=None):
    """Each output has X's dtype (or ``dtype``) and shape and is close to its reference;
    ``groups`` names the output groups (``"XH"`` gives X_1_new.., H_1_new..)."""
    dtype = np.dtype(dtype or xs[0].dtype)
    rtol, atol = tolerances or TOLERANCES[dtype]
    names = [f"{p}_{i + 1}_new" for p in groups for i in range(len(xs))]
    assert len(outs) == len(refs) == len(names)
    for name, out, ref, x in zip(names, outs, refs, list(xs) * len(groups)):
        assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
        assert out.shape == x.shape, f"{name}: shape {out.shape}, expected {x.shape}"
        scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol * scale,
                                   err_msg=name)


def assert_clear(message: str, needles) -> None:
    low = message.lower()
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o.lower() in low for o in options), (
            f"error message lacks {' or '.join(map(repr, options))}: {message}")


_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def ordered(a: np.ndarray) -> np.ndarray:
    """The float bit patterns of ``a`` mapped to integers that sort like the values
    (-0 and +0 both map to 0), so that ``|ordered(a) - ordered(b)|`` counts ulps."""
    a = np.asarray(a, order="C")
    size = a.dtype.itemsize
    bits = a.view(_INT[size]).astype(np.int64)
    sign = np.int64(1) << np.int64(8 * size - 1)
    return np.where(bits < 0, -(bits & (sign - 1)), bits)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise distance in ulps between two arrays of the same float dtype."""
    assert np.asarray(a).dtype == np.asarray(b).dtype
    return np.abs(ordered(np.asarray(a)) - ordered(np.asarray(b)))


def spacing16(y: np.ndarray, dtype) -> np.ndarray:
    """The distance between adjacent values of the 16-bit ``dtype`` around ``y``."""
    fi = ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)
    mag = np.maximum(np.abs(y), float(fi.tiny))
    return np.exp2(np.floor(np.log2(mag)) - fi.nmant)


def assert_adam16_close(out, ref64, slop, dtype, name=""):
    """``out`` (16-bit) within 1 ulp of ``ref64`` rounded to ``dtype``, or (near a
    cancellation) within one 16-bit spacing plus the f32 ``slop`` of the float64 value."""
    dtype = np.dtype(dtype)
    assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref64.shape, f"{name}: shape {out.shape}, expected {ref64.shape}"
    if out.size == 0:
        return
    rounded = ref64.astype(dtype)
    d = ulp_distance(out, rounded)
    err = np.abs(wide(out) - ref64)
    ok = (d <= 1) | (err <= spacing16(ref64, dtype) + slop)
    if not np.all(ok):
        k = int(np.flatnonzero(~ok.reshape(-1))[0])
        raise AssertionError(
            f"{name}: {int((~ok).sum())} of {out.size} elements off by more than 1 ulp; "
            f"first at flat index {k}: got {wide(out).reshape(-1)[k]!r}, reference "
            f"{ref64.reshape(-1)[k]!r} (rounded {wide(rounded).reshape(-1)[k]!r}), "
            f"{int(d.reshape(-1)[k])} ulps")


def assert_adam16_matches(outs, r, t, xs, gs, vs, hs, dtype=None, **attrs):
    """Every output of a 16-bit Adam node against the rounded float64 reference."""
    dtype = np.dtype(dtype or np.asarray(xs[0]).dtype)
    refs = adam16(r, t, xs, gs, vs, hs, **attrs)
    slops = adam16_slop(r, t, xs, gs, vs, hs, **attrs)
    n = len(xs)
    assert len(outs) == 3 * n
    names = [f"{p}_{i + 1}_new" for p in "XVH" for i in range(n)]
    for name, out, ref, slop in zip(names, outs, refs, slops):
        assert_adam16_close(np.asarray(out), ref, slop, dtype, name)
    return refs
