"""Gradient rules for ConvTranspose, LRN, InstanceNormalization and GroupNormalization.
Registered into :data:`.rules.RULES`."""

from __future__ import annotations

import numpy as np

from .graph import Builder
from .rules import Ctx, rule


def _dims_static(c: Ctx, name: str, what: str) -> list[int]:
    s = c.b.shape(name)
    if s is None or not all(isinstance(d, int) for d in s):
        raise c.fail(f"the gradient needs the {what}'s shape statically ('{name}': {s})")
    return list(s)


def _shape_slice(b: Builder, x: str, start: int, end: int) -> str:
    return b.op("Slice", [b.op("Shape", [x]), b.ints([start]), b.ints([end])])


# -- ConvTranspose ------------------------------------------------------------------------

@rule("ConvTranspose")
def conv_transpose(c: Ctx):
    """dX is the convolution of dY with W (ConvTranspose's adjoint); dW a convolution of dY
    (batch as channels) with X, strides and dilations swapped; explicit pads or VALID
    (``output_shape`` and SAME_* pads: onnxruntime and the ONNX spec place them
    differently, so the gradient refuses them)."""
    b = c.b
    X, W, B = c.x(0), c.x(1), c.x(2)
    w_shape = _dims_static(c, W, "weight")
    n = len(w_shape) - 2
    auto = c.attr("auto_pad", "NOTSET")
    if c.attr("output_shape") is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        raise c.fail("output_shape and auto_pad=SAME_* are not supported (give explicit pads)")
    k = w_shape[2:]
    strides = list(c.attr("strides", [1] * n))
    dil = list(c.attr("dilations", [1] * n))
    group = int(c.attr("group", 1))
    pads = [0] * (2 * n) if auto == "VALID" else list(c.attr("pads", [0] * (2 * n)))
    opad = list(c.attr("output_padding", [0] * n))
    if any(p >= s for p, s in zip(opad, strides)):
        raise c.fail(f"output_padding {opad} >= strides {strides} is not supported")
    gy = c.gy
    out = [None, None, None]
    sp = list(range(2, n + 2))
    if c.need(0):
        # output_padding < strides: the convolution's output is exactly X's size
        out[0] = b.op("Conv", [gy, W], strides=strides, dilations=dil, pads=pads, group=group)
    if c.need(1):
        perm = [1, 0] + sp
        gt = b.op("Transpose", [gy], perm=perm)          # [C_out, N, out]
        xt = b.op("Transpose", [X], perm=perm)           # [C_in, N, in]
        full = b.op("Conv", [gt, xt], strides=dil, dilations=strides, pads=pads)
        full = b.op("Slice", [full, b.ints([0] * n), b.ints(k), b.ints(sp)])  # [C_out, C_in, k]
        c_in, cog = w_shape[0], w_shape[1]
        if group == 1:
            out[1] = b.op("Transpose", [full], perm=perm)
        else:
            cig = c_in // group
            g5 = b.op("Reshape", [full, b.ints([group, cog, group, cig] + k)])
            eye = np.eye(group, dtype=b.np_dtype(W)).reshape([group, 1, group, 1] + [1] * n)
            diag = b.reduce("ReduceSum", b.op("Mul", [g5, b.const(eye)]), [2], keepdims=0)
            t = b.op("Transpose", [diag], perm=[0, 2, 1] + list(range(3, n + 3)))
            out[1] = b.op("Reshape", [t, b.ints(w_shape)])
    if B is not None and c.need(2):
        out[2] = b.reduce("ReduceSum", gy, [0] + sp, keepdims=0)
    return out


# -- LRN -------------------------------------------------------------------------------------

@rule("LRN")
def lrn(c: Ctx):
    """``y = x d^-beta``, ``d = bias + alpha/size * window(x^2)``:
    ``dx = dy d^-beta - (2 alpha beta / size) x window'(dy x d^(-beta-1))``, the channel
    windows summed by a ones-kernel Conv over ``[N, 1, C, -1]`` (window' mirrored)."""
    b = c.b
    x = c.x(0)
    size = int(c.attr("size"))
    alpha, beta = float(c.attr("alpha", 1e-4)), float(c.attr("beta", 0.75))
    bias = float(c.attr("bias", 1.0))
    lo = (size - 1) // 2
    hi = size - 1 - lo
    dims = b.shape(x)
    if dims is not None and len(dims) >= 2 and all(isinstance(d, int) for d in dims[:2]):
        four = b.ints([dims[0], 1, dims[1], -1])
    else:
        four = b.op("Concat", [_shape_slice(b, x, 0, 1), b.ints([1]), _shape_slice(b, x, 1, 2),
                               b.ints([-1])], axis=0)
    ones = b.const(np.ones([1, 1, size, 1], b.np_dtype(x)))
    x_shape = b.shape_of(x)

    def window(t: str, before: int, after: int) -> str:
        s = b.op("Conv", [b.op("Reshape", [t, four]), ones], pads=[before, 0, after, 0])
        return b.op("Reshape", [s, x_shape])

    s = lambda v: b.scalar(v, x)  # noqa: E731
    d = b.op("Add", [s(bias), b.op("Mul", [s(alpha / size), window(b.op("Mul", [x, x]), lo, hi)])])
    d_mb = b.op("Pow", [d, s(-beta)])
    t = b.op("Div", [b.op("Mul", [b.op("Mul", [c.gy, x]), d_mb]), d])
    back = b.op("Mul", [b.op("Mul", [x, window(t, hi, lo)]), s(2 * alpha * beta / size)])
    return [b.op("Sub", [b.op("Mul", [c.gy, d_mb]), back])]


