"""ai.onnx.preview.training::Adagrad through onnxruntime with the trainops library, against
the independent float64 reference in helpers/references.py (and onnx's own cases)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.checks import TOLERANCES_16, assert_clear, assert_outputs, same_bits
from helpers.data import tensors
from helpers.references import adagrad as adagrad_ref
from helpers.runners import (assert_in_place_equals_out_of_place, check_onnx_case,
                             check_reference_on_case, run_thread_counts)
from trainops.models import adagrad_feeds, adagrad_model

F32, F64 = np.float32, np.float64
NON_DEFAULT = {"decay_factor": 0.25, "epsilon": 0.125, "norm_coefficient": 0.3}
ONNX_CASES = ["test_adagrad", "test_adagrad_multiple"]


def data(rng, shapes, dtype=F32, g_shapes=None):
    return tensors(rng, shapes, dtype, g_shapes, state="H")


def run(sess, r, t, xs, gs, hs):
    return sess.run(None, adagrad_feeds(r, t, xs, gs, hs))


def check(outs, r, t, xs, gs, hs, dtype=None, tolerances=None, **attrs):
    assert_outputs(outs, adagrad_ref(r, t, xs, gs, hs, **attrs), xs, "XH", dtype, tolerances)


# --- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("t", [0, 1, 5])
def test_defaults(make_session, rng, dtype, t):
    xs, gs, hs = data(rng, [(7,)], dtype)
    sess = make_session(adagrad_model([(7,)], dtype))
    check(run(sess, 0.05, t, xs, gs, hs), 0.05, t, xs, gs, hs)


# Negative T decays the other way; T past 2^31 / 2^32 catches a T narrowed to 32 bits.
T_VALUES = [-3, 0, 1, 2, 10, 1000, 10**6, 2**31 + 1, 2**32 + 1, 2**62]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("t", T_VALUES)
def test_update_count_and_decay(make_session, rng, dtype, t):
    xs, gs, hs = data(rng, [(11,)], dtype)
    sess = make_session(adagrad_model([(11,)], dtype, decay_factor=0.1))
    check(run(sess, 0.1, t, xs, gs, hs), 0.1, t, xs, gs, hs, decay_factor=0.1)


def test_decay_factor_scales_the_step(make_session, rng):
    """r = R / (1 + T * decay_factor): R = 0.3, T = 4, decay 0.5 gives the step of R = 0.1."""
    xs, gs, hs = data(rng, [(9,)], F64)
    decayed = run(make_session(adagrad_model([(9,)], F64, decay_factor=0.5)), 0.3, 4, xs, gs, hs)
    plain = run(make_session(adagrad_model([(9,)], F64)), 0.1, 4, xs, gs, hs)
    np.testing.assert_allclose(decayed[0], plain[0], rtol=1e-15, atol=0)
    assert same_bits(decayed[1], plain[1])  # H does not depend on the rate


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_single_attribute(make_session, rng, dtype, name):
    value = NON_DEFAULT[name]
    xs, gs, hs = data(rng, [(4, 6)], dtype)
    # The attribute must change the result, or this test would prove nothing.
    default = adagrad_ref(0.1, 3, xs, gs, hs)
    changed = adagrad_ref(0.1, 3, xs, gs, hs, **{name: value})
    assert not np.allclose(default[0], changed[0], rtol=1e-3)
    sess = make_session(adagrad_model([(4, 6)], dtype, **{name: value}))
    check(run(sess, 0.1, 3, xs, gs, hs), 0.1, 3, xs, gs, hs, **{name: value})


@pytest.mark.parametrize("dtype", [F32, F64])
def test_all_attributes(make_session, rng, dtype):
    xs, gs, hs = data(rng, [(5, 3)], dtype)
    sess = make_session(adagrad_model([(5, 3)], dtype, **NON_DEFAULT))
    for t in (0, 1, 4):
        check(run(sess, 0.02, t, xs, gs, hs), 0.02, t, xs, gs, hs, **NON_DEFAULT)


def test_explicit_defaults_equal_implicit(make_session, rng):
    xs, gs, hs = data(rng, [(9,)], F32)
    implicit = run(make_session(adagrad_model([(9,)])), 0.1, 2, xs, gs, hs)
    explicit = run(make_session(adagrad_model([(9,)], decay_factor=0.0, epsilon=1e-6,
                                              norm_coefficient=0.0)), 0.1, 2, xs, gs, hs)
    assert all(same_bits(a, b) for a, b in zip(implicit, explicit))


# --- types -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,r_dtype", [(F32, F32), (F32, F64), (F64, F32), (F64, F64)],
                         ids=["float-R_float", "float-R_double", "double-R_float",
                              "double-R_double"])
def test_dtypes(make_session, rng, dtype, r_dtype):
    xs, gs, hs = data(rng, [(3, 4)], dtype)
    sess = make_session(adagrad_model([(3, 4)], dtype, r_dtype=r_dtype, **NON_DEFAULT))
    r = np.array(0.0123456789, dtype=r_dtype)
    outs = run(sess, r, 5, xs, gs, hs)
    check(outs, r, 5, xs, gs, hs, **NON_DEFAULT)


def test_float16(make_session, rng):
    """The float16 extension: math in float32, stored in float16."""
    xs, gs, hs = data(rng, [(6, 7)], np.float16)
    sess = make_session(adagrad_model([(6, 7)], np.float16, r_dtype=F32, **NON_DEFAULT))
    r = np.array(0.1, F32)
    check(run(sess, r, 2, xs, gs, hs), r, 2, xs, gs, hs, tolerances=TOLERANCES_16, **NON_DEFAULT)


def test_float16_gradient_with_float_weights(make_session, rng):
    xs, _, hs = data(rng, [(6, 7)], F32)
    gs = [rng.standard_normal((6, 7)).astype(np.float16)]
    sess = make_session(adagrad_model([(6, 7)], F32, g_dtype=np.float16, **NON_DEFAULT))
    check(run(sess, 0.1, 2, xs, gs, hs), 0.1, 2, xs, gs, hs, **NON_DEFAULT)


# --- shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
def test_several_tensors(make_session, rng, dtype):
    shapes = [(3,), (2, 5), (4, 1, 3)]
    xs, gs, hs = data(rng, shapes, dtype)
    attrs = {"decay_factor": 0.1, "norm_coefficient": 0.01}
    sess = make_session(adagrad_model(shapes, dtype, **attrs))
    outs = run(sess, 0.1, 7, xs, gs, hs)
    check(outs, 0.1, 7, xs, gs, hs, **attrs)
    # Each group on its own gives the same bits as inside the 3-tensor node.
    for i, shape in enumerate(shapes):
        one = run(make_session(adagrad_model([shape], dtype, **attrs)), 0.1, 7, [xs[i]], [gs[i]],
                  [hs[i]])
        for k in range(2):
            assert same_bits(one[k], outs[k * len(shapes) + i])


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("g_shape", [(5,), (1, 5), (), (2, 1), (1,), (1, 1)], ids=str)
def test_broadcast_gradient(make_session, rng, dtype, g_shape):
    xs, gs, hs = data(rng, [(2, 5)], dtype, [g_shape])
    sess = make_session(adagrad_model([(2, 5)], dtype, g_shapes=[g_shape], norm_coefficient=0.1))
    check(run(sess, 0.1, 2, xs, gs, hs), 0.1, 2, xs, gs, hs, norm_coefficient=0.1)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_zero_element_tensors(make_session, rng, dtype):
    shapes = [(0,), (3, 0), (4,)]
    xs, gs, hs = data(rng, shapes, dtype)
    outs = run(make_session(adagrad_model(shapes, dtype)), 0.1, 1, xs, gs, hs)
    assert [o.shape for o in outs] == shapes * 2
    check(outs, 0.1, 1, xs, gs, hs)


# --- aliasing, inputs and threads --------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_inplace_iobinding_equals_out_of_place(make_session, rng, dtype, threads):
    shapes = [(3,), (2, 5), (4, 1, 3), (300_001,)]
    g_shapes = [(3,), (1, 5), (4, 1, 3), (300_001,)]
    xs, gs, hs = data(rng, shapes, dtype, g_shapes)
    sess = make_session(adagrad_model(shapes, dtype, g_shapes=g_shapes, **NON_DEFAULT),
                        threads=threads)
    feeds = adagrad_feeds(0.1, 3, xs, gs, hs)
    expected = assert_in_place_equals_out_of_place(sess, feeds, "XH", len(shapes))
    check(expected, 0.1, 3, xs, gs, hs, **NON_DEFAULT)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_thread_count_bitwise_equal(make_session, rng, dtype):
    shapes = [(300_000,), (1000, 301), (5,)]
    g_shapes = [(300_000,), (301,), (5,)]
    xs, gs, hs = data(rng, shapes, dtype, g_shapes)
    model = adagrad_model(shapes, dtype, g_shapes=g_shapes, **NON_DEFAULT)
    feeds = adagrad_feeds(0.01, 9, xs, gs, hs)
    results = run_thread_counts(make_session, model, feeds)
    check(results[2], 0.01, 9, xs, gs, hs, **NON_DEFAULT)


# --- onnx's cases and reference ----------------------------------------------------------

@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_case(make_session, models_dir, name):
    check_onnx_case(make_session, models_dir / name)


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_case_against_our_reference(models_dir, name):
    """Our float64 reference reproduces onnx's expected outputs (no library needed)."""
    check_reference_on_case(models_dir / name, adagrad_ref, 3,
                            lambda node: {a.name: a.f for a in node.attribute})


