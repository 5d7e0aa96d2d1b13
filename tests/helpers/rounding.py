"""Rounding-error bounds of a float32 training step, for tests that compare two float32
backwards whose summation orders differ (onnxruntime's MLAS kernels against trainops'
fused gradient kernels; MLAS's blocking and SIMD paths also change with the CPU).

Such a test cannot use a fixed tolerance: how far two orders of the same sum may drift
apart depends on the terms being summed, not on the machine the test was tuned on. The
bound used here is the classical one (Higham, *Accuracy and Stability of Numerical
Algorithms*, ch. 3): a float32 sum or dot product of ``n`` terms, in ANY order, blocked,
vectorised or with fused multiply-adds, is within ``gamma(n) * sum|terms|`` of the exact
value, ``gamma(n) = n u / (1 - n u)``, ``u = 2^-24``.

:func:`step_bounds` runs a model's forward and backward in float64 from the operators'
definitions (not from trainops' rules). Both runs compute the backward from the same
forward values, so the forward is taken as exact; every backward operation carries a bound
``E`` on how far ANY float32 evaluation of it may be from its float64 value: the bounds of
its inputs propagated through it (with the magnitudes of its coefficients), plus
``gamma(n)`` times the magnitudes of the terms it sums. What the backward recomputes from
the forward values rounds too and is bounded the same way: a BatchNorm / LayerNorm's
mean, variance and x̂, the softmax of the loss's gradient, Gelu's derivative. The bound is
large where the sums cancel (a BatchNorm bias's gradient sums terms of both signs) and
small where they do not.

Elementary functions: onnxruntime's vectorised ``Exp``, ``Erf`` and ``Tanh`` are within 4.6
ulps of the exact value over [-20, 20] (1.17.3 and 1.32.0); each is allowed ``ELEMENTARY``
ulps here. Decisions: when the two runs' parameters differ (:mod:`helpers.adam_pair`), a
Relu input or two max-pool candidates within the width by which the two forwards may
differ could be decided differently; the bound there takes the whole routed gradient.

The rules also propagate forward errors (``e``). By default :func:`step_bounds` only feeds
them the decision widths: the forward's worst-case bound, which assumes every rounding of
every layer aligned, is far too loose to be of use in deep models. Where the two runs'
forwards differ (another forward kernel, another batch split) and the model is shallow,
``step_bounds(forward_errors=True)`` carries them whole, forward and into the backward: a
bound of the whole step against float64, for one run on its own, with no model.

GRU (layout 0): a rule over bounded leaves (:class:`_Ex`), its Sigmoid / Tanh allowed
``GRU_ACT`` ulps of 1 (measured: onnxruntime's GRU kernel and ops, GRUTrain); with
``forward_errors="linear"`` its state errors pass from step to step through the signed
Jacobians of the exact steps (first order) where the worst case compounds out of use.
:func:`mean_of_parts` bounds the mean of k parts' gradients (micro-batches, ranks);
:func:`clip_pair` carries a bound through torch's clip_grad_norm_ in two runs.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper, numpy_helper

from helpers.numpy_graph import _col2im, _conv_geometry, _im2col

U = 2.0 ** -24  # float32's unit roundoff
ELEMENTARY = 16  # ulps allowed for each Exp / Erf / Tanh (measured worst: 4.6, Tanh)


def gamma(n) -> float:
    """Higham's gamma_n for float32: the relative bound of n roundings in a row."""
    n = float(n)
    assert n * U < 0.01, n
    return n * U / (1 - n * U)


def _attrs(n):
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _s(a):
    return a.decode() if isinstance(a, bytes) else a


# -- im2col and the window geometry: helpers.numpy_graph's --------------------------------

def _geometry(n, w_shape=None, shape=None):
    """numpy_graph's ``(kernel, strides, pads, dilations)`` of a 2-D Conv or MaxPool, with
    MaxPool's ``ceil_mode`` 1 (``shape``: its input's) as extra end padding, so that the
    floor of the padded size gives ONNX's ceil count (less a last window that would start
    in the end padding, which onnxruntime drops)."""
    k, s, p, d = _conv_geometry(n, w_shape)
    if _attrs(n).get("ceil_mode", 0):
        assert shape is not None, n
        for i in range(2):
            span = shape[2 + i] + p[i] + p[i + 2] - (d[i] * (k[i] - 1) + 1)
            out = -(-span // s[i]) + 1
            if (out - 1) * s[i] >= shape[2 + i] + p[i]:
                out -= 1
            p[i + 2] += max(0, (out - 1) * s[i] + d[i] * (k[i] - 1) + 1
                            - (shape[2 + i] + p[i] + p[i + 2]))
    return k, s, p, d


# -- the operators: forward (value, error) and backward (gradient, error) ---------------------
#
# Forward: each rule gets the inputs' float64 values ``v`` and error bounds ``e`` (what a
# float32 evaluation may be off by) and returns the output's, plus a cache. Backward: each
# gets the output gradient ``g`` and its bound ``E`` and returns, per input, the gradient
# and ITS bound: the input errors of the forward (the coefficients a float32 backward
# multiplies by) and of ``g`` propagated, plus gamma(terms) times the terms' magnitudes.
# ``A = |g| + E`` is an upper bound on the magnitude of any float32 gradient there.

def _sum_to(a, shape):
    """Sum ``a`` down to ``shape`` (undo numpy broadcasting); also the number of terms."""
    lead = a.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape) if s == 1 and a.shape[i + lead] != 1)
    terms = int(np.prod([a.shape[i] for i in axes])) if axes else 1
    return (a.sum(axis=axes).reshape(shape) if axes else a.reshape(shape)), terms


def _conv(n, v, e, a):
    x, w = v[0], v[1]
    k, s, p, d = _geometry(n, w.shape)
    cols, ecols = _im2col(x, k, s, p, d), _im2col(e[0], k, s, p, d)
    y = np.einsum("nckloh,mckl->nmoh", cols, w, optimize=True)
    mag = np.einsum("nckloh,mckl->nmoh", np.abs(cols) + ecols, np.abs(w), optimize=True)
    terms = w[0].size
    if len(v) > 2:
        y = y + v[2][None, :, None, None]
        mag = mag + np.abs(v[2])[None, :, None, None]
        terms += 1
    ey = np.einsum("nckloh,mckl->nmoh", ecols, np.abs(w), optimize=True) + gamma(terms) * mag
    return y, ey, (cols, ecols, k, s, p, d, x.shape)


def _conv_back(n, v, e, cache, g, E):
    cols, ecols, k, s, p, d, xshape = cache
    w = v[1]
    A = np.abs(g) + E
    acols = np.abs(cols) + ecols
    nsum = g.shape[0] * g.shape[2] * g.shape[3]
    gw = np.einsum("nmoh,nckloh->mckl", g, cols, optimize=True)
    Ew = (np.einsum("nmoh,nckloh->mckl", E, acols, optimize=True)
          + np.einsum("nmoh,nckloh->mckl", np.abs(g), ecols, optimize=True)
          + gamma(nsum) * np.einsum("nmoh,nckloh->mckl", A, acols, optimize=True))
    gx = _col2im(np.einsum("nmoh,mckl->nckloh", g, w, optimize=True), xshape, k, s, p, d)
    # Each element of dX sums (output channels) x (kernel taps) products, in any order.
    Ex = (_col2im(np.einsum("nmoh,mckl->nckloh", E, np.abs(w), optimize=True), xshape, k, s, p, d)
          + gamma(w.shape[0] * k[0] * k[1])
          * _col2im(np.einsum("nmoh,mckl->nckloh", A, np.abs(w), optimize=True), xshape, k, s, p, d))
    out = [(gx, Ex), (gw, Ew)]
    if len(v) > 2:
        out.append((g.sum(axis=(0, 2, 3)), E.sum(axis=(0, 2, 3)) + gamma(nsum) * A.sum(axis=(0, 2, 3))))
    return out


def _T(t):
    return np.swapaxes(t, -1, -2)


def _matmul_fwd(x, ex, w, ew):
    """y = x @ w (numpy's batched matmul): each output sums K products."""
    y = x @ w
    ey = ex @ np.abs(w) + np.abs(x) @ ew + ex @ ew \
        + gamma(x.shape[-1]) * ((np.abs(x) + ex) @ (np.abs(w) + ew))
    return y, ey


def _matmul_back(x, ex, w, ew, g, E):
    """Gradients of y = x @ w and their bounds; an operand broadcast over batch
    dimensions sums its gradient over them too (one sum of all the terms, any order)."""
    A = np.abs(g) + E
    ax, aw = np.abs(x) + ex, np.abs(w) + ew
    out = []
    for val, grad, err, mag, inner in (
            (x, g @ _T(w), E @ _T(aw) + np.abs(g) @ _T(ew), A @ _T(aw), w.shape[-1]),
            (w, _T(x) @ g, _T(ax) @ E + _T(ex) @ np.abs(g), _T(ax) @ A, x.shape[-2])):
        grad, cnt = _sum_to(grad, val.shape)
        err, _ = _sum_to(err + gamma(inner * cnt) * mag, val.shape)
        out.append((grad, err))
    return out


