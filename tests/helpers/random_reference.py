"""The random-distribution contract (README, PhiloxUniform/PhiloxNormal/PhiloxDropout)
re-implemented in numpy on words from randomgen's Philox4x32-10, an implementation
independent of the library's own Philox.

randomgen increments its counter before each block, so block ``c`` comes from a generator
started at counter ``c - 1``."""

from __future__ import annotations

import numpy as np
import pytest

M128 = (1 << 128) - 1
FLOAT, FLOAT16, DOUBLE, BFLOAT16 = 1, 10, 11, 16


def typed_outputs_supported() -> bool:
    """Whether the installed onnxruntime can give PhiloxUniform/PhiloxNormal an output type
    other than float: the library sets it from an inference callback on onnxruntime 1.24+
    only (older ones ignore the type or crash on a "" optional input; README, PhiloxUniform)."""
    import onnxruntime as ort

    return tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 24)


def skip_unless_typed(elem: int) -> None:
    if elem != FLOAT and not typed_outputs_supported():
        import onnxruntime as ort

        pytest.skip(f"onnxruntime {ort.__version__} gives PhiloxUniform/PhiloxNormal float outputs "
                    "only (non-float outputs need onnxruntime 1.24+)")


def counter(state) -> int:
    s = [int(w) for w in np.asarray(state).ravel()]
    return s[0] | s[1] << 32 | s[2] << 64 | s[3] << 96


def make_state(c: int, k0: int, k1: int) -> np.ndarray:
    return np.array([(c >> (32 * i)) & 0xFFFFFFFF for i in range(4)] + [k0, k1], np.uint32)


def words(state, n: int) -> np.ndarray:
    """Words ``0 .. n-1`` of the Philox stream of ``state``."""
    randomgen = pytest.importorskip("randomgen")
    s = np.asarray(state, np.uint32).ravel()
    if n == 0:
        return np.zeros(0, np.uint32)
    gen = randomgen.Philox(number=4, width=32, counter=(counter(s) - 1) & M128,
                           key=int(s[4]) | int(s[5]) << 32)
    return gen.random_raw(n).astype(np.uint32)


def advanced(state, n_words: int) -> int:
    """The counter after ``n_words`` words."""
    return (counter(state) + (n_words + 3) // 4) & M128


def bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def np_dtype(elem: int):
    return {FLOAT: np.dtype(np.float32), DOUBLE: np.dtype(np.float64),
            FLOAT16: np.dtype(np.float16)}.get(elem) or bfloat16()


def f32_of(x: np.ndarray) -> np.ndarray:
    return ((x & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1)


def f16_of(x: np.ndarray) -> np.ndarray:
    bits = ((x & np.uint32(0x3FF)) | np.uint32(0x3C00)).astype(np.uint16)
    return bits.view(np.float16) - np.float16(1)


def bf16_of(x: np.ndarray) -> np.ndarray:
    bits = ((x & np.uint32(0x7F)) | np.uint32(0x3F80)).astype(np.uint16)
    return (bits.view(bfloat16()).astype(np.float32) - np.float32(1)).astype(bfloat16())


def f64_of(x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
    bits = ((x0.astype(np.uint64) & np.uint64(0xFFFFF)) << np.uint64(32)) | x1.astype(np.uint64)
    return (bits | np.uint64(0x3FF0000000000000)).view(np.float64) - 1.0


def uniform(state, n: int, elem: int = FLOAT, low: float = 0.0, high: float = 1.0):
    """(values, next counter) of PhiloxUniform."""
    lo32, hi32 = np.float32(low), np.float32(high)
    if elem == DOUBLE:
        w = words(state, 2 * n)
        u = f64_of(w[0::2], w[1::2])
        return u * (float(hi32) - float(lo32)) + float(lo32), advanced(state, 2 * n)
    w = words(state, n)
    r = np.float32(hi32 - lo32)
    if elem == FLOAT:
        return (f32_of(w) * r).astype(np.float32) + lo32, advanced(state, n)
    u = f16_of(w).astype(np.float32) if elem == FLOAT16 else bf16_of(w).astype(np.float32)
    return ((u * r).astype(np.float32) + lo32).astype(np_dtype(elem)), advanced(state, n)


def normal_z(state, n: int, double: bool):
    """(z in float64, r of each element's pair, next counter) of BoxMuller{Float,Double}."""
    pairs = (n + 1) // 2
    if double:
        w = words(state, 4 * pairs).reshape(-1, 4)
        u1 = np.maximum(f64_of(w[:, 0], w[:, 1]), 1.0e-7)
        v1 = 2 * np.pi * f64_of(w[:, 2], w[:, 3])
        used = 4 * pairs
    else:
        w = words(state, 2 * pairs).reshape(-1, 2)
        u1 = np.maximum(f32_of(w[:, 0]), np.float32(1.0e-7)).astype(np.float64)
        v1 = (2 * np.pi * f32_of(w[:, 1]).astype(np.float64)).astype(np.float32).astype(np.float64)
        used = 2 * pairs
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.stack([r * np.sin(v1), r * np.cos(v1)], axis=1).ravel()[:n]
    return z, np.repeat(r, 2)[:n], advanced(state, used)


def normal(state, n: int, elem: int = FLOAT, mean: float = 0.0, scale: float = 1.0):
    """(values, float64 z, r, next counter) of PhiloxNormal: ``z`` rounded to float32 then
    ``z * scale + mean`` in float32 (float64 for double), rounded once to 16 bits."""
    z, r, nxt = normal_z(state, n, elem == DOUBLE)
    if elem == DOUBLE:
        return z * float(np.float32(scale)) + float(np.float32(mean)), z, r, nxt
    v = (z.astype(np.float32) * np.float32(scale)).astype(np.float32) + np.float32(mean)
    return v.astype(np_dtype(elem)), z, r, nxt


def dropout(state, data: np.ndarray, ratio: float):
    """(output, mask, next counter) of PhiloxDropout in training mode; ``ratio`` is the
    float32 input's value."""
    ratio = float(np.float32(ratio))
    n = data.size
    w = words(state, n)
    keep = f32_of(w).astype(np.float64) >= float(ratio)
    factor = keep.astype(data.dtype if data.dtype == np.float64 else np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        if data.dtype == np.float64:
            out = (data.ravel() * (1.0 / (1.0 - float(ratio)))) * factor
        else:
            s32 = np.float32(1) / (np.float32(1) - np.float32(ratio))
            out = ((data.ravel().astype(np.float32) * s32).astype(np.float32) * factor).astype(data.dtype)
    return out.reshape(data.shape), keep.reshape(data.shape), advanced(state, n)
