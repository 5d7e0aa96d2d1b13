"""ai.onnx.preview.training::Momentum ("standard" and "nesterov") through onnxruntime with
the trainops library, against the independent float64 reference in helpers/references.py
(and onnx's own cases)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.checks import TOLERANCES_16, assert_clear, assert_outputs, same_bits
from helpers.data import tensors
from helpers.references import MOMENTUM_ATTRIBUTES, MOMENTUM_MODES
from helpers.references import momentum as momentum_ref
from helpers.runners import (assert_in_place_equals_out_of_place, check_onnx_case,
                             check_reference_on_case, run_thread_counts)
from trainops.models import momentum_feeds, momentum_model

F32, F64 = np.float32, np.float64
ONNX_CASES = ["test_momentum", "test_momentum_multiple", "test_nesterov_momentum"]


def attrs(mode="standard", **changes):
    """A full attribute set (ONNX requires all four)."""
    return {"alpha": 0.9, "beta": 0.5, "mode": mode, "norm_coefficient": 0.01, **changes}


def data(rng, shapes, dtype=F32, g_shapes=None):
    return tensors(rng, shapes, dtype, g_shapes, state="V")


def run(sess, r, t, xs, gs, vs):
    return sess.run(None, momentum_feeds(r, t, xs, gs, vs))


def check(outs, r, t, xs, gs, vs, a, dtype=None, tolerances=None):
    assert_outputs(outs, momentum_ref(r, t, xs, gs, vs, **a), xs, "XV", dtype, tolerances)


modes = pytest.mark.parametrize("mode", MOMENTUM_MODES)


# --- values ------------------------------------------------------------------------------

@modes
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("t", [0, 1, 5])
def test_modes(make_session, rng, mode, dtype, t):
    xs, gs, vs = data(rng, [(7,)], dtype)
    sess = make_session(momentum_model([(7,)], dtype, **attrs(mode)))
    check(run(sess, 0.05, t, xs, gs, vs), 0.05, t, xs, gs, vs, attrs(mode))


@modes
def test_beta_is_one_until_t_is_positive(make_session, rng, mode):
    """beta_adjusted = T > 0 ? beta : 1; v' = alpha * v + beta_adjusted * g (T = 0 keeps
    alpha * v: it is not v' = g)."""
    a = attrs(mode, beta=0.25, norm_coefficient=0.0)
    xs, gs, vs = data(rng, [(13,)], F64)
    sess = make_session(momentum_model([(13,)], F64, **a))
    alpha = float(np.float32(0.9))
    for t, beta in [(-5, 1.0), (0, 1.0), (1, 0.25), (2, 0.25)]:
        x_new, v_new = run(sess, 0.5, t, xs, gs, vs)
        np.testing.assert_allclose(v_new, alpha * vs[0] + beta * gs[0], rtol=1e-15, atol=1e-15)
        step = v_new if mode == "standard" else gs[0] + alpha * v_new
        np.testing.assert_allclose(x_new, xs[0] - 0.5 * step, rtol=1e-15, atol=1e-15)


# T past 2^31 / 2^32 catches a T narrowed to 32 bits (2^32 read as 0 would drop beta).
T_VALUES = [-3, 0, 1, 2, 1000, 2**32, 2**31 + 1, 2**63 - 1, -(2**63)]


@modes
@pytest.mark.parametrize("t", T_VALUES)
def test_update_count(make_session, rng, mode, t):
    xs, gs, vs = data(rng, [(11,)], F32)
    sess = make_session(momentum_model([(11,)], **attrs(mode, beta=0.3)))
    check(run(sess, 0.1, t, xs, gs, vs), 0.1, t, xs, gs, vs, attrs(mode, beta=0.3))


@modes
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name,value", [("alpha", 0.5), ("beta", 0.75), ("norm_coefficient", 0.3)])
def test_single_attribute(make_session, rng, mode, dtype, name, value):
    xs, gs, vs = data(rng, [(4, 6)], dtype)
    base, changed = attrs(mode), attrs(mode, **{name: value})
    # The attribute must change the result, or this test would prove nothing.
    assert not np.allclose(momentum_ref(0.1, 3, xs, gs, vs, **base)[0],
                           momentum_ref(0.1, 3, xs, gs, vs, **changed)[0], rtol=1e-3)
    sess = make_session(momentum_model([(4, 6)], dtype, **changed))
    check(run(sess, 0.1, 3, xs, gs, vs), 0.1, 3, xs, gs, vs, changed)


def test_modes_differ(make_session, rng):
    xs, gs, vs = data(rng, [(8,)], F64)
    standard, nesterov = (run(make_session(momentum_model([(8,)], F64, **attrs(m))), 0.1, 2,
                              xs, gs, vs) for m in MOMENTUM_MODES)
    assert same_bits(standard[1], nesterov[1])  # the same momentum ...
    assert not np.allclose(standard[0], nesterov[0], rtol=1e-3)  # ... a different step