def _matmul(n, v, e, a):
    y, ey = _matmul_fwd(v[0], e[0], v[1], e[1])
    return y, ey, None


def _matmul_back_rule(n, v, e, cache, g, E):
    return _matmul_back(v[0], e[0], v[1], e[1], g, E)


def _gemm(n, v, e, a):
    assert a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0, a
    ta, tb = a.get("transA", 0), a.get("transB", 0)
    x = v[0].T if ta else v[0]
    ex = e[0].T if ta else e[0]
    w = v[1].T if tb else v[1]
    ew = e[1].T if tb else e[1]
    if len(v) == 2:
        y, ey = _matmul_fwd(x, ex, w, ew)
        return y, ey, (ta, tb)
    # The bias is one more term of each sum, which a kernel may add first (then every
    # rounding of the sum applies to it too): gamma(K + 1) of all the terms.
    y = x @ w + v[2]
    ey = ex @ np.abs(w) + np.abs(x) @ ew + ex @ ew + e[2] + gamma(x.shape[-1] + 1) * (
        (np.abs(x) + ex) @ (np.abs(w) + ew) + np.abs(v[2]) + e[2])
    return y, ey, (ta, tb)


def _gemm_back(n, v, e, cache, g, E):
    ta, tb = cache
    x = v[0].T if ta else v[0]
    ex = e[0].T if ta else e[0]
    w = v[1].T if tb else v[1]
    ew = e[1].T if tb else e[1]
    (gx, Ex), (gw, Ew) = _matmul_back(x, ex, w, ew, g, E)
    out = [(gx.T, Ex.T) if ta else (gx, Ex), (gw.T, Ew.T) if tb else (gw, Ew)]
    if len(v) > 2:
        gb, cnt = _sum_to(g, v[2].shape)
        Eb, _ = _sum_to(E + gamma(cnt) * (np.abs(g) + E), v[2].shape)
        out.append((gb, Eb))
    return out


def _add(n, v, e, a):
    y = v[0] + v[1]
    return y, e[0] + e[1] + U * (np.abs(y) + e[0] + e[1]), None


def _ties(x, ex):
    """Relu / LeakyRelu inputs whose sign float32 rounding could flip (an exact 0 with no
    error stays 0)."""
    return (np.abs(x) <= ex) & ~((x == 0) & (ex == 0))


def _relu(n, v, e, a):
    x, ex = v[0], e[0]
    tie = _ties(x, ex)
    # Relu is 1-Lipschitz: the output is off by at most the input's error
    return np.maximum(x, 0), np.where((x > 0) | tie, ex, 0.0), (x > 0, tie)


def _relu_back(n, v, e, cache, g, E):
    mask, tie = cache
    # at a near-tie float32 may pass the gradient or not: off by its whole magnitude
    return [(g * mask, np.where(tie, np.abs(g) + E, E * mask))]


def _leaky_relu(n, v, e, a):
    x, ex = v[0], e[0]
    alpha = float(np.float32(a.get("alpha", 0.01)))
    tie = _ties(x, ex)
    y = np.where(x > 0, x, alpha * x)
    ey = np.where(x > 0, ex, abs(alpha) * ex + U * (abs(alpha) * (np.abs(x) + ex)))
    return y, np.where(tie, max(1.0, abs(alpha)) * ex + U * np.abs(x), ey), (x > 0, alpha, tie)


def _leaky_relu_back(n, v, e, cache, g, E):
    mask, alpha, tie = cache
    slope = np.where(mask, 1.0, alpha)
    A = np.abs(g) + E
    Ex = np.abs(slope) * E + np.where(mask, 0.0, U * abs(alpha) * A)
    return [(g * slope, np.where(tie, abs(1 - alpha) * A + Ex, Ex))]


def _sigmoid_op(n, v, e, a):
    """onnxruntime's Sigmoid allowed ELEMENTARY ulps; x off by ex moves it by at most
    s (1 - s) ex + ex^2 / 10 (|sigmoid''| <= 0.1)."""
    x, ex = v[0], e[0]
    s = 0.5 * (1 + np.tanh(x / 2))
    return s, s * (1 - s) * ex + 0.1 * ex * ex + ELEMENTARY * U * s, s


def _sigmoid_back(n, v, e, s, g, E):
    """The rule's gy * (y * (1 - y)) from the forward's y (off by its own bound)."""
    es = s * (1 - s) * e[0] + 0.1 * e[0] * e[0] + ELEMENTARY * U * s
    d = s * (1 - s)
    Ed = (1 + 2 * s) * es + es * es + gamma(2) * s * (1 + s)
    A = np.abs(g) + E
    return [(g * d, d * E + A * Ed + U * A * (d + Ed))]


def _hard_parts(x, ex, alpha, beta):
    """HardSigmoid's u = alpha x + beta and its bound, and the inputs whose side of the
    kinks (u = 0, u = 1) float32 rounding could flip."""
    u = alpha * x + beta
    eu = abs(alpha) * ex + gamma(2) * (np.abs(alpha * x) + abs(beta))
    tie = ((np.abs(u) <= eu) | (np.abs(u - 1) <= eu)) & ~((eu == 0))
    return u, eu, tie


def _hard_sigmoid(n, v, e, a):
    x, ex = v[0], e[0]
    alpha, beta = float(np.float32(a.get("alpha", 0.2))), float(np.float32(a.get("beta", 0.5)))
    u, eu, tie = _hard_parts(x, ex, alpha, beta)
    inside = (u > 0) & (u < 1)
    return np.clip(u, 0, 1), np.where(inside | tie, eu, 0.0), (inside, tie, alpha)


def _hard_sigmoid_back(n, v, e, cache, g, E):
    inside, tie, alpha = cache
    d = np.where(inside, alpha, 0.0)
    A = np.abs(g) + E
    Ex = abs(alpha) * E * inside + U * A * abs(alpha) * inside
    # at a kink the float32 run may take either side: off by the whole alpha * gy
    return [(g * d, np.where(tie, abs(alpha) * A * (1 + U) + Ex, Ex))]


def _hard_swish(n, v, e, a):
    """ONNX HardSwish, x * clip(x / 6 + 1/2, 0, 1); its derivative jumps by 1/2 at both
    kinks (x = -3, 3)."""
    x, ex = v[0], e[0]
    u, eu, tie = _hard_parts(x, ex, 1 / 6, 0.5)
    c = np.clip(u, 0, 1)
    d = np.where(u <= 0, 0.0, np.where(u >= 1, 1.0, x / 3 + 0.5))
    ey = (np.abs(d) + ex / 3) * ex + gamma(3) * np.abs(x) * (np.abs(c) + eu)
    return x * c, ey, (x, tie)


def _hard_swish_back(n, v, e, cache, g, E):
    """The rule's 0 / gy / gy * (x / 3 + 1/2) on the thresholds -3 and 3."""
    x, tie = cache
    tie = tie | (np.abs(np.abs(x) - 3) <= e[0] + 4 * U * 3)
    mid = (x >= -3) & (x <= 3)
    d = np.where(x < -3, 0.0, np.where(x > 3, 1.0, x / 3 + 0.5))
    Ed = np.where(mid, e[0] / 3 + gamma(2) * (np.abs(x) / 3 + 0.5), 0.0)
    A = np.abs(g) + E
    Ex = np.abs(d) * E + A * Ed + U * A * (np.abs(d) + Ed)
    return [(g * d, np.where(tie, A * (0.5 + Ed) * (1 + U) + Ex, Ex))]


def _maxpool(n, v, e, a):
    x, ex = v[0], e[0]
    k, s, p, d = _geometry(n, shape=x.shape)
    assert d == [1, 1], d
    cols = _im2col(x, k, s, p, fill=-np.inf)
    ecols = _im2col(ex, k, s, p)
    nn, c, kh, kw, oh, ow = cols.shape
    flat, eflat = cols.reshape(nn, c, kh * kw, oh, ow), ecols.reshape(nn, c, kh * kw, oh, ow)
    idx = flat.argmax(axis=2)
    top = np.take_along_axis(flat, idx[:, :, None], 2)[:, :, 0]
    etop = np.take_along_axis(eflat, idx[:, :, None], 2)[:, :, 0]
    # Candidates float32 may pick: within both error bounds of the maximum (values equal
    # to it with no error on either side are equal in float32 too: the first one wins).
    cand = (top[:, :, None] - flat <= eflat + etop[:, :, None]) \
        & ~((flat == top[:, :, None]) & (eflat == 0) & (etop[:, :, None] == 0))
    cand |= np.arange(kh * kw)[None, None, :, None, None] == idx[:, :, None]
    tied = cand.sum(axis=2) > 1
    # the maximum of a window moves by at most the largest error in it
    return top, eflat.max(axis=2), (idx, cand & tied[:, :, None], x.shape, k, s, p)


