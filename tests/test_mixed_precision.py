"""Mixed precision: Adam on float16/bfloat16 tensors and on float32 weights with
16-bit gradients, com.trainops::MixedPrecisionAdam, trainops.Policy, trainops.optimizer_model
and the bfloat16 I/O helpers, against the independent references in helpers/references.py.

bfloat16 tensors go in and out through trainops.run / to_ortvalue (onnxruntime's numpy
bridge has no bfloat16)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import trainops
from helpers.checks import TOLERANCES, assert_adam16_matches, assert_matches_reference, same_bits
from helpers.data import BF16, COPY_TYPES, F16, F32, F64, group, groups
from helpers.references import adam as adam_ref
from helpers.references import adam16, dynamic_loss_scale, mixed_precision_adam, unscale, wide
from trainops import Policy, from_ortvalue, optimizer_model, run, to_ortvalue
from trainops.models import (adam_feeds, adam_model, mixed_precision_adam_feeds,
                             mixed_precision_adam_model, mixed_precision_adam_names)

NON_DEFAULT = {
    "alpha": 0.5,
    "beta": 0.75,
    "epsilon": 0.25,
    "norm_coefficient": 0.3,
    "norm_coefficient_post": 0.125,
}
HALF = [F16, BF16]
HALF_IDS = ["float16", "bfloat16"]


def rel_close(out, ref, name, dtype=F32):
    """float32 output against a float64 reference, with helpers.checks' float32 tolerance."""
    rtol, atol = TOLERANCES[np.dtype(dtype)]
    ref = np.asarray(ref, np.float64)
    scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
    np.testing.assert_allclose(wide(out), ref, rtol=rtol, atol=atol * scale, err_msg=name)


# =========================================================================================
# bfloat16 I/O helpers
# =========================================================================================

def test_ortvalue_round_trip_every_dtype(rng):
    for dtype in (F16, BF16, F32, F64, np.dtype(np.int64), np.dtype(np.bool_)):
        a = (rng.standard_normal((3, 4)) * 100).astype(dtype)
        v = to_ortvalue(a)
        if dtype == BF16:
            assert v.data_type() == "tensor(bfloat16)"
        back = from_ortvalue(v)
        assert same_bits(back, a), dtype
        assert same_bits(from_ortvalue(v, dtype), a)


def test_ortvalue_shares_memory_and_checks_dtype():
    a = np.arange(6, dtype=np.float32).astype(BF16).reshape(2, 3)
    v = to_ortvalue(a)
    assert v.data_ptr() == a.ctypes.data  # bound in place, not copied
    assert v.shape() == [2, 3]
    with pytest.raises(TypeError, match="bfloat16"):
        from_ortvalue(v, np.float16)
    assert from_ortvalue(to_ortvalue(np.zeros((0, 3), BF16))).shape == (0, 3)


def test_plain_onnxruntime_rejects_bfloat16_numpy(make_session):
    """The reason for the helpers: onnxruntime's numpy bridge has no bfloat16."""
    sess = make_session(adam_model([(3,)], BF16, r_dtype=F32))
    x = np.ones(3, BF16)
    with pytest.raises(Exception):
        sess.run(None, adam_feeds(np.float32(0.1), 1, [x], [x], [x], [x]))
    outs = run(sess, adam_feeds(np.float32(0.1), 1, [x], [x], [x], [x]))
    assert [o.dtype for o in outs] == [BF16] * 3


def test_run_output_selection_and_order(make_session, rng):
    xs, gs, vs, hs = groups(rng, [(4,)], BF16)
    sess = make_session(adam_model([(4,)], BF16, r_dtype=F32))
    feeds = adam_feeds(np.float32(0.1), 2, xs, gs, vs, hs)
    every = run(sess, feeds)
    some = run(sess, feeds, ["H_1_new", "X_1_new"])
    assert same_bits(some[0], every[2]) and same_bits(some[1], every[0])
    # unknown shapes: ORT allocates, the helper reads the bfloat16 buffer back
    dyn = make_session(adam_model(1, BF16, r_dtype=F32, dynamic=True))
    assert all(same_bits(a, b) for a, b in zip(run(dyn, feeds), every))
    with pytest.raises(KeyError, match="nope"):
        run(sess, feeds, ["nope"])


# =========================================================================================
# ai.onnx.preview.training::Adam on float16 / bfloat16 tensors
# =========================================================================================

@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("t", [0, 1, 5, 1000])
@pytest.mark.parametrize("r_dtype", [F32, F64], ids=["R_float", "R_double"])
def test_adam16_defaults(make_session, rng, dtype, t, r_dtype):
    shapes = [(7,), (3, 33)]
    xs, gs, vs, hs = groups(rng, shapes, dtype)
    sess = make_session(adam_model(shapes, dtype, r_dtype=r_dtype))
    r = np.array(0.01, r_dtype)
    outs = run(sess, adam_feeds(r, t, xs, gs, vs, hs))
    assert [o.dtype for o in outs] == [dtype] * 6
    assert_adam16_matches(outs, r, t, xs, gs, vs, hs)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_adam16_attributes(make_session, rng, dtype):
    shapes = [(5, 7), (130,)]
    xs, gs, vs, hs = groups(rng, shapes, dtype)
    sess = make_session(adam_model(shapes, dtype, r_dtype=F32, **NON_DEFAULT))
    for t in (0, 1, 4):
        outs = run(sess, adam_feeds(np.float32(0.02), t, xs, gs, vs, hs))
        assert_adam16_matches(outs, np.float32(0.02), t, xs, gs, vs, hs, **NON_DEFAULT)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_adam16_large_and_small_magnitudes(make_session, rng, dtype):
    """Values spanning the 16-bit range: subnormal-sized moments, large weights."""
    n = 257
    x = (rng.standard_normal(n) * np.logspace(-3, 3, n)).astype(dtype)
    g = (rng.standard_normal(n) * np.logspace(2, -6, n)).astype(dtype)
    v = (rng.standard_normal(n) * 1e-3).astype(dtype)
    h = (rng.random(n) * np.logspace(-8, 0, n)).astype(dtype)
    sess = make_session(adam_model([(n,)], dtype, r_dtype=F32, beta=0.99))
    outs = run(sess, adam_feeds(np.float32(0.1), 3, [x], [g], [v], [h]))
    assert_adam16_matches(outs, np.float32(0.1), 3, [x], [g], [v], [h], beta=0.99)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_adam16_rounds_to_nearest_even(make_session, dtype):
    """With alpha = 0.5, ``v' = (v + g) / 2`` is exact in f32 and can land exactly half way
    between two 16-bit values: ties go to the even neighbour (not truncated, not away)."""
    ulp = 2.0 ** -10 if dtype == F16 else 2.0 ** -7
    # v' = 1 + ulp/2: tie between 1 (even) and 1 + ulp (odd) -> 1
    # v' = 1 + 3ulp/2: tie between 1 + ulp (odd) and 1 + 2ulp (even) -> 1 + 2ulp
    # v' = -(1 + 3ulp/2): the same, negative -> -(1 + 2ulp)
    v = np.array([1.0, 1.0 + ulp, -(1.0 + ulp)], np.float64).astype(dtype)
    g = np.array([1.0 + ulp, 1.0 + 2 * ulp, -(1.0 + 2 * ulp)], np.float64).astype(dtype)
    x = np.zeros(3, dtype)
    h = np.ones(3, dtype)
    sess = make_session(adam_model([(3,)], dtype, r_dtype=F32, alpha=0.5))
    outs = run(sess, adam_feeds(np.float32(0.0), 0, [x], [g], [v], [h]))
    expected = np.array([1.0, 1.0 + 2 * ulp, -(1.0 + 2 * ulp)]).astype(dtype)
    assert same_bits(outs[1], expected), f"V_1_new {wide(outs[1])}, expected {wide(expected)}"


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("g_shape", [(5,), (1, 5), (), (2, 1)], ids=str)
def test_adam16_broadcast_gradient(make_session, rng, dtype, g_shape):
    x, _, v, h = group(rng, (2, 5), dtype)
    g = rng.standard_normal(g_shape).astype(dtype)
    sess = make_session(adam_model([(2, 5)], dtype, r_dtype=F32, g_shapes=[g_shape],
                                   norm_coefficient=0.1))
    outs = run(sess, adam_feeds(np.float32(0.1), 2, [x], [g], [v], [h]))
    assert_adam16_matches(outs, np.float32(0.1), 2, [x], [g], [v], [h], norm_coefficient=0.1)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_adam16_zero_element(make_session, rng, dtype):
    shapes = [(0,), (3, 0), (4,)]
    xs, gs, vs, hs = groups(rng, shapes, dtype)
    sess = make_session(adam_model(shapes, dtype, r_dtype=F32))
    outs = run(sess, adam_feeds(np.float32(0.1), 1, xs, gs, vs, hs))
    assert [o.shape for o in outs] == shapes * 3
    assert_adam16_matches(outs, np.float32(0.1), 1, xs, gs, vs, hs)


