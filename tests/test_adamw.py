"""com.trainops::AdamW through onnxruntime with the trainops library, against a numpy replica
of torch.optim.AdamW's single-tensor step (torch 2.x ``_single_tensor_adam`` with decoupled
weight decay), written here operation by operation with torch's roundings: Python-float
scalars rounded to the tensor's type, ``lerp_`` and ``addcmul_`` fused (one rounding, as
torch's CPU kernels compute them), every other tensor operation rounded. float16 / bfloat16
tensors compute in float32 and round once per stored output (the op's documented choice).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from helpers.checks import assert_clear, same_bits
from helpers.data import BF16, F16, F32, F64
from helpers.fma_reference import fma32
from helpers.runners import run_in_place, run_thread_counts
from trainops import run as run_any  # bfloat16 through an IOBinding
from trainops.models import adamw_feeds, adamw_groups, adamw_model

# --- the replica -------------------------------------------------------------------------


def fma64(a, b, c):
    """``a * b + c`` on float64 arrays with one rounding, exactly (fractions)."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, F64) for v in (a, b, c)))
    out = np.empty(a.shape, F64)
    for i, (x, y, z) in enumerate(zip(a.ravel(), b.ravel(), c.ravel())):
        if np.isfinite(x) and np.isfinite(y) and np.isfinite(z):
            out.flat[i] = float(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        else:
            out.flat[i] = x * y + z
    return out


def torch_adamw(lr, step, x, g, m, v, vmax=None, *, beta1=0.9, beta2=0.999, epsilon=1e-8,
                weight_decay=1e-2, maximize=False):
    """One step of ``torch.optim.AdamW`` on one tensor, in ``x``'s float type (float32 or
    float64): returns ``(x, m, v, vmax)``. ``lr`` and the attributes are Python floats."""
    ct = x.dtype.type
    fma = fma32 if ct is np.float32 else fma64
    grad = -g if maximize else g
    param = x
    if weight_decay != 0:
        param = param * ct(1 - lr * weight_decay)            # param.mul_(1 - lr * wd)
    w = ct(1 - beta1)                                         # exp_avg.lerp_(grad, 1 - beta1)
    if abs(w) < 0.5:
        exp_avg = fma(w, grad - m, m)
    else:
        exp_avg = fma(w - ct(1), grad - m, grad)
    exp_avg_sq = v * ct(beta2)                                # exp_avg_sq.mul_(beta2)
    exp_avg_sq = fma(ct(1 - beta2) * grad, grad, exp_avg_sq)  # .addcmul_(grad, grad, 1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    if vmax is not None:
        vmax = np.maximum(vmax, exp_avg_sq)                   # torch.maximum(..., out=...)
        second = vmax
    else:
        second = exp_avg_sq
    denom = np.sqrt(second) / ct(bias_correction2_sqrt) + ct(epsilon)
    param = param + (ct(-step_size) * exp_avg) / denom       # addcdiv_: self + value * t1 / t2
    return param, exp_avg, exp_avg_sq, vmax


def replica(dtype, lr, step, x, g, m, v, vmax=None, **attrs):
    """:func:`torch_adamw` for any of the op's types: 16-bit tensors (and 16-bit gradients of
    float32 weights) widened exactly to float32, outputs rounded once to ``dtype``."""
    wide = F64 if np.dtype(dtype) == F64 else F32
    f = (lambda a: None if a is None else np.asarray(a).astype(wide))
    outs = torch_adamw(lr, step, f(x), f(g), f(m), f(v), f(vmax), **attrs)
    return [None if o is None else o.astype(dtype) for o in outs]


# --- helpers -----------------------------------------------------------------------------

def r_dtype(dtype):
    """R's type for weights of ``dtype``: double for double, else float."""
    return F64 if np.dtype(dtype) == F64 else F32


def state(rng, shape, dtype, g_dtype=None, amsgrad=False):
    x = rng.standard_normal(shape).astype(dtype)
    g = rng.standard_normal(shape).astype(g_dtype or dtype)
    m = (0.1 * rng.standard_normal(shape)).astype(dtype)
    v = (0.01 * rng.random(shape)).astype(dtype)
    vmax = (0.012 * rng.random(shape)).astype(dtype) if amsgrad else None
    return x, g, m, v, vmax


def run_steps(sess, steps, lr, x, g_of, m, v, vmax, dtype, r_type=None, **attrs):
    """``steps`` updates from T = 1, outputs fed back; after each, every output is bitwise
    the replica's (which runs its own state forward)."""
    ours = [x, m, v] + ([vmax] if vmax is not None else [])
    theirs = list(ours) + ([None] if vmax is None else [])
    r = np.array(lr, dtype=r_type or r_dtype(dtype))
    for t in range(1, steps + 1):
        g = g_of(t)
        feeds = adamw_feeds(r, t, [ours[0]], [g], [ours[1]], [ours[2]],
                            None if vmax is None else [ours[3]])
        ours = run_any(sess, feeds)
        theirs = replica(dtype, float(r), t, theirs[0], g, *theirs[1:], **attrs)
        for name, a, b in zip(["X", "M", "V", "Vmax"], ours, theirs):
            assert a.dtype == np.dtype(dtype), name
            assert same_bits(a, b), f"step {t}: {name} differs from the replica at " \
                f"{np.flatnonzero(a.view(np.uint8) != b.view(np.uint8))[:4]}"
    return ours


# --- values ------------------------------------------------------------------------------

TYPES = [(F32, None), (F64, None), (F16, None), (BF16, None), (F32, F16), (F32, BF16)]
ATTRS = [
    {},
    {"weight_decay": 0.0},
    {"maximize": 1, "weight_decay": 0.1},
    {"beta1": 0.3, "beta2": 0.99, "epsilon": 1e-6},  # lerp's weight >= 0.5: from the end
]


@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=lambda t: getattr(t, "name", "same"))
@pytest.mark.parametrize("amsgrad", [0, 1])
@pytest.mark.parametrize("attrs", ATTRS, ids=["defaults", "no-decay", "maximize", "betas"])
def test_many_steps_match_the_torch_replica(make_session, rng, dtype, g_dtype, amsgrad, attrs):
    shape = (37,) if dtype == F64 else (5, 67)  # odd lengths: SIMD body and tail
    x, g0, m, v, vmax = state(rng, shape, dtype, g_dtype, amsgrad)
    grads = {t: (g0 * (1 + 0.1 * t) * (-1) ** t).astype(g0.dtype) for t in range(1, 31)}
    sess = make_session(adamw_model([shape], dtype, r_dtype(dtype), g_dtype=g_dtype, amsgrad=amsgrad,
                                    **attrs))
    attrs = {**attrs, "maximize": bool(attrs.get("maximize", 0))}
    steps = 8 if dtype == F64 else 30
    run_steps(sess, steps, 0.01, x, grads.get, m, v, vmax, dtype, **attrs)