# --- types -------------------------------------------------------------------------------

@modes
@pytest.mark.parametrize("dtype,r_dtype", [(F32, F32), (F32, F64), (F64, F32), (F64, F64)],
                         ids=["float-R_float", "float-R_double", "double-R_float",
                              "double-R_double"])
def test_dtypes(make_session, rng, mode, dtype, r_dtype):
    xs, gs, vs = data(rng, [(3, 4)], dtype)
    sess = make_session(momentum_model([(3, 4)], dtype, r_dtype=r_dtype, **attrs(mode)))
    r = np.array(0.0123456789, dtype=r_dtype)
    check(run(sess, r, 5, xs, gs, vs), r, 5, xs, gs, vs, attrs(mode))


@modes
def test_float16(make_session, rng, mode):
    """The float16 extension: math in float32, stored in float16."""
    xs, gs, vs = data(rng, [(6, 7)], np.float16)
    sess = make_session(momentum_model([(6, 7)], np.float16, r_dtype=F32, **attrs(mode)))
    r = np.array(0.1, F32)
    check(run(sess, r, 2, xs, gs, vs), r, 2, xs, gs, vs, attrs(mode), tolerances=TOLERANCES_16)


@modes
def test_float16_gradient_with_float_weights(make_session, rng, mode):
    xs, _, vs = data(rng, [(6, 7)], F32)
    gs = [rng.standard_normal((6, 7)).astype(np.float16)]
    sess = make_session(momentum_model([(6, 7)], F32, g_dtype=np.float16, **attrs(mode)))
    check(run(sess, 0.1, 2, xs, gs, vs), 0.1, 2, xs, gs, vs, attrs(mode))


# --- shapes ------------------------------------------------------------------------------

@modes
@pytest.mark.parametrize("dtype", [F32, F64])
def test_several_tensors(make_session, rng, mode, dtype):
    shapes = [(3,), (2, 5), (4, 1, 3)]
    xs, gs, vs = data(rng, shapes, dtype)
    sess = make_session(momentum_model(shapes, dtype, **attrs(mode)))
    outs = run(sess, 0.1, 7, xs, gs, vs)
    check(outs, 0.1, 7, xs, gs, vs, attrs(mode))
    # Each group on its own gives the same bits as inside the 3-tensor node.
    for i, shape in enumerate(shapes):
        one = run(make_session(momentum_model([shape], dtype, **attrs(mode))), 0.1, 7, [xs[i]],
                  [gs[i]], [vs[i]])
        for k in range(2):
            assert same_bits(one[k], outs[k * len(shapes) + i])


@modes
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("g_shape", [(5,), (1, 5), (), (2, 1), (1,), (1, 1)], ids=str)
def test_broadcast_gradient(make_session, rng, mode, dtype, g_shape):
    xs, gs, vs = data(rng, [(2, 5)], dtype, [g_shape])
    sess = make_session(momentum_model([(2, 5)], dtype, g_shapes=[g_shape], **attrs(mode)))
    check(run(sess, 0.1, 2, xs, gs, vs), 0.1, 2, xs, gs, vs, attrs(mode))


def test_zero_element_tensors(make_session, rng):
    shapes = [(0,), (3, 0), (4,)]
    xs, gs, vs = data(rng, shapes)
    outs = run(make_session(momentum_model(shapes, **attrs())), 0.1, 1, xs, gs, vs)
    assert [o.shape for o in outs] == shapes * 2
    check(outs, 0.1, 1, xs, gs, vs, attrs())


# --- aliasing, inputs and threads --------------------------------------------------------

@modes
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_inplace_iobinding_equals_out_of_place(make_session, rng, mode, dtype, threads):
    shapes = [(3,), (2, 5), (4, 1, 3), (300_001,)]
    g_shapes = [(3,), (1, 5), (4, 1, 3), (300_001,)]
    xs, gs, vs = data(rng, shapes, dtype, g_shapes)
    sess = make_session(momentum_model(shapes, dtype, g_shapes=g_shapes, **attrs(mode)),
                        threads=threads)
    feeds = momentum_feeds(0.1, 3, xs, gs, vs)
    expected = assert_in_place_equals_out_of_place(sess, feeds, "XV", len(shapes))
    check(expected, 0.1, 3, xs, gs, vs, attrs(mode))


@modes
@pytest.mark.parametrize("dtype", [F32, F64])
def test_thread_count_bitwise_equal(make_session, rng, mode, dtype):
    shapes = [(300_000,), (1000, 301), (5,)]
    g_shapes = [(300_000,), (301,), (5,)]
    xs, gs, vs = data(rng, shapes, dtype, g_shapes)
    model = momentum_model(shapes, dtype, g_shapes=g_shapes, **attrs(mode))
    feeds = momentum_feeds(0.01, 9, xs, gs, vs)
    results = run_thread_counts(make_session, model, feeds)
    check(results[2], 0.01, 9, xs, gs, vs, attrs(mode))


