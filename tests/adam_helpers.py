"""Shared helpers for the Adam tests (data, running, comparing)."""

from __future__ import annotations

import numpy as np

from adam_reference import adam as adam_ref
from trainops.models import adam_feeds

# float32 kernel vs the float64 reference: rtol 1e-5, atol 1e-6 scaled by the data.
# float64 kernel vs the float64 reference: a few ulps of rounding-order freedom.
TOLERANCES = {
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float64): (1e-10, 1e-12),
}


def group(rng, shape, dtype=np.float32, g_shape=None):
    """(x, g, v, h) for one tensor group; h >= 0 as a second moment is."""
    g_shape = shape if g_shape is None else g_shape
    x = rng.standard_normal(shape).astype(dtype)
    g = rng.standard_normal(g_shape).astype(dtype)
    v = (0.1 * rng.standard_normal(shape)).astype(dtype)
    h = (0.01 * rng.random(shape)).astype(dtype)
    return x, g, v, h


def groups(rng, shapes, dtype=np.float32, g_shapes=None):
    g_shapes = g_shapes or shapes
    data = [group(rng, s, dtype, gs) for s, gs in zip(shapes, g_shapes)]
    return [list(col) for col in zip(*data)] if data else [[], [], [], []]


def run(sess, r, t, xs, gs, vs, hs, r_dtype=None):
    feeds = adam_feeds(r, t, xs, gs, vs, hs, r_dtype=r_dtype)
    return sess.run(None, feeds)


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


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
