"""The gradient rule for Resize (modes nearest and linear). Registered into
:data:`.rules.RULES`.

Resize is linear in its input and separable: along each resized axis ``y = A x`` with a
constant ``[out, in]`` matrix ``A`` (one 1 per row for nearest, two weights for linear). The
gradient applies ``A^T`` along each axis (a MatMul). ``A`` is computed here as onnxruntime
computes its coordinates (float32 arithmetic, the clamping at the borders, the rounding
of each nearest_mode), so the resized axes' input sizes and the scales or sizes must be
known statically; axes with scale 1 are the identity (as in onnxruntime, even for
tf_half_pixel_for_nn) and may be dynamic (batch, channels).

Covered: coordinate_transformation_mode half_pixel, asymmetric, align_corners,
pytorch_half_pixel, half_pixel_symmetric, tf_half_pixel_for_nn; nearest_mode
round_prefer_floor, round_prefer_ceil, floor, ceil (and opset 10's rounding);
keep_aspect_ratio_policy; axes. Not covered (a GradientError): mode cubic, antialias,
tf_crop_and_resize.
"""

from __future__ import annotations

import numpy as np

from .rules import Ctx, rule

F = np.float32
COVERED_MODES = ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel",
                 "half_pixel_symmetric", "tf_half_pixel_for_nn")


def _original(mode: str, out_len: int, in_len: int, scale) -> np.ndarray:
    """Each output index's coordinate in the input, in float32 as onnxruntime has it."""
    x = np.arange(out_len, dtype=F)
    half = F(0.5)
    if mode == "asymmetric":
        return x / scale
    if mode == "pytorch_half_pixel":
        return (x + half) / scale - half if out_len > 1 else np.zeros(out_len, F)
    if mode == "tf_half_pixel_for_nn":
        return (x + half) / scale
    if mode == "align_corners":
        if out_len == 1:
            return np.zeros(out_len, F)
        return x * F(in_len - 1) / F(out_len - 1)
    if mode == "half_pixel_symmetric":  # onnxruntime mixes double literals in here
        adjustment = F(F(out_len) / (scale * F(in_len)))
        offset = F(F(in_len) / F(2)) * (F(1) - adjustment)
        return (offset + (x.astype(np.float64) + 0.5) / float(scale) - 0.5).astype(F)
    return (x + half) / scale - half  # half_pixel


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + F(0.5))


def _matrix(mode: str, interp: str, nearest: str, out_len: int, in_len: int, scale) -> np.ndarray:
    """The ``[out, in]`` matrix of one axis."""
    orig = _original(mode, out_len, in_len, scale)
    a = np.zeros((out_len, in_len), np.float64)
    rows = np.arange(out_len)
    if interp == "nearest":
        if nearest == "round_prefer_floor":
            idx = np.where(orig == np.trunc(orig) + F(0.5), np.floor(orig), _round_half_away(orig))
        elif nearest == "round_prefer_ceil":
            idx = _round_half_away(orig)
        elif nearest == "floor":
            idx = np.floor(orig)
        elif nearest == "ceil":
            idx = np.ceil(orig)
        else:  # opset 10: ceil when downsampling, else truncation
            idx = np.ceil(orig) if scale < 1 else np.trunc(orig)
        idx = np.clip(idx.astype(np.int64), 0, in_len - 1)
        a[rows, idx] = 1.0
        return a
    c = np.clip(orig, F(0), F(in_len - 1))
    x1 = np.minimum(c.astype(np.int64), in_len - 1)
    x2 = np.minimum(x1 + 1, in_len - 1)
    d1 = np.abs(c - x1.astype(F))  # the weight of x2
    d2 = np.abs(c - x2.astype(F))  # the weight of x1
    same = x1 == x2
    d1, d2 = np.where(same, F(0.5), d1), np.where(same, F(0.5), d2)
    np.add.at(a, (rows, x1), d2.astype(np.float64))
    np.add.at(a, (rows, x2), d1.astype(np.float64))
    return a


