"""Independent references of the library's ops, written from the operators' contracts
(README.md, "Op reference"), not from the library or from onnx's reference implementation.

- ``ai.onnx.preview.training`` Adam, Adagrad and Momentum in float64;
- 16-bit Adam: the float64 Adam on the 16-bit inputs widened exactly (:func:`adam16`),
  to be rounded once to the 16-bit type (numpy float16 / ml_dtypes.bfloat16,
  round-to-nearest-even) by the comparison (:mod:`helpers.checks`);
- ``MixedPrecisionAdam``: ``g = float32(G) / float32(loss_scale)`` in float32, one
  finiteness verdict over every g of the node, then the float64 Adam or the inputs back;
- ``DynamicLossScale``: the contract's rule in float32, and separately a plain-Python model
  of PyTorch's ``GradScaler`` update (``torch._amp_update_scale_``) with a ``min_scale``;
- ``AllFinite``: ``np.isfinite`` over everything.

ONNX float attributes are 32-bit (``AttributeProto.f``), so the references use the
attribute values as the model stores them: rounded to float32, then widened to float64.
"""

from __future__ import annotations

import math

import numpy as np

from helpers.data import COPY_TYPES


# --- Adam ---------------------------------------------------------------------------------

DEFAULTS = {
    "alpha": 0.9,
    "beta": 0.999,
    "epsilon": 1e-6,
    "norm_coefficient": 0.0,
    "norm_coefficient_post": 0.0,
}


def attr_f32(value: float) -> float:
    """The value an ONNX FLOAT attribute actually carries."""
    return float(np.float32(value))


def _one(value, what: str):
    a = np.asarray(value)
    if a.size != 1:
        raise ValueError(f"{what} must hold exactly one element, got shape {a.shape}")
    return a.reshape(-1)[0]


def adjusted_rate(r: float, t: int, alpha: float, beta: float) -> float:
    """``T > 0 ? R * sqrt(1 - beta^T) / (1 - alpha^T) : R``, in float64."""
    if t > 0:
        # math.pow takes T as a float64: exact for |T| <= 2^53, and beta^T underflows to
        # 0 for huge T, as the real number does.
        return r * math.sqrt(1.0 - math.pow(beta, float(t))) / (1.0 - math.pow(alpha, float(t)))
    return r