@pytest.mark.parametrize("r_dtype", [F32, F64])
def test_learning_rate_of_either_type(make_session, rng, r_dtype):
    x, g, m, v, _ = state(rng, (50,), F32)
    sess = make_session(adamw_model([(50,)], F32, r_dtype=r_dtype))
    run_steps(sess, 5, 3e-3, x, lambda t: g, m, v, None, F32, r_type=r_dtype)


def test_first_step_of_zero_state(make_session, rng):
    """torch's first step: m = 0.1 g, v = 0.001 g^2, x moves by about lr against sign(g)."""
    x = rng.standard_normal(40).astype(F32)
    g = rng.standard_normal(40).astype(F32)
    z = np.zeros_like(x)
    sess = make_session(adamw_model([(40,)], F32))
    x1, m1, v1 = sess.run(None, adamw_feeds(np.float32(1e-3), 1, [x], [g], [z], [z]))
    np.testing.assert_allclose(m1, 0.1 * g.astype(F64), rtol=1e-6)
    np.testing.assert_allclose(v1, 0.001 * g.astype(F64) ** 2, rtol=1e-6)
    step = x.astype(F64) * (1 - 1e-5) - 1e-3 * np.sign(g)
    np.testing.assert_allclose(x1, step, rtol=0, atol=1e-6)


def test_several_tensors_and_broadcast_gradient(make_session, rng):
    shapes, g_shapes = [(3, 4), (7,)], [(1, 4), (7,)]
    xs = [rng.standard_normal(s).astype(F32) for s in shapes]
    gs = [rng.standard_normal(s).astype(F32) for s in g_shapes]
    ms = [(0.1 * rng.standard_normal(s)).astype(F32) for s in shapes]
    vs = [(0.01 * rng.random(s)).astype(F32) for s in shapes]
    sess = make_session(adamw_model(shapes, F32, g_shapes=g_shapes))
    outs = sess.run(None, adamw_feeds(np.float32(0.05), 4, xs, gs, ms, vs))
    for i in range(2):
        want = replica(F32, float(np.float32(0.05)), 4, xs[i], np.broadcast_to(gs[i], shapes[i]),
                       ms[i], vs[i])
        for k in range(3):
            assert same_bits(outs[k * 2 + i], want[k]), (i, k)


def test_huge_step_count(make_session, rng):
    """beta^T underflows: no bias correction left; T past 2^32 is not narrowed."""
    x, g, m, v, _ = state(rng, (20,), F32)
    sess = make_session(adamw_model([(20,)], F32))
    for t in (1000, 2**32 + 1, 2**62):
        outs = sess.run(None, adamw_feeds(np.float32(0.01), t, [x], [g], [m], [v]))
        want = replica(F32, float(np.float32(0.01)), t, x, g, m, v)
        assert all(same_bits(a, b) for a, b in zip(outs, want[:3])), t


