"""ai.onnx.preview.training::Adam through onnxruntime with the trainops library, against
the independent float64 reference in helpers/references.py."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.checks import assert_matches_reference, same_bits
from helpers.data import group, groups
from helpers.references import adam as adam_ref
from helpers.runners import run, run_thread_counts
from trainops.models import adam_feeds, adam_model

F32, F64 = np.float32, np.float64

NON_DEFAULT = {
    "alpha": 0.5,
    "beta": 0.75,
    "epsilon": 0.25,
    "norm_coefficient": 0.3,
    "norm_coefficient_post": 0.125,
}


# --- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("t", [0, 1])
def test_defaults(make_session, rng, dtype, t):
    xs, gs, vs, hs = groups(rng, [(7,)], dtype)
    sess = make_session(adam_model([(7,)], dtype))
    assert_matches_reference(run(sess, 0.05, t, xs, gs, vs, hs), 0.05, t, xs, gs, vs, hs)


# T <= 0: no bias correction. Large T: beta^T, alpha^T underflow to 0 (rate -> R); T past
# 2^31 / 2^32 catches a T narrowed to 32 bits (2^32 + 1 would read as 1).
T_VALUES = [-3, 0, 1, 2, 3, 10, 1000, 10**6, 2**31 + 1, 2**32 + 1, 2**62, 2**63 - 1]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("t", T_VALUES)
def test_update_count(make_session, rng, dtype, t):
    xs, gs, vs, hs = groups(rng, [(11,)], dtype)
    sess = make_session(adam_model([(11,)], dtype, alpha=0.8, beta=0.99))
    outs = run(sess, 0.1, t, xs, gs, vs, hs)
    assert_matches_reference(outs, 0.1, t, xs, gs, vs, hs, alpha=0.8, beta=0.99)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_single_attribute(make_session, rng, dtype, name):
    value = NON_DEFAULT[name]
    xs, gs, vs, hs = groups(rng, [(4, 6)], dtype)
    # The attribute must change the result, or this test would prove nothing.
    default = adam_ref(0.1, 3, xs, gs, vs, hs)
    changed = adam_ref(0.1, 3, xs, gs, vs, hs, **{name: value})
    assert not np.allclose(default[0], changed[0], rtol=1e-3)
    sess = make_session(adam_model([(4, 6)], dtype, **{name: value}))
    outs = run(sess, 0.1, 3, xs, gs, vs, hs)
    assert_matches_reference(outs, 0.1, 3, xs, gs, vs, hs, **{name: value})


@pytest.mark.parametrize("dtype", [F32, F64])
def test_all_attributes(make_session, rng, dtype):
    xs, gs, vs, hs = groups(rng, [(5, 3)], dtype)
    sess = make_session(adam_model([(5, 3)], dtype, **NON_DEFAULT))
    for t in (0, 1, 4):
        outs = run(sess, 0.02, t, xs, gs, vs, hs)
        assert_matches_reference(outs, 0.02, t, xs, gs, vs, hs, **NON_DEFAULT)


def test_explicit_defaults_equal_implicit(make_session, rng):
    xs, gs, vs, hs = groups(rng, [(9,)], F32)
    implicit = run(make_session(adam_model([(9,)])), 0.1, 2, xs, gs, vs, hs)
    explicit = run(make_session(adam_model([(9,)], alpha=0.9, beta=0.999, epsilon=1e-6,
                                           norm_coefficient=0.0, norm_coefficient_post=0.0)),
                   0.1, 2, xs, gs, vs, hs)
    assert all(same_bits(a, b) for a, b in zip(implicit, explicit))


# --- types -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,r_dtype", [(F32, F32), (F32, F64), (F64, F32), (F64, F64)],
                         ids=["float-R_float", "float-R_double", "double-R_float",
                              "double-R_double"])
def test_dtypes(make_session, rng, dtype, r_dtype):
    xs, gs, vs, hs = groups(rng, [(3, 4)], dtype)
    sess = make_session(adam_model([(3, 4)], dtype, r_dtype=r_dtype, **NON_DEFAULT))
    # An R that float32 cannot hold exactly: with a double R it is used as given.
    r = np.array(0.0123456789, dtype=r_dtype)
    outs = run(sess, r, 5, xs, gs, vs, hs)
    assert [o.dtype for o in outs] == [np.dtype(dtype)] * 3
    assert_matches_reference(outs, r, 5, xs, gs, vs, hs, **NON_DEFAULT)


# --- shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
def test_several_tensors(make_session, rng, dtype):
    shapes = [(3,), (2, 5), (4, 1, 3)]
    xs, gs, vs, hs = groups(rng, shapes, dtype)
    sess = make_session(adam_model(shapes, dtype, alpha=0.85, norm_coefficient=0.01))
    outs = run(sess, 0.1, 7, xs, gs, vs, hs)
    assert_matches_reference(outs, 0.1, 7, xs, gs, vs, hs, alpha=0.85, norm_coefficient=0.01)
    # Each group on its own gives the same bits as inside the 3-tensor node.
    for i, shape in enumerate(shapes):
        one = run(make_session(adam_model([shape], dtype, alpha=0.85, norm_coefficient=0.01)),
                  0.1, 7, [xs[i]], [gs[i]], [vs[i]], [hs[i]])
        for k in range(3):
            assert same_bits(one[k], outs[k * len(shapes) + i])


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("g_shape", [(5,), (1, 5), (), (2, 1), (1,), (1, 1)], ids=str)
def test_broadcast_gradient(make_session, rng, dtype, g_shape):
    x, _, v, h = group(rng, (2, 5), dtype)
    g = rng.standard_normal(g_shape).astype(dtype)
    sess = make_session(adam_model([(2, 5)], dtype, g_shapes=[g_shape], norm_coefficient=0.1))
    outs = run(sess, 0.1, 2, [x], [g], [v], [h])
    assert_matches_reference(outs, 0.1, 2, [x], [g], [v], [h], norm_coefficient=0.1)


def test_broadcast_gradient_several_tensors(make_session, rng):
    shapes = [(3,), (2, 5), (4, 1, 3)]
    g_shapes = [(1,), (5,), (1, 3)]
    xs, gs, vs, hs = groups(rng, shapes, F32, g_shapes)
    sess = make_session(adam_model(shapes, g_shapes=g_shapes))
    outs = run(sess, 0.1, 1, xs, gs, vs, hs)
    assert_matches_reference(outs, 0.1, 1, xs, gs, vs, hs)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_zero_element_tensors(make_session, rng, dtype):
    shapes = [(0,), (3, 0), (4,)]
    xs, gs, vs, hs = groups(rng, shapes, dtype)
    sess = make_session(adam_model(shapes, dtype))
    outs = run(sess, 0.1, 1, xs, gs, vs, hs)
    assert [o.shape for o in outs] == shapes * 3
    assert_matches_reference(outs, 0.1, 1, xs, gs, vs, hs)


def test_zero_element_only(make_session, rng):
    shapes = [(0,), (3, 0)]
    xs, gs, vs, hs = groups(rng, shapes, F32, [(1,), (0,)])  # G broadcast onto empty X too
    sess = make_session(adam_model(shapes, g_shapes=[(1,), (0,)]))
    outs = run(sess, 0.1, 1, xs, gs, vs, hs)
    assert [o.shape for o in outs] == shapes * 3
    assert all(o.dtype == np.float32 for o in outs)


@pytest.mark.parametrize("r_shape", [(), (1,), (1, 1)], ids=str)
@pytest.mark.parametrize("t_shape", [(), (1,), (1, 1)], ids=str)
def test_r_and_t_rank(make_session, rng, r_shape, t_shape):
    xs, gs, vs, hs = groups(rng, [(6,)], F32)
    sess = make_session(adam_model([(6,)], r_shape=r_shape, t_shape=t_shape))
    r = np.full(r_shape, 0.1, dtype=F32)
    t = np.full(t_shape, 5, dtype=np.int64)
    outs = run(sess, r, t, xs, gs, vs, hs)
    assert_matches_reference(outs, r, t, xs, gs, vs, hs)


# --- aliasing and inputs -----------------------------------------------------------------

def _inplace(sess, feeds, n):
    """Run with X_i_new/V_i_new/H_i_new bound to X_i/V_i/H_i's own OrtValues."""
    import onnxruntime as ort

    values = {k: ort.OrtValue.ortvalue_from_numpy(np.array(a, copy=True)) for k, a in feeds.items()}
    binding = sess.io_binding()
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    names = [f"{p}_{i}" for p in "XVH" for i in range(1, n + 1)]
    for name in names:
        binding.bind_ortvalue_output(f"{name}_new", values[name])
    sess.run_with_iobinding(binding)
    bound = binding.get_outputs()
    for name, out in zip(names, bound):
        # The kernel really got output buffer == input buffer.
        assert out.data_ptr() == values[name].data_ptr(), name
    return [values[name].numpy() for name in names], values


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_inplace_iobinding_equals_out_of_place(make_session, rng, dtype, threads):
    shapes = [(3,), (2, 5), (4, 1, 3), (300_001,)]
    g_shapes = [(3,), (1, 5), (4, 1, 3), (300_001,)]
    xs, gs, vs, hs = groups(rng, shapes, dtype, g_shapes)
    sess = make_session(adam_model(shapes, dtype, g_shapes=g_shapes, **NON_DEFAULT),
                        threads=threads)
    feeds = adam_feeds(0.1, 3, xs, gs, vs, hs)
    expected = sess.run(None, feeds)
    actual, values = _inplace(sess, feeds, len(shapes))
    for name, a, e in zip([f"{p}_{i}" for p in "XVH" for i in range(1, 5)], actual, expected):
        assert same_bits(a, e), f"{name}: in-place differs from out-of-place"
    # R, T and G were inputs only.
    for name in ["R", "T"] + [f"G_{i}" for i in range(1, 5)]:
        assert same_bits(values[name].numpy(), feeds[name]), f"{name} was written"


