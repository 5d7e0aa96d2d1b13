"""Independent references for the mixed-precision ops, written from the contract
(shared/spec/ops.md sections 1 and 3), not from the library:

- 16-bit Adam: the float64 Adam of adam_reference.py on the 16-bit inputs widened exactly,
  rounded once to the 16-bit type (numpy float16 / ml_dtypes.bfloat16, round-to-nearest-even);
- ``MixedPrecisionAdam``: ``g = float32(G) / float32(loss_scale)`` in float32, one
  finiteness verdict over every g of the node, then the float64 Adam or the inputs back;
- ``DynamicLossScale``: the contract's rule in float32, and separately a plain-Python model
  of PyTorch's ``GradScaler`` update (``torch._amp_update_scale_``) with a ``min_scale``;
- ``AllFinite``: ``np.isfinite`` over everything.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from adam_reference import adam as adam_ref
from adam_reference import attr_f32

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

# ONNX TensorProto data types used by copy_dtype.
COPY_TYPES = {10: F16, 16: BF16}

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def wide(a) -> np.ndarray:
    """float64 copy of an array of any float dtype (bfloat16 included), exact."""
    return np.asarray(a).astype(np.float64)


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


def same_bits(a, b) -> bool:
    a = np.asarray(a, order="C")
    b = np.asarray(b, order="C")
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- Adam on 16-bit tensors ---------------------------------------------------------------

def adam16(r, t, xs, gs, vs, hs, **attrs):
    """The float64 reference (outputs in op order) on the 16-bit inputs; not yet rounded."""
    return adam_ref(r, t, [wide(x) for x in xs], [wide(g) for g in gs],
                    [wide(v) for v in vs], [wide(h) for h in hs], **attrs)


def adam16_slop(r, t, xs, gs, vs, hs, **attrs):
    """Per output (op order), the absolute error a float32 evaluation of the formula may
    add on top of the final 16-bit rounding: 8 float32 ulps of the terms' magnitudes.

    The kernel computes in f32: near a cancellation (``alpha*v + (1-alpha)*g`` close to 0,
    ``x`` close to its step) the result is small and its 16-bit ulp finer than f32's error
    on the terms; everywhere else this is far below one 16-bit ulp."""
    a = {k: attr_f32(attrs.get(k, d)) for k, d in
         {"alpha": 0.9, "beta": 0.999, "norm_coefficient": 0.0,
          "norm_coefficient_post": 0.0}.items()}
    eps32 = 2.0 ** -24
    outs = adam16(r, t, xs, gs, vs, hs, **attrs)
    n = len(xs)
    slops = [None] * (3 * n)
    for i in range(n):
        x, v, h = wide(xs[i]), wide(vs[i]), wide(hs[i])
        g = np.broadcast_to(wide(gs[i]), x.shape)
        g_terms = np.abs(a["norm_coefficient"] * x) + np.abs(g)
        keep = 1.0 - a["norm_coefficient_post"]
        step = np.abs(x - outs[i] / keep) if keep != 0 else np.abs(x)
        slops[i] = 8 * eps32 * (np.abs(x) + step)
        slops[n + i] = 8 * eps32 * (np.abs(a["alpha"] * v) + (1 - a["alpha"]) * g_terms)
        slops[2 * n + i] = 8 * eps32 * (a["beta"] * h + (1 - a["beta"]) * g_terms ** 2)
    return slops


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


# --- MixedPrecisionAdam -------------------------------------------------------------------

def unscale(g, loss_scale) -> np.ndarray:
    """``g = G / loss_scale`` in float32 (IEEE division, correctly rounded)."""
    ls = np.float32(np.asarray(loss_scale, dtype=np.float32).reshape(-1)[0])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return np.asarray(g).astype(np.float32) / ls


def mixed_precision_adam(r, t, loss_scale, xs, gs, vs, hs, copy_dtype=0, **attrs):
    """``(finite, outputs)``: ``outputs`` in op order (``X_new.., V_new.., H_new..``, then
    ``X_copy..`` when ``copy_dtype``), float64 when the step is taken (compare with float32
    tolerance), the inputs themselves (bitwise) when it is skipped. The copies of a taken
    step are ``None``: they are defined as the cast of the kernel's own ``X_new``."""
    unscaled = [unscale(g, loss_scale) for g in gs]
    finite = all(bool(np.all(np.isfinite(u))) for u in unscaled)
    n = len(xs)
    if finite:
        outs = adam_ref(r, t, xs, unscaled, vs, hs, **attrs)
        copies = [None] * n
    else:
        outs = list(xs) + list(vs) + list(hs)
        copies = [np.asarray(x).astype(COPY_TYPES[copy_dtype]) for x in xs] if copy_dtype else []
    if copy_dtype:
        outs = outs + copies
    return finite, outs


# --- DynamicLossScale ---------------------------------------------------------------------

def f32_mul(a, b) -> np.float32:
    """float32 product, rounded once (the product of two float32 is exact in float64)."""
    with np.errstate(over="ignore"):
        return np.float32(np.float64(np.float32(a)) * np.float64(np.float32(b)))


def dynamic_loss_scale(scale, good_steps, finite, growth_interval=2000, growth_factor=2.0,
                       backoff_factor=0.5, min_scale=0.0):
    """The contract's rule (ops.md section 3), in float32: returns (scale, good_steps)."""
    scale = np.float32(scale)
    growth_factor, backoff_factor, min_scale = (attr_f32(growth_factor),
                                                attr_f32(backoff_factor), attr_f32(min_scale))
    if finite:
        if good_steps + 1 == growth_interval:
            grown = f32_mul(scale, growth_factor)
            return (grown if np.isfinite(grown) else scale), 0
        return scale, good_steps + 1
    return max(f32_mul(scale, backoff_factor), np.float32(min_scale)), 0


class GradScalerModel:
    """A plain-Python model of PyTorch's ``torch.cuda.amp.GradScaler`` scale update
    (``torch._amp_update_scale_``), from its documented semantics: the scale is a float32
    tensor; on an inf/nan ``scale *= backoff_factor`` and the growth tracker resets;
    otherwise the tracker counts successful steps and, when it reaches
    ``growth_interval``, ``scale *= growth_factor`` (kept only if finite) and the tracker
    resets. PyTorch has no floor; ``min_scale`` (0: none) clamps the backoff like Keras'."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, min_scale=0.0):
        self.scale = np.float32(init_scale)
        self.growth_tracker = 0
        self.growth_factor = float(np.float32(growth_factor))
        self.backoff_factor = float(np.float32(backoff_factor))
        self.growth_interval = int(growth_interval)
        self.min_scale = float(np.float32(min_scale))

    def update(self, found_inf: bool) -> None:
        if found_inf:
            new = np.float32(float(self.scale) * self.backoff_factor)
            if self.min_scale and float(new) < self.min_scale:
                new = np.float32(self.min_scale)
            self.scale = new
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:
            with np.errstate(over="ignore"):
                new = np.float32(float(self.scale) * self.growth_factor)
            if math.isfinite(float(new)):
                self.scale = new
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful


# --- AllFinite ----------------------------------------------------------------------------

def all_finite(arrays) -> bool:
    with np.errstate(invalid="ignore"):  # signalling NaNs raise "invalid" in isfinite
        return all(bool(np.all(np.isfinite(np.asarray(a)))) for a in arrays)
