"""8-bit optimizer state in numpy: the format of ``com.trainops::Adam8bit`` and
``com.trainops::AdamW8bit``, to initialise, inspect and build their state and nodes.

Each moment of a float32 parameter of ``n`` elements is stored as ``uint8`` codes shaped like
the parameter and one float32 scale per block of :data:`BLOCK` = 256 consecutive elements
(flat, row-major; ``ceil(n / 256)`` scales, the block's largest ``|value|``). The value of a
code ``c`` in a block with scale ``a`` is ``map[c] * a`` (float32). The first moment uses the
signed dynamic map, the second the unsigned one (:func:`dynamic_map`, bitsandbytes'
``create_dynamic_map``). Quantising: a value ``v`` becomes the map entry nearest to
``v / a`` (float32 division; ``v / 1`` for an all-zero block), the lower entry on a tie;
a block holding a NaN gets a NaN scale. 2 + 8/256 bytes per parameter for both moments.

    from trainops import quantized as q
    codes, scales = q.quantize_blockwise(m, signed=True)
    m_again = q.dequantize_blockwise(codes, scales, signed=True)
    state = q.zero_state((1024, 3))        # {"M_q": ..., "M_absmax": ..., "V_q": ..., ...}
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

__all__ = [
    "BLOCK",
    "STATE",
    "dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    "state_specs",
    "zero_state",
    "names",
]

BLOCK = 256

# The state groups of the 8-bit ops after X and G, in input order: (name, dtype, signed map).
STATE = (("M_q", np.uint8, True), ("M_absmax", np.float32, True),
         ("V_q", np.uint8, False), ("V_absmax", np.float32, False))


@lru_cache(maxsize=2)
def _map(signed: bool) -> np.ndarray:
    data: list[float] = []
    for i in range(7):  # max_exponent_bits = 7
        items = 2 ** i if signed else 2 ** (i + 1)
        boundaries = 0.1 + 0.9 * np.arange(items + 1, dtype=np.float64) / items
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)[i]  # 10**(i - 6)
        data += list(scale * means)
        if signed:
            data += list(-scale * means)
    data += [0.0, 1.0]
    assert len(data) == 256
    out = np.sort(np.array(data, dtype=np.float64).astype(np.float32))
    out.setflags(write=False)
    return out


def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: 256
    sorted float32 values in [-1, 1] (signed) or [0, 1] (unsigned). For each exponent
    ``i = 0..6``, ``10**(i - 6)`` times the midpoints of ``linspace(0.1, 1, k + 1)``
    (``k = 2**i`` signed, with their negatives; ``2**(i + 1)`` unsigned), then 0 and 1;
    computed in float64 and rounded once to float32. A read-only array."""
    return _map(bool(signed))


@lru_cache(maxsize=2)
def _midpoints(signed: bool) -> np.ndarray:
    m = dynamic_map(signed).astype(np.float64)
    return (m[:-1] + m[1:]) / 2.0  # exact in float64


def _blocks(flat: np.ndarray) -> np.ndarray:
    """``flat`` padded with zeros to whole blocks, as ``(blocks, BLOCK)``."""
    nb = -(-flat.size // BLOCK)
    padded = np.zeros(nb * BLOCK, dtype=flat.dtype)
    padded[:flat.size] = flat
    return padded.reshape(nb, BLOCK)


def quantize_blockwise(x, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, absmax)`` of ``x`` (cast to float32): uint8 codes shaped like ``x`` and one
    float32 scale per 256 elements (1-D), with the signed or the unsigned map."""
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    if flat.size == 0:
        return np.zeros(x.shape, np.uint8), np.zeros(0, np.float32)
    b = _blocks(flat)
    with np.errstate(invalid="ignore"):
        absmax = np.abs(b).max(axis=1)  # NaN propagates
    divisor = np.where(absmax == 0, np.float32(1), absmax).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = (b / divisor[:, None]).astype(np.float32).reshape(-1)[:flat.size]
    # Nearest entry, ties low: the number of midpoints strictly below y.
    codes = np.searchsorted(_midpoints(bool(signed)), y.astype(np.float64), side="left")
    codes = np.where(np.isnan(y), 0, codes).astype(np.uint8)
    return codes.reshape(x.shape), absmax.astype(np.float32)


def dequantize_blockwise(codes, absmax, signed: bool) -> np.ndarray:
    """float32 values ``map[codes] * absmax`` of each code's block, shaped like ``codes``."""
    codes = np.asarray(codes, dtype=np.uint8)
    absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    n = codes.size
    if absmax.size != -(-n // BLOCK):
        raise ValueError(f"dequantize_blockwise: {n} codes need {-(-n // BLOCK)} scales "
                         f"(one per {BLOCK}), got {absmax.size}")
    scales = np.repeat(absmax, BLOCK)[:n]
    return (dynamic_map(signed)[codes.reshape(-1)] * scales).astype(np.float32).reshape(codes.shape)


def state_specs(shape: Sequence[int]) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """The 8-bit state of one float32 parameter of ``shape``, in the ops' input order:
    ``[("M_q", shape, uint8), ("M_absmax", (ceil(n/256),), float32), ("V_q", ...),
    ("V_absmax", ...)]``."""
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape, dtype=np.int64))
    scales = (-(-n // BLOCK),)
    return [(name, shape if dtype == np.uint8 else scales, np.dtype(dtype)) for name, dtype, _ in STATE]


def zero_state(shape: Sequence[int]) -> dict[str, np.ndarray]:
    """Zero moments for a parameter of ``shape`` (PyTorch's initial state): scales 0 and each
    map's code of 0. Keys ``M_q, M_absmax, V_q, V_absmax``."""
    out = {}
    for (name, shp, dtype), (_, _, signed) in zip(state_specs(shape), STATE):
        if dtype == np.uint8:
            zero_code = int(np.flatnonzero(dynamic_map(signed) == 0)[0])
            out[name] = np.full(shp, zero_code, dtype=np.uint8)
        else:
            out[name] = np.zeros(shp, dtype=np.float32)
    return out


def names(n: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of an ``Adam8bit`` / ``AdamW8bit`` node over ``n``
    parameters: ``R, T, X_i.., G_i.., M_q_i.., M_absmax_i.., V_q_i.., V_absmax_i..`` and
    ``X_i_new.., M_q_i_new.., M_absmax_i_new.., V_q_i_new.., V_absmax_i_new..``."""
    idx = range(1, n + 1)
    groups = ["X", "G"] + [name for name, _, _ in STATE]
    inputs = ["R", "T"] + [f"{g}_{i}" for g in groups for i in idx]
    outputs = [f"{g}_{i}_new" for g in groups if g != "G" for i in idx]
    return inputs, outputs