def _maxpool_back(n, v, e, cache, g, E):
    idx, cand, shape, k, s, p = cache
    nn, c, oh, ow = idx.shape

    def to_input(flat):
        return _col2im(flat.reshape(nn, c, k[0], k[1], oh, ow), shape, k, s, p)

    def scatter(t):
        flat = np.zeros((nn, c, k[0] * k[1], oh, ow))
        np.put_along_axis(flat, idx[:, :, None], t[:, :, None], 2)
        return flat
    A = np.abs(g) + E
    # a tied window may send its gradient to any candidate: each is off by all of it
    Eflat = np.where(cand, A[:, :, None], scatter(E))
    # overlapping windows add up to ceil(k/s)^2 routed gradients into one input
    overlap = math.ceil(k[0] / s[0]) * math.ceil(k[1] / s[1])
    Ex = to_input(Eflat) + (gamma(overlap) * to_input(np.where(cand, A[:, :, None], scatter(A)))
                            if overlap > 1 else 0)
    return [(to_input(scatter(g)), Ex)]


def _normalize(x, ex, axes, eps):
    """Statistics over ``axes`` and the normalised x̂ with error bounds that hold for any
    float32 evaluation: the mean as a sum in any order, the variance either as the mean of
    (x - mean)^2 (the standard ops, trainops' kernels) or as E[x^2] - mean^2 (a one-pass
    kernel), then 1/sqrt(var + eps)."""
    cnt = int(np.prod([x.shape[i] for i in axes]))
    mean = x.mean(axis=axes, keepdims=True)
    emean = ex.mean(axis=axes, keepdims=True) + gamma(cnt + 1) * (np.abs(x) + ex).mean(axis=axes, keepdims=True)
    xc = x - mean
    var = (xc ** 2).mean(axis=axes, keepdims=True)
    ed = ex + emean
    evar = ((2 * np.abs(xc) + ed) * ed).mean(axis=axes, keepdims=True) \
        + gamma(cnt + 4) * (((np.abs(x) + ex) ** 2).mean(axis=axes, keepdims=True) + (np.abs(mean) + emean) ** 2)
    assert (evar < 0.5 * (var + eps)).all(), "variance not resolved in float32"
    rstd = 1 / np.sqrt(var + eps)
    # relative error of rstd: half that of var + eps (first order, with the 2x slack of
    # evar < (var + eps) / 2), plus add, sqrt and reciprocal
    rho = evar / (var + eps) + gamma(3)
    xhat = xc * rstd
    exhat = ed * rstd * (1 + rho) + np.abs(xhat) * rho + U * (np.abs(xhat) + ed * rstd)
    return mean, rstd, rho, xhat, exhat, cnt


def _affine(x, ex, mean, rstd, xhat, exhat, scale, bias):
    """y = scale * x̂ + bias (BatchNorm's, LayerNorm's), or x * (scale rstd) + (bias -
    mean scale rstd): magnitudes of both orders, four roundings."""
    y = scale * xhat + bias
    ey = np.abs(scale) * exhat + gamma(4) * (np.abs(scale) * rstd * (np.abs(x) + np.abs(mean) + ex) + np.abs(bias))
    return y, ey


def _affine_back(g, E, A, xhat, exhat, ax, axes, cnt):
    """The gradients of scale and bias, sums over ``axes`` (``cnt`` terms) of ``g x̂`` and
    ``g``, and their bounds: ``((gs, Es), (gb, Eb))``."""
    gb = g.sum(axis=axes)
    Eb = E.sum(axis=axes) + gamma(cnt) * A.sum(axis=axes)
    gs = (g * xhat).sum(axis=axes)
    Es = (E * ax + np.abs(g) * exhat).sum(axis=axes) + gamma(cnt + 1) * (A * ax).sum(axis=axes)
    return (gs, Es), (gb, Eb)


def _centered(g, E, A, xhat, exhat, ax, axes, cnt):
    """``g - mean(g) - x̂ mean(g x̂)`` over ``axes`` (``cnt`` terms), the normalisation's
    backward before the 1/std scaling, and its bound."""
    m1 = g.mean(axis=axes, keepdims=True)
    m2 = (g * xhat).mean(axis=axes, keepdims=True)
    Em1 = E.mean(axis=axes, keepdims=True) + gamma(cnt + 1) * A.mean(axis=axes, keepdims=True)
    Em2 = (E * ax + np.abs(g) * exhat).mean(axis=axes, keepdims=True) \
        + gamma(cnt + 2) * (A * ax).mean(axis=axes, keepdims=True)
    inner = g - m1 - xhat * m2
    Ein = E + Em1 + ax * Em2 + exhat * np.abs(m2) \
        + gamma(3) * (A + np.abs(m1) + Em1 + ax * (np.abs(m2) + Em2))
    return inner, Ein


def _batchnorm(n, v, e, a):
    """Training mode (the Trainer's default): batch statistics, biased variance."""
    x, ex = v[0], e[0]
    scale, bias = v[1], v[2]
    eps = float(np.float32(a.get("epsilon", 1e-5)))
    axes = (0,) + tuple(range(2, x.ndim))
    chan = (1, -1) + (1,) * (x.ndim - 2)
    mean, rstd, rho, xhat, exhat, cnt = _normalize(x, ex, axes, eps)
    sc = scale.reshape(chan)
    y, ey = _affine(x, ex, mean, rstd, xhat, exhat, sc, bias.reshape(chan))
    return y, ey, (xhat, exhat, rstd, rho, sc, axes, cnt)


def _batchnorm_back(n, v, e, cache, g, E):
    xhat, exhat, rstd, rho, sc, axes, cnt = cache
    A = np.abs(g) + E
    ax = np.abs(xhat) + exhat
    (gs, Es), (gb, Eb) = _affine_back(g, E, A, xhat, exhat, ax, axes, cnt)
    inner, Ein = _centered(g, E, A, xhat, exhat, ax, axes, cnt)
    k = np.abs(sc) * rstd
    gx = sc * rstd * inner
    Ex = k * Ein + k * (rho + gamma(2)) * (np.abs(inner) + Ein)
    return [(gx, Ex), (gs, Es), (gb, Eb)]


def _layernorm(n, v, e, a):
    """Normalised over the axes from ``axis`` on; Scale and Bias have those axes' shape."""
    x, ex = v[0], e[0]
    axis = a.get("axis", -1) % x.ndim
    assert a.get("stash_type", 1) == 1, a
    axes = tuple(range(axis, x.ndim))
    eps = float(np.float32(a.get("epsilon", 1e-5)))
    mean, rstd, rho, xhat, exhat, cnt = _normalize(x, ex, axes, eps)
    scale = v[1]
    bias = v[2] if len(v) > 2 else np.zeros_like(scale)
    y, ey = _affine(x, ex, mean, rstd, xhat, exhat, scale, bias)
    return y, ey, (xhat, exhat, rstd, rho, scale, cnt, axes)


def _layernorm_back(n, v, e, cache, g, E):
    xhat, exhat, rstd, rho, scale, cnt, axes = cache
    lead = tuple(range(axes[0]))
    rows = int(np.prod(g.shape[:axes[0]]))
    A = np.abs(g) + E
    ax = np.abs(xhat) + exhat
    (gs, Es), (gb, Eb) = _affine_back(g, E, A, xhat, exhat, ax, lead, rows)
    gh = g * scale
    Eh = E * np.abs(scale) + U * A * np.abs(scale)
    inner, Ein = _centered(gh, Eh, np.abs(gh) + Eh, xhat, exhat, ax, axes, cnt)
    gx = rstd * inner
    Ex = rstd * Ein + rstd * (rho + U) * (np.abs(inner) + Ein)
    out = [(gx, Ex), (gs, Es)]
    if len(v) > 2:
        out.append((gb, Eb))
    return out


_erf = np.vectorize(math.erf, otypes=[np.float64])
K_TANH, C_TANH = math.sqrt(2 / math.pi), 0.044715


def _gelu_parts(x, approximate):
    """Gelu(x), Gelu'(x), and bounds on the rounding error of a float32 evaluation of each
    from an exact x: ELEMENTARY ulps of the magnitude of every term (the standard form's
    ten operations and its Erf / Exp or Tanh; the fused kernel is within 1 ulp)."""
    r = ELEMENTARY * U
    if approximate == "none":
        cdf = 0.5 * (1 + _erf(x / math.sqrt(2)))
        pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        y, d = x * cdf, cdf + x * pdf
        return y, d, r * np.abs(x) * (0.5 + np.abs(cdf - 0.5)), r * (cdf + np.abs(x * pdf))
    u = K_TANH * (x + C_TANH * x ** 3)
    t = np.tanh(u)
    du = K_TANH * (1 + 3 * C_TANH * x * x)
    y, d = 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du
    # u itself is off by a few roundings of its terms; Gelu moves by at most
    # |x| (1 - t^2) / 2 and Gelu' by (1 - t^2)(1/2 + |x| du) per unit of u
    eu = gamma(4) * K_TANH * (np.abs(x) + C_TANH * np.abs(x) ** 3)
    ey = r * np.abs(x) * (0.5 + 0.5 * np.abs(t)) + 0.5 * np.abs(x) * (1 - t * t) * eu
    ed = r * (0.5 * (1 + np.abs(t)) + 0.5 * np.abs(x) * (1 + t * t) * du) \
        + (1 - t * t) * (0.5 + np.abs(x) * du) * eu
    return y, d, ey, ed