def test_non_finite_values_propagate(make_session):
    x = np.array([np.nan, 1.0, 2.0, np.inf], F32)
    g = np.array([1.0, np.nan, 1.0, 1.0], F32)
    m = np.array([0.0, 0.0, np.inf, 0.0], F32)
    v = np.zeros(4, F32)
    sess = make_session(adamw_model([(4,)], F32))
    x1, m1, v1 = sess.run(None, adamw_feeds(np.float32(0.01), 1, [x], [g], [m], [v]))
    assert np.isnan(x1[0]) and np.isnan(x1[1]) and np.isnan(m1[1]) and np.isnan(v1[1])
    assert np.isnan(m1[2]) and np.isnan(x1[2])  # lerp: 0.1 * (1 - inf) + inf
    assert np.isposinf(x1[3])


# --- in place and threads ----------------------------------------------------------------

@pytest.mark.parametrize("amsgrad", [0, 1])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_in_place_through_iobinding(make_session, rng, dtype, amsgrad):
    x, g, m, v, vmax = state(rng, (3000,), dtype, amsgrad=amsgrad)
    sess = make_session(adamw_model([(3000,)], dtype, r_dtype(dtype), amsgrad=amsgrad))
    feeds = adamw_feeds(np.float32(0.01), 3, [x], [g], [m], [v], [vmax] if amsgrad else None)
    groups = [p for p in adamw_groups(bool(amsgrad)) if p != "G"]
    expected = sess.run(None, feeds)
    actual, values = run_in_place(sess, feeds, groups, 1)
    want = replica(dtype, float(np.float32(0.01)), 3, x, g, m, v, vmax)
    for name, a, e, w in zip(groups, actual, expected, want):
        assert same_bits(a, e), f"{name}: in place differs from out of place"
        assert same_bits(a, w), f"{name}: differs from the replica"
    assert same_bits(values["G_1"].numpy(), g)


def test_thread_counts_agree(make_session, rng):
    shape = (300_017,)  # several chunks
    x, g, m, v, vmax = state(rng, shape, F32, amsgrad=True)
    feeds = adamw_feeds(np.float32(0.01), 2, [x], [g], [m], [v], [vmax])
    results = run_thread_counts(make_session, adamw_model([shape], F32, amsgrad=1), feeds)
    want = replica(F32, float(np.float32(0.01)), 2, x, g, m, v, vmax)
    assert all(same_bits(a, b) for a, b in zip(results[1], want))


# --- bad input ---------------------------------------------------------------------------

def _error(make_session, model, feeds):
    with pytest.raises(Exception) as e:
        make_session(model).run(None, feeds)
    return str(e.value)


def test_step_count_below_one_is_refused(make_session, rng):
    x, g, m, v, _ = state(rng, (5,), F32)
    msg = _error(make_session, adamw_model([(5,)], F32),
                 adamw_feeds(np.float32(0.01), 0, [x], [g], [m], [v]))
    assert_clear(msg, ["AdamW", "T", ">= 1", "got 0"])


@pytest.mark.parametrize("attrs,needles", [
    ({"beta1": 1.0}, ["AdamW", "beta1", "[0, 1)", "got 1"]),
    ({"beta2": -0.5}, ["AdamW", "beta2", "[0, 1)"]),
    ({"epsilon": -1.0}, ["AdamW", "epsilon", ">= 0"]),
    ({"weight_decay": -0.1}, ["AdamW", "weight_decay", ">= 0"]),
    ({"maximize": 2}, ["AdamW", "maximize", "0 or 1", "got 2"]),
])
def test_bad_attributes_are_named(make_session, rng, attrs, needles):
    x, g, m, v, _ = state(rng, (5,), F32)
    with pytest.raises(Exception) as e:
        make_session(adamw_model([(5,)], F32, **attrs)).run(
            None, adamw_feeds(np.float32(0.01), 1, [x], [g], [m], [v]))
    assert_clear(str(e.value), needles)


def test_bad_amsgrad_is_named(make_session):
    with pytest.raises(Exception) as e:
        make_session(adamw_model(1, F32, amsgrad=3))
    assert_clear(str(e.value), ["AdamW", "amsgrad", "0 or 1", "got 3"])


