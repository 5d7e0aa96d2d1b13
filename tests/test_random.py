"""com.trainops::PhiloxUniform, PhiloxNormal and PhiloxDropout through onnxruntime, against
the contract re-implemented in numpy on randomgen's Philox4x32 (helpers.random_reference):
bit for bit for uniform and dropout, within the contract's tolerance for normal; every
dtype, odd sizes, counters at the carries, thread invariance, in-place state, errors, and
statistical sanity (mean, variance, a Kolmogorov-Smirnov test on 10^6 normals)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import random_reference as ref
from helpers.checks import same_bits
from trainops.bfloat16 import run as run16
from trainops.random import dropout_model, normal_model, uniform_model

M128 = ref.M128
DTYPES = [ref.FLOAT, ref.DOUBLE, ref.FLOAT16, ref.BFLOAT16]
DTYPE_IDS = ["float", "double", "float16", "bfloat16"]
# Counters whose next blocks carry out of one, two, three words, and wrap at 2^128.
CARRIES = [0, (1 << 32) - 3, (1 << 64) - 2, (1 << 96) - 5, M128, M128 - 1]
SIZES = [1, 2, 3, 7, 17, 64, 1001]


def feeds(state, n=None):
    f = {"state": np.asarray(state, np.uint32)}
    if n is not None:
        f["shape"] = np.asarray(n if isinstance(n, (list, tuple)) else [n], np.int64)
    return f


def run(sess, feed):
    """session.run, bfloat16 outputs included (through an IOBinding)."""
    return run16(sess, feed)


def _typed_sessions(make_session, build):
    """One session per dtype the installed onnxruntime can type (float always)."""
    return {d: make_session(build(None, d)) for d in DTYPES
            if d == ref.FLOAT or ref.typed_outputs_supported()}


@pytest.fixture(scope="module")
def uniform_sessions(make_session):
    return _typed_sessions(make_session, uniform_model)


@pytest.fixture(scope="module")
def normal_sessions(make_session):
    return _typed_sessions(make_session, normal_model)


# ---------------------------------------------------------------------------- uniform


@pytest.mark.parametrize("elem", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("c", CARRIES)
def test_uniform_matches_numpy_bit_for_bit(uniform_sessions, elem, c):
    ref.skip_unless_typed(elem)
    sess = uniform_sessions[elem]
    state = ref.make_state(c, 0x9E3779B9, 0x01234567)
    for n in SIZES:
        out, st = run(sess, feeds(state, n))
        want, nxt = ref.uniform(state, n, elem)
        assert same_bits(out, want), (n, out[:4], want[:4])
        assert ref.counter(st) == nxt and st[4:].tolist() == [0x9E3779B9, 0x01234567]


@pytest.mark.parametrize("elem", DTYPES, ids=DTYPE_IDS)
def test_uniform_low_high(make_session, elem):
    ref.skip_unless_typed(elem)
    sess = make_session(uniform_model([3, 5], elem, low=-2.5, high=7.25))
    state = ref.make_state(123, 4, 5)
    out, _ = run(sess, {"state": state})
    want, _ = ref.uniform(state, 15, elem, -2.5, 7.25)
    assert out.shape == (3, 5) and same_bits(out.ravel(), want)
    assert out.min() >= -2.5 and out.max() <= 7.25


def test_uniform_default_dtype_is_float(make_session):
    sess = make_session(uniform_model([4]))
    out, st = sess.run(None, {"state": np.zeros(6, np.uint32)})
    assert out.dtype == np.float32 and same_bits(out, ref.uniform(np.zeros(6), 4)[0])
    assert st.tolist() == [1, 0, 0, 0, 0, 0]


def test_large_outputs_are_thread_invariant(make_session):
    """Past the threaded threshold; 1 and 2 threads give the numpy bits, for uniform and
    dropout (normal runs the same split)."""
    n = (1 << 18) + 5
    state = ref.make_state((1 << 64) - 100, 7, 9)
    want, _ = ref.uniform(state, n, ref.FLOAT)
    data = np.linspace(-3, 3, n, dtype=np.float32)
    want_d, want_m, _ = ref.dropout(state, data, 0.25)
    for threads in (1, 2):
        (out, _) = make_session(uniform_model(None, np.float32), threads=threads).run(None, feeds(state, n))
        assert same_bits(out, want)
        sess = make_session(dropout_model(np.float32), threads=threads)
        o, m, _ = sess.run(None, {"data": data, "ratio": np.array(0.25, np.float32),
                                  "training_mode": np.array(True), "state": state})
        assert same_bits(o, want_d) and same_bits(m, want_m)
        z, _ = make_session(normal_model(None, np.float32), threads=threads).run(None, feeds(state, n))
        if threads == 1:
            z1 = z
        else:
            assert same_bits(z, z1)


def test_state_updated_in_place_through_iobinding(make_session):
    import onnxruntime as ort

    sess = make_session(uniform_model([10], np.float32))
    start = ref.make_state(M128, 3, 4)
    state = ort.OrtValue.ortvalue_from_numpy(start.copy())
    binding = sess.io_binding()
    binding.bind_ortvalue_input("state", state)
    binding.bind_output("output")
    binding.bind_ortvalue_output("state_out", state)
    seen = []
    for _ in range(3):
        sess.run_with_iobinding(binding)
        seen.append(binding.copy_outputs_to_cpu()[0])
    # Each call uses 3 blocks (10 words): the stream continues where the last call stopped.
    w = ref.words(start, 36).reshape(3, 12)[:, :10].ravel()
    assert same_bits(np.concatenate(seen), ref.f32_of(w))
    assert ref.counter(state.numpy()) == (M128 + 9) & M128


def test_zero_elements_keep_the_state(uniform_sessions, normal_sessions):
    state = ref.make_state(77, 1, 2)
    for sess in (uniform_sessions[ref.FLOAT], normal_sessions[ref.FLOAT]):
        out, st = run(sess, feeds(state, [3, 0]))
        assert out.shape == (3, 0) and same_bits(st, state)


# ---------------------------------------------------------------------------- normal


def assert_normal_close(out, elem, z, r, mean=0.0, scale=1.0):
    got = np.asarray(out).astype(np.float64).ravel()
    want = z * float(np.float32(scale)) + float(np.float32(mean))
    if elem in (ref.FLOAT, ref.DOUBLE):
        tol = (4e-6 if elem == ref.FLOAT else 1e-12) * np.maximum(1.0, r) * max(1.0, abs(scale))
        # The float64 formula rounded to float32 once more (scale and mean in float32).
        slack = np.abs(want) * 2.0 ** -23 * 2 if elem == ref.FLOAT else 0
        bad = np.abs(got - want) > tol + slack
    else:
        # 16-bit: the float32 value rounded once; at most one 16-bit ulp from the float64 one.
        bits = 10 if elem == ref.FLOAT16 else 7
        bad = np.abs(got - want) > np.maximum(np.abs(want) * 2.0 ** -bits, 2.0 ** -24) + 4e-6 * r
    assert not bad.any(), (np.flatnonzero(bad)[:5], got[bad][:5], want[bad][:5])


@pytest.mark.parametrize("elem", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("c", [0, (1 << 32) - 3, M128])
def test_normal_within_tolerance_of_numpy(normal_sessions, elem, c):
    ref.skip_unless_typed(elem)
    sess = normal_sessions[elem]
    state = ref.make_state(c, 0xDEADBEEF, 0xFEEDF00D)
    for n in SIZES + [4097]:
        out, st = run(sess, feeds(state, n))
        want, z, r, nxt = ref.normal(state, n, elem)
        assert out.shape == (n,)
        assert_normal_close(out, elem, z, r)
        assert ref.counter(st) == nxt, n  # an odd last element uses up its pair


@pytest.mark.parametrize("elem", DTYPES, ids=DTYPE_IDS)
def test_normal_mean_scale(make_session, elem):
    ref.skip_unless_typed(elem)
    sess = make_session(normal_model([2, 7], elem, mean=3.0, scale=-0.5))
    state = ref.make_state(5, 6, 7)
    out, _ = run(sess, {"state": state})
    _, z, r, _ = ref.normal(state, 14, elem)
    assert out.shape == (2, 7)
    assert_normal_close(out, elem, z, r, mean=3.0, scale=-0.5)


def _phi(x: np.ndarray) -> np.ndarray:
    erf = np.frompyfunc(math.erf, 1, 1)
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0)).astype(np.float64))


def test_statistics_of_a_million(make_session):
    """Uniform: mean 1/2, variance 1/12. Normal: mean 0, variance 1, and a two-sided
    Kolmogorov-Smirnov test against the standard normal at the 0.1% level."""
    n = 1_000_000
    state = ref.make_state(2024, 11, 12)
    (u, _) = make_session(uniform_model([n], np.float32)).run(None, {"state": state})
    (z, _) = make_session(normal_model([n], np.float32)).run(None, {"state": state})
    se = 1 / math.sqrt(n)
    assert abs(u.mean() - 0.5) < 5 * se * math.sqrt(1 / 12)
    assert abs(u.var() - 1 / 12) < 5 * se * math.sqrt(1 / 180)
    z = np.sort(z.astype(np.float64))
    assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * se * math.sqrt(2)
    cdf = _phi(z)
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert d < 1.95 / math.sqrt(n), d  # critical value of D at alpha = 0.001


# ---------------------------------------------------------------------------- dropout


def dropout_feeds(data, ratio=0.5, training=True, state=None, ratio_dtype=np.float32):
    f = {"data": data}
    if ratio is not None:
        f["ratio"] = np.array(ratio, ratio_dtype)
    if training is not None:
        f["training_mode"] = np.array(training)
    f["state"] = ref.make_state(99, 1, 2) if state is None else state
    return f


def special_data(n, dtype, rng):
    d = rng.normal(0, 4, n)
    d[5::13] = np.resize([np.nan, np.inf, -np.inf, -0.0, -1.5], d[5::13].size)
    return d.astype(dtype)


@pytest.mark.parametrize("elem", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.3, 0.999])
def test_dropout_matches_numpy_bit_for_bit(make_session, rng, elem, ratio):
    dtype = ref.np_dtype(elem)
    sess = make_session(dropout_model(dtype))
    for c in (0, (1 << 64) - 2, M128):
        state = ref.make_state(c, 0xABCDEF01, 0x12345678)
        for n in (1, 7, 17, 1001):
            data = special_data(n, dtype, rng).reshape(1, n)
            out, mask, st = run(sess, dropout_feeds(data, ratio, state=state))
            want, keep, nxt = ref.dropout(state, data, ratio)
            assert same_bits(mask, keep)
            assert same_bits(out, want), (n, out, want)
            assert ref.counter(st) == nxt


def test_dropout_semantics(make_session, rng):
    data = rng.normal(size=(4, 33)).astype(np.float32)
    sess = make_session(dropout_model(np.float32))
    # Not training: identity, mask all true, state unchanged.
    for training in (False, None):
        s = make_session(dropout_model(np.float32, training_mode=training is not None))
        out, mask, st = s.run(None, {k: v for k, v in dropout_feeds(data, 0.9, training).items()
                                     if v is not None})
        assert same_bits(out, data) and mask.all() and same_bits(st, ref.make_state(99, 1, 2))
    # Default ratio 0.5 when the input is left out.
    s = make_session(dropout_model(np.float32, ratio=None))
    out, mask, _ = s.run(None, {"data": data, "training_mode": np.array(True), "state": ref.make_state(99, 1, 2)})
    want, keep, _ = ref.dropout(ref.make_state(99, 1, 2), data, 0.5)
    assert same_bits(out, want) and same_bits(mask, keep)
    # Kept values are scaled by 1 / (1 - ratio), dropped ones are zero; about ratio dropped.
    big = rng.normal(size=100_000).astype(np.float32)
    out, mask, _ = sess.run(None, dropout_feeds(big, 0.3))
    assert np.array_equal(out[mask], big[mask] * np.float32(1 / np.float32(0.7)))
    assert not out[~mask].any() and abs((~mask).mean() - 0.3) < 0.01
    # Without mask and state_out outputs.
    s = make_session(dropout_model(np.float32, mask=False, state_out=False))
    (out,) = s.run(None, dropout_feeds(data, 0.5))
    assert same_bits(out, ref.dropout(ref.make_state(99, 1, 2), data, 0.5)[0])


def test_dropout_in_place(make_session, rng):
    """output bound to data's buffer and state_out to state's: the out-of-place bits."""
    import onnxruntime as ort

    sess = make_session(dropout_model(np.float32, shape=[50]))
    data = rng.normal(size=50).astype(np.float32)
    state = ref.make_state(5, 6, 7)
    want, keep, nxt = ref.dropout(state, data, 0.4)
    values = {k: ort.OrtValue.ortvalue_from_numpy(np.array(v, copy=True))
              for k, v in dropout_feeds(data, 0.4, state=state).items()}
    binding = sess.io_binding()
    for k, v in values.items():
        binding.bind_ortvalue_input(k, v)
    binding.bind_ortvalue_output("output", values["data"])
    binding.bind_output("mask")
    binding.bind_ortvalue_output("state_out", values["state"])
    sess.run_with_iobinding(binding)
    assert same_bits(values["data"].numpy(), want)
    assert same_bits(binding.get_outputs()[1].numpy(), keep)
    assert ref.counter(values["state"].numpy()) == nxt


# ---------------------------------------------------------------------------- errors


def _message(excinfo) -> str:
    return " ".join(str(excinfo.value).split())


@pytest.mark.parametrize("state, shape, needles", [
    (np.zeros(5, np.uint32), [4], ["PhiloxUniform", "input 0 (state)", "exactly 6 elements"]),
    (np.zeros(6, np.uint32), [2, -3], ["PhiloxUniform", "input 1 (shape)", "negative dimension -3"]),
    (np.zeros(6, np.uint32), [1 << 16, 1 << 16], ["input 1 (shape)", "limit"]),
])
def test_bad_inputs_are_clear_errors(make_session, state, shape, needles):
    sess = make_session(uniform_model(None, np.float32, dynamic=True))
    with pytest.raises(Exception) as excinfo:
        sess.run(None, feeds(state, shape))
    for needle in needles:
        assert needle in _message(excinfo), _message(excinfo)
    out, _ = sess.run(None, feeds(np.zeros(6, np.uint32), 4))  # still usable
    assert out.shape == (4,)


def test_bad_dtype_fails_at_session_creation(make_session):
    from trainops.models import node_model

    model = node_model("PhiloxNormal", [("state", np.uint32, [6])], [("output", np.float32, None)],
                       domain="com.trainops", shape=[4], dtype=6)
    with pytest.raises(Exception) as excinfo:
        make_session(model)
    assert "PhiloxNormal" in _message(excinfo) and "attribute 'dtype'" in _message(excinfo)


def test_both_shape_sources_is_an_error(make_session):
    from trainops.models import node_model

    both = node_model("PhiloxNormal", [("state", np.uint32, [6]), ("shape", np.int64, [1])],
                      [("output", np.float32, None)], domain="com.trainops", shape=[4])
    with pytest.raises(Exception) as excinfo:
        make_session(both).run(None, feeds(np.zeros(6, np.uint32), 4))
    assert "PhiloxNormal: input 1 (shape)" in _message(excinfo) and "both" in _message(excinfo)


def test_dropout_errors(make_session):
    sess = make_session(dropout_model(np.float32))
    data = np.ones(8, np.float32)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(Exception) as excinfo:
            sess.run(None, dropout_feeds(data, bad))
        assert "PhiloxDropout: input 1 (ratio)" in _message(excinfo) and "[0, 1)" in _message(excinfo)
    # Outside training any ratio is fine (ONNX's Dropout ignores it).
    out, mask, _ = sess.run(None, dropout_feeds(data, 1.0, training=False))
    assert same_bits(out, data)
    # A double ratio is refused when the session is made (ratio is declared float).
    with pytest.raises(Exception) as excinfo:
        make_session(dropout_model(np.float32, ratio=np.float64))
    assert "ratio" in _message(excinfo)


def test_an_optional_input_named_empty_does_not_crash(make_session):
    """ONNX Runtime up to 1.23 dereferences null building an inference context for a node
    whose optional input is "": the library installs no inference callback there."""
    from trainops.models import node_model

    model = node_model("PhiloxUniform", [("state", np.uint32, [6])], [("output", np.float32, [4])],
                       domain="com.trainops", shape=[4])
    model.graph.node[0].input.append("")
    out = make_session(model).run(None, {"state": np.zeros(6, np.uint32)})[0]
    assert same_bits(out, ref.uniform(np.zeros(6, np.uint32), 4)[0])