# -- InstanceNormalization, GroupNormalization ------------------------------------------------

def _normalize_back(b: Builder, gh: str, xhat: str, rstd: str, axes: list[int]) -> str:
    """d/dx of ``xhat = (x - mean) / sqrt(var + eps)`` over ``axes`` applied to ``gh``."""
    m1 = b.reduce("ReduceMean", gh, axes, 1)
    m2 = b.reduce("ReduceMean", b.op("Mul", [gh, xhat]), axes, 1)
    return b.op("Mul", [rstd, b.op("Sub", [b.op("Sub", [gh, m1]), b.op("Mul", [xhat, m2])])])


def _standardize(b: Builder, x: str, axes: list[int], eps: float) -> tuple[str, str]:
    mu = b.reduce("ReduceMean", x, axes, 1)
    xc = b.op("Sub", [x, mu])
    var = b.reduce("ReduceMean", b.op("Mul", [xc, xc]), axes, 1)
    rstd = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.scalar(eps, x)])])])
    return b.op("Mul", [xc, rstd]), rstd


@rule("InstanceNormalization")
def instance_norm(c: Ctx):
    b = c.b
    X, scale = c.x(0), c.x(1)
    r = c.rank(X)
    axes = list(range(2, r))
    xhat, rstd = _standardize(b, X, axes, float(c.attr("epsilon", 1e-5)))
    chan = lambda t: b.op("Reshape", [t, b.ints([-1] + [1] * (r - 2))])  # noqa: E731
    gy = c.gy
    out = [None, None, None]
    if c.need(0):
        out[0] = _normalize_back(b, b.op("Mul", [gy, chan(scale)]), xhat, rstd, axes)
    if c.need(1):
        out[1] = b.reduce("ReduceSum", b.op("Mul", [gy, xhat]), [0] + axes, 0)
    if c.need(2):
        out[2] = b.reduce("ReduceSum", gy, [0] + axes, 0)
    return out


@rule("GroupNormalization")
def group_norm(c: Ctx):
    """Statistics over ``[N, G, C/G * spatial]``; scale and bias per group (opset 18) or per
    channel (opset 21)."""
    b = c.b
    X, scale = c.x(0), c.x(1)
    groups = int(c.attr("num_groups"))
    r = c.rank(X)
    per_channel = b.opset >= 21
    view = b.op("Reshape", [X, b.ints([0, groups, -1])])
    b.set_info(view, b.dtype(X), None)
    xhat_v, rstd = _standardize(b, view, [2], float(c.attr("epsilon", 1e-5)))
    x_shape = b.shape_of(X)
    xhat = b.op("Reshape", [xhat_v, x_shape])
    chan = lambda t: b.op("Reshape", [t, b.ints([-1] + [1] * (r - 2))])  # noqa: E731
    if per_channel:
        scale_c = scale
    else:  # [G] -> [C]: each group's value for its C/G channels
        per_group = b.op("Div", [_shape_slice(b, X, 1, 2), b.ints([groups])])
        scale_c = b.op("Reshape", [b.op("Expand", [
            b.op("Reshape", [scale, b.ints([groups, 1])]),
            b.op("Concat", [b.ints([groups]), per_group], axis=0)]), b.ints([-1])])
    gy = c.gy
    out = [None, None, None]
    if c.need(0):
        gh = b.op("Reshape", [b.op("Mul", [gy, chan(scale_c)]), b.ints([0, groups, -1])])
        out[0] = b.op("Reshape", [_normalize_back(b, gh, xhat_v, rstd, [2]), x_shape])
    red = [0] + list(range(2, r))

    def per_param(t: str) -> str:
        s = b.reduce("ReduceSum", t, red, 0)  # [C]
        if per_channel:
            return s
        return b.reduce("ReduceSum", b.op("Reshape", [s, b.ints([groups, -1])]), [1], 0)
    if c.need(1):
        out[1] = per_param(b.op("Mul", [gy, xhat]))
    if c.need(2):
        out[2] = per_param(gy)
    return out