def test_missing_vmax_is_an_arity_error(make_session, rng):
    """amsgrad without the Vmax inputs: 2 + 4n inputs where 2 + 5n are expected."""
    from trainops.models import node_model
    inputs = [("R", F32, ()), ("T", np.int64, ())] + [(p, F32, (5,)) for p in ("X_1", "G_1", "M_1", "V_1")]
    outputs = [(p, F32, (5,)) for p in ("X_1_new", "M_1_new", "V_1_new", "Vmax_1_new")]
    with pytest.raises(Exception) as e:
        model = node_model("AdamW", inputs, outputs, domain="com.trainops", amsgrad=1)
        x, g, m, v, _ = state(rng, (5,), F32)
        make_session(model).run(None, adamw_feeds(np.float32(0.01), 1, [x], [g], [m], [v]))
    assert_clear(str(e.value), ["AdamW", "2 + 5n", "Vmax_1..Vmax_n", "got 6"])


def test_state_of_another_type_is_named(make_session, rng):
    from trainops.models import node_model
    x, g, m, v, _ = state(rng, (5,), F32)
    inputs = [("R", F32, ()), ("T", np.int64, ()), ("X_1", F32, (5,)), ("G_1", F32, (5,)),
              ("M_1", F64, (5,)), ("V_1", F32, (5,))]
    outputs = [(p, F32, (5,)) for p in ("X_1_new", "M_1_new", "V_1_new")]
    model = node_model("AdamW", inputs, outputs, domain="com.trainops")
    msg = _error(make_session, model, adamw_feeds(np.float32(0.01), 1, [x], [g], [m.astype(F64)], [v]))
    assert_clear(msg, ["AdamW", "M_1", "float"])


def test_state_of_another_shape_is_named(make_session, rng):
    x, g, m, v, _ = state(rng, (5,), F32)
    model = adamw_model(1, F32, dynamic=True)
    msg = _error(make_session, model, adamw_feeds(np.float32(0.01), 1, [x], [g], [m], [v[:4]]))
    assert_clear(msg, ["AdamW", "V_1", "shape"])


# --- the replica itself ------------------------------------------------------------------

def test_fma32_rounds_once():
    """Cases where a*b + c rounded twice differs from the fused result."""
    a = np.array([1 + 2.0 ** -12], F32)
    b = np.array([1 + 2.0 ** -12], F32)
    c = np.array([-1.0], F32)
    # Exact: 2^-11 + 2^-24; rounded product first would lose the 2^-24.
    assert fma32(a, b, c)[0] == np.float32(2.0 ** -11 + 2.0 ** -24)
    assert (a * b + c)[0] == np.float32(2.0 ** -11)
    # A float64 sum exactly halfway between two float32s, with an error that decides it.
    x = np.array([1 + 2.0 ** -23], F32)
    y = np.array([1 + 2.0 ** -23], F32)  # x*y = 1 + 2^-22 + 2^-46
    z = np.array([-(2.0 ** -24) * 3], F32)  # sum: 1 + 2^-22 - 3*2^-24 + 2^-46 = 1 + 2^-24 + 2^-46
    want = Fraction(float(x[0])) * Fraction(float(y[0])) + Fraction(float(z[0]))
    lo, hi = np.float32(1.0), np.nextafter(np.float32(1.0), np.float32(2))
    nearest = hi if abs(Fraction(float(hi)) - want) < abs(Fraction(float(lo)) - want) else lo
    assert fma32(x, y, z)[0] == nearest


# --- trainops.optim.AdamW ----------------------------------------------------------------

def test_python_adamw_describes_the_node(make_session, rng):
    """PyTorch's names and defaults; the ONNX attributes they become give the op's defaults'
    bits; state and domain; to_dict / from_dict round trip (through JSON)."""
    import json

    from trainops.onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN
    from trainops.optim import Adam, AdamW, from_dict

    opt = AdamW()
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.amsgrad, opt.maximize) == \
        (1e-3, (0.9, 0.999), 1e-8, 1e-2, False, False)
    assert opt.attributes() == {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                                "weight_decay": 1e-2, "amsgrad": 0, "maximize": 0}
    assert (opt.op_type, opt.domain, opt.state) == ("AdamW", TRAINOPS_DOMAIN, ("M", "V"))
    assert AdamW(amsgrad=True).state == ("M", "V", "Vmax")
    assert Adam().domain == TRAINING_DOMAIN
    other = AdamW(lr=3e-4, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.1, amsgrad=True,
                  maximize=True)
    assert from_dict(json.loads(json.dumps(other.to_dict()))) == other
    assert other.betas == (0.8, 0.95)
    with pytest.raises(ValueError, match="betas"):
        AdamW(betas=(0.9,))
    x, g, m, v, _ = state(rng, (33,), F32)
    feeds = adamw_feeds(np.float32(0.01), 2, [x], [g], [m], [v])
    implicit = make_session(adamw_model([(33,)], F32)).run(None, feeds)
    explicit = make_session(adamw_model([(33,)], F32, **opt.attributes())).run(None, feeds)
    assert same_bits(implicit, explicit)
