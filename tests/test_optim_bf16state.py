"""com.trainops::AdamBf16State and AdamWBf16State: Adam / AdamW with bfloat16 moments,
rounded stochastically with Philox bits keyed by the ``seed`` attribute.

Expected values come from ``helpers/bf16state_reference.py`` (numpy float32 updates in the
operators' order, randomgen's Philox, the rounding as a comparison), bitwise, over many
steps. Statistics: rounding a fixed value many times averages to it (and not to its
round-to-nearest neighbour). Convergence: on a least-squares problem the bfloat16-state
optimizers end within a stated margin of float32 Adam / AdamW written in numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers.bf16state_reference import BF16, F32, UPDATES, random_words, step, stochastic_round
from helpers.checks import assert_clear, same_bits
from helpers.convergence import against_float32, least_squares
import trainops
from trainops.bfloat16 import from_ortvalue, to_ortvalue
from trainops.models import node_model
from trainops.onnx_defs import TRAINOPS_DOMAIN

OPS = ["AdamBf16State", "AdamWBf16State"]
SHAPES = [(1,), (5,), (3, 7), (2, 2, 129)]
GROUPS = ("X", "G", "M", "V")


# ---- models -------------------------------------------------------------------------------

def model_bf16(op, shapes, g_dtype=F32, g_shapes=None, **attrs):
    """One node of ``op`` over tensors of ``shapes`` (gradients of ``g_shapes``, default the
    same)."""
    n = len(shapes)
    g_shapes = g_shapes or shapes
    types = {"X": F32, "G": g_dtype, "M": BF16, "V": BF16}
    inputs = [("R", F32, ()), ("T", np.int64, ())]
    for group in GROUPS:
        inputs += [(f"{group}_{i + 1}", types[group], (g_shapes if group == "G" else shapes)[i]) for i in range(n)]
    outputs = [(f"{group}_{i + 1}_new", types[group], shapes[i]) for group in ("X", "M", "V") for i in range(n)]
    return node_model(op, inputs, outputs, domain=TRAINOPS_DOMAIN, **attrs)


def feeds_of(r, t, xs, gs, ms, vs):
    feeds = {"R": np.array(r, F32), "T": np.array(t, np.int64)}
    for group, arrays in zip(GROUPS, (xs, gs, ms, vs)):
        feeds.update({f"{group}_{i + 1}": a for i, a in enumerate(arrays)})
    return feeds


def initial(rng, shapes, g_dtype=F32):
    xs = [rng.standard_normal(s).astype(F32) for s in shapes]
    gs = [(0.1 * rng.standard_normal(s)).astype(g_dtype) for s in shapes]
    ms = [(0.01 * rng.standard_normal(s)).astype(BF16) for s in shapes]
    vs = [(1e-4 * rng.random(s)).astype(BF16) for s in shapes]
    return xs, gs, ms, vs


def run(sess, feeds, n):
    """``(xs, ms, vs)`` of one run (bfloat16 through an IOBinding)."""
    outs = trainops.run(sess, feeds)
    return outs[:n], outs[n:2 * n], outs[2 * n:]


def check_bits(got, want, what):
    for name, g, w in zip(("X", "M", "V"), got, want):
        for i, (a, b) in enumerate(zip(g, w)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}_{i + 1}"
            assert same_bits(a, b), f"{what} {name}_{i + 1}"


# ---- the reference's own pieces ----------------------------------------------------------

def test_reference_rounding_is_exactly_unbiased_over_every_random_value():
    x = np.array([1 + 2 ** -9, -3.14159, 1e-30, 2.5e-41, 0.1, 65504.7], F32)
    r = np.arange(1 << 16)
    for v in x:
        rounded = stochastic_round(np.full(r.size, v, F32), r).astype(np.float64)
        assert rounded.mean() == float(v), v
    assert same_bits(stochastic_round(np.array([np.inf, -np.inf, 0.0, -0.0], F32), np.full(4, 0xFFFF)),
                     np.array([np.inf, -np.inf, 0.0, -0.0], BF16))
    big = stochastic_round(np.array([np.finfo(F32).max, -np.finfo(F32).max], F32), np.full(2, 0xFFFF))
    assert same_bits(big, np.array([ml_max(), -ml_max()], BF16))
    nan = stochastic_round(np.array([0x7F800001], np.uint32).view(F32), np.zeros(1))
    assert nan.view(np.uint16)[0] == 0x7FC0


def ml_max():
    return float(np.array(0x7F7F, np.uint16).view(BF16))


# ---- the ops against the reference ---------------------------------------------------------

CASES = [
    ("AdamBf16State", {}),
    ("AdamBf16State", {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-8, "norm_coefficient": 0.01,
                       "norm_coefficient_post": 0.001, "seed": -5}),
    ("AdamWBf16State", {}),
    ("AdamWBf16State", {"beta1": 0.3, "beta2": 0.95, "epsilon": 1e-6, "weight_decay": 0.1, "maximize": 1,
                        "seed": (1 << 62) + 12345}),
]


@pytest.mark.parametrize("op,attrs", CASES)
def test_many_steps_match_the_reference_bitwise(make_session, rng, op, attrs):
    sess = make_session(model_bf16(op, SHAPES, **attrs))
    seed = attrs.get("seed", 0)
    update = {k: v for k, v in attrs.items() if k != "seed"}
    xs, gs, ms, vs = initial(rng, SHAPES)
    for t in range(1, 21):
        gs = [(0.1 * rng.standard_normal(s)).astype(F32) for s in SHAPES]
        gs[1][:] = 0  # a zero gradient: the moments decay and keep rounding
        got = run(sess, feeds_of(0.01, t, xs, gs, ms, vs), len(SHAPES))
        want = step(op, 0.01, t, seed, xs, gs, ms, vs, **update)
        check_bits(got, want, f"{op} t={t}")
        xs, ms, vs = got


@pytest.mark.parametrize("g_dtype", [np.float16, BF16])
@pytest.mark.parametrize("op", OPS)
def test_16bit_and_broadcast_gradients(make_session, rng, op, g_dtype):
    shapes, g_shapes = [(3, 7), (4, 5)], [(1, 7), (4, 5)]
    sess = make_session(model_bf16(op, shapes, g_dtype=g_dtype, g_shapes=g_shapes))
    xs, _, ms, vs = initial(rng, shapes)
    gs = [(0.1 * rng.standard_normal(s)).astype(g_dtype) for s in g_shapes]
    got = run(sess, feeds_of(0.01, 3, xs, gs, ms, vs), 2)
    check_bits(got, step(op, 0.01, 3, 0, xs, gs, ms, vs), op)


def run_bound_in_place(sess, feeds, n):
    """Every ``X/M/V_i_new`` bound to its input's own OrtValue; their new contents."""
    values = {k: to_ortvalue(np.array(a, copy=True)) for k, a in feeds.items()}
    binding = sess.io_binding()
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    names = [f"{p}_{i}" for p in ("X", "M", "V") for i in range(1, n + 1)]
    for name in names:
        binding.bind_ortvalue_output(f"{name}_new", values[name])
    sess.run_with_iobinding(binding)
    for name, out in zip(names, binding.get_outputs()):
        assert out.data_ptr() == values[name].data_ptr(), name
    return [from_ortvalue(values[name]) for name in names]