# --- onnx's cases and reference ----------------------------------------------------------

@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_case(make_session, models_dir, name):
    check_onnx_case(make_session, models_dir / name)


@pytest.mark.parametrize("name", ONNX_CASES)
def test_onnx_case_against_our_reference(models_dir, name):
    """Our float64 reference reproduces onnx's expected outputs (no library needed)."""
    import onnx

    def attributes(node):
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        a["mode"] = a["mode"].decode()
        return a

    check_reference_on_case(models_dir / name, momentum_ref, 3, attributes)


@modes
@pytest.mark.parametrize("t", [0, 3])
def test_reference_matches_onnx_reference_evaluator(mode, t):
    """Our reference against onnx's evaluator, in float64 (no library needed)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(12)
    xs, gs, vs = data(rng, [(3, 4), (5,)], F64)
    model = momentum_model([(3, 4), (5,)], F64, **attrs(mode))
    feeds = momentum_feeds(0.05, t, xs, gs, vs)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for a, b in zip(momentum_ref(0.05, t, xs, gs, vs, **attrs(mode)), theirs):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@modes
def test_matches_onnx_reference_evaluator(make_session, rng, mode):
    from onnx.reference import ReferenceEvaluator

    xs, gs, vs = data(rng, [(3,), (2, 4)], F32)
    model = momentum_model([(3,), (2, 4)], **attrs(mode))
    feeds = momentum_feeds(0.1, 4, xs, gs, vs)
    ours = make_session(model).run(None, feeds)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=1e-5, atol=1e-6,
                                   err_msg=f"output {k}")


# --- errors ------------------------------------------------------------------------------

def _load_error(make_session, model) -> str:
    """The message of the error that loading (creating the session for) ``model`` raises."""
    with pytest.raises(Exception) as info:
        make_session(model)
    return str(info.value)


@pytest.mark.parametrize("name", MOMENTUM_ATTRIBUTES)
def test_missing_attribute(make_session, rng, name):
    a = attrs()
    del a[name]
    message = _load_error(make_session, momentum_model([(2, 5)], **a))
    assert_clear(message, [f"Momentum: attribute '{name}': required"])
    # The process lives on: a complete node loads and runs.
    xs, gs, vs = data(rng, [(2, 5)])
    check(run(make_session(momentum_model([(2, 5)], **attrs())), 0.1, 1, xs, gs, vs),
          0.1, 1, xs, gs, vs, attrs())


@pytest.mark.parametrize("mode", ["Standard", "NESTEROV", "adam", "", "standard "])
def test_unknown_mode(make_session, mode):
    message = _load_error(make_session, momentum_model([(2, 5)], **attrs(mode)))
    assert_clear(message, ["Momentum: attribute 'mode'", '"standard" or "nesterov"',
                           f"got {mode!r}".replace("'", '"')])


@pytest.mark.parametrize("changes,needles", [
    ({"mode": 1}, ["Momentum: attribute 'mode'", "expected a string attribute",
                   "got an int attribute"]),
    ({"mode": 1.5}, ["Momentum: attribute 'mode'", "expected a string", "got a float"]),
    ({"alpha": 1}, ["Momentum: attribute 'alpha'", "expected a float", "got an int"]),
    ({"beta": "0.5"}, ["Momentum: attribute 'beta'", "expected a float", "got a string"]),
    ({"norm_coefficient": [0.1]}, ["Momentum: attribute 'norm_coefficient'", "expected a float",
                                   "list of floats"]),
], ids=["int-mode", "float-mode", "int-alpha", "string-beta", "floats-norm_coefficient"])
def test_wrong_attribute_type(make_session, changes, needles):
    assert_clear(_load_error(make_session, momentum_model([(2, 5)], **attrs(**changes))), needles)


@pytest.mark.parametrize("feed,needles", [
    ({"V_1": np.zeros((5, 2), F32)}, ["Momentum", "input 4", "(V_1)", "shape"]),
    ({"G_1": np.zeros((1, 2, 5), F32)}, ["Momentum", "input 3", "(G_1)", "broadcast"]),
    ({"T": np.array([1, 2], np.int64)}, ["Momentum", "input 1", "(T)", "one element"]),
], ids=["V-shape", "G-higher-rank", "T-two-elements"])
def test_bad_input_then_good_input(make_session, rng, feed, needles):
    sess = make_session(momentum_model(1, dynamic=True, **attrs()))
    xs, gs, vs = data(rng, [(2, 5)])
    with pytest.raises(Exception) as info:
        sess.run(None, {**momentum_feeds(0.1, 1, xs, gs, vs), **feed})
    assert_clear(str(info.value), needles)
    check(run(sess, 0.1, 1, xs, gs, vs), 0.1, 1, xs, gs, vs, attrs())  # the session still works