@pytest.mark.parametrize("g_dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("t", [0, 1, 7])
def test_adam_float32_weights_16bit_gradient(make_session, rng, g_dtype, t):
    shapes = [(9,), (4, 33)]
    xs, _, vs, hs = groups(rng, shapes, F32)
    gs = [rng.standard_normal(s).astype(g_dtype) for s in shapes]
    sess = make_session(adam_model(shapes, F32, g_dtype=g_dtype, alpha=0.85,
                                   norm_coefficient=0.01))
    outs = run(sess, adam_feeds(0.05, t, xs, gs, vs, hs))
    assert [o.dtype for o in outs] == [F32] * 6
    assert_matches_reference(outs, 0.05, t, xs, [wide(g) for g in gs], vs, hs,
                             alpha=0.85, norm_coefficient=0.01)


@pytest.mark.parametrize("g_dtype", HALF, ids=HALF_IDS)
def test_adam_float32_weights_16bit_gradient_broadcast(make_session, rng, g_dtype):
    x, _, v, h = group(rng, (3, 4), F32)
    g = rng.standard_normal((1, 4)).astype(g_dtype)
    sess = make_session(adam_model([(3, 4)], F32, g_dtype=g_dtype, g_shapes=[(1, 4)]))
    outs = run(sess, adam_feeds(0.1, 2, [x], [g], [v], [h]))
    assert_matches_reference(outs, 0.1, 2, [x], [wide(g)], [v], [h])


def test_adam_groups_of_different_types_in_one_node(make_session, rng):
    """'One type within a group i apart from that gradient; groups may differ.'"""
    kinds = [(F16, F16), (BF16, BF16), (F32, F32), (F32, F16), (F32, BF16), (F64, F64)]
    shapes = [(5,), (3, 2), (7,), (4,), (2, 3), (6,)]
    data = [group(rng, s, xd) for s, (xd, _) in zip(shapes, kinds)]
    xs = [d[0] for d in data]
    gs = [rng.standard_normal(s).astype(gd) for s, (_, gd) in zip(shapes, kinds)]
    vs = [d[2] for d in data]
    hs = [d[3] for d in data]
    from trainops.models import node_model

    n = len(kinds)
    inputs = [("R", F32, ()), ("T", np.int64, ())]
    inputs += [(f"X_{i + 1}", kinds[i][0], shapes[i]) for i in range(n)]
    inputs += [(f"G_{i + 1}", kinds[i][1], shapes[i]) for i in range(n)]
    inputs += [(f"{p}_{i + 1}", kinds[i][0], shapes[i]) for p in "VH" for i in range(n)]
    outputs = [(f"{p}_{i + 1}_new", kinds[i][0], shapes[i]) for p in "XVH" for i in range(n)]
    sess = make_session(node_model("Adam", inputs, outputs, alpha=0.8))
    outs = run(sess, adam_feeds(np.float32(0.05), 3, xs, gs, vs, hs))
    for i, (xd, gd) in enumerate(kinds):
        one = [outs[i], outs[n + i], outs[2 * n + i]]
        args = (np.float32(0.05), 3, [xs[i]], [gs[i]], [vs[i]], [hs[i]])
        if xd in (F16, BF16):
            assert_adam16_matches(one, *args, alpha=0.8)
        else:
            assert_matches_reference(one, np.float32(0.05), 3, [xs[i]], [wide(gs[i])], [vs[i]],
                                     [hs[i]], dtype=xd, alpha=0.8)


def _bind_inplace(sess, feeds, pairs):
    """IOBinding with each (output, input) pair bound to the input's OrtValue."""
    keep = {k: np.array(a, copy=True) for k, a in feeds.items()}
    values = {k: to_ortvalue(a) for k, a in keep.items()}
    binding = sess.io_binding()
    for k, v in values.items():
        binding.bind_ortvalue_input(k, v)
    for out, inp in pairs:
        binding.bind_ortvalue_output(out, values[inp])
    return binding, values, keep


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_adam16_inplace_equals_out_of_place(make_session, rng, dtype, threads):
    shapes = [(3,), (2, 5), (200_003,)]
    xs, gs, vs, hs = groups(rng, shapes, dtype)
    sess = make_session(adam_model(shapes, dtype, r_dtype=F32, **NON_DEFAULT), threads=threads)
    feeds = adam_feeds(np.float32(0.1), 3, xs, gs, vs, hs)
    expected = run(sess, feeds)
    names = [f"{p}_{i}" for p in "XVH" for i in range(1, 4)]
    binding, values, keep = _bind_inplace(sess, feeds, [(n + "_new", n) for n in names])
    sess.run_with_iobinding(binding)
    for name, e in zip(names, expected):
        assert same_bits(keep[name], e), f"{name}: in place differs from out of place"
    for name in ["R", "T", "G_1", "G_2", "G_3"]:
        assert same_bits(keep[name], feeds[name]), f"{name} was written"


@pytest.mark.parametrize("dtype", HALF + [F32], ids=HALF_IDS + ["float32_with_bf16_grad"])
def test_adam16_thread_count_bitwise_equal(make_session, rng, dtype):
    shapes = [(300_000,), (513, 301)]
    g_dtype = BF16 if dtype == F32 else dtype
    xs, _, vs, hs = groups(rng, shapes, dtype)
    gs = [rng.standard_normal(s).astype(g_dtype) for s in shapes]
    model = adam_model(shapes, dtype, r_dtype=F32, g_dtype=g_dtype, **NON_DEFAULT)
    feeds = adam_feeds(np.float32(0.01), 9, xs, gs, vs, hs)
    results = [run(make_session(model, threads=k), feeds) for k in (1, 2, 3)]
    for k, res in zip((2, 3), results[1:]):
        for i, (a, b) in enumerate(zip(results[0], res)):
            assert same_bits(a, b), f"output {i}: {k} threads differ from 1"


# =========================================================================================
# com.trainops::MixedPrecisionAdam
# =========================================================================================

MP_SHAPES = [(7,), (3, 11), (40,)]


def mp_data(rng, shapes, g_dtype, loss_scale=1.0, spread=1.0):
    """X/V/H float32, G = (true gradient * loss_scale) in g_dtype (G may be per tensor);
    the true gradient is clipped to +-1.5 so that G stays finite in float16 up to 2^15."""
    g_dtypes = g_dtype if isinstance(g_dtype, list) else [g_dtype] * len(shapes)
    xs, _, vs, hs = groups(rng, shapes, F32)
    gs = [(np.clip(rng.standard_normal(s), -1.5, 1.5) * spread * loss_scale).astype(gd)
          for s, gd in zip(shapes, g_dtypes)]
    return xs, gs, vs, hs


def check_mixed(outs, r, t, loss_scale, xs, gs, vs, hs, copy_dtype=0, **attrs):
    """outs = [finite, X_new.., V_new.., H_new.., (X_copy..)] against the reference."""
    n = len(xs)
    finite, refs = mixed_precision_adam(r, t, loss_scale, xs, gs, vs, hs, copy_dtype, **attrs)
    assert len(outs) == 1 + 3 * n + (n if copy_dtype else 0)
    flag = outs[0]
    assert flag.dtype == np.bool_ and flag.shape == (), f"finite: {flag.dtype} {flag.shape}"
    assert bool(flag) == finite, f"finite is {bool(flag)}, expected {finite}"
    names = mixed_precision_adam_names(n, bool(copy_dtype))[1][1:]
    for k, (name, out, ref) in enumerate(zip(names, outs[1:], refs)):
        if k < 3 * n:
            assert out.dtype == F32 and out.shape == xs[k % n].shape, name
            if finite:
                rel_close(out, ref, name)
            else:
                assert same_bits(out, ref), f"{name}: changed although the step was skipped"
        else:
            i = k - 3 * n
            want = COPY_TYPES[copy_dtype]
            assert out.dtype == want and out.shape == xs[i].shape, name
            # The copy is the kernel's own X_new cast to 16 bits (round to nearest even).
            assert same_bits(out, outs[1 + i].astype(want)), f"{name} is not cast(X_{i + 1}_new)"
    return finite


@pytest.mark.parametrize("g_dtype", [F16, BF16, F32], ids=["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0, 3.0, 2.0 ** 15, 0.375])
def test_mixed_unscales_and_updates(make_session, rng, g_dtype, loss_scale):
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, g_dtype, loss_scale)
    sess = make_session(mixed_precision_adam_model(MP_SHAPES, g_dtype, alpha=0.8, beta=0.99))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 4, loss_scale, xs, gs, vs, hs))
    assert check_mixed(outs, 0.01, 4, loss_scale, xs, gs, vs, hs, alpha=0.8, beta=0.99)


