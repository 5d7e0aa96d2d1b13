"""An independent float64 reference of ``ai.onnx.preview.training::Adam``, written from
the operator's contract (shared/spec/ops.md section 1, onnx defs/training/defs.cc), not from
the library or from onnx's reference implementation.

ONNX float attributes are 32-bit (``AttributeProto.f``), so the reference uses the
attribute values as the model stores them: rounded to float32, then widened to float64.
"""

from __future__ import annotations

import math

import numpy as np

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