def test_inplace_repeated_steps(make_session, rng):
    shapes = [(4,), (3, 3)]
    xs, gs, vs, hs = groups(rng, shapes, F64)
    sess = make_session(adam_model(shapes, F64))
    import onnxruntime as ort

    values = {}
    for k, arrs in zip("XGVH", (xs, gs, vs, hs)):
        for i, a in enumerate(arrs, 1):
            values[f"{k}_{i}"] = ort.OrtValue.ortvalue_from_numpy(a.copy())
    ref_x, ref_v, ref_h = list(xs), list(vs), list(hs)
    for t in range(1, 6):
        r = np.array(0.1, F64)
        tt = np.array(t, np.int64)
        binding = sess.io_binding()
        binding.bind_cpu_input("R", r)
        binding.bind_cpu_input("T", tt)
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        for p in "XVH":
            for i in (1, 2):
                binding.bind_ortvalue_output(f"{p}_{i}_new", values[f"{p}_{i}"])
        sess.run_with_iobinding(binding)
        out = adam_ref(r, t, ref_x, gs, ref_v, ref_h)
        ref_x, ref_v, ref_h = out[0:2], out[2:4], out[4:6]
    for i in (1, 2):
        for p, ref in (("X", ref_x), ("V", ref_v), ("H", ref_h)):
            np.testing.assert_allclose(values[f"{p}_{i}"].numpy(), ref[i - 1],
                                       rtol=1e-10, atol=1e-12, err_msg=f"{p}_{i}")


