"""com.trainops::AllFinite: any number of float, double, float16 or bfloat16 tensors ->
one bool scalar, true when every element of every input is finite."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.data import BF16, F16, F32, F64
from helpers.references import all_finite
from trainops import run
from trainops.models import all_finite_model

DTYPES = [F32, F64, F16, BF16]
IDS = ["float", "double", "float16", "bfloat16"]

# Non-finite bit patterns beyond np.nan/np.inf: signalling NaNs, NaN payloads, negative NaN.
ODD_NANS = {
    F32: [0x7F800001, 0x7FBFFFFF, 0xFFC00000, 0x7FC12345],
    F64: [0x7FF0000000000001, 0xFFF8000000000000, 0x7FF8000000000123],
    F16: [0x7C01, 0x7DFF, 0xFE00, 0xFFFF],
    BF16: [0x7F81, 0x7FC1, 0xFFC0, 0xFFFF],
}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def finite_of(sess, *arrays):
    out = run(sess, {f"x_{i + 1}": a for i, a in enumerate(arrays)})
    assert len(out) == 1
    flag = out[0]
    assert flag.dtype == np.bool_ and flag.shape == (), f"finite: {flag.dtype} {flag.shape}"
    return bool(flag)


def largest(dtype):
    import ml_dtypes

    return (ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)).max


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_finite_values(make_session, rng, dtype):
    sess = make_session(all_finite_model([dtype]))
    big = largest(dtype)
    a = np.array([0.0, -0.0, 1.0, -1.0, big, -big], np.float64).astype(dtype)
    tiny = np.array([1], _UINT[np.dtype(dtype).itemsize]).view(dtype)  # smallest subnormal
    assert finite_of(sess, a)
    assert finite_of(sess, tiny)
    assert finite_of(sess, rng.standard_normal(10_001).astype(dtype))
    assert finite_of(sess, np.zeros((3, 0, 2), dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("size", [1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 4099])
def test_one_bad_value_anywhere(make_session, dtype, bad, size):
    """The non-finite value at every position of short arrays (SIMD heads and tails) and
    at a sample of positions of longer ones."""
    sess = make_session(all_finite_model([dtype]))
    positions = range(size) if size <= 64 else [0, 1, size // 2, size - 17, size - 2, size - 1]
    for pos in positions:
        a = np.ones(size, dtype)
        a[pos] = bad
        assert not finite_of(sess, a), f"{bad} at {pos} of {size} not seen"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_odd_nan_bit_patterns(make_session, dtype):
    sess = make_session(all_finite_model([dtype]))
    uint = _UINT[np.dtype(dtype).itemsize]
    for bits in ODD_NANS[dtype]:
        for size, pos in [(1, 0), (37, 36), (37, 5)]:
            raw = np.ones(size, dtype).view(uint).copy()
            raw[pos] = bits
            a = raw.view(dtype)
            assert not all_finite([a])
            assert not finite_of(sess, a), f"{hex(bits)} at {pos} of {size}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_shapes(make_session, dtype):
    sess = make_session(all_finite_model([dtype], dynamic=True))
    for shape in [(), (1,), (3, 4), (2, 3, 5, 7)]:
        a = np.full(shape, 2.5, dtype)
        assert finite_of(sess, a)
        a.reshape(-1)[-1] = np.nan
        assert not finite_of(sess, a)


def test_zero_size_inputs_are_finite(make_session):
    sess = make_session(all_finite_model(DTYPES))
    empties = [np.zeros((0,), F32), np.zeros((2, 0), F64), np.zeros((0, 0, 3), F16),
               np.zeros((0,), BF16)]
    assert finite_of(sess, *empties)
    # an empty input next to a non-finite one does not hide it
    for k in range(4):
        arrays = list(empties)
        arrays[k] = np.array([1.0, np.inf], DTYPES[k])
        assert not finite_of(sess, *arrays), k


def test_many_inputs_of_every_type(make_session, rng):
    """60 inputs, the four types in turn: a single NaN or inf in any one of them."""
    dtypes = [DTYPES[i % 4] for i in range(60)]
    sizes = [int(s) for s in rng.integers(0, 300, 60)]
    sizes[59] = max(sizes[59], 1)
    sess = make_session(all_finite_model(dtypes))
    arrays = [rng.standard_normal(n).astype(dt) for n, dt in zip(sizes, dtypes)]
    assert finite_of(sess, *arrays)
    for k in [0, 1, 2, 3, 30, 57, 58, 59]:
        if sizes[k] == 0:
            continue
        for bad in (np.nan, -np.inf):
            changed = list(arrays)
            changed[k] = arrays[k].copy()
            changed[k][rng.integers(sizes[k])] = bad
            assert all_finite(changed) is False
            assert not finite_of(sess, *changed), f"{bad} in input {k} ({dtypes[k]})"


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_inputs_any_thread_count(make_session, threads):
    n = 3_000_017
    sess = make_session(all_finite_model([F32, BF16]), threads=threads)
    a = np.ones(n, F32)
    b = np.ones(n, BF16)
    assert finite_of(sess, a, b)
    for pos in (0, n // 3, n - 1):
        b[pos] = np.nan
        assert not finite_of(sess, a, b), pos
        b[pos] = 1
        a[pos] = -np.inf
        assert not finite_of(sess, a, b), pos
        a[pos] = 1


def test_inputs_not_written(make_session, rng):
    sess = make_session(all_finite_model([F32, F16]))
    a = rng.standard_normal(1000).astype(F32)
    b = rng.standard_normal(1000).astype(F16)
    b[3] = np.nan
    before = (a.copy(), b.copy())
    assert not finite_of(sess, a, b)
    assert a.tobytes() == before[0].tobytes() and b.tobytes() == before[1].tobytes()


# --- errors ---------------------------------------------------------------------------------

def _clear(message, needles):
    low = message.lower()
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o.lower() in low for o in options), (
            f"error message lacks {' or '.join(map(repr, options))}: {message}")


@pytest.mark.parametrize("dtypes,bad_index", [
    ([np.int32], 0),
    ([F32, np.int64], 1),
    ([F32, F16, np.bool_], 2),
    ([np.uint8, F32], 0),
], ids=["int32", "float-int64", "float-float16-bool", "uint8-float"])
def test_wrong_type(make_session, dtypes, bad_index):
    model = all_finite_model(dtypes)
    name = f"x_{bad_index + 1}"
    needles = ["AllFinite", ("input", name)]
    try:
        sess = make_session(model)
    except Exception as exc:  # noqa: BLE001
        _clear(str(exc), needles)
    else:
        with pytest.raises(Exception) as info:
            run(sess, {f"x_{i + 1}": np.ones(3, dt) for i, dt in enumerate(dtypes)})
        _clear(str(info.value), needles + [f"input {bad_index}"])
    good = make_session(all_finite_model([F32]))
    assert finite_of(good, np.ones(2, F32))