@pytest.mark.parametrize("g_dtype", HALF, ids=HALF_IDS)
def test_mixed_unscaling_is_a_float32_division(make_session, rng, g_dtype):
    """g = G / loss_scale in float32, not G * (1/loss_scale): with loss_scale 3 the two
    differ in the last bit for some elements, and the update with a huge epsilon is
    linear in g, which makes that bit visible in V_new = (1 - alpha) * g."""
    n = 4096
    g = (rng.standard_normal(n) * 3).astype(g_dtype)
    x = np.zeros(n, F32)
    v = np.zeros(n, F32)
    h = np.zeros(n, F32)
    div = unscale(g, 3.0)
    mul = g.astype(F32) * (np.float32(1) / np.float32(3))
    assert np.any(div != mul)  # the case distinguishes the two
    # alpha = 0: V_new = g exactly.
    sess = make_session(mixed_precision_adam_model([(n,)], g_dtype, alpha=0.0))
    outs = run(sess, mixed_precision_adam_feeds(0.0, 1, 3.0, [x], [g], [v], [h]))
    assert bool(outs[0])
    assert same_bits(outs[2], div), "V_1_new (alpha = 0) is not G / 3 in float32"


@pytest.mark.parametrize("t", [0, 1, 10])
def test_mixed_attributes(make_session, rng, t):
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, F16, 512.0)
    sess = make_session(mixed_precision_adam_model(MP_SHAPES, F16, **NON_DEFAULT))
    outs = run(sess, mixed_precision_adam_feeds(0.02, t, 512.0, xs, gs, vs, hs))
    assert check_mixed(outs, 0.02, t, 512.0, xs, gs, vs, hs, **NON_DEFAULT)


@pytest.mark.parametrize("copy_dtype", [10, 16])
@pytest.mark.parametrize("g_dtype", [F16, BF16, F32], ids=["float16", "bfloat16", "float32"])
def test_mixed_copies(make_session, rng, copy_dtype, g_dtype):
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, g_dtype, 64.0)
    sess = make_session(mixed_precision_adam_model(MP_SHAPES, g_dtype, copy_dtype))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 2, 64.0, xs, gs, vs, hs))
    assert len(outs) == 1 + 4 * len(MP_SHAPES)
    assert check_mixed(outs, 0.01, 2, 64.0, xs, gs, vs, hs, copy_dtype)


@pytest.mark.parametrize("copy_dtype", [None, 0], ids=["omitted", "zero"])
def test_mixed_no_copies(make_session, rng, copy_dtype):
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, F16, 8.0)
    model = mixed_precision_adam_model(MP_SHAPES, F16, copy_dtype)
    assert len(model.graph.output) == 1 + 3 * len(MP_SHAPES)
    sess = make_session(model)
    assert len(sess.get_outputs()) == 1 + 3 * len(MP_SHAPES)
    outs = run(sess, mixed_precision_adam_feeds(0.01, 2, 8.0, xs, gs, vs, hs))
    assert check_mixed(outs, 0.01, 2, 8.0, xs, gs, vs, hs)