@pytest.mark.parametrize("threads", [1, 2])
def test_inputs_not_written(make_session, rng, threads):
    shapes = [(2, 5), (300_000,)]
    xs, gs, vs, hs = groups(rng, shapes, F32)
    feeds = adam_feeds(0.1, 2, xs, gs, vs, hs)
    before = {k: np.array(a, copy=True) for k, a in feeds.items()}
    sess = make_session(adam_model(shapes, **NON_DEFAULT), threads=threads)
    outs = sess.run(None, feeds)  # numpy inputs are passed zero-copy
    for name, a in feeds.items():
        assert same_bits(a, before[name]), f"input {name} was written"
    assert_matches_reference(outs, 0.1, 2, xs, gs, vs, hs, **NON_DEFAULT)


# --- threads -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F64])
def test_thread_count_bitwise_equal(make_session, rng, dtype):
    shapes = [(300_000,), (1000, 301), (5,)]
    g_shapes = [(300_000,), (301,), (5,)]
    xs, gs, vs, hs = groups(rng, shapes, dtype, g_shapes)
    model = adam_model(shapes, dtype, g_shapes=g_shapes, **NON_DEFAULT)
    results = run_thread_counts(make_session, model, adam_feeds(0.01, 9, xs, gs, vs, hs))
    assert_matches_reference(results[2], 0.01, 9, xs, gs, vs, hs, **NON_DEFAULT)


def test_float32_against_float64_reference(make_session, rng):
    shapes = [(257,), (64, 33), (10_007,)]
    xs, gs, vs, hs = groups(rng, shapes, F32)
    attrs = {"alpha": 0.93, "beta": 0.995, "epsilon": 1e-5, "norm_coefficient": 0.02,
             "norm_coefficient_post": 0.001}
    sess = make_session(adam_model(shapes, **attrs))
    for t in (1, 17, 5000):
        outs = run(sess, 0.003, t, xs, gs, vs, hs)
        assert [o.dtype for o in outs] == [np.dtype(F32)] * 9
        assert_matches_reference(outs, 0.003, t, xs, gs, vs, hs, **attrs)


def test_matches_onnx_reference_evaluator(make_session, rng):
    """Values (not dtypes: onnx's evaluator promotes to float64 when T > 0)."""
    from onnx.reference import ReferenceEvaluator

    shapes = [(3,), (2, 4)]
    xs, gs, vs, hs = groups(rng, shapes, F32)
    model = adam_model(shapes, alpha=0.9, beta=0.99, norm_coefficient=0.01)
    feeds = adam_feeds(0.1, 4, xs, gs, vs, hs)
    ours = make_session(model).run(None, feeds)
    theirs = ReferenceEvaluator(model).run(None, feeds)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=1e-5, atol=1e-6,
                                   err_msg=f"output {k}")
