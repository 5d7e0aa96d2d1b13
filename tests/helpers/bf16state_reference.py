"""AdamBf16State / AdamWBf16State re-implemented in numpy from their contract: the float32
update of each optimizer written operation by operation (ONNX Adam's order; torch AdamW's,
with its two fused multiply-adds), the random words from randomgen's Philox4x32-10 (an
implementation independent of the library's), and stochastic rounding to bfloat16 as a
comparison of those words with the value's low bits.

Counter (the op's contract): element ``e`` of tensor ``i`` (0-based in the node) at update
count ``T`` takes word ``e`` of the Philox stream of state ``[0, 0, T mod 2^32, i, seed low,
seed high]``; its low 16 bits round ``M``, its high 16 bits round ``V``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from helpers.fma_reference import fma32
from helpers.random_reference import words

F32, F64 = np.float32, np.float64
BF16 = np.dtype(ml_dtypes.bfloat16)
M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def stochastic_round(x, r) -> np.ndarray:
    """float32 ``x`` to bfloat16 with 16-bit random values ``r``: away from zero when
    ``r >= 2^16 - (low 16 bits of x)`` (probability low / 2^16), else toward zero; a NaN to
    its quiet NaN (high bits kept, quiet bit set); a finite value never to infinity (the
    largest finite bfloat16 of its sign instead)."""
    x = np.ascontiguousarray(x, F32)
    bits = x.view(np.uint32).astype(np.int64)
    low, toward = bits & 0xFFFF, bits >> 16
    away = np.asarray(r, np.int64) >= 0x10000 - low
    out = toward + away
    out = np.where(np.isfinite(x) & ((out & 0x7FFF) == 0x7F80), out - 1, out)
    out = np.where(np.isnan(x), toward | 0x40, out)
    return out.astype(np.uint16).view(BF16).reshape(x.shape)


def random_words(seed: int, t: int, tensor: int, n: int) -> np.ndarray:
    """The random word of each of ``n`` elements of tensor ``tensor`` at update count ``t``."""
    key = seed & M64
    state = np.array([0, 0, t & M32, tensor, key & M32, key >> 32], np.uint32)
    return words(state, n)


def adam_update(r, t, x, g, m, v, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
                norm_coefficient_post=0.0):
    """ONNX Adam on float32 arrays: scalars formed in float64 from the float32 attributes and
    rounded once, every operation in float32 in the operator's order. ``m``, ``v`` are its
    ``V``, ``H``."""
    a, b = float(F32(alpha)), float(F32(beta))
    rate = r * math.sqrt(1 - b ** t) / (1 - a ** t) if t > 0 else r
    with np.errstate(all="ignore"):
        g = F32(float(F32(norm_coefficient))) * x + g
        m = F32(a) * m + F32(1 - a) * g
        v = F32(b) * v + F32(1 - b) * (g * g)
        x = x - F32(rate) * (m / (np.sqrt(v) + F32(epsilon)))
        return F32(1 - float(F32(norm_coefficient_post))) * x, m, v


def adamw_update(lr, t, x, g, m, v, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=1e-2,
                 maximize=0):
    """torch.optim.AdamW's single-tensor step on float32 arrays (Python-float scalars rounded
    to float32; ``lerp_`` and ``addcmul_`` fused, as torch's CPU kernels)."""
    with np.errstate(all="ignore"):
        grad = -g if maximize else g
        param = x * F32(1 - lr * weight_decay) if weight_decay != 0 else x * F32(1)
        w = F32(1 - beta1)
        if abs(w) < 0.5:
            m = fma32(w, grad - m, m)
        else:
            m = fma32(w - F32(1), grad - m, grad)
        v = fma32(F32(1 - beta2) * grad, grad, v * F32(beta2))
        step_size = lr / (1 - beta1 ** float(t))
        bias_correction2_sqrt = (1 - beta2 ** float(t)) ** 0.5
        denom = np.sqrt(v) / F32(bias_correction2_sqrt) + F32(epsilon)
        return param + (F32(-step_size) * m) / denom, m, v


UPDATES = {"AdamBf16State": adam_update, "AdamWBf16State": adamw_update}


def step(op, r, t, seed, xs, gs, ms, vs, **attrs):
    """One node's step: ``(xs, ms, vs)`` new, moments bfloat16. ``r`` is read as float32."""
    r = float(F32(r))
    out_x, out_m, out_v = [], [], []
    for i, (x, g, m, v) in enumerate(zip(xs, gs, ms, vs)):
        x = np.asarray(x, F32)
        g = np.broadcast_to(np.asarray(g).astype(F32), x.shape)
        x, m32, v32 = UPDATES[op](r, t, x, g, np.asarray(m).astype(F32), np.asarray(v).astype(F32), **attrs)
        w = random_words(seed, t, i, x.size).reshape(x.shape)
        out_x.append(np.asarray(x, F32))
        out_m.append(stochastic_round(m32, w & 0xFFFF))
        out_v.append(stochastic_round(v32, w >> 16))
    return out_x, out_m, out_v