@pytest.mark.parametrize("g_shape", [(1, 5), (5,), (), (2, 1)], ids=str)
@pytest.mark.parametrize("g_dtype", [F16, BF16], ids=HALF_IDS)
def test_mixed_broadcast_gradient(make_session, rng, g_shape, g_dtype):
    """Section 1's shapes: G unidirectionally broadcastable to X; a non-finite element of
    a broadcast G skips the step too."""
    x, _, v, h = group(rng, (2, 5), F32)
    g = np.asarray(rng.standard_normal(g_shape) * 64).astype(g_dtype)
    sess = make_session(mixed_precision_adam_model(1, g_dtype, 10, dynamic=True))
    outs = run(sess, mixed_precision_adam_feeds(0.1, 2, 64.0, [x], [g], [v], [h]))
    assert check_mixed(outs, 0.1, 2, 64.0, [x], [g], [v], [h], 10)
    g.reshape(-1)[-1] = np.inf
    outs = run(sess, mixed_precision_adam_feeds(0.1, 2, 64.0, [x], [g], [v], [h]))
    assert not check_mixed(outs, 0.1, 2, 64.0, [x], [g], [v], [h], 10)


def test_mixed_gradient_types_may_differ_per_tensor(make_session, rng):
    g_dtypes = [F16, BF16, F32]
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, g_dtypes, 16.0)
    sess = make_session(mixed_precision_adam_model(MP_SHAPES, g_dtypes, 16))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 3, 16.0, xs, gs, vs, hs))
    assert check_mixed(outs, 0.01, 3, 16.0, xs, gs, vs, hs, 16)


BAD_VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@pytest.mark.parametrize("bad", sorted(BAD_VALUES))
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("g_dtype", [F16, BF16, F32], ids=["float16", "bfloat16", "float32"])
def test_mixed_one_verdict_for_the_node(make_session, rng, bad, which, where, g_dtype):
    """A non-finite value in one gradient of one tensor skips the whole node: every
    output equals its input bit for bit, the copies are cast(X), finite is false."""
    shapes = [(7,), (3, 11), (300,)]
    xs, gs, vs, hs = mp_data(rng, shapes, g_dtype, 4.0)
    flat = gs[which].reshape(-1)
    pos = {"first": 0, "middle": flat.size // 2, "last": flat.size - 1}[where]
    flat[pos] = BAD_VALUES[bad]
    sess = make_session(mixed_precision_adam_model(shapes, g_dtype, 10, **NON_DEFAULT))
    outs = run(sess, mixed_precision_adam_feeds(0.1, 5, 4.0, xs, gs, vs, hs))
    assert not check_mixed(outs, 0.1, 5, 4.0, xs, gs, vs, hs, 10, **NON_DEFAULT)


@pytest.mark.parametrize("copy_dtype", [0, 10, 16])
def test_mixed_skip_bitwise_with_awkward_values(make_session, copy_dtype):
    """Skipped: -0.0, subnormals and NaN payloads in X/V/H come back bit for bit."""
    bits = np.array([0x80000000, 0x00000001, 0x7FC00123, 0xFF800000, 0x3F800001], np.uint32)
    x = bits.view(np.float32).copy()
    v = bits[::-1].copy().view(np.float32)
    h = np.array([0.0, 1e-45, 3.0, np.inf, np.nan], F32)
    g = np.array([1, 2, np.inf, 4, 5], F16)
    sess = make_session(mixed_precision_adam_model([(5,)], F16, copy_dtype or None))
    outs = run(sess, mixed_precision_adam_feeds(0.1, 1, 1.0, [x], [g], [v], [h]))
    assert not bool(outs[0])
    for name, out, inp in zip(["X_1_new", "V_1_new", "H_1_new"], outs[1:4], [x, v, h]):
        assert same_bits(out, inp), name
    if copy_dtype:
        assert outs[4].dtype == COPY_TYPES[copy_dtype]
        # cast(X): compare as values (NaN payloads may differ after a cast), NaN where NaN
        want = x.astype(COPY_TYPES[copy_dtype])
        assert np.array_equal(wide(outs[4]), wide(want), equal_nan=True)
        assert np.array_equal(np.signbit(wide(outs[4])), np.signbit(wide(want)))


@pytest.mark.parametrize("g_dtype", [F16, BF16], ids=HALF_IDS)
def test_mixed_overflow_from_tiny_loss_scale(make_session, rng, g_dtype):
    """A finite G can overflow float32 once divided by a small scale: the step is skipped.
    Only one element overflows here; with a larger scale none does (and g * g stays
    finite in float32 too, so that the float32 kernel and the float64 reference agree)."""
    shapes = [(64,), (5,)]
    xs, _, vs, hs = groups(rng, shapes, F32)
    gs = [np.ones(s).astype(g_dtype) for s in shapes]
    big = np.float32(65504.0) if g_dtype == F16 else np.float32(2.0 ** 120)
    gs[0][17] = big
    assert all(np.all(np.isfinite(wide(g))) for g in gs)
    # big / ls > float32 max, 1 / ls finite
    ls_over = np.float32(2.0 ** -113) if g_dtype == F16 else np.float32(2.0 ** -9)
    ls_fine = np.float32(2.0 ** -40) if g_dtype == F16 else np.float32(2.0 ** 60)
    assert not np.isfinite(unscale(gs[0], ls_over)).all()
    assert np.isfinite(unscale(gs[0], ls_fine)).all()
    sess = make_session(mixed_precision_adam_model(shapes, g_dtype, 10))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 1, ls_over, xs, gs, vs, hs))
    assert not check_mixed(outs, 0.01, 1, ls_over, xs, gs, vs, hs, 10)
    outs = run(sess, mixed_precision_adam_feeds(0.01, 1, ls_fine, xs, gs, vs, hs))
    assert check_mixed(outs, 0.01, 1, ls_fine, xs, gs, vs, hs, 10)


@pytest.mark.parametrize("loss_scale", [0.0, np.nan, -0.0], ids=["zero", "nan", "minus_zero"])
def test_mixed_degenerate_loss_scale_skips(make_session, rng, loss_scale):
    """G / 0 is inf (or nan for G = 0), G / nan is nan: not finite, skipped."""
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, F16, 1.0)
    sess = make_session(mixed_precision_adam_model(MP_SHAPES, F16, 16))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 1, loss_scale, xs, gs, vs, hs))
    assert not check_mixed(outs, 0.01, 1, loss_scale, xs, gs, vs, hs, 16)