@pytest.mark.parametrize("op", OPS)
def test_thread_counts_and_in_place_give_the_same_bits(make_session, rng, op):
    # Above the kernels' serial threshold (65536 elements): cut into tasks over threads.
    shapes = [(70_000 + 123,), (257,)]
    model = model_bf16(op, shapes, seed=99)
    xs, gs, ms, vs = initial(rng, shapes)
    feeds = feeds_of(0.01, 2, xs, gs, ms, vs)
    before = {k: np.array(a, copy=True) for k, a in feeds.items()}
    want = step(op, 0.01, 2, 99, xs, gs, ms, vs)
    flat_want = [a for group in want for a in group]
    for threads in (1, 2, 3):
        got = trainops.run(make_session(model, threads=threads), feeds)
        assert all(same_bits(a, b) for a, b in zip(got, flat_want)), f"{threads} threads"
    assert all(same_bits(feeds[k], before[k]) for k in feeds), "an input was written"
    in_place = run_bound_in_place(make_session(model, threads=2), feeds, 2)
    assert all(same_bits(a, b) for a, b in zip(in_place, flat_want))


def test_seed_and_step_pick_the_bits(make_session, rng):
    xs, gs, ms, vs = initial(rng, [(4096,)])
    feeds = feeds_of(0.01, 5, xs, gs, ms, vs)
    a = run(make_session(model_bf16("AdamBf16State", [(4096,)], seed=1)), feeds, 1)
    again = run(make_session(model_bf16("AdamBf16State", [(4096,)], seed=1)), feeds, 1)
    other = run(make_session(model_bf16("AdamBf16State", [(4096,)], seed=2)), feeds, 1)
    later = run(make_session(model_bf16("AdamBf16State", [(4096,)], seed=1)), feeds_of(0.01, 6, xs, gs, ms, vs), 1)
    assert same_bits(a[1][0], again[1][0]) and same_bits(a[2][0], again[2][0])
    assert same_bits(a[0][0], other[0][0])  # X never depends on the bits
    assert not same_bits(a[1][0], other[1][0]) and not same_bits(a[2][0], other[2][0])
    # Any two roundings agree or are one bfloat16 step apart.
    steps = np.abs(a[1][0].view(np.int16).astype(int) - other[1][0].view(np.int16).astype(int))
    assert steps.max() == 1
    assert not same_bits(a[1][0], later[1][0])