# |Gelu''| <= 0.8 for both forms (its largest value, at x = 0: 2 phi(0) = 0.798)
GELU2 = 0.8


def _gelu(n, v, e, a):
    x, ex = v[0], e[0]
    approximate = _s(a.get("approximate", "none"))
    y, d, ey, ed = _gelu_parts(x, approximate)
    # x off by ex moves Gelu by at most (|Gelu'(x)| + 0.8 ex) ex
    return y, (np.abs(d) + GELU2 * ex) * ex + ey, (d, ed)


def _gelu_back(n, v, e, cache, g, E):
    """From the forward's Gelu'(x) and its rounding bound."""
    d, ed = cache
    Ed = GELU2 * e[0] + ed
    A = np.abs(g) + E
    return [(g * d, np.abs(d) * E + A * Ed + U * A * (np.abs(d) + Ed))]


def _loss_weights(labels, a):
    """d loss / d sample loss (0 where the label is ignore_index) and the labels with
    those samples' replaced by 0 (any valid row index)."""
    w = np.ones(labels.shape)
    if "ignore_index" in a:
        w[labels == a["ignore_index"]] = 0
    reduction = _s(a.get("reduction", "mean"))
    assert reduction in ("mean", "sum"), reduction
    return (w / w.sum() if reduction == "mean" else w), np.where(w > 0, labels, 0)


def _sce(n, v, e, a):
    assert len(v) == 2, "no class weights"
    z, ez = v[0], e[0]
    dw, labels = _loss_weights(v[1].astype(np.int64), a)
    nb, c = z.shape
    m = z.max(axis=1, keepdims=True)
    ex_ = np.exp(z - m)
    p = ex_ / ex_.sum(axis=1, keepdims=True)
    lse = (m + np.log(ex_.sum(axis=1, keepdims=True)))[:, 0]
    zt = z[np.arange(nb), labels]
    li = lse - zt
    loss = (dw * li).sum()
    # lse is 1-Lipschitz in the max norm; computing it: c exps, a sum of c, a log, adds
    elem = (c + 3 * ELEMENTARY + 4) * U * (1 + np.abs(lse) + np.abs(m[:, 0]))
    eli = ez.max(axis=1) + elem + ez[np.arange(nb), labels] + U * np.abs(li)
    eloss = (dw * eli).sum() + gamma(nb + 2) * (dw * (np.abs(li) + eli)).sum()
    return np.float64(loss), np.float64(eloss), (p, labels, dw, ez)


def _sce_back(n, v, e, cache, g, E):
    p, labels, dw, ez = cache
    nb = p.shape[0]
    assert np.all(E == 0), "the loss is the output: its gradient is 1, exact"
    y = np.zeros_like(p)
    y[np.arange(nb), labels] = 1
    ep = _softmax_bound(p, ez, 1)
    gz = g * (p - y) * dw[:, None]
    Ez = np.abs(g) * (ep + 3 * U * (np.abs(p - y) + ep)) * dw[:, None]
    return [(gz, Ez), None]


def _softmax_bound(p, e, axis):
    """How far a float32 softmax over ``axis`` of inputs off by ``e`` may be from ``p``:
    each p_i moves by at most p_i (e_i + max e) (first order, doubled); computing it: c
    exps, a sum of c, a division."""
    c = p.shape[axis]
    return p * 2 * (e + e.max(axis=axis, keepdims=True)) + (c + 2 * ELEMENTARY + 4) * U * p


def _softmax(n, v, e, a):
    x, ex = v[0], e[0]
    axis = a.get("axis", -1) % x.ndim
    m = x.max(axis=axis, keepdims=True)
    ex_ = np.exp(x - m)
    y = ex_ / ex_.sum(axis=axis, keepdims=True)
    return y, _softmax_bound(y, ex, axis), (y, axis)


def _softmax_back(n, v, e, cache, g, E):
    """dx = y (gy - sum(gy y)), from the forward's y (both runs read the same one)."""
    y, axis = cache
    c = y.shape[axis]
    A = np.abs(g) + E
    s = (g * y).sum(axis=axis, keepdims=True)
    Es = (E * y).sum(axis=axis, keepdims=True) + gamma(c + 1) * (A * y).sum(axis=axis, keepdims=True)
    inner = g - s
    Ein = E + Es + U * (A + np.abs(s) + Es)
    return [(y * inner, y * Ein + U * y * (np.abs(inner) + Ein))]


def _log_softmax(n, v, e, a):
    x, ex = v[0], e[0]
    axis = a.get("axis", -1) % x.ndim
    m = x.max(axis=axis, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))
    c = x.shape[axis]
    ey = ex + ex.max(axis=axis, keepdims=True) + (c + 3 * ELEMENTARY + 4) * U * (np.abs(x) + np.abs(lse) + 1)
    return x - lse, ey, (np.exp(x - lse), axis)


def _log_softmax_back(n, v, e, cache, g, E):
    """dx = gy - softmax sum(gy); the softmax recomputed (exp of the output)."""
    p, axis = cache
    c = p.shape[axis]
    A = np.abs(g) + E
    s = g.sum(axis=axis, keepdims=True)
    Es = E.sum(axis=axis, keepdims=True) + gamma(c) * A.sum(axis=axis, keepdims=True)
    ep = (ELEMENTARY + 2) * U * p
    gx = g - p * s
    Ex = E + p * Es + ep * (np.abs(s) + Es) + gamma(2) * (A + (p + ep) * (np.abs(s) + Es))
    return [(gx, Ex)]


def _nll(n, v, e, a):
    assert len(v) == 2, "no class weights"
    lp, elp = v[0], e[0]
    dw, labels = _loss_weights(v[1].astype(np.int64), a)
    rows = np.arange(lp.shape[0])
    loss = -(dw * lp[rows, labels]).sum()
    eloss = (dw * elp[rows, labels]).sum() + gamma(lp.shape[0] + 2) * (dw * np.abs(lp[rows, labels])).sum()
    return np.float64(loss), np.float64(eloss), (lp.shape, labels, dw)


def _nll_back(n, v, e, cache, g, E):
    shape, labels, dw = cache
    gl = np.zeros(shape)
    gl[np.arange(shape[0]), labels] = -g * dw
    return [(gl, 2 * U * np.abs(gl)), None]


def _mul(n, v, e, a):
    y = v[0] * v[1]
    return y, np.abs(v[1]) * e[0] + np.abs(v[0]) * e[1] + e[0] * e[1] \
        + U * (np.abs(v[0]) + e[0]) * (np.abs(v[1]) + e[1]), None


def _mul_back(n, v, e, cache, g, E):
    A = np.abs(g) + E
    out = []
    for x, other, eother in ((v[0], v[1], e[1]), (v[1], v[0], e[0])):
        gx, cnt = _sum_to(g * other, x.shape)
        terms = E * np.abs(other) + A * eother + U * A * (np.abs(other) + eother)
        Ex, _ = _sum_to(terms + (gamma(cnt) * A * (np.abs(other) + eother) if cnt > 1 else 0), x.shape)
        out.append((gx, Ex))
    return out


def _reshape(n, v, e, a):
    shape = [int(d) for d in v[1]]
    shape = [v[0].shape[i] if d == 0 and not a.get("allowzero", 0) else d for i, d in enumerate(shape)]
    return v[0].reshape(shape), e[0].reshape(shape), v[0].shape




def _transpose(n, v, e, a):
    perm = list(a.get("perm", range(v[0].ndim)[::-1]))
    return v[0].transpose(perm), e[0].transpose(perm), np.argsort(perm)


def _transpose_back(n, v, e, inverse, g, E):
    return [(g.transpose(inverse), E.transpose(inverse))]