def test_mixed_zero_element_tensors(make_session, rng):
    shapes = [(0,), (3, 0), (4,)]
    xs, gs, vs, hs = mp_data(rng, shapes, F16, 2.0)
    sess = make_session(mixed_precision_adam_model(shapes, F16, 10))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 1, 2.0, xs, gs, vs, hs))
    assert check_mixed(outs, 0.01, 1, 2.0, xs, gs, vs, hs, 10)
    assert [o.shape for o in outs[1:]] == shapes * 4
    # only empty tensors: finite (nothing is non-finite)
    shapes = [(0,), (2, 0)]
    xs, gs, vs, hs = mp_data(rng, shapes, BF16, 2.0)
    sess = make_session(mixed_precision_adam_model(shapes, BF16, 16))
    outs = run(sess, mixed_precision_adam_feeds(0.01, 1, 2.0, xs, gs, vs, hs))
    assert check_mixed(outs, 0.01, 1, 2.0, xs, gs, vs, hs, 16)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=str)
def test_mixed_scalar_inputs_any_rank(make_session, rng, shape):
    xs, gs, vs, hs = mp_data(rng, MP_SHAPES, F16, 8.0)
    sess = make_session(mixed_precision_adam_model(MP_SHAPES, F16, loss_scale_shape=shape))
    feeds = mixed_precision_adam_feeds(0.01, 2, np.full(shape, 8.0, F32), xs, gs, vs, hs)
    assert check_mixed(run(sess, feeds), 0.01, 2, 8.0, xs, gs, vs, hs)


@pytest.mark.parametrize("threads", [1, 2])
def test_mixed_inplace_equals_out_of_place(make_session, rng, threads):
    shapes = [(3,), (2, 5), (200_003,)]
    xs, gs, vs, hs = mp_data(rng, shapes, BF16, 1.0)
    sess = make_session(mixed_precision_adam_model(shapes, BF16, 16, **NON_DEFAULT),
                        threads=threads)
    feeds = mixed_precision_adam_feeds(0.1, 3, 1.0, xs, gs, vs, hs)
    expected = run(sess, feeds)
    names = [f"{p}_{i}" for p in "XVH" for i in range(1, 4)]
    binding, values, keep = _bind_inplace(sess, feeds, [(n + "_new", n) for n in names])
    binding.bind_output("finite", "cpu")
    copies = [np.zeros(s, BF16) for s in shapes]
    copy_values = [to_ortvalue(c) for c in copies]
    for i, v in enumerate(copy_values, 1):
        binding.bind_ortvalue_output(f"X_{i}_copy", v)
    sess.run_with_iobinding(binding)
    for name, e in zip(names, expected[1:]):
        assert same_bits(keep[name], e), f"{name}: in place differs from out of place"
    for c, e in zip(copies, expected[10:]):
        assert same_bits(c, e)
    for name in ["R", "T", "loss_scale", "G_1", "G_2", "G_3"]:
        assert same_bits(keep[name], feeds[name]), f"{name} was written"


def test_mixed_thread_count_bitwise_equal(make_session, rng):
    shapes = [(300_000,), (513, 301)]
    xs, gs, vs, hs = mp_data(rng, shapes, F16, 1024.0)
    model = mixed_precision_adam_model(shapes, F16, 10, **NON_DEFAULT)
    feeds = mixed_precision_adam_feeds(0.01, 9, 1024.0, xs, gs, vs, hs)
    results = [run(make_session(model, threads=k), feeds) for k in (1, 2, 3)]
    for res in results[1:]:
        assert all(same_bits(a, b) for a, b in zip(results[0], res))
    assert check_mixed(results[1], 0.01, 9, 1024.0, xs, gs, vs, hs, 10, **NON_DEFAULT)
    # one inf near the end of the big tensor: every thread count skips
    gs[1][-1, -1] = np.inf
    feeds = mixed_precision_adam_feeds(0.01, 9, 1024.0, xs, gs, vs, hs)
    for k in (1, 2, 3):
        outs = run(make_session(model, threads=k), feeds)
        assert not check_mixed(outs, 0.01, 9, 1024.0, xs, gs, vs, hs, 10, **NON_DEFAULT)


# =========================================================================================
# errors: a clear message (op, input or attribute), and the process/session carries on
# =========================================================================================

def _clear(message, needles):
    low = message.lower()
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o.lower() in low for o in options), (
            f"error message lacks {' or '.join(map(repr, options))}: {message}")


def _good_mixed_run(sess, rng, g_dtype=F16):
    """A correct input through a dynamic MixedPrecisionAdam session of one tensor."""
    xs, gs, vs, hs = mp_data(rng, [(2, 5)], g_dtype, 8.0)
    outs = run(sess, mixed_precision_adam_feeds(0.01, 2, 8.0, xs, gs, vs, hs))
    check_mixed(outs, 0.01, 2, 8.0, xs, gs, vs, hs)


def _raw_mixed(inputs, outputs, **attrs):
    from trainops.models import node_model

    return node_model("MixedPrecisionAdam", [(n, d, None) for n, d in inputs],
                      [(n, d, None) for n, d in outputs], domain="com.trainops", **attrs)


_MP_IN = [("R", F32), ("T", np.int64), ("loss_scale", F32)]

MIXED_ERRORS = [
    ("X-float16", lambda: mixed_precision_adam_model([(2, 5)], F16, dtype=F16),
     ["MixedPrecisionAdam", ("input 3", "X_1"), "float16"], {}),
    ("X-double", lambda: mixed_precision_adam_model([(2, 5)], F16, dtype=F64),
     # X must be float32 whatever G is: the message should blame X_1, not G_1
     ["MixedPrecisionAdam", "input 3 (X_1)", "double"], {}),
    ("G-double", lambda: mixed_precision_adam_model([(2, 5)], F64),
     ["MixedPrecisionAdam", ("input 4", "G_1"), "double"], {}),
    ("loss_scale-double", lambda: mixed_precision_adam_model([(2, 5)], F16,
                                                            loss_scale_dtype=F64),
     ["MixedPrecisionAdam", ("input 2", "loss_scale"), "double"], {}),
    ("R-int64", lambda: mixed_precision_adam_model([(2, 5)], F16, r_dtype=np.int64),
     ["MixedPrecisionAdam", ("input 0", "(R)"), "int64"], {}),
    ("T-float", lambda: mixed_precision_adam_model([(2, 5)], F16, t_dtype=F32),
     ["MixedPrecisionAdam", ("input 1", "(T)"), "float"], {}),
    ("8-inputs", lambda: _raw_mixed(_MP_IN + [(n, F32) for n in ["X_1", "G_1", "V_1", "H_1", "Z"]],
                                    [("finite", np.bool_), ("X_1_new", F32), ("V_1_new", F32),
                                     ("H_1_new", F32)]),
     ["MixedPrecisionAdam", "input", "8"], {}),
    ("6-inputs", lambda: _raw_mixed(_MP_IN + [(n, F32) for n in ["X_1", "G_1", "V_1"]],
                                    [("finite", np.bool_), ("X_1_new", F32), ("V_1_new", F32),
                                     ("H_1_new", F32)]),
     ["MixedPrecisionAdam", "input", "6"], {}),
    ("outputs-without-copies", lambda: mixed_precision_adam_model([(2, 5)], F16, 10, copies=False),
     ["MixedPrecisionAdam", "output", "4"], {}),
    ("copies-without-copy_dtype", lambda: mixed_precision_adam_model([(2, 5)], F16, 0, copies=True),
     ["MixedPrecisionAdam", "output", "5"], {}),
    ("copy_dtype-1", lambda: mixed_precision_adam_model([(2, 5)], F16, 1),
     ["MixedPrecisionAdam", "copy_dtype"], {}),
    ("copy_dtype-11", lambda: mixed_precision_adam_model([(2, 5)], F16, 11),
     ["MixedPrecisionAdam", "copy_dtype"], {}),
    ("copy_dtype-float-attribute", lambda: mixed_precision_adam_model(
        [(2, 5)], F16, 10.0, copies=True, copy_output_dtype=F16),
     ["MixedPrecisionAdam", "copy_dtype"], {}),
    ("alpha-int-attribute", lambda: mixed_precision_adam_model([(2, 5)], F16, alpha=1),
     ["MixedPrecisionAdam", "alpha", "float"], {}),
]


