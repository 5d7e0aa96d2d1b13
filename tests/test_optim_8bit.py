"""com.trainops::Adam8bit and AdamW8bit: Adam / AdamW with blockwise 8-bit moments.

Every expected value comes from this file's own numpy code: bitsandbytes' dynamic map as
published (``create_dynamic_map``, with ``np.linspace``), nearest-entry quantisation by
``argmin`` over the map, and each optimizer's quantise-update-requantise step in float32
(the operations of the op contracts, in their order, so results are bitwise), run for many
steps. ``trainops.quantized`` (the package's numpy helper) is held to the same references.
Convergence: on a least-squares problem the 8-bit optimizers end within a stated margin of
float32 Adam / AdamW written in numpy.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from helpers.checks import assert_clear, same_bits
from helpers.convergence import against_float32, least_squares
from helpers.runners import run_in_place, run_thread_counts
import trainops
from trainops import quantized
from trainops.models import node_model
from trainops.onnx_defs import TRAINOPS_DOMAIN

F32 = np.float32
BLOCK = 256
SHAPES = [(1,), (255,), (256,), (257,), (3, 300), (2, 2, 129)]


# ---- independent references --------------------------------------------------------------

def bnb_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes' ``create_dynamic_map`` as published, with numpy's float64 linspace in
    place of torch's float32 one, rounded to float32 at the end."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = np.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += (10 ** (-(max_exponent_bits - 1) + i) * means).tolist()
        if signed:
            data += (-10 ** (-(max_exponent_bits - 1) + i) * means).tolist()
    assert additional_items == 0
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    return np.sort(np.array(data, dtype=np.float64).astype(F32))


MAPS = {True: bnb_dynamic_map(True), False: bnb_dynamic_map(False)}


def nearest(y, signed):
    """Index of the nearest map entry (the lower on a tie: argmin's first), 0 for NaN."""
    m = MAPS[signed].astype(np.float64)
    y = np.asarray(y, F32).astype(np.float64).reshape(-1)
    out = np.zeros(y.size, np.uint8)
    ok = ~np.isnan(y)
    out[ok] = np.argmin(np.abs(y[ok, None] - m[None, :]), axis=1)
    return out


def quantize(v, signed):
    """(codes, absmax) of float32 ``v``, block by block."""
    flat = np.asarray(v, F32).reshape(-1)
    codes, scales = [np.zeros(0, np.uint8)], []
    for s in range(0, flat.size, BLOCK):
        block = flat[s:s + BLOCK]
        a = F32(np.nan) if np.isnan(block).any() else np.abs(block).max()
        d = F32(1) if a == 0 else a
        with np.errstate(invalid="ignore"):
            codes.append(nearest(block / d, signed))
        scales.append(a)
    return np.concatenate(codes).reshape(np.shape(v)), np.array(scales, F32)


def dequantize(codes, scales, signed):
    flat = np.asarray(codes).reshape(-1)
    out = np.array([MAPS[signed][c] * scales[i // BLOCK] for i, c in enumerate(flat)], F32)
    return out.reshape(np.shape(codes))


def adam_update(r, t, x, g, m, v, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
                norm_coefficient_post=0.0):
    """ONNX Adam on float32 arrays, scalars formed in float64 from the float32 attributes."""
    a, b = float(F32(alpha)), float(F32(beta))
    rate = r * math.sqrt(1 - b ** t) / (1 - a ** t) if t > 0 else r
    g = F32(float(F32(norm_coefficient))) * x + g
    m = F32(a) * m + F32(1 - a) * g
    v = F32(b) * v + F32(1 - b) * (g * g)
    x = x - F32(rate) * (m / (np.sqrt(v) + F32(epsilon)))
    return F32(1 - float(F32(norm_coefficient_post))) * x, m, v


def adamw_update(lr, t, x, g, m, v, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01,
                 maximize=0):
    """torch.optim.AdamW's single-tensor step on float32 arrays."""
    b1, b2 = float(F32(beta1)), float(F32(beta2))
    g = -g if maximize else g
    x = x * F32(1 - lr * float(F32(weight_decay)))
    w = F32(1 - b1)
    m = m + w * (g - m) if abs(w) < 0.5 else g - (g - m) * (F32(1) - w)
    v = v * F32(b2) + F32(1 - b2) * g * g
    bias1, bias2 = (1 - b1 ** t, 1 - b2 ** t) if t > 0 else (1.0, 1.0)
    denom = np.sqrt(v) / F32(math.sqrt(bias2)) + F32(epsilon)
    return x - F32(lr / bias1) * m / denom, m, v


def step_8bit(update, r, t, x, g, state, **attrs):
    """Dequantise, update in float32, requantise: the new X and state. ``r`` is widened from
    float32, as the op reads its float32 ``R``."""
    r = float(F32(r))
    m = dequantize(state["M_q"], state["M_absmax"], True)
    v = dequantize(state["V_q"], state["V_absmax"], False)
    x, m, v = update(r, t, x, np.asarray(g).astype(F32), m, v, **attrs)
    mq, ma = quantize(m, True)
    vq, va = quantize(v, False)
    return x, {"M_q": mq, "M_absmax": ma, "V_q": vq, "V_absmax": va}


UPDATES = {"Adam8bit": adam_update, "AdamW8bit": adamw_update}


# ---- models -------------------------------------------------------------------------------

def model_8bit(op, shapes, g_dtype=F32, **attrs):
    ins, outs = quantized.names(len(shapes))
    types = {"X": F32, "G": g_dtype, "M_q": np.uint8, "M_absmax": F32, "V_q": np.uint8, "V_absmax": F32}

    def spec(name):
        group, i = name.rsplit("_", 1)
        x_shape = shapes[int(i) - 1]
        shape = (-(-math.prod(x_shape) // BLOCK),) if group.endswith("absmax") else x_shape
        return name, types[group], shape

    inputs = [("R", F32, ()), ("T", np.int64, ())] + [spec(n) for n in ins[2:]]
    outputs = [(o, *spec(o[:-4])[1:]) for o in outs]
    return node_model(op, inputs, outputs, domain=TRAINOPS_DOMAIN, **attrs)


def initial(rng, shapes, g_dtype=F32):
    """Weights, gradients and a state quantised from random moments (by the reference)."""
    xs = [rng.standard_normal(s).astype(F32) for s in shapes]
    gs = [(0.1 * rng.standard_normal(s)).astype(g_dtype) for s in shapes]
    states = []
    for s in shapes:
        mq, ma = quantize((0.01 * rng.standard_normal(s)).astype(F32), True)
        vq, va = quantize((1e-4 * rng.random(s)).astype(F32), False)
        states.append({"M_q": mq, "M_absmax": ma, "V_q": vq, "V_absmax": va})
    return xs, gs, states


def feeds_of(r, t, xs, gs, states):
    feeds = {"R": np.array(r, F32), "T": np.array(t, np.int64)}
    for group, arrays in (("X", xs), ("G", gs)):
        feeds.update({f"{group}_{i + 1}": a for i, a in enumerate(arrays)})
    for key in ("M_q", "M_absmax", "V_q", "V_absmax"):
        feeds.update({f"{key}_{i + 1}": s[key] for i, s in enumerate(states)})
    return feeds


def unpack(outs, n):
    xs = outs[:n]
    states = [{key: outs[(k + 1) * n + i] for k, key in enumerate(("M_q", "M_absmax", "V_q", "V_absmax"))}
              for i in range(n)]
    return xs, states


# ---- the map and the numpy helper ---------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_the_published_construction(signed):
    m = quantized.dynamic_map(signed)
    assert m.dtype == F32 and m.shape == (256,)
    np.testing.assert_array_equal(m, MAPS[signed])
    assert m[-1] == 1.0 and (m == 0).sum() == 1 and np.all(np.diff(m) > 0)
    assert (m < 0).sum() == (127 if signed else 0)


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000])
def test_numpy_helper_quantises_like_the_reference(rng, n):
    for signed in (True, False):
        v = (rng.standard_normal(n) if signed else rng.random(n)).astype(F32)
        if n > 300:
            v[256:512] = 0  # an all-zero block
            v[600] = np.nan  # a NaN poisons its block's scale
        codes, scales = quantized.quantize_blockwise(v, signed)
        want_codes, want_scales = quantize(v, signed)
        np.testing.assert_array_equal(codes, want_codes)
        assert same_bits(scales, want_scales)
        back = quantized.dequantize_blockwise(codes, scales, signed)
        assert same_bits(back, dequantize(want_codes, want_scales, signed))
    assert quantized.state_specs((3, 300)) == [
        ("M_q", (3, 300), np.dtype(np.uint8)), ("M_absmax", (4,), np.dtype(F32)),
        ("V_q", (3, 300), np.dtype(np.uint8)), ("V_absmax", (4,), np.dtype(F32))]
    zero = quantized.zero_state((300,))
    assert not dequantize(zero["M_q"], zero["M_absmax"], True).any()
    assert MAPS[True][zero["M_q"][0]] == 0 and MAPS[False][zero["V_q"][0]] == 0


def test_ties_go_to_the_lower_entry():
    m = MAPS[False].astype(np.float64)
    mids = (m[:-1] + m[1:]) / 2
    exact = np.flatnonzero(mids.astype(F32).astype(np.float64) == mids)
    assert exact.size > 0
    codes, _ = quantized.quantize_blockwise(np.append(mids[exact].astype(F32), 1.0), False)
    np.testing.assert_array_equal(codes[:-1], exact)


# ---- the ops ------------------------------------------------------------------------------

CASES = [
    ("Adam8bit", {}),
    ("Adam8bit", {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-8, "norm_coefficient": 0.01,
                  "norm_coefficient_post": 0.001}),
    ("AdamW8bit", {}),
    ("AdamW8bit", {"beta1": 0.3, "beta2": 0.95, "epsilon": 1e-6, "weight_decay": 0.1, "maximize": 1}),
]


@pytest.mark.parametrize("op,attrs", CASES)
def test_many_steps_match_the_reference_bitwise(make_session, rng, op, attrs):
    sess = make_session(model_8bit(op, SHAPES, **attrs))
    xs, gs, states = initial(rng, SHAPES)
    r = 0.01
    for t in range(0, 25):
        gs = [(0.1 * rng.standard_normal(s)).astype(F32) for s in SHAPES]
        gs[1][:] = 0  # a zero gradient, a zero block of moments after a while
        outs = sess.run(None, feeds_of(r, t, xs, gs, states))
        new_xs, new_states = unpack(outs, len(SHAPES))
        for i in range(len(SHAPES)):
            want_x, want_state = step_8bit(UPDATES[op], r, t, xs[i], gs[i], states[i], **attrs)
            assert same_bits(new_xs[i], want_x), f"{op} t={t} X_{i + 1}"
            for key, want in want_state.items():
                assert same_bits(new_states[i][key], want), f"{op} t={t} {key}_{i + 1}"
        xs, states = new_xs, new_states


@pytest.mark.parametrize("g_dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", ["Adam8bit", "AdamW8bit"])
def test_16bit_gradients(make_session, rng, op, g_dtype):
    sess = make_session(model_8bit(op, SHAPES[:4], g_dtype=g_dtype))
    xs, gs, states = initial(rng, SHAPES[:4], g_dtype)
    outs = trainops.run(sess, feeds_of(0.01, 3, xs, gs, states))  # bfloat16 through IOBinding
    new_xs, new_states = unpack(outs, 4)
    for i in range(4):
        want_x, want_state = step_8bit(UPDATES[op], 0.01, 3, xs[i], gs[i], states[i])
        assert same_bits(new_xs[i], want_x)
        assert all(same_bits(new_states[i][k], w) for k, w in want_state.items())


@pytest.mark.parametrize("op", ["Adam8bit", "AdamW8bit"])
def test_in_place_and_thread_counts(make_session, rng, op):
    shapes = [(70_000 + 123,), (257,)]
    model = model_8bit(op, shapes)
    xs, gs, states = initial(rng, shapes)
    feeds = feeds_of(0.01, 2, xs, gs, states)
    results = run_thread_counts(make_session, model, feeds)
    actual, _ = run_in_place(make_session(model, threads=2), feeds, ["X", "M_q", "M_absmax", "V_q", "V_absmax"], 2)
    assert same_bits(actual, results[1])
    want_x, want_state = step_8bit(UPDATES[op], 0.01, 2, xs[0], gs[0], states[0])
    assert same_bits(results[1][0], want_x) and same_bits(results[1][2], want_state["M_q"])


def test_state_is_2_03_bytes_per_parameter():
    specs = quantized.state_specs((1 << 20,))
    nbytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    assert nbytes / (1 << 20) == 2 + 8 / 256


# ---- convergence --------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Adam8bit", "AdamW8bit"])
def test_converges_like_float32(make_session, rng, op):
    """After 300 steps the 8-bit optimizer's loss is within 15% (plus 1e-4) of the same
    optimizer with float32 moments, and both are far below the start (measured: 0.0040
    against 0.0037 for both Adam and AdamW, from 0.45)."""
    loss_grad = least_squares(rng)
    n, steps, lr = 600, 300, 0.01
    attrs = {"weight_decay": 0.0} if op == "AdamW8bit" else {}
    sess = make_session(model_8bit(op, [(n,)], **attrs))
    state = quantized.zero_state((n,))

    def op_step(t, x8, g):
        nonlocal state
        (x8,), (state,) = unpack(sess.run(None, feeds_of(lr, t, [x8], [g], [state])), 1)
        return x8

    loss8, loss32, start = against_float32(loss_grad, op_step, UPDATES[op], n, steps, lr, **attrs)
    assert loss32 < 0.05 * start
    assert loss8 <= 1.15 * loss32 + 1e-4, (loss8, loss32, start)


# ---- bad inputs ---------------------------------------------------------------------------

def _error(make_session, model, feeds):
    try:
        make_session(model).run(None, feeds)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return str(exc)
    raise AssertionError("expected an error")


def test_wrong_absmax_length_is_a_clear_error(make_session, rng):
    xs, gs, states = initial(rng, [(300,)])
    states[0]["M_absmax"] = np.zeros(3, F32)
    model = model_8bit("Adam8bit", [(300,)])
    model.graph.input[5].type.tensor_type.shape.dim[0].dim_value = 3
    msg = _error(make_session, model, feeds_of(0.01, 1, xs, gs, states))
    assert_clear(msg, ["Adam8bit", "M_absmax_1", "2 elements", "one per 256", "[3]"])


def test_wrong_dtype_is_a_clear_error(make_session, rng):
    xs, gs, states = initial(rng, [(300,)])
    states[0]["V_q"] = states[0]["V_q"].astype(F32)
    model = model_8bit("AdamW8bit", [(300,)])
    model.graph.input[6].type.tensor_type.elem_type = 1
    model.graph.output[3].type.tensor_type.elem_type = 1
    msg = _error(make_session, model, feeds_of(0.01, 1, xs, gs, states))
    assert_clear(msg, ["AdamW8bit", "V_q_1", "uint8", "float"])


def test_bad_maximize_and_arity_are_clear_errors(make_session, rng):
    xs, gs, states = initial(rng, [(10,)])
    msg = _error(make_session, model_8bit("AdamW8bit", [(10,)], maximize=2), feeds_of(0.01, 1, xs, gs, states))
    assert_clear(msg, ["AdamW8bit", "maximize", "0 or 1"])
    model = model_8bit("Adam8bit", [(10,)])
    del model.graph.input[-1]
    model.graph.node[0].input.pop()
    feeds = feeds_of(0.01, 1, xs, gs, states)
    del feeds["V_absmax_1"]
    msg = _error(make_session, model, feeds)
    assert_clear(msg, ["Adam8bit", "2 + 6n inputs", "got 7"])