def _split(n, v, e, a):
    axis = a.get("axis", 0) % v[0].ndim
    sizes = [int(d) for d in v[1]] if len(v) > 1 else a.get("split")
    if sizes is None:
        sizes = [v[0].shape[axis] // len(n.output)] * len(n.output)
    cuts = np.cumsum(sizes)[:-1]
    return np.split(v[0], cuts, axis=axis), np.split(e[0], cuts, axis=axis), (axis, sizes)


def _split_back(n, v, e, cache, gs):
    """``gs``: (gradient, bound) per output, None where an output has none."""
    axis, sizes = cache
    parts = []
    for ge, size in zip(gs, sizes):
        shape = list(v[0].shape)
        shape[axis] = size
        parts.append(ge if ge is not None else (np.zeros(shape), np.zeros(shape)))
    out = [(np.concatenate([p[0] for p in parts], axis=axis),
            np.concatenate([p[1] for p in parts], axis=axis))]
    return out + [None] * (len(v) - 1)


def _mean(x, ex, axes, keep):
    """The mean over ``axes``: a sum of its terms in any order and a division."""
    cnt = int(np.prod([x.shape[d] for d in axes]))
    y = x.mean(axis=axes, keepdims=keep)
    ey = ex.mean(axis=axes, keepdims=keep) + gamma(cnt + 1) * (np.abs(x) + ex).mean(axis=axes, keepdims=keep)
    return y, ey, (x.shape, axes, keep, cnt)


def _reduce_mean(n, v, e, a):
    x = v[0]
    axes = [int(d) for d in v[1]] if len(v) > 1 else a.get("axes", list(range(x.ndim)))
    return _mean(x, e[0], tuple(d % x.ndim for d in axes), bool(a.get("keepdims", 1)))


def _reduce_mean_back(n, v, e, cache, g, E):
    shape, axes, keep, cnt = cache
    if not keep:
        g, E = np.expand_dims(g, axes), np.expand_dims(E, axes)
    out = [(np.broadcast_to(g / cnt, shape), np.broadcast_to((E + U * (np.abs(g) + E)) / cnt, shape))]
    return out + [None] * (len(v) - 1)


def _reduce_sum(n, v, e, a):
    x = v[0]
    axes = [int(d) for d in v[1]] if len(v) > 1 else a.get("axes")
    if not axes:
        assert not a.get("noop_with_empty_axes", 0), a
        axes = list(range(x.ndim))
    axes = tuple(d % x.ndim for d in axes)
    keep = bool(a.get("keepdims", 1))
    cnt = int(np.prod([x.shape[d] for d in axes]))
    y = x.sum(axis=axes, keepdims=keep)
    ey = e[0].sum(axis=axes, keepdims=keep) + gamma(cnt) * (np.abs(x) + e[0]).sum(axis=axes, keepdims=keep)
    return y, ey, (x.shape, axes, keep)


def _reduce_sum_back(n, v, e, cache, g, E):
    shape, axes, keep = cache
    if not keep:
        g, E = np.expand_dims(g, axes), np.expand_dims(E, axes)
    return [(np.broadcast_to(g, shape), np.broadcast_to(E, shape))] + [None] * (len(v) - 1)


def _sum(n, v, e, a):
    """Sum of k inputs (broadcast): k - 1 roundings of the k terms, in any order."""
    y = sum(v)
    mag = sum(np.abs(x) + ex for x, ex in zip(v, e))
    return y, sum(e) + gamma(len(v) - 1) * mag, None


def _sum_back(n, v, e, cache, g, E):
    """Add's and Sum's: each input's gradient is g summed down to its shape (a sum of the
    broadcast copies, in any order)."""
    out = []
    for x in v:
        gx, cnt = _sum_to(g, x.shape)
        Ex, _ = _sum_to(E + (gamma(cnt) * (np.abs(g) + E) if cnt > 1 else 0), x.shape)
        out.append((gx, Ex))
    return out


def _flatten(n, v, e, a):
    axis = a.get("axis", 1)
    shape = (int(np.prod(v[0].shape[:axis])), -1)
    return v[0].reshape(shape), e[0].reshape(shape), v[0].shape


def _reshape_back(n, v, e, shape, g, E):
    """Reshape's and Flatten's (no gradient for Reshape's shape input)."""
    return [(g.reshape(shape), E.reshape(shape))] + [None] * (len(v) - 1)


def _gap(n, v, e, a):
    """ReduceMean over the spatial axes, kept."""
    return _mean(v[0], e[0], tuple(range(2, v[0].ndim)), True)


def _identity(n, v, e, a):
    return v[0], e[0], None


def _identity_back(n, v, e, cache, g, E):
    return [(g, E)]


# -- GRU: expressions over bounded leaves --------------------------------------------------

# Absolute error allowed for each Sigmoid / Tanh a GRU evaluates, in units of U (the values
# lie in (-1, 1)). Measured against float64 over [-100, 100] (1.17.3 and 1.32.0 alike):
# onnxruntime's GRU kernel (its own rational tanh; sigmoid by MLAS) 10.1, its Tanh op 5.5,
# its Sigmoid op 3.0, GRUTrain's exp-based forms 2.3; allowed: about 3 times the worst.
GRU_ACT = 32


class _Ex:
    """A polynomial expression over bounded leaves, evaluated three ways at once: its
    value ``v``, and, with every subtraction made an addition and every coefficient its
    magnitude, at the leaves' magnitudes (``a0``) and at their magnitudes plus their
    bounds (``a1``). Leaves off by at most their bounds move the value by at most
    ``a1 - a0`` (every monomial of the difference holds an error factor), and any
    floating-point evaluation in which each term passes at most ``depth`` roundings (any
    order of the sums, any association of the products) is within ``gamma(depth) * a1``
    of the exact value at those leaves. :meth:`close` makes the result a leaf bounded by
    the sum of both: for the quantities every GRU implementation materialises by the
    same formula (ONNX's equations and their derivatives, written out below)."""

    __slots__ = ("v", "a0", "a1")

    def __init__(self, v, a0, a1):
        self.v, self.a0, self.a1 = v, a0, a1

    @staticmethod
    def leaf(v, e):
        return _Ex(v, np.abs(v), np.abs(v) + e)

    @property
    def e(self):
        return self.a1 - self.a0

    @staticmethod
    def of(x):
        return x if isinstance(x, _Ex) else _Ex(x, np.abs(x), np.abs(x))

    def __add__(self, o):
        o = _Ex.of(o)
        return _Ex(self.v + o.v, self.a0 + o.a0, self.a1 + o.a1)

    __radd__ = __add__

    def __sub__(self, o):
        o = _Ex.of(o)
        return _Ex(self.v - o.v, self.a0 + o.a0, self.a1 + o.a1)

    def __rsub__(self, o):
        return _Ex.of(o) - self

    def __mul__(self, o):
        o = _Ex.of(o)
        return _Ex(self.v * o.v, self.a0 * o.a0, self.a1 * o.a1)

    __rmul__ = __mul__

    def __matmul__(self, o):
        return _Ex(self.v @ o.v, self.a0 @ o.a0, self.a1 @ o.a1)

    def __getitem__(self, k):
        return _Ex(self.v[k], self.a0[k], self.a1[k])

    @property
    def T(self):
        return _Ex(_T(self.v), _T(self.a0), _T(self.a1))

    def sum(self, axis):
        return _Ex(self.v.sum(axis), self.a0.sum(axis), self.a1.sum(axis))

    def close(self, depth):
        return _Ex.leaf(self.v, self.a1 - self.a0 + gamma(depth) * self.a1)

    @staticmethod
    def cat(parts, axis):
        return _Ex(*(np.concatenate([getattr(p, k) for p in parts], axis=axis)
                     for k in ("v", "a0", "a1")))


def _sig64(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def _activation(x, f, slope):
    """f of a leaf: its error moved by at most f's largest slope within the error (the
    slope peaks at 0 and falls with |x| for both functions), plus GRU_ACT of rounding."""
    return _Ex.leaf(f(x.v), slope(np.maximum(np.abs(x.v) - x.e, 0)) * x.e + GRU_ACT * U)


def _sigmoid(x):
    return _activation(x, _sig64, lambda t: _sig64(t) * (1 - _sig64(t)))


def _tanh(x):
    return _activation(x, np.tanh, lambda t: 1 - np.tanh(t) ** 2)


def _gru_inputs(n, v, e, a):
    names = list(n.input) + [""] * (6 - len(n.input))
    assert not names[4], "GRU: no sequence_lens"
    assert a.get("layout", 0) == 0 and "clip" not in a and "activations" not in a, a
    it = iter(zip(v, e))
    got = {k: next(it) if name else None for k, name in zip("XWRBsh", names)}
    return got["X"], got["W"], got["R"], got["B"], got["h"]


def _gru_step(x, w, r, bw, br, h, hid, lbr):
    """One GRU step from the state leaf ``h``: the closed leaves z, r, ĥ, the h gate's
    recurrent term (``h Rh^T + Rbh``, lbr 1, or ``r ⊙ h``, lbr 0), ``1 - z`` and the new
    state. Depths: a pre-activation sums ``inp + hid`` products and the biases (any order,
    one rounding per product), ``(1 - z) ĥ + z h`` rounds twice on each path."""
    g = [slice(k * hid, (k + 1) * hid) for k in range(3)]
    inp = x.v.shape[-1]
    nb = 0 if bw is None else 2

    def biased(s, k, both=True):
        if bw is None:
            return s
        return s + bw[g[k]] + br[g[k]] if both else s + bw[g[k]]

    z = _sigmoid(biased(x @ w[g[0]].T + h @ r[g[0]].T, 0).close(inp + hid + nb))
    rg = _sigmoid(biased(x @ w[g[1]].T + h @ r[g[1]].T, 1).close(inp + hid + nb))
    if lbr:
        hr = (h @ r[g[2]].T + (0 if br is None else br[g[2]])).close(hid + nb // 2)
        hh = _tanh(biased(x @ w[g[2]].T + rg * hr, 2, both=False).close(inp + 1 + nb // 2))
    else:
        hr = (rg * h).close(1)
        hh = _tanh(biased(x @ w[g[2]].T + hr @ r[g[2]].T, 2).close(inp + hid + nb))
    omz = (1 - z).close(1)
    return z, rg, hh, hr, omz, (omz * hh + z * h).close(2)


def _gru_jacobian(h, z, rg, hh, hr, r, hid, lbr):
    """``d h_t / d h_{t-1}`` per batch row (``[batch, hid, hid]``, float64, from the exact
    values): z's, r's and ĥ's dependence on the previous state through R."""
    R = r.v
    Rz, Rr, Rh = R[:hid], R[hid:2 * hid], R[2 * hid:]
    zv, rv, hv, hp = z.v, rg.v, hh.v, h.v
    az = (zv * (1 - zv))[:, :, None] * Rz[None]  # d z / d h
    ar = (rv * (1 - rv))[:, :, None] * Rr[None]
    if lbr:
        dpre = rv[:, :, None] * Rh[None] + hr.v[:, :, None] * ar
    else:
        dpre = Rh[None] * rv[:, None, :] + np.einsum("ij,bj,bjk->bik", Rh, hp, ar)
    J = ((hp - hv)[:, :, None] * az + ((1 - zv) * (1 - hv * hv))[:, :, None] * dpre)
    J[:, np.arange(hid), np.arange(hid)] += zv
    return J


def _propagate(Js, inject, transpose=False):
    """First-order error propagation through a recurrence ``e_k = J e_{k-1} + d_k`` (the
    GRU's states, ``Js[k]`` mapping state k to k + 1, ``[batch, hid, hid]`` each) with the
    SIGNED products of its Jacobians, the magnitudes taken last: ``|e_k| <= sum_m |J_{k-1}
    ... J_m| d_m``, ``d_m`` (``inject[m]``, ``[batch, hid]``) bounding what enters at
    state m. Far tighter than carrying ``|J|`` step by step, which multiplies the row sums
    of |R| and misses the contraction. ``transpose``: the backward's recurrence, the
    gradient of state k being ``J_k^T`` times that of state k + 1 plus what enters there:
    ``|eps_k| <= sum_m |J_k^T ... J_{m-1}^T| d_m``, from the last state down."""
    K = len(inject)
    eye = np.broadcast_to(np.eye(inject[0].shape[-1]), Js[0].shape) if Js else None
    out, prods = [None] * K, []
    for k in (range(K - 1, -1, -1) if transpose else range(K)):
        if prods:
            J = np.swapaxes(Js[k], 1, 2) if transpose else Js[k - 1]
            prods = [(J @ P, m) for P, m in prods]
        prods.append((eye, k))
        out[k] = sum(inject[m] if P is None else np.einsum("bij,bj->bi", np.abs(P), inject[m])
                     for P, m in prods)
    return out


def _gru(n, v, e, a, mode="carry"):
    """ONNX's GRU (layout 0, Sigmoid and Tanh), step by step (:func:`_gru_step`): every
    pre-activation within gamma of its terms, each gate GRU_ACT more, the new state two
    roundings. How a step's state error reaches the next (``mode``):

    - ``"carry"``: whole, as a leaf (the worst case, every rounding aligned: a theorem;
      it multiplies by the row sums of |R| each step, so it is of use for short, narrow
      GRUs only);
    - ``"linear"``: through the signed Jacobians of the exact steps (:func:`_propagate`):
      first order in the roundings (the terms left out are products of two error bounds),
      and as tight as the dynamics contract;
    - ``"local"``: not at all (step_bounds' forward taken as exact: each step starts from
      the exact state and only its own roundings count).

    Returns ``([Y, Y_h], bounds, cache)``."""
    (X, eX), (W, eW), (R, eR), B, h0 = _gru_inputs(n, v, e, a)
    hid = int(a["hidden_size"])
    lbr = bool(a.get("linear_before_reset", 0))
    direction = _s(a.get("direction", "forward"))
    nd = 2 if direction == "bidirectional" else 1
    seq, batch, _ = X.shape
    Y, eY = np.zeros((seq, nd, batch, hid)), np.zeros((seq, nd, batch, hid))
    Yh, eYh = np.zeros((nd, batch, hid)), np.zeros((nd, batch, hid))
    xs = [_Ex.leaf(X[t], eX[t]) for t in range(seq)]
    dirs = []
    for d in range(nd):
        w, r = _Ex.leaf(W[d], eW[d]), _Ex.leaf(R[d], eR[d])
        bw = br = None
        if B is not None:
            bw = _Ex.leaf(B[0][d, :3 * hid], B[1][d, :3 * hid])
            br = _Ex.leaf(B[0][d, 3 * hid:], B[1][d, 3 * hid:])
        hv = h0[0][d] if h0 is not None else np.zeros((batch, hid))
        he = h0[1][d] if h0 is not None else np.zeros((batch, hid))
        times = list(range(seq - 1, -1, -1) if (direction == "reverse" or d == 1) else range(seq))
        steps, Js = [], []
        if mode == "linear":
            # the exact trajectory, each step's own error and Jacobian; then the states'
            # first-order bounds, and the steps again from states off by those
            h, local = _Ex.leaf(hv, 0 * hv), [he]
            for t in times:
                z, rg, hh, hr, omz, hn = _gru_step(xs[t], w, r, bw, br, h, hid, lbr)
                Js.append(_gru_jacobian(h, z, rg, hh, hr, r, hid, lbr))
                local.append(hn.e)
                h = _Ex.leaf(hn.v, 0 * hn.v)
            bounds = _propagate(Js, local)
            # The terms first order leaves out: the state map's second derivatives are
            # within about 2 rho^2 (rho: |R|'s largest row sum; |sigma''| <= 0.1,
            # |tanh''| <= 0.77), so each step adds at most about 2 rho^2 e^2 beside the
            # e it carries: kept below a fifth of the bound, or no bound is claimed.
            rho = np.abs(R[d]).sum(axis=1).max()
            worst = max(b.max() for b in bounds)
            if 2 * rho ** 2 * worst > 0.2:
                raise ValueError(f"GRU: a first-order bound of {worst:.3g} with |R| row sums "
                                 f"up to {rho:.3g} is out of its regime")
        h = _Ex.leaf(hv, he)
        for i, t in enumerate(times):
            z, rg, hh, hr, omz, hn = _gru_step(xs[t], w, r, bw, br, h, hid, lbr)
            steps.append((t, h, z, rg, hh, hr, omz))
            eh = bounds[i + 1] if mode == "linear" else hn.e if mode == "carry" else 0 * hn.e
            Y[t, d], eY[t, d] = hn.v, (hn.e if mode == "local" else eh)
            h = _Ex.leaf(hn.v, eh)
        Yh[d], eYh[d] = Y[times[-1], d], eY[times[-1], d]
        dirs.append((w, r, steps, Js))
    outs = [(Y, eY), (Yh, eYh)][:len(n.output)]
    return [o[0] for o in outs], [o[1] for o in outs], \
        (xs, dirs, hid, lbr, B is not None, h0 is not None, mode)


def _gru_back_step(dh, hp, z, rg, hh, hr, omz, r, hid, lbr):
    """One step of backpropagation through time, as GRUGrad and the standard-op Scan
    compute it: ``dA_h = dH (1 - z)(1 - ĥ^2)``, ``dA_z = dH (h - ĥ) z (1 - z)``, ``dA_r``
    and the gradient of the previous state through R, each a closed leaf. Returns
    ``(dA, dA of R's and Rb's h gate, dH_prev)``."""
    omh2 = (1 - hh * hh).close(2)
    dhh = (hp - hh).close(1)
    omr = (1 - rg).close(1)
    da_h = (dh * omz * omh2).close(2)
    da_z = (dh * dhh * z * omz).close(3)
    if lbr:
        da_r = (da_h * hr * rg * omr).close(3)
        d_hr = (da_h * rg).close(1)
        prev = (dh * z + _Ex.cat([da_z, da_r, d_hr], 1) @ r).close(3 * hid + 1)
    else:
        drh = (da_h @ r[2 * hid:]).close(hid)
        da_r = (drh * hp * rg * omr).close(3)
        d_hr = da_h
        prev = (dh * z + drh * rg + _Ex.cat([da_z, da_r], 1) @ r[:2 * hid]).close(2 * hid + 2)
    return _Ex.cat([da_z, da_r, da_h], 1), d_hr, prev


def _gru_back(n, v, e, cache, gs):
    """Backpropagation through time (:func:`_gru_back_step`) from the forward's bounded
    leaves (either run's own gates, recomputed or saved, are such evaluations); dW, dR,
    dB sum seq * batch terms and dX 3 H per direction, in any order. The carried gradient
    of the state passes its error on as the forward's mode says: whole (``"carry"``,
    ``"local"``) or through the transposed signed Jacobians (``"linear"``: what each step
    adds, from the exact carried gradient, propagated first-order; then every step again
    from gradients off by those bounds)."""
    xs, dirs, hid, lbr, has_b, has_h0, mode = cache
    gs = list(gs) + [None] * (2 - len(gs))
    seq, batch = len(xs), xs[0].v.shape[0]

    def zero(*shape):
        return _Ex.leaf(np.zeros(shape), np.zeros(shape))

    def with_dy(carry, t, d):
        if gs[0] is None:
            return carry
        return (carry + _Ex.leaf(gs[0][0][t, d], gs[0][1][t, d])).close(1)

    dX = [zero(*xs[0].v.shape) for _ in range(seq)]
    dW, dR, dB, dh0 = [], [], [], []
    for d, (w, r, steps, Js) in enumerate(dirs):
        last = _Ex.leaf(gs[1][0][d], gs[1][1][d]) if gs[1] is not None else zero(batch, hid)
        S = len(steps)
        if mode == "linear":
            # the exact gradients of the states, and the error each step's backward adds
            # to them (from exact inputs); then the first-order bounds of those gradients
            inject, exact, carry, lam = [None] * (S + 1), [None] * S, last, 0
            for i in range(S - 1, -1, -1):
                dh = with_dy(carry, steps[i][0], d)
                inject[i + 1], exact[i] = dh.e + lam, dh.v
                _, _, prev = _gru_back_step(_Ex.leaf(dh.v, 0 * dh.v), *steps[i][1:], r, hid, lbr)
                carry, lam = _Ex.leaf(prev.v, 0 * prev.v), prev.e
            inject[0] = lam
            eps = _propagate(Js, inject, transpose=True)
        carry = last
        dw = zero(*w.v.shape)
        dr_zr, dr_h = zero(2 * hid, hid), zero(hid, hid)
        dbw, dbr_zr, dbr_h = zero(3 * hid), zero(2 * hid), zero(hid)
        for i in range(S - 1, -1, -1):
            t, hp, z, rg, hh, hr, omz = steps[i]
            dh = with_dy(carry, t, d) if mode != "linear" else _Ex.leaf(exact[i], eps[i + 1])
            da, d_hr, carry = _gru_back_step(dh, hp, z, rg, hh, hr, omz, r, hid, lbr)
            dzr = da[:, :2 * hid]
            dw = dw + da.T @ xs[t]
            dr_zr = dr_zr + dzr.T @ hp
            dr_h = dr_h + d_hr.T @ (hp if lbr else hr)
            dbw = dbw + da.sum(0)
            dbr_zr = dbr_zr + dzr.sum(0)
            dbr_h = dbr_h + d_hr.sum(0)
            dX[t] = dX[t] + da @ w
        if mode == "linear":
            carry = _Ex.leaf(carry.v, eps[0])
        n_sum = seq * batch
        dW.append(dw.close(n_sum))
        dR.append(_Ex.cat([dr_zr, dr_h], 0).close(n_sum))
        dB.append(_Ex.cat([dbw, dbr_zr, dbr_h], 0).close(n_sum))
        dh0.append(carry)
    dXc = [x.close(len(dirs) * 3 * hid) for x in dX]

    def stack(parts):
        return np.stack([p.v for p in parts]), np.stack([p.e for p in parts])

    out = [stack(dXc), stack(dW), stack(dR)]
    if has_b:
        out.append(stack(dB))
    if has_h0:
        out.append(stack(dh0))
    return out


OPS = {
    "Conv": (_conv, _conv_back),
    "MatMul": (_matmul, _matmul_back_rule),
    "Gemm": (_gemm, _gemm_back),
    "Add": (_add, _sum_back),
    "Relu": (_relu, _relu_back),
    "LeakyRelu": (_leaky_relu, _leaky_relu_back),
    "MaxPool": (_maxpool, _maxpool_back),
    "BatchNormalization": (_batchnorm, _batchnorm_back),
    "LayerNormalization": (_layernorm, _layernorm_back),
    "Gelu": (_gelu, _gelu_back),
    "Sigmoid": (_sigmoid_op, _sigmoid_back),
    "HardSigmoid": (_hard_sigmoid, _hard_sigmoid_back),
    "HardSwish": (_hard_swish, _hard_swish_back),
    "SoftmaxCrossEntropyLoss": (_sce, _sce_back),
    "Softmax": (_softmax, _softmax_back),
    "LogSoftmax": (_log_softmax, _log_softmax_back),
    "NegativeLogLikelihoodLoss": (_nll, _nll_back),
    "Mul": (_mul, _mul_back),
    "Reshape": (_reshape, _reshape_back),
    "Transpose": (_transpose, _transpose_back),
    "Split": (_split, _split_back),
    "ReduceMean": (_reduce_mean, _reduce_mean_back),
    "ReduceSum": (_reduce_sum, _reduce_sum_back),
    "Sum": (_sum, _sum_back),
    "Flatten": (_flatten, _reshape_back),
    "GlobalAveragePool": (_gap, _reduce_mean_back),
    "Identity": (_identity, _identity_back),
    "GRU": (_gru, _gru_back),
}


EXACT_OPS = {"Relu", "LeakyRelu", "MaxPool", "Flatten", "Identity", "Reshape", "Transpose",
             "Split"}  # no rounding of their own
MULTI_OUTPUT = {"Split", "GRU"}
CARRY_RULES = {"GRU"}  # ops whose own steps pass errors on only in the carrying forward


def _fuse_matmul_add(nodes, outputs):
    """The nodes with each MatMul whose one reader is an Add (its output no graph output)
    merged with that Add into one Gemm-like node (x @ w + b, any ranks): a runtime may
    fuse them (onnxruntime does), adding the bias inside the product's sum, and the
    Gemm's bound (gamma(K + 1) of all the terms) holds for both forms."""
    readers = {}
    for n in nodes:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    made = {n.output[0]: n for n in nodes if n.op_type == "MatMul"}
    out, gone = [], set()
    for n in nodes:
        if n.op_type == "Add":
            k = next((k for k, i in enumerate(n.input) if i in made and readers[i] == 1
                      and i not in outputs), None)
            if k is not None:
                mm = made[n.input[k]]
                gone.add(mm.output[0])
                n = helper.make_node("Gemm", [mm.input[0], mm.input[1], n.input[1 - k]],
                                     [n.output[0]], name=n.name)
        out.append(n)
    return [n for n in out if not (n.op_type == "MatMul" and n.output[0] in gone)]


def _forward(model, params, feeds, other_values=None, carry=False):
    """The forward in float64 at ``params``; every op sees exact inputs (the two runs share
    them) except the decision ops, which see the width by which the two runs' values of
    their input may differ: twice the local rounding bound of the op that made it (a
    rounding on either side) plus the exact difference ``other_values`` gives.

    ``carry``: every op sees its inputs' bounds instead, the forward's own errors carried
    through (how far ANY float32 evaluation of this forward is from the float64 one), and
    the tape keeps them for the backward rules."""
    g = model.graph
    vals = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in g.initializer}
    vals.update({k: np.asarray(x, np.float64) for k, x in params.items()})
    vals.update({k: np.asarray(x, np.float64) for k, x in feeds.items()})
    width = {k: np.zeros_like(x) for k, x in vals.items()}
    nodes = _fuse_matmul_add(list(g.node), {o.name for o in g.output}) if carry else g.node
    tape = []
    for n in nodes:
        if n.op_type not in OPS:
            raise NotImplementedError(f"rounding.step_bounds: no rule for {n.op_type}")
        ins = [i for i in n.input if i]
        v = [vals[i] for i in ins]
        e = [width[i] if carry or n.op_type in EXACT_OPS else np.zeros_like(vals[i]) for i in ins]
        if n.op_type in CARRY_RULES:
            mode = "linear" if carry == "linear" else "carry" if carry else "local"
            y, ey, cache = OPS[n.op_type][0](n, v, e, _attrs(n), mode=mode)
        else:
            y, ey, cache = OPS[n.op_type][0](n, v, e, _attrs(n))
        outs = list(n.output) if n.op_type in MULTI_OUTPUT else [n.output[0]]
        ys, eys = (y, ey) if n.op_type in MULTI_OUTPUT else ([y], [ey])
        for out, y, ey in zip(outs, ys, eys):
            if not out:
                continue
            vals[out] = y
            if carry or n.op_type in EXACT_OPS:
                width[out] = ey
            else:
                diff = 0 if other_values is None else np.abs(y - other_values[out])
                width[out] = 2 * ey + diff
        tape.append((n, ins, v, e if carry else [np.zeros_like(x) for x in v], cache))
    return vals, width, tape


def _backward(vals, width, tape, params, loss):
    """The backward over a :func:`_forward`'s tape: step_bounds' result."""
    grads = {loss: (np.float64(1.0), np.float64(0.0))}
    for n, ins, v, e, cache in reversed(tape):
        if n.op_type in MULTI_OUTPUT:
            if not any(o in grads for o in n.output if o):
                continue
            back = OPS[n.op_type][1](n, v, e, cache, [grads.pop(o, None) if o else None
                                                      for o in n.output])
        elif n.output[0] in grads:
            back = OPS[n.op_type][1](n, v, e, cache, *grads.pop(n.output[0]))
        else:
            continue
        for name, ge in zip(ins, back):
            if ge is None:
                continue
            if name in grads:  # a tensor read twice: the two gradients add, once rounded
                (g1, e1), (g2, e2) = grads[name], ge
                ge = (g1 + g2, e1 + e2 + U * (np.abs(g1) + np.abs(g2) + e1 + e2))
            grads[name] = ge
    return (float(vals[loss]), float(width[loss]),
            {p: grads[p][0] for p in params}, {p: grads[p][1] for p in params})


def step_bounds(model, params: dict, feeds: dict, loss: str = "loss",
                forward_errors: bool | str = False):
    """One training step of ``model`` (BatchNormalization in training mode) in float64 at
    ``params`` (float32 values, exact) on ``feeds``, for two float32 runs whose backwards
    differ (kernels, summation orders) and whose forwards run the same nodes at the same
    parameters (:func:`pair_bounds`: at other parameters).

    Returns ``(loss, loss_width, grads, grad_bounds)``:

    - ``grad_bounds[p]``: any float32 backward, in any summation order, evaluated on this
      run's forward values, is within it of the exact gradient there (``grads[p]``, the
      float64 one: the forward values are taken as the float64 ones for the magnitudes);
      where the two runs may take a Relu / MaxPool decision differently it holds the
      whole routed gradient;
    - ``loss_width``: twice the rounding bound of the loss's own computation.

    ``forward_errors``: for runs whose forwards differ too (another kernel for a forward
    op, another batch split): the forward's own rounding bounds are carried through it
    and into the backward (whose coefficients are the forward's values), so that
    ``grad_bounds[p]`` bounds ANY float32 evaluation of the whole step (forward and
    backward, any summation orders) against the float64 gradient, and ``loss_width`` the
    loss's distance to the float64 loss: a theorem (given the allowances for the
    elementary functions), for one run on its own. Worst-case bounds compound layer by
    layer: for shallow models. ``forward_errors="linear"``: the same, but a GRU's state
    errors pass from step to step (forward and backward) through the signed Jacobians of
    its exact steps (first order in the roundings: the terms left out are products of two
    error bounds), for GRUs whose worst case compounds out of use over the sequence."""
    return _backward(*_forward(model, params, feeds, carry=forward_errors), params, loss)


def same_params(xa: dict, xb: dict) -> bool:
    """Two parameter sets with the same names and bits: every bound computed at one holds
    at the other, computed once."""
    return xa.keys() == xb.keys() and all(
        np.asarray(xa[k], np.float64).tobytes() == np.asarray(xb[k], np.float64).tobytes()
        and np.shape(xa[k]) == np.shape(xb[k]) for k in xa)


def pair_bounds(model, xa: dict, xb: dict, feeds: dict, loss: str = "loss",
                forward_errors: bool | str = False):
    """:func:`step_bounds` for two runs at parameters ``xa`` and ``xb`` on the same
    ``feeds``: ``(bounds_a, bounds_b)``, each as step_bounds returns it, computed once
    where the two parameter sets are the same.

    Without ``forward_errors`` the two runs' forwards run the same nodes and differ by
    their parameters: each run's decision ops (Relu, MaxPool) see how far the two runs'
    values of their input may be apart (the exact difference the other parameters make
    plus twice the local rounding bound), and each ``loss_width`` holds the exact change
    between the two parameter sets too (the forwards' difference, modelled as each op
    rounding its own terms the other way). A forward's values do not depend on the
    widths it carries, so ``xa``'s forward gives ``xb``'s its other values: three
    forwards, not four. With ``forward_errors`` each run's bound is its own (a theorem
    for each run against float64 at its parameters)."""
    if same_params(xa, xb):
        one = step_bounds(model, xa, feeds, loss, forward_errors)
        return one, one
    if forward_errors:
        return (step_bounds(model, xa, feeds, loss, forward_errors),
                step_bounds(model, xb, feeds, loss, forward_errors))
    vals_b, _, _ = _forward(model, xb, feeds)
    fa = _forward(model, xa, feeds, vals_b)
    fb = _forward(model, xb, feeds, fa[0])
    return _backward(*fa, xa, loss), _backward(*fb, xb, loss)


def forward(model, params: dict, feeds: dict, forward_errors: bool | str = False):
    """The forward of :func:`step_bounds` alone: ``(values, widths)`` by tensor name, the
    float64 values and the width by which two runs' float32 values may differ when only
    their roundings flip (twice each op's own rounding bound, exact ops passing theirs);
    with ``forward_errors`` (as step_bounds takes it), how far ANY float32 evaluation of
    the forward may be from the float64 values instead."""
    vals, width, _ = _forward(model, params, feeds, carry=forward_errors)
    return vals, width


def batch_stats(x, width):
    """A BatchNormalization input's batch mean and biased variance per channel (float64),
    and how far two runs' float32 values of each may differ by rounding alone: the input's
    ``width`` carried through, plus twice the statistic's own rounding (the mean as a sum
    in any order; the variance either two-pass or as E[x^2] - mean^2, whose error follows
    the mean's to first order: hence the |mean| terms)."""
    axes = (0,) + tuple(range(2, x.ndim))
    n = int(np.prod([x.shape[i] for i in axes]))
    mean = x.mean(axis=axes)
    m = x.mean(axis=axes, keepdims=True)
    var = ((x - m) ** 2).mean(axis=axes)
    wmean = width.mean(axis=axes) + 2 * gamma(n + 1) * np.abs(x).mean(axis=axes)
    wvar = ((2 * (np.abs(x) + np.abs(m)) + width) * width).mean(axis=axes) \
        + 2 * (np.abs(mean) + np.abs(x - m).mean(axis=axes)) * wmean \
        + 2 * gamma(n + 4) * ((x ** 2).mean(axis=axes) + mean ** 2)
    return mean, var, wmean, wvar, n


def mean_of_parts(model, params: dict, parts: list, loss: str = "loss"):
    """The step of ``model`` at ``params`` taken on each of ``parts`` (feeds) alone and the
    gradients averaged: what ``accumulate=k`` does with k micro-batches (a buffer summing
    them, then ``/ k``) and data-parallel ranks do (an Allreduce's sum in any order, then
    ``* (1 / n)``). Each part's step is bounded by :func:`step_bounds` with its forward's
    errors carried (``forward_errors``: a theorem for one run), and the mean of k computed
    gradients off by ``E_i`` is within ``(sum E_i + gamma(k) sum(|g_i| + E_i)) / k`` of
    the mean of the exact ones (k - 1 additions in any order and one scaling).

    Returns ``(loss, loss_bound, grads, grad_bounds)`` as :func:`step_bounds`, for the
    mean of the parts' losses and gradients. With one batch of the parts' rows and a loss
    that is a mean over rows, the exact mean is that batch's exact gradient."""
    res = [step_bounds(model, params, f, loss, forward_errors=True) for f in parts]
    k = len(res)
    L = sum(r[0] for r in res) / k
    eL = (sum(r[1] for r in res) + gamma(k) * sum(abs(r[0]) + r[1] for r in res)) / k
    g = {p: sum(r[2][p] for r in res) / k for p in params}
    E = {p: (sum(r[3][p] for r in res) + gamma(k) * sum(np.abs(r[2][p]) + r[3][p] for r in res)) / k
         for p in params}
    return L, eL, g, E


def clip_pair(max_norm: float, ga: dict, Ea: dict, gb: dict, Eb: dict, D: dict):
    """torch's clip_grad_norm_ (trainops/train/clip.py: a ReduceL2 per gradient, a ReduceL2
    of those, ``coef = min(1 / (total + 1e-6) * max_norm, 1)``, ``g * coef``) applied by
    two runs whose gradients are within ``Ea`` / ``Eb`` of the exact ``ga`` / ``gb`` and
    within ``D`` of each other (per parameter).

    Each run's total norm is within the 2-norm of its ``E`` of the exact norm (triangle
    inequality) and off by its own rounding: sums of squares of n nonnegative terms are
    within gamma(n), so the total within ``gamma(2 max n + P + 1)`` relative (P tensors);
    each coefficient then lies in an interval (three roundings: the add, the reciprocal,
    the product), and ``|c_a G_a - c_b G_b| <= |c_a - c_b| |G_a| + c_b |G_a - G_b|`` plus
    each product's rounding. Returns ``(D_clipped, norm_bound, (lo_a, hi_a), (lo_b,
    hi_b))``: the clipped gradients' bound, how far the two reported totals may be apart,
    and each run's coefficient interval."""
    names = list(ga)
    rel = gamma(2 * max(np.size(ga[p]) for p in names) + len(names) + 1)
    eps = np.float32(1e-6)

    def total(g, E):
        n64 = np.sqrt(sum(np.sum(np.square(g[p])) for p in names))
        dev = np.sqrt(sum(np.sum(np.square(E[p])) for p in names))
        return max(n64 - dev, 0.0) * (1 - rel), (n64 + dev) * (1 + rel)

    def coef(lo_t, hi_t):
        c = lambda t: max_norm / (t + float(eps))  # noqa: E731
        return min(c(hi_t) * (1 - gamma(3)), 1.0), min(c(lo_t) * (1 + gamma(3)), 1.0)

    ta, tb = total(ga, Ea), total(gb, Eb)
    ca, cb = coef(*ta), coef(*tb)
    dc = max(ca[1] - cb[0], cb[1] - ca[0], 0.0)
    out = {}
    for p in names:
        Aa, Ab = np.abs(ga[p]) + Ea[p], np.abs(gb[p]) + Eb[p]
        out[p] = dc * Aa + cb[1] * D[p] + U * (ca[1] * Aa + cb[1] * Ab)
    return out, max(ta[1] - tb[0], tb[1] - ta[0]), ca, cb