@pytest.mark.parametrize("case", MIXED_ERRORS, ids=[c[0] for c in MIXED_ERRORS])
def test_mixed_error_at_load_or_run(make_session, rng, case):
    _, build, needles, _ = case
    model = build()
    good = make_session(mixed_precision_adam_model(1, F16, dynamic=True))
    try:
        sess = make_session(model)
    except Exception as exc:  # noqa: BLE001 - any type, as long as it is clear
        _clear(str(exc), needles)
        _good_mixed_run(good, rng)
        return
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        shape = () if vi.name in ("R", "T", "loss_scale") else (2, 5)
        feeds[vi.name] = (np.ones(shape) if vi.name != "T" else np.ones(shape)).astype(dtype)
    with pytest.raises(Exception) as info:
        run(sess, feeds)
    _clear(str(info.value), needles)
    _good_mixed_run(good, rng)


MIXED_RUN_ERRORS = [
    ("loss_scale-two-elements", {"loss_scale": np.array([1.0, 2.0], F32)},
     ["MixedPrecisionAdam", ("input 2", "loss_scale"), "element"]),
    ("loss_scale-no-element", {"loss_scale": np.zeros((0,), F32)},
     ["MixedPrecisionAdam", ("input 2", "loss_scale"), "element"]),
    ("R-two-elements", {"R": np.array([0.1, 0.2], F32)},
     ["MixedPrecisionAdam", ("input 0", "(R)"), "element"]),
    ("V-shape", {"V_1": np.zeros((5, 2), F32)},
     ["MixedPrecisionAdam", ("input 5", "V_1"), "shape"]),
    ("H-shape", {"H_1": np.zeros((2, 4), F32)},
     ["MixedPrecisionAdam", ("input 6", "H_1"), "shape"]),
]


@pytest.mark.parametrize("case", MIXED_RUN_ERRORS, ids=[c[0] for c in MIXED_RUN_ERRORS])
def test_mixed_error_at_run_session_survives(make_session, rng, case):
    _, override, needles = case
    sess = make_session(mixed_precision_adam_model(1, F16, dynamic=True))
    xs, gs, vs, hs = mp_data(rng, [(2, 5)], F16, 8.0)
    feeds = mixed_precision_adam_feeds(0.01, 2, 8.0, xs, gs, vs, hs)
    feeds.update(override)
    for _ in range(2):
        with pytest.raises(Exception) as info:
            run(sess, feeds)
        _clear(str(info.value), needles)
        _good_mixed_run(sess, rng)


ADAM16_ERRORS = [
    ("X-float16-G-bfloat16", F16, BF16, F16),
    ("X-bfloat16-G-float16", BF16, F16, BF16),
    ("X-float16-G-float32", F16, F32, F16),
    ("X-double-G-float16", F64, F16, F64),
    ("X-float32-V-float16", F32, F32, F16),
    ("X-float16-V-float32", F16, F16, F32),
]


@pytest.mark.parametrize("case", ADAM16_ERRORS, ids=[c[0] for c in ADAM16_ERRORS])
def test_adam16_type_errors(make_session, rng, case):
    _, x_dtype, g_dtype, v_dtype = case
    model = adam_model([(2, 5)], x_dtype, r_dtype=F32, g_dtype=g_dtype)
    for vi in model.graph.input:
        if vi.name in ("V_1",):
            vi.type.tensor_type.elem_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(v_dtype))
    wrong = "G_1" if g_dtype != x_dtype or v_dtype == x_dtype else "V_1"
    needles = ["Adam", ("input 3", "G_1") if wrong == "G_1" else ("input 4", "V_1")]
    try:
        sess = make_session(model)
    except Exception as exc:  # noqa: BLE001
        _clear(str(exc), needles)
        return
    x = np.ones((2, 5), x_dtype)
    with pytest.raises(Exception) as info:
        run(sess, adam_feeds(np.float32(0.1), 1, [x], [np.ones((2, 5), g_dtype)],
                             [np.ones((2, 5), v_dtype)], [x]))
    _clear(str(info.value), needles)


# =========================================================================================
# trainops.Policy
# =========================================================================================

@pytest.mark.parametrize("name,compute,variable,scaling", [
    ("float32", "float32", "float32", False),
    ("float64", "float64", "float64", False),
    ("float16", "float16", "float16", False),
    ("bfloat16", "bfloat16", "bfloat16", False),
    ("mixed_float16", "float16", "float32", True),
    ("mixed_bfloat16", "bfloat16", "float32", False),
])
def test_policy(name, compute, variable, scaling):
    p = Policy(name)
    assert p.name == name
    assert p.compute_dtype == compute and p.variable_dtype == variable
    assert p.compute_np_dtype == (BF16 if compute == "bfloat16" else np.dtype(compute))
    assert p.variable_np_dtype == np.dtype(variable)
    assert p.uses_loss_scaling is scaling
    assert p.is_mixed is (compute != variable)
    if scaling:
        assert p.loss_scale == 2.0 ** 15  # Keras' LossScaleOptimizer initial scale
        assert p.growth_interval == 2000
    else:
        assert p.loss_scale is None and p.growth_interval is None
    assert repr(p) == f'<Policy "{name}">'
    assert Policy(p) == p and hash(Policy(name)) == hash(p)
    assert p != Policy("float32" if name != "float32" else "float64")


@pytest.mark.parametrize("name", ["mixed_float32", "float8", "int32", "", "Float32",
                                  "mixed_float16 ", "mixed-float16", "_infer"])
def test_policy_unknown_name(name):
    with pytest.raises(ValueError, match="Cannot convert") as info:
        Policy(name)
    assert "mixed_float16" in str(info.value) and repr(name) in str(info.value).replace('"', "'")