@pytest.mark.parametrize("t", [0, 3])
def test_reference_matches_onnx_reference_evaluator(t):
    """Our reference against onnx's evaluator, in float64 (no library needed)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(11)
    xs, gs, hs = data(rng, [(3, 4), (5,)], F64)
    model = adagrad_model([(3, 4), (5,)], F64, **NON_DEFAULT)
    feeds = adagrad_feeds(0.05, t, xs, gs, hs)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for a, b in zip(adagrad_ref(0.05, t, xs, gs, hs, **NON_DEFAULT), theirs):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_matches_onnx_reference_evaluator(make_session, rng):
    from onnx.reference import ReferenceEvaluator

    xs, gs, hs = data(rng, [(3,), (2, 4)], F32)
    model = adagrad_model([(3,), (2, 4)], decay_factor=0.1, norm_coefficient=0.01)
    feeds = adagrad_feeds(0.1, 4, xs, gs, hs)
    ours = make_session(model).run(None, feeds)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=1e-5, atol=1e-6,
                                   err_msg=f"output {k}")


# --- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("attrs,needles", [
    ({"decay_factor": 1}, ["Adagrad", "decay_factor", "float", "int"]),
    ({"epsilon": "1e-6"}, ["Adagrad", "epsilon", "float", "string"]),
    ({"norm_coefficient": [0.1, 0.2]}, ["Adagrad", "norm_coefficient", "float", "list"]),
], ids=["int-decay_factor", "string-epsilon", "floats-norm_coefficient"])
def test_wrong_attribute_type(make_session, rng, attrs, needles):
    with pytest.raises(Exception) as info:
        make_session(adagrad_model([(2, 5)], **attrs))
    assert_clear(str(info.value), needles)


@pytest.mark.parametrize("feed,needles", [
    ({"H_1": np.zeros((5, 2), F32)}, ["Adagrad", "input 4", "(H_1)", "shape"]),
    ({"G_1": np.zeros((3,), F32)}, ["Adagrad", "input 3", "(G_1)", "broadcast"]),
    ({"R": np.zeros((2,), F32)}, ["Adagrad", "input 0", "(R)", "one element"]),
], ids=["H-shape", "G-not-broadcastable", "R-two-elements"])
def test_bad_input_then_good_input(make_session, rng, feed, needles):
    sess = make_session(adagrad_model(1, dynamic=True))
    xs, gs, hs = data(rng, [(2, 5)])
    with pytest.raises(Exception) as info:
        sess.run(None, {**adagrad_feeds(0.1, 1, xs, gs, hs), **feed})
    assert_clear(str(info.value), needles)
    check(run(sess, 0.1, 1, xs, gs, hs), 0.1, 1, xs, gs, hs)  # the session still works


def test_wrong_arity(make_session):
    from trainops.models import node_model

    ins = [("R", F32, ()), ("T", np.int64, ())]
    ins += [(n, F32, None) for n in ("X_1", "G_1", "H_1", "Z")]
    model = node_model("Adagrad", ins, [("X_1_new", F32, None), ("H_1_new", F32, None)])
    try:
        sess = make_session(model)
    except Exception as exc:  # noqa: BLE001 - load or run, as long as it is clear
        assert_clear(str(exc), ["Adagrad", "2 + 3n inputs", "got 6"])
        return
    feeds = {n: np.ones((2,), F32) for n, _, _ in ins[2:]}
    with pytest.raises(Exception) as info:
        sess.run(None, {"R": np.array(0.1, F32), "T": np.array(1, np.int64), **feeds})
    assert_clear(str(info.value), ["Adagrad", "2 + 3n inputs", "got 6"])