def _plan(c: Ctx) -> dict[int, tuple[int, int, np.float32]]:
    """axis -> (input length, output length, float32 scale) for each resized axis."""
    b = c.b
    x = c.x(0)
    r = c.rank(x)
    dims = b.shape(x)
    axes = list(c.attr("axes", range(r))) if b.opset >= 18 else list(range(r))
    axes = [a + r if a < 0 else a for a in axes]
    scales_name = c.x(1) if b.opset < 11 else c.x(2)
    sizes_name = c.x(3) if b.opset >= 11 else None
    sizes = b.constant_value(sizes_name) if sizes_name else None
    scales = b.constant_value(scales_name) if scales_name else None
    if (sizes_name and sizes is None) or (scales_name and scales is None):
        raise c.fail("the gradient needs the scales and sizes as constants")
    if sizes is not None and np.asarray(sizes).size:
        sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(sizes) == r and len(axes) != r:
            sizes = [sizes[a] for a in axes]
        ins = []
        for a in axes:
            if not (dims is not None and isinstance(dims[a], int)):
                raise c.fail(f"sizes given: the gradient needs the input's axis {a} statically "
                             f"('{x}': {dims})")
            ins.append(dims[a])
        sc = [F(o) / F(i) if i else F(1) for o, i in zip(sizes, ins)]
        outs = list(sizes)
        policy = c.attr("keep_aspect_ratio_policy", "stretch") if b.opset >= 18 else "stretch"
        if policy != "stretch":
            one = min(sc) if policy == "not_larger" else max(sc)
            sc = [one] * len(sc)
            outs = [int(np.round(F(one) * F(i))) for i in ins]
        plan = {a: (i, o, s) for a, i, o, s in zip(axes, ins, outs, sc)}
    else:
        if scales is None or not np.asarray(scales).size:
            raise c.fail("neither scales nor sizes is given")
        sc = [F(v) for v in np.asarray(scales).reshape(-1)]
        if len(sc) == r and len(axes) != r:
            sc = [sc[a] for a in axes]
        plan = {}
        for a, s in zip(axes, sc):
            if s == F(1):  # the identity in onnxruntime, whatever the mode and the length
                continue
            if not (dims is not None and isinstance(dims[a], int)):
                raise c.fail(f"the gradient needs the input's axis {a} statically ('{x}': {dims})")
            plan[a] = (dims[a], int(F(s) * F(dims[a])), s)
    return plan


@rule("Resize")
def resize(c: Ctx):
    b = c.b
    x = c.x(0)
    if b.opset < 10:
        raise c.fail("Resize before opset 10 does not exist")
    interp = c.attr("mode", "nearest")
    if interp not in ("nearest", "linear"):
        raise c.fail(f"mode={interp!r}: the gradient covers nearest and linear")
    mode = c.attr("coordinate_transformation_mode", "half_pixel") if b.opset >= 11 \
        else "asymmetric"
    if mode not in COVERED_MODES:
        raise c.fail(f"coordinate_transformation_mode={mode!r} is not supported (covered: "
                     f"{', '.join(COVERED_MODES)})")
    if b.opset >= 18 and int(c.attr("antialias", 0)):
        raise c.fail("antialias=1 is not supported")
    nearest = c.attr("nearest_mode", "round_prefer_floor") if b.opset >= 11 else "simple"
    r = c.rank(x)
    y_dims = b.shape(c.y)
    g = c.gy
    for axis, (n_in, n_out, scale) in sorted(_plan(c).items()):
        if y_dims is not None and isinstance(y_dims[axis], int) and y_dims[axis] != n_out:
            raise c.fail(f"axis {axis}: computed output length {n_out}, but the graph says "
                         f"{y_dims[axis]}")
        if scale == F(1):  # onnxruntime copies such axes (even where a mode would shift them)
            continue
        a = _matrix(mode, interp, nearest, n_out, n_in, scale)
        mat = b.const(a.astype(b.np_dtype(x)), hint="resize_matrix")
        if axis == r - 1:
            g = b.op("MatMul", [g, mat])
        else:
            perm = list(range(r))
            perm[axis], perm[r - 1] = r - 1, axis
            g = b.op("Transpose", [b.op("MatMul", [b.op("Transpose", [g], perm=perm), mat])],
                     perm=perm)
    return [g] + [None] * (len(c.node.input) - 1)