@pytest.mark.parametrize("name", [None, 32, np.float32])
def test_policy_not_a_string(name):
    with pytest.raises(TypeError):
        Policy(name)


# =========================================================================================
# trainops.optimizer_model
# =========================================================================================

POLICIES = ["float32", "float64", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"]
PARAMS = [("w", (3, 4)), ("b", (4,)), ("emb", (6, 2))]


@pytest.mark.parametrize("policy", POLICIES)
def test_optimizer_model_structure(policy):
    model = optimizer_model(PARAMS, policy, alpha=0.8)
    onnx.checker.check_model(model)
    assert model.ir_version == 8
    opsets = {o.domain: o.version for o in model.opset_import}
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    for domain, _ in ops:
        assert domain in opsets, f"no opset import for {domain!r}"
    ins = [i.name for i in model.graph.input]
    outs = [o.name for o in model.graph.output]
    p = Policy(policy)
    for n, _ in PARAMS:
        assert {n, n + ".grad", n + ".m", n + ".v"} <= set(ins)
        assert {n + ".new", n + ".m.new", n + ".v.new"} <= set(outs)
        assert (n + ".copy" in outs) is p.is_mixed
    assert {"lr", "step"} <= set(ins) and "step.new" in outs
    assert ("loss_scale" in ins) is p.uses_loss_scaling
    assert ("good_steps" in ins) is p.uses_loss_scaling
    assert ("loss_scale.new" in outs) is p.uses_loss_scaling
    assert ("finite" in outs) is p.is_mixed
    # every <name>.new output has the type and shape of input <name> (bindable in place)
    types = {v.name: v.type for v in model.graph.input}
    for o in model.graph.output:
        if o.name.endswith(".new"):
            assert o.type == types[o.name[:-4]], o.name
    if p.is_mixed:
        assert ("com.trainops", "MixedPrecisionAdam") in ops
        assert (("com.trainops", "DynamicLossScale") in ops) is p.uses_loss_scaling
        node = next(n for n in model.graph.node if n.op_type == "MixedPrecisionAdam")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["copy_dtype"] == (10 if policy == "mixed_float16" else 16)
        assert attrs["alpha"] == pytest.approx(0.8)
    else:
        assert ops == {("", "Add"), ("ai.onnx.preview.training", "Adam")}
    assert trainops.optimizer_names(PARAMS, policy) == (ins, outs)


def test_optimizer_model_arguments():
    m = optimizer_model({"w": (2,)}, "mixed_float16", growth_interval=7, growth_factor=4.0,
                        backoff_factor=0.25, min_scale=1.0)
    node = next(n for n in m.graph.node if n.op_type == "DynamicLossScale")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"growth_interval": 7, "growth_factor": 4.0, "backoff_factor": 0.25,
                     "min_scale": 1.0}
    assert next(n for n in m.graph.node if n.op_type == "DynamicLossScale")
    # lr with a default: an overridable initializer
    m = optimizer_model({"w": (2,)}, "float32", lr=0.25)
    assert [i.name for i in m.graph.initializer if i.name == "lr"] == ["lr"]
    with pytest.raises(TypeError, match="gamma"):
        optimizer_model({"w": (2,)}, gamma=0.1)
    with pytest.raises(ValueError, match="clash"):
        optimizer_model([("w", (2,)), ("w", (3,))])
    with pytest.raises(ValueError, match="clash"):
        optimizer_model([("lr", (2,))])
    with pytest.raises(ValueError, match="clash"):
        optimizer_model([("w", (2,)), ("w.m", (2,))])
    with pytest.raises(ValueError, match="loss scaling"):
        optimizer_model({"w": (2,)}, "mixed_bfloat16", growth_interval=5)
    with pytest.raises(ValueError):
        optimizer_model([])
    with pytest.raises(ValueError, match="Cannot convert"):
        optimizer_model({"w": (2,)}, "mixed_float64")


def _reference_step(policy, state, grads, lr, **attrs):
    """The expected state after one step: the Adam / MixedPrecisionAdam references, the
    loss-scale rule, step + 1 when applied. Returns (expected dict, finite, exact names)."""
    p = Policy(policy)
    names = [n for n, _ in PARAMS]
    t = int(state["step"]) + 1
    xs = [state[n] for n in names]
    gs = [grads[n] for n in names]
    ms = [state[n + ".m"] for n in names]
    vs = [state[n + ".v"] for n in names]
    exp = {}
    if not p.is_mixed:
        half = p.compute_dtype in ("float16", "bfloat16")
        refs = (adam16 if half else adam_ref)(lr, t, xs, gs, ms, vs, **attrs)
        finite = True
    else:
        ls = state["loss_scale"] if p.uses_loss_scaling else 1.0
        finite, refs = mixed_precision_adam(lr, t, ls, xs, gs, ms, vs, **attrs)
    k = len(names)
    for i, n in enumerate(names):
        exp[n], exp[n + ".m"], exp[n + ".v"] = refs[i], refs[k + i], refs[2 * k + i]
    exp["step"] = np.array(t if finite else t - 1)
    if p.uses_loss_scaling:
        s, gsteps = dynamic_loss_scale(state["loss_scale"], int(state["good_steps"]), finite,
                                       growth_interval=3)
        exp["loss_scale"], exp["good_steps"] = np.float32(s), np.int64(gsteps)
    return exp, finite


def _check_step(policy, opt, before, exp, finite):
    """float32/float64 state against the float64 reference (bitwise when skipped)."""
    p = Policy(policy)
    var = p.variable_np_dtype
    for name, want in exp.items():
        got = opt[name]
        if name in ("step", "good_steps", "loss_scale"):
            assert got.shape == () and float(got) == float(want), f"{name}: {got} != {want}"
        elif not finite:
            assert same_bits(got, before[name]), f"{name} changed in a skipped step"
        else:
            assert got.dtype == var
            rel_close(got, want, name, var)
    if p.is_mixed:
        for n, _ in PARAMS:
            assert same_bits(opt[n + ".copy"], opt[n].astype(p.compute_np_dtype)), n
        assert opt.finite is finite