def adam_step(r, t, x, g, v, h, **attrs):
    """One Adam step on one tensor group, all in float64. Returns (x_new, v_new, h_new).

    ``g`` must be unidirectionally broadcastable to ``x``'s shape; the outputs take
    ``x``'s shape."""
    unknown = set(attrs) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown attributes {sorted(unknown)}")
    a = {k: attr_f32(attrs.get(k, d)) for k, d in DEFAULTS.items()}
    r = float(_one(r, "R"))
    t = int(_one(t, "T"))
    x = np.asarray(x, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    h = np.asarray(h, dtype=np.float64)
    if v.shape != x.shape or h.shape != x.shape:
        raise ValueError("X, V, H must have the same shape")
    g = np.broadcast_to(np.asarray(g, dtype=np.float64), x.shape)  # raises if not

    g = a["norm_coefficient"] * x + g
    v_new = a["alpha"] * v + (1.0 - a["alpha"]) * g
    h_new = a["beta"] * h + (1.0 - a["beta"]) * g * g
    rate = adjusted_rate(r, t, a["alpha"], a["beta"])
    x_new = x - rate * v_new / (np.sqrt(h_new) + a["epsilon"])
    x_new = (1.0 - a["norm_coefficient_post"]) * x_new
    return x_new, v_new, h_new


def adam(r, t, xs, gs, vs, hs, **attrs):
    """Adam over n tensor groups: returns ``[X_1_new..X_n_new, V_1_new.., H_1_new..]`` in
    float64, the order of the operator's outputs."""
    steps = [adam_step(r, t, x, g, v, h, **attrs) for x, g, v, h in zip(xs, gs, vs, hs)]
    return [s[0] for s in steps] + [s[1] for s in steps] + [s[2] for s in steps]


# --- Adagrad and Momentum -------------------------------------------------------------

ADAGRAD_DEFAULTS = {"decay_factor": 0.0, "epsilon": 1e-6, "norm_coefficient": 0.0}
MOMENTUM_ATTRIBUTES = ("alpha", "beta", "mode", "norm_coefficient")  # all required
MOMENTUM_MODES = ("standard", "nesterov")


def _tensors(x, g, s, name):
    """x and s (the optimizer state) as float64 of one shape, g broadcast to it."""
    x = np.asarray(x, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    if s.shape != x.shape:
        raise ValueError(f"X and {name} must have the same shape")
    g = np.broadcast_to(np.asarray(g, dtype=np.float64), x.shape)  # raises if not
    return x, g, s


def adagrad_rate(r: float, t: int, decay_factor: float) -> float:
    """``R / (1 + T * decay_factor)`` in float64 (T is exact as float64 up to 2^53)."""
    return r / (1.0 + float(t) * decay_factor)


def adagrad_step(r, t, x, g, h, **attrs):
    """One Adagrad step on one tensor group. Returns (x_new, h_new)."""
    unknown = set(attrs) - set(ADAGRAD_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown attributes {sorted(unknown)}")
    a = {k: attr_f32(attrs.get(k, d)) for k, d in ADAGRAD_DEFAULTS.items()}
    rate = adagrad_rate(float(_one(r, "R")), int(_one(t, "T")), a["decay_factor"])
    x, g, h = _tensors(x, g, h, "H")
    g = a["norm_coefficient"] * x + g
    h_new = h + g * g
    x_new = x - rate * g / (np.sqrt(h_new) + a["epsilon"])
    return x_new, h_new


def adagrad(r, t, xs, gs, hs, **attrs):
    """Adagrad over n tensor groups: ``[X_1_new..X_n_new, H_1_new..H_n_new]`` in float64."""
    steps = [adagrad_step(r, t, x, g, h, **attrs) for x, g, h in zip(xs, gs, hs)]
    return [s[0] for s in steps] + [s[1] for s in steps]


def momentum_step(r, t, x, g, v, *, alpha, beta, mode, norm_coefficient):
    """One Momentum step on one tensor group. Returns (x_new, v_new)."""
    if mode not in MOMENTUM_MODES:
        raise ValueError(f"mode must be one of {MOMENTUM_MODES}, got {mode!r}")
    alpha, beta, norm = attr_f32(alpha), attr_f32(beta), attr_f32(norm_coefficient)
    r = float(_one(r, "R"))
    t = int(_one(t, "T"))
    x, g, v = _tensors(x, g, v, "V")
    g = norm * x + g
    beta_adjusted = beta if t > 0 else 1.0  # the first update takes the whole gradient
    v_new = alpha * v + beta_adjusted * g
    if mode == "standard":
        x_new = x - r * v_new
    else:
        x_new = x - r * (g + alpha * v_new)
    return x_new, v_new


def momentum(r, t, xs, gs, vs, **attrs):
    """Momentum over n tensor groups: ``[X_1_new..X_n_new, V_1_new..V_n_new]`` in float64."""
    missing = set(MOMENTUM_ATTRIBUTES) - set(attrs)
    if missing:
        raise TypeError(f"Momentum needs every attribute; missing {sorted(missing)}")
    steps = [momentum_step(r, t, x, g, v, **attrs) for x, g, v in zip(xs, gs, vs)]
    return [s[0] for s in steps] + [s[1] for s in steps]


# --- Adam on 16-bit tensors ---------------------------------------------------------------

def wide(a) -> np.ndarray:
    """float64 copy of an array of any float dtype (bfloat16 included), exact."""
    return np.asarray(a).astype(np.float64)


def adam16(r, t, xs, gs, vs, hs, **attrs):
    """The float64 reference (outputs in op order) on the 16-bit inputs; not yet rounded."""
    return adam(r, t, [wide(x) for x in xs], [wide(g) for g in gs],
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
        outs = adam(r, t, xs, unscaled, vs, hs, **attrs)
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
    """The contract's rule (README.md, "Op reference", mixed precision), in float32:
    returns (scale, good_steps)."""
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