# ---- statistics of the rounding ---------------------------------------------------------

def test_rounding_of_a_fixed_value_is_unbiased(make_session):
    """alpha = beta = 0 make ``M_new = G`` and ``V_new = G * G`` before rounding: a value
    between two bfloat16 neighbours, stored for 200k elements (and for one element over 400
    steps), averages to itself within 5 standard errors, far from the nearest neighbour that
    round-to-nearest would give every time."""
    n = 200_000
    c = np.float32(1 + 0.3 * 2 ** -7)  # 30% of the way from 1 to the next bfloat16
    sess = make_session(model_bf16("AdamBf16State", [(n,)], alpha=0.0, beta=0.0, seed=7))
    zeros = np.zeros(n, BF16)
    _, (m,), (v,) = run(sess, feeds_of(0.0, 1, [np.zeros(n, F32)], [np.full(n, c, F32)], [zeros], [zeros]), 1)
    for got, exact in ((m, c), (v, np.float32(c * c))):
        lo, hi = neighbours(exact)
        values = got.astype(np.float64)
        assert set(np.unique(values)) == {lo, hi}
        p = (float(exact) - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(values.mean() - float(exact)) < 5 * se, (values.mean(), float(exact), se)
        assert abs(float(exact.astype(BF16)) - float(exact)) > 100 * se  # round-to-nearest's bias
    one = make_session(model_bf16("AdamBf16State", [(1,)], alpha=0.0, beta=0.0, seed=3))
    z1, c1 = np.zeros(1, BF16), np.full(1, c, F32)
    seen = [float(run(one, feeds_of(0.0, t, [np.zeros(1, F32)], [c1], [z1], [z1]), 1)[1][0][0]) for t in range(1, 401)]
    lo, hi = neighbours(c)
    p = (float(c) - lo) / (hi - lo)
    assert abs(np.mean(seen) - float(c)) < 5 * (hi - lo) * math.sqrt(p * (1 - p) / 400)


def neighbours(x):
    """The bfloat16 values just below and above float32 ``x`` (as floats)."""
    bits = int(np.array(x, F32).view(np.uint32)) >> 16
    lo, hi = (np.array([bits, bits + 1], np.uint16).view(BF16)).astype(np.float64)
    return float(lo), float(hi)


# ---- convergence --------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_converges_like_float32(make_session, rng, op):
    """After 300 steps the bfloat16-state optimizer's loss is within 10% (plus 1e-4) of the
    same optimizer with float32 moments (numpy), and both are far below the start."""
    loss_grad = least_squares(rng)
    n, steps, lr = 600, 300, 0.01
    attrs = {"weight_decay": 0.0} if op == "AdamWBf16State" else {}
    sess = make_session(model_bf16(op, [(n,)], seed=11, **attrs))
    m16, v16 = np.zeros(n, BF16), np.zeros(n, BF16)

    def op_step(t, x16, g):
        nonlocal m16, v16
        (x16,), (m16,), (v16,) = run(sess, feeds_of(lr, t, [x16], [g], [m16], [v16]), 1)
        return x16

    loss16, loss32, start = against_float32(loss_grad, op_step, UPDATES[op], n, steps, lr, **attrs)
    assert loss32 < 0.05 * start
    assert loss16 <= 1.10 * loss32 + 1e-4, (loss16, loss32, start)


# ---- bad inputs ---------------------------------------------------------------------------

def _error(make_session, model, feeds):
    try:
        trainops.run(make_session(model), feeds)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return str(exc)
    raise AssertionError("expected an error")


def _retype(model, name, elem):
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name in (name, f"{name}_new"):
            vi.type.tensor_type.elem_type = elem


def test_float32_moments_are_a_clear_error(make_session, rng):
    xs, gs, ms, vs = initial(rng, [(10,)])
    model = model_bf16("AdamBf16State", [(10,)])
    _retype(model, "M_1", 1)
    msg = _error(make_session, model, feeds_of(0.01, 1, xs, gs, [ms[0].astype(F32)], vs))
    assert_clear(msg, ["AdamBf16State", "M_1", "bfloat16", "float"])


def test_other_weight_type_and_shape_are_clear_errors(make_session, rng):
    xs, gs, ms, vs = initial(rng, [(10,)])
    model = model_bf16("AdamWBf16State", [(10,)])
    _retype(model, "X_1", 10)
    msg = _error(make_session, model, feeds_of(0.01, 1, [xs[0].astype(np.float16)], gs, ms, vs))
    assert_clear(msg, ["AdamWBf16State", "X_1", "float", "float16"])
    model = model_bf16("AdamWBf16State", [(10,)])
    model.graph.input[5].type.tensor_type.shape.dim[0].dim_value = 9
    msg = _error(make_session, model, feeds_of(0.01, 1, xs, gs, ms, [vs[0][:9]]))
    assert_clear(msg, ["AdamWBf16State", "V_1", "[10]", "[9]"])


def test_adamw_step_below_one_amsgrad_and_arity_are_clear_errors(make_session, rng):
    xs, gs, ms, vs = initial(rng, [(10,)])
    msg = _error(make_session, model_bf16("AdamWBf16State", [(10,)]), feeds_of(0.01, 0, xs, gs, ms, vs))
    assert_clear(msg, ["AdamWBf16State", "T", ">= 1", "0"])
    msg = _error(make_session, model_bf16("AdamWBf16State", [(10,)], amsgrad=1), feeds_of(0.01, 1, xs, gs, ms, vs))
    assert_clear(msg, ["AdamWBf16State", "amsgrad", "not supported"])
    model = model_bf16("AdamBf16State", [(10,)])
    del model.graph.input[-1]
    model.graph.node[0].input.pop()
    feeds = feeds_of(0.01, 1, xs, gs, ms, vs)
    del feeds["V_1"]
    msg = _error(make_session, model, feeds)
    assert_clear(msg, ["AdamBf16State", "2 + 4n inputs", "got 5"])


def test_state_is_4_bytes_per_parameter():
    assert BF16.itemsize * 2 == 4
    w = random_words(0, 0, 0, 4)
    assert list(w) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]  # Random123's vector