@pytest.mark.parametrize("policy", POLICIES)
def test_optimizer_model_runs_in_place(make_session, library_path, rng, policy):
    """Each policy's model in onnxruntime, every state bound in place through IOBinding,
    three steps (in a mixed policy the third with an inf gradient) against the references."""
    p = Policy(policy)
    weights = {n: rng.standard_normal(s) for n, s in PARAMS}
    kwargs = {"growth_interval": 3} if p.uses_loss_scaling else {}
    opt = trainops.InPlaceOptimizer(weights, policy, lr=0.01, library=library_path,
                                    log_severity_level=4, alpha=0.85, **kwargs)
    addresses = {k: opt[k].ctypes.data for k in opt.state}
    scale = opt.loss_scale
    for step in range(3):
        grads = {n: (np.clip(rng.standard_normal(s), -1.5, 1.5) * scale
                     ).astype(p.compute_np_dtype) for n, s in PARAMS}
        if step == 2 and p.is_mixed:  # a plain Adam has no skipping: it would apply inf
            grads["b"][1] = np.inf
        before = {k: np.array(v, copy=True) for k, v in opt.state.items()}
        exp, finite = _reference_step(policy, before, grads, 0.01, alpha=0.85)
        applied = opt.step(grads)
        if p.is_mixed:
            assert applied is finite
            assert finite is (step != 2)
        else:
            assert applied is True and finite
        if p.compute_dtype in ("float16", "bfloat16") and not p.is_mixed:
            names = [n for n, _ in PARAMS]
            outs = [opt[n + s] for s in ("", ".m", ".v") for n in names]
            assert_adam16_matches(outs, 0.01, int(before["step"]) + 1,
                                  [before[n] for n in names], [grads[n] for n in names],
                                  [before[n + ".m"] for n in names],
                                  [before[n + ".v"] for n in names], alpha=0.85)
            assert int(opt["step"]) == step + 1
        else:
            _check_step(policy, opt, before, exp, finite)
        # in place: the arrays were rewritten, never replaced
        assert all(opt[k].ctypes.data == a for k, a in addresses.items())
        scale = opt.loss_scale
    if p.uses_loss_scaling:
        # two finite steps then an overflow: 2^15 kept, kept, halved
        assert opt.loss_scale == 2.0 ** 14 and opt.good_steps == 0
        assert opt.iterations == 2


def test_optimizer_model_mixed_float16_many_steps(make_session, library_path):
    """60 in-place steps of the mixed_float16 model, some with an inf or nan gradient,
    against a reference loop (float64 Adam on G / scale, the skip rule, the loss-scale
    rule, the step count): the verdicts, the scale and the counts agree exactly, the
    weights to float32 accuracy."""
    rng = np.random.default_rng(11)
    params = [("w", (4, 3)), ("b", (3,))]
    weights = {n: rng.standard_normal(s) for n, s in params}
    opt = trainops.InPlaceOptimizer(weights, "mixed_float16", lr=0.01, library=library_path,
                                    log_severity_level=4, growth_interval=4, beta=0.99)
    ref = {k: np.array(v, copy=True) for k, v in opt.state.items()}
    x = {n: ref[n].astype(np.float64) for n, _ in params}
    m = {n: np.zeros(s) for n, s in params}
    v = {n: np.zeros(s) for n, s in params}
    scale, good, step = np.float32(2.0 ** 15), 0, 0
    verdicts = []
    for k in range(60):
        with np.errstate(over="ignore"):  # a grown scale may overflow float16: skipped
            grads = {n: (np.clip(rng.standard_normal(s), -1.5, 1.5) * float(scale)
                         ).astype(F16) for n, s in params}
        if rng.random() < 0.2:
            grads[params[k % 2][0]].reshape(-1)[0] = [np.inf, np.nan][k % 2]
        applied = opt.step(grads)
        names = [n for n, _ in params]
        finite, outs = mixed_precision_adam(
            0.01, step + 1, scale, [x[n] for n in names], [grads[n] for n in names],
            [m[n] for n in names], [v[n] for n in names], beta=0.99)
        assert applied is finite, f"step {k}"
        verdicts.append(finite)
        if finite:
            for i, n in enumerate(names):
                x[n], m[n], v[n] = (np.asarray(o, np.float64) for o in outs[i::2])
            step += 1
        scale, good = dynamic_loss_scale(scale, good, finite, growth_interval=4)
        assert opt.loss_scale == float(scale) and opt.good_steps == good, f"step {k}"
        assert opt.iterations == step
        for n in names:
            np.testing.assert_allclose(opt[n], x[n], rtol=1e-5, atol=1e-5, err_msg=f"{n}, {k}")
            np.testing.assert_allclose(opt[n + ".m"], m[n], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(opt[n + ".v"], v[n], rtol=1e-4, atol=1e-6)
            assert same_bits(opt[n + ".copy"], opt[n].astype(F16))
    assert not all(verdicts) and any(verdicts)


def test_optimizer_model_loss_scale_grows_and_lr_override(make_session, library_path, rng):
    weights = {"w": rng.standard_normal((4,))}
    opt = trainops.InPlaceOptimizer(weights, "mixed_float16", lr=0.1, library=library_path,
                                    log_severity_level=4, growth_interval=2)
    seen = []
    for _ in range(5):
        opt.step({"w": rng.uniform(-0.1, 0.1, 4) * opt.loss_scale})
        seen.append((opt.loss_scale, opt.good_steps))
    assert seen == [(2.0 ** 15, 1), (2.0 ** 16, 0), (2.0 ** 16, 1), (2.0 ** 17, 0),
                    (2.0 ** 17, 1)]
    # lr changes per step through the bound buffer; lr 0 leaves w alone
    w = opt["w"].copy()
    opt.step({"w": np.ones(4)}, lr=0.0)
    assert same_bits(opt["w"], w)


def test_optimizer_model_plain_run_against_reference(make_session, rng):
    """Without the helper class: trainops.run on the model, feeds by name."""
    model = optimizer_model(PARAMS, "mixed_bfloat16", lr=0.05)
    sess = make_session(model)
    state = trainops.optimizer_state({n: rng.standard_normal(s) for n, s in PARAMS},
                                     "mixed_bfloat16")
    grads = {n + ".grad": rng.standard_normal(s).astype(BF16) for n, s in PARAMS}
    out_names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(out_names, run(sess, {**state, **grads})))
    names = [n for n, _ in PARAMS]
    finite, refs = mixed_precision_adam(
        0.05, 1, 1.0, [state[n] for n in names], [grads[n + ".grad"] for n in names],
        [state[n + ".m"] for n in names], [state[n + ".v"] for n in names])
    assert finite and bool(outs["finite"]) and int(outs["step.new"]) == 1
    for i, n in enumerate(names):
        rel_close(outs[n + ".new"], refs[i], n)
        assert outs[n + ".copy"].dtype == BF16
        assert same_bits(outs[n + ".copy"], outs[n + ".new"].astype(BF16))
    # the lr default is overridable
    outs2 = dict(zip(out_names, run(sess, {**state, **grads, "lr": np.array(0.0, F32)})))
    assert same_bits(outs2["w.new"], state["w"])


def test_optimizer_model_symbolic_shapes(make_session, rng):
    model = optimizer_model([("w", ("n", 3))], "mixed_float16")
    sess = make_session(model)
    for n in (1, 5):
        state = trainops.optimizer_state({"w": rng.standard_normal((n, 3))}, "mixed_float16",
                                         lr=0.01)
        outs = run(sess, {**state, "w.grad": np.ones((n, 3), F16)}, ["w.new", "w.copy"])
        assert outs[0].shape == (n, 3) and outs[1].dtype == F16
