"""Independent float64 references of ``ai.onnx.preview.training::Adagrad`` and ``Momentum``,
written from the operators' contracts (onnx ``defs/training/defs.cc``: the pseudo code of
each op's documentation), not from the library or from onnx's reference implementation.

As in ``adam_reference``, FLOAT attributes are used as the model stores them (rounded to
float32, then widened), and every operation runs in float64.
"""

from __future__ import annotations

import numpy as np

from adam_reference import _one, attr_f32

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
