"""The CUDA kernels' arithmetic, checked without a GPU: a numpy transcription of each
optimizer kernel of crates/trainops-cuda/cuda/trainops.cu (the same float32 operations in the
same order, each rounded on its own as --fmad=false compiles them, with the coefficients the
device kernel is given: ONNX float attributes and R rounded to float32, combined in double,
rounded once) must equal the library's CPU kernels bitwise. A GPU then only has to show that
the PTX computes what the CUDA C says (scripts/gpu_check).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper

f32 = np.float32
TRAINING = "ai.onnx.preview.training"


def a32(v: float) -> float:
    return float(np.float32(v))


def model(op, n, streams, **attrs):
    ins = ["X", "G", *streams]
    node = helper.make_node(op, ["R", "T", *ins], [f"{s}_new" for s in ["X", *streams]], domain=TRAINING, **attrs)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node],
        "g",
        [vi("R", TensorProto.FLOAT, []), vi("T", TensorProto.INT64, [])] + [vi(s, TensorProto.FLOAT, [n]) for s in ins],
        [vi(f"{s}_new", TensorProto.FLOAT, [n]) for s in ["X", *streams]],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    m.ir_version = 8
    return m


@pytest.fixture(params=[1, 16, 257, 10_007])
def data(request):
    n = request.param
    rng = np.random.default_rng(n)
    x, g, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    return n, x, g, v, rng.random(n).astype(np.float32)


R, T = a32(0.01), 7


def run(make_session, m, **feeds):
    return make_session(m).run(None, {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **feeds})


def test_adam_kernel_arithmetic(make_session, data):
    n, x, g, v, h = data
    alpha, beta, eps, norm, post = a32(0.9), a32(0.999), a32(1e-6), a32(0.01), a32(0.001)
    rate = R * math.sqrt(1 - beta**T) / (1 - alpha**T)
    gr = f32(norm) * x + g
    v_new = f32(alpha) * v + f32(1 - alpha) * gr
    h_new = f32(beta) * h + f32(1 - beta) * (gr * gr)
    x_new = f32(1 - post) * (x - f32(rate) * (v_new / (np.sqrt(h_new) + f32(eps))))
    m = model("Adam", n, ["V", "H"], alpha=alpha, beta=beta, epsilon=eps, norm_coefficient=norm, norm_coefficient_post=post)
    for got, want in zip(run(make_session, m, X=x, G=g, V=v, H=h), (x_new, v_new, h_new)):
        np.testing.assert_array_equal(got, want)


def test_adagrad_kernel_arithmetic(make_session, data):
    n, x, g, _, h = data
    decay, eps, norm = a32(0.1), a32(1e-6), a32(0.01)
    gr = f32(norm) * x + g
    h_new = h + gr * gr
    x_new = x - (f32(R / (1 + T * decay)) * gr) / (np.sqrt(h_new) + f32(eps))
    m = model("Adagrad", n, ["H"], decay_factor=decay, epsilon=eps, norm_coefficient=norm)
    for got, want in zip(run(make_session, m, X=x, G=g, H=h), (x_new, h_new)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", ["standard", "nesterov"])
def test_momentum_kernel_arithmetic(make_session, data, mode):
    n, x, g, v, _ = data
    alpha, beta, norm = a32(0.9), a32(0.5), a32(0.01)
    gr = f32(norm) * x + g
    v_new = f32(alpha) * v + f32(beta) * gr
    x_new = x - f32(R) * (v_new if mode == "standard" else gr + f32(alpha) * v_new)
    m = model("Momentum", n, ["V"], alpha=alpha, beta=beta, norm_coefficient=norm, mode=mode)
    for got, want in zip(run(make_session, m, X=x, G=g, V=v), (x_new, v_new)):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- mixed precision
# trainops_set_flag / trainops_finite / trainops_mp_adam / trainops_cast_f16 / trainops_cast_bf16
# / trainops_loss_scale, transcribed. The 16-bit loads are the kernel's: float16 widened exactly
# (cvt.f32.f16), bfloat16 as its bits shifted into the top half of a float32.

from helpers.data import BF16, F16  # noqa: E402

from trainops import run as run_io  # noqa: E402
from trainops.models import (all_finite_model, dynamic_loss_scale_model,  # noqa: E402
                             mixed_precision_adam_feeds, mixed_precision_adam_model)

LENGTHS = [0, 1, 7, 8, 9, 257, 10_007]


def load_f32(g: np.ndarray) -> np.ndarray:
    """load_f32: the kernel's widening of a gradient to float32."""
    if g.dtype == BF16:
        return (g.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return g.astype(np.float32)


def finite_flag(tensors, scale=None) -> bool:
    """trainops_set_flag(1), then trainops_finite over each tensor (divided by *scale in float32
    when given): 0 on any Inf or NaN."""
    flag = True
    with np.errstate(all="ignore"):
        for g in tensors:
            if g.dtype == np.float64:
                ok = np.isfinite(g)
            else:
                w = load_f32(g)
                ok = np.isfinite(w / f32(scale) if scale is not None else w)
            if not ok.all():
                flag = False
    return flag


def cast_f16(x: np.ndarray) -> np.ndarray:
    """trainops_cast_f16: cvt.rn.f16.f32 (IEEE round to nearest even, as numpy's cast) except
    NaN, which keeps its sign and top payload bits with the quiet bit set."""
    b = x.view(np.uint32)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    with np.errstate(over="ignore"):
        r = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    quiet = ((b >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7E00) | ((b & np.uint32(0x7FFFFF)) >> np.uint32(13))
    return np.where(nan, quiet, r).astype(np.uint16).view(np.float16)


def cast_bf16(x: np.ndarray) -> np.ndarray:
    """trainops_cast_bf16: NaN keeps its top bits with the quiet bit; else round to nearest even."""
    b = x.view(np.uint32)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    up = ((b & np.uint32(0x8000)) != 0) & ((b & np.uint32(0x17FFF)) != 0)
    top = (b >> np.uint32(16)).astype(np.uint32)
    r = np.where(nan, top | np.uint32(0x40), np.where(up, top + np.uint32(1), top))
    return r.astype(np.uint16).view(BF16)


@np.errstate(all="ignore")  # the transcriptions meet Inf and NaN on purpose
def mirror_mp_adam(r, t, scale, xs, gs, vs, hs, copy_dtype, alpha=0.9, beta=0.999, epsilon=1e-6,
                   norm_coefficient=0.0, norm_coefficient_post=0.0):
    """The host's coefficients (Adam::coeffs: float attributes and R widened, double, rounded
    once), the verdict over every gradient, then trainops_mp_adam per group and the copies."""
    alpha, beta, eps, norm, post = (a32(v) for v in (alpha, beta, epsilon, norm_coefficient, norm_coefficient_post))
    rate = r * math.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else r
    finite = finite_flag(gs, scale)
    outs_x, outs_v, outs_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        if finite:
            gi = load_f32(g) / f32(scale)
            gr = f32(norm) * x + gi
            v = f32(alpha) * v + f32(1 - alpha) * gr
            h = f32(beta) * h + f32(1 - beta) * (gr * gr)
            x = f32(1 - post) * (x - f32(rate) * (v / (np.sqrt(h) + f32(eps))))
        outs_x.append(x)
        outs_v.append(v)
        outs_h.append(h)
    copies = []
    if copy_dtype == 10:
        copies = [cast_f16(x) for x in outs_x]
    elif copy_dtype == 16:
        copies = [cast_bf16(x) for x in outs_x]
    return [np.array(finite), *outs_x, *outs_v, *outs_h, *copies]


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.tobytes() == b.tobytes()


def mp_case(n_shapes, g_dtype, scale, seed):
    rng = np.random.default_rng(seed)
    shapes = [(n,) for n in n_shapes]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    vs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    hs = [rng.random(s).astype(np.float32) for s in shapes]
    gs = [(np.clip(rng.standard_normal(s), -1.5, 1.5) * scale).astype(g_dtype) for s in shapes]
    return shapes, xs, gs, vs, hs


@pytest.mark.parametrize("copy_dtype", [0, 10, 16])
@pytest.mark.parametrize("g_dtype", [np.float32, F16, BF16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scale", [1024.0, 0.375, 3.0])
def test_mixed_precision_adam_kernel_arithmetic(make_session, g_dtype, scale, copy_dtype):
    attrs = dict(alpha=0.5, beta=0.75, epsilon=0.25, norm_coefficient=0.3, norm_coefficient_post=0.125)
    for k, n in enumerate(LENGTHS):
        shapes, xs, gs, vs, hs = mp_case([n, LENGTHS[-1 - k]], g_dtype, scale, seed=n)
        sess = make_session(mixed_precision_adam_model(shapes, g_dtype, copy_dtype, **attrs))
        for t in (1, 7, 0):
            got = run_io(sess, mixed_precision_adam_feeds(R, t, scale, xs, gs, vs, hs))
            want = mirror_mp_adam(R, t, scale, xs, gs, vs, hs, copy_dtype, **attrs)
            assert bool(want[0]), "the random gradients are finite"
            for j, (a, b) in enumerate(zip(got, want)):
                assert same(a, b), f"n = {n}, t = {t}, output {j}"


@pytest.mark.parametrize("copy_dtype", [0, 10, 16])
@pytest.mark.parametrize("case", ["inf16", "nan32", "overflow_by_division", "nan_scale", "zero_scale", "tiny_scale_finite"])
def test_mixed_precision_adam_kernel_skips_as_the_cpu(make_session, case, copy_dtype):
    """The verdict is on G / loss_scale over every group: a non-finite one anywhere leaves every
    output equal to its input (NaN, -0.0 and infinite weights included)."""
    g_dtype = F16 if case == "inf16" else np.float32
    shapes, xs, gs, vs, hs = mp_case([9, 300], g_dtype, 8.0, seed=3)
    scale = 8.0
    xs[0][:4] = [-0.0, np.nan, np.inf, 65520.0]
    xs[0][4:8] = np.array([0x7F800001, 0xFFC12345, 0x7FBFFFFF, 0x80000001], np.uint32).view(np.float32)  # NaN payloads
    if case == "inf16":
        gs[1][299] = np.inf
    elif case == "nan32":
        gs[0][0] = np.nan
    elif case == "overflow_by_division":
        gs[1][5], scale = 3e38, 0.5  # finite in float32, infinite once divided
    elif case == "nan_scale":
        scale = float("nan")
    elif case == "zero_scale":
        scale = 0.0
    else:
        gs[1][5], scale = 1e30, 1e-7  # large but finite after division
    sess = make_session(mixed_precision_adam_model(shapes, g_dtype, copy_dtype))
    got = run_io(sess, mixed_precision_adam_feeds(R, 3, scale, xs, gs, vs, hs))
    want = mirror_mp_adam(R, 3, scale, xs, gs, vs, hs, copy_dtype)
    assert bool(want[0]) == (case == "tiny_scale_finite")
    for j, (a, b) in enumerate(zip(got, want)):
        assert same(a, b), f"{case}: output {j}"


@pytest.mark.parametrize("dtypes", [[np.float32], [F16, np.float32], [BF16, np.float64, F16]], ids=str)
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_all_finite_kernel_arithmetic(make_session, dtypes, bad):
    rng = np.random.default_rng(5)
    for n in LENGTHS:
        xs = [(rng.standard_normal(n) * 1e3).astype(d) for d in dtypes]
        if bad is not None and n:
            xs[-1][n // 2] = bad
        sess = make_session(all_finite_model(dtypes, [(n,)] * len(dtypes)))
        (got,) = run_io(sess, {f"x_{k + 1}": x for k, x in enumerate(xs)})
        want = finite_flag(xs)
        assert bool(got) == want == (bad is None or n == 0), f"n = {n}"


@np.errstate(all="ignore")  # the transcriptions meet Inf and NaN on purpose
def mirror_loss_scale(scale, good, finite, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5, min_scale=0.0):
    """trainops_loss_scale, one thread: float32 products, fmaxf, a saturating increment."""
    s = f32(scale)
    if not finite:
        return np.fmax(s * f32(backoff_factor), f32(min_scale)), 0
    steps = good if good == 2**63 - 1 else good + 1
    if steps == growth_interval:
        with np.errstate(over="ignore"):
            grown = s * f32(growth_factor)
        return (grown if np.isfinite(grown) else s), 0
    return s, steps


@pytest.mark.parametrize("attrs", [{}, dict(growth_interval=3, growth_factor=3.0, backoff_factor=0.25, min_scale=600.0),
                                   dict(growth_interval=1, growth_factor=1e30, backoff_factor=0.0, min_scale=0.0)], ids=str)
def test_dynamic_loss_scale_kernel_arithmetic(make_session, attrs):
    sess = make_session(dynamic_loss_scale_model(**attrs))
    interval = attrs.get("growth_interval", 2000)
    scales = [1024.0, 3.4e38, 1e-45, 0.0, float("inf"), float("nan"), 65536.0, 700.0]
    goods = [0, 1, interval - 1, interval, 2**63 - 1, -5]
    for s in scales:
        for good in goods:
            for finite in (True, False):
                feeds = {"scale": np.array(s, np.float32), "good_steps": np.array(good, np.int64), "finite": np.array(finite)}
                got_s, got_g = sess.run(None, feeds)
                want_s, want_g = mirror_loss_scale(s, good, finite, **attrs)
                assert same(got_s, np.array(want_s, np.float32)) and int(got_g) == want_g, (s, good, finite)


# ---------------------------------------------------------------- PhiloxUniform
# trainops_uniform on the words of the CPU Philox op (the device's words are the Rust emulation's
# business, crates/trainops-ort/src/ops/random/device.rs), transcribed.

from helpers.random_reference import skip_unless_typed  # noqa: E402
from trainops.models import node_model, philox_model  # noqa: E402

UNIFORM_TYPES = {np.float32: (1, 0x7FFFFF, 0), F16: (10, 0x3FF, 13), BF16: (16, 0x7F, 16), np.float64: (11, 0, 0)}


@np.errstate(all="ignore")  # the transcriptions meet Inf and NaN on purpose
def mirror_uniform(words: np.ndarray, dtype, low: float, high: float) -> np.ndarray:
    _, mask, shift = UNIFORM_TYPES[dtype]
    if dtype == np.float64:
        w = words.astype(np.uint64)
        bits = np.uint64(0x3FF0000000000000) | ((w[0::2] & np.uint64(0xFFFFF)) << np.uint64(32)) | w[1::2]
        return (bits.view(np.float64) - 1.0) * (float(f32(high)) - float(f32(low))) + float(f32(low))
    u = (np.uint32(0x3F800000) | ((words & np.uint32(mask)) << np.uint32(shift))).view(np.float32) - f32(1)
    v = u * (f32(high) - f32(low)) + f32(low)
    return {np.float32: lambda a: a, F16: cast_f16, BF16: cast_bf16}[dtype](v)


@pytest.mark.parametrize("dtype", list(UNIFORM_TYPES), ids=["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("low_high", [(0.0, 1.0), (-1.75, 3.5), (1e-3, 7e4)], ids=str)
def test_philox_uniform_kernel_arithmetic(make_session, dtype, low_high):
    low, high = low_high
    tp = UNIFORM_TYPES[dtype][0]
    skip_unless_typed(tp)  # onnxruntime < 1.24: PhiloxUniform gives float outputs only
    state = np.array([0xFFFFFFFE, 0xFFFFFFFF, 0xFFFFFFFF, 7, 0x12345678, 0x9ABCDEF0], np.uint32)
    philox = make_session(philox_model())
    per = 2 if dtype == np.float64 else 1
    for n in LENGTHS:
        words, _ = philox.run(None, {"state": state, "shape": np.array([n * per], np.int64)})
        m = node_model("PhiloxUniform", [("state", np.uint32, (6,))], [("output", dtype, None), ("state_out", np.uint32, (6,))],
                       domain="com.trainops", shape=[n], dtype=tp, low=low, high=high)
        got, got_state = run_io(make_session(m), {"state": state})
        assert same(got, mirror_uniform(words, dtype, low, high)), f"n = {n}"
        blocks = (n * per + 3) // 4
        counter = sum(int(w) << (32 * k) for k, w in enumerate(state[:4])) + blocks
        assert [int(w) for w in got_state] == [(counter >> (32 * k)) & 0xFFFFFFFF for k in range(4)] + [int(w) for w in state[4:]]


# ---------------------------------------------------------------- PhiloxNormal
# trainops_normal on the words of the CPU Philox op, transcribed: TensorFlow's Box-Muller with
# the float64 log, sqrt, sin and cos of Python's math module (the C library's, as the CPU
# kernel's Rust std calls). On a GPU they are CUDA's (log 1 ulp, sin and cos 2 ulp): this
# checks the layout, the uniforms, the roundings and the state; scripts/gpu_check the rest.

TWO_PI = 2.0 * math.pi  # as Rust's 2.0 * PI, and trainops_normal's 0x401921FB54442D18
assert np.float64(TWO_PI).view(np.uint64) == 0x401921FB54442D18


def _box_muller(u1: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """Interleaved z0, z1 of each pair, float64, element by element through libm."""
    z = np.empty(2 * len(u1), np.float64)
    for j, (a, b) in enumerate(zip(u1.tolist(), v1.tolist())):
        r = math.sqrt(-2.0 * math.log(a))
        z[2 * j], z[2 * j + 1] = r * math.sin(b), r * math.cos(b)
    return z


@np.errstate(all="ignore")
def mirror_normal(words: np.ndarray, dtype, n: int, mean: float, scale: float) -> np.ndarray:
    if dtype == np.float64:
        w = words.astype(np.uint64).reshape(-1, 4)

        def u64(a, b):
            bits = np.uint64(0x3FF0000000000000) | ((a & np.uint64(0xFFFFF)) << np.uint64(32)) | b
            return bits.view(np.float64) - 1.0

        u1 = np.maximum(u64(w[:, 0], w[:, 1]), 1.0e-7)
        z = _box_muller(u1, TWO_PI * u64(w[:, 2], w[:, 3]))[:n]
        return z * float(f32(scale)) + float(f32(mean))
    w = words.reshape(-1, 2)
    u = (np.uint32(0x3F800000) | (w & np.uint32(0x7FFFFF))).view(np.float32) - f32(1)
    u1 = np.maximum(u[:, 0], f32(1.0e-7))
    v1 = (TWO_PI * u[:, 1].astype(np.float64)).astype(np.float32)
    z = _box_muller(u1.astype(np.float64), v1.astype(np.float64)).astype(np.float32)[:n]
    v = z * f32(scale) + f32(mean)  # two float32 roundings, no FMA (--fmad=false)
    return {np.float32: lambda a: a, F16: cast_f16, BF16: cast_bf16}[dtype](v)


@pytest.mark.parametrize("dtype", list(UNIFORM_TYPES), ids=["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("mean_scale", [(0.0, 1.0), (-1.25, 3.5), (1e3, 1e-3)], ids=str)
def test_philox_normal_kernel_arithmetic(make_session, dtype, mean_scale):
    mean, scale = mean_scale
    tp = UNIFORM_TYPES[dtype][0]
    skip_unless_typed(tp)  # onnxruntime < 1.24: float outputs only
    state = np.array([0xFFFFFFFE, 0xFFFFFFFF, 0xFFFFFFFF, 7, 0x12345678, 0x9ABCDEF0], np.uint32)
    philox = make_session(philox_model())
    per_pair = 4 if dtype == np.float64 else 2
    for n in LENGTHS:
        count = per_pair * ((n + 1) // 2)
        words, _ = philox.run(None, {"state": state, "shape": np.array([count], np.int64)})
        m = node_model("PhiloxNormal", [("state", np.uint32, (6,))], [("output", dtype, None), ("state_out", np.uint32, (6,))],
                       domain="com.trainops", shape=[n], dtype=tp, mean=mean, scale=scale)
        got, got_state = run_io(make_session(m), {"state": state})
        assert same(got, mirror_normal(words, dtype, n, mean, scale)), f"n = {n}"
        counter = sum(int(w) << (32 * k) for k, w in enumerate(state[:4])) + (count + 3) // 4
        assert [int(w) for w in got_state] == [(counter >> (32 * k)) & 0xFFFFFFFF for k in range(4)] + [int(w) for w in state[4:]]


# ---------------------------------------------------------------- AdamW
# trainops_adamw_f32 / trainops_adamw_amsgrad_f32, transcribed: torch's lerp and addcmul are
# fused multiply-adds (__fmaf_rn), emulated exactly below.

from trainops.models import adamw_feeds, adamw_model  # noqa: E402


def fma32(a, b, c) -> np.ndarray:
    """float32 fma(a, b, c) with one rounding: a * b is exact in float64; s + e = p + c exactly
    (TwoSum); rounding s to float32 is rounding p + c, except when s is a float32 midpoint and
    e pushes the exact sum off it."""
    a, b, c = (np.asarray(t, np.float32).astype(np.float64) for t in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)
        r = s.astype(np.float32)
        toward = np.where(s > r.astype(np.float64), np.float32(np.inf), np.float32(-np.inf))
        other = np.nextafter(r, toward)
        mid = (r.astype(np.float64) + other.astype(np.float64)) / 2
        tie = (s == mid) & (e != 0) & np.isfinite(s)
        # Off the midpoint toward `other` (e has the sign of other - r): other; else r.
        pick = tie & (np.sign(e) == np.sign(other.astype(np.float64) - r.astype(np.float64)))
        return np.where(pick, other, r)


def test_fma32_is_exact_on_ties():
    """The emulation against exact rational arithmetic, on random values and on values made to
    land p + c exactly on a float32 midpoint with a tiny remainder."""
    from fractions import Fraction

    rng = np.random.default_rng(9)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = rng.standard_normal(2000).astype(np.float32)
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24, a float32 midpoint: c = +-2^-60 leaves float64's sum on
    # it with a remainder (the tie branch), c = 0 is a true tie (to even).
    a[:4] = b[:4] = np.float32(1 + 2**-12)
    c[:4] = [np.float32(2**-60), np.float32(-(2**-60)), np.float32(0), np.float32(2**-24)]
    got = fma32(a, b, c)
    for x, y, z, g in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        lo = np.float32(float(exact))
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))
        assert g == best, (x, y, z)


@np.errstate(all="ignore")  # the transcriptions meet Inf and NaN on purpose
def mirror_adamw(lr, t, xs, gs, ms, vs, vmaxs, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=1e-2, maximize=0):
    written = lambda v: float(str(np.float32(v)))  # adamw::as_written  # noqa: E731
    beta1, beta2, epsilon, weight_decay = (written(v) for v in (beta1, beta2, epsilon, weight_decay))
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    bc2_sqrt = f32(bc2**0.5)
    weight = f32(1 - beta1)
    from_end = not (-0.5 < weight < 0.5)
    lerp = weight - f32(1) if from_end else weight
    decay = f32(1 - lr * weight_decay) if weight_decay != 0 else f32(1)
    b2, omb2, eps, step = f32(beta2), f32(1 - beta2), f32(epsilon), f32(lr / bc1)
    out = ([], [], [], [])
    for k, (x, g, m, v) in enumerate(zip(xs, gs, ms, vs)):
        g = -g if maximize else g
        x = x * decay
        m_new = fma32(lerp, g - m, g if from_end else m)
        v_new = fma32(omb2 * g, g, v * b2)
        s = v_new
        if vmaxs is not None:
            a = vmaxs[k]
            s = np.where((a > v_new) | np.isnan(a), a, v_new)
            out[3].append(s)
        denom = np.sqrt(s) / bc2_sqrt + eps
        out[0].append(x - (step * m_new) / denom)
        out[1].append(m_new)
        out[2].append(v_new)
    return [a for lst in out for a in lst]


@pytest.mark.parametrize("amsgrad", [0, 1])
@pytest.mark.parametrize("attrs", [{}, dict(beta1=0.3, beta2=0.75, epsilon=0.25, weight_decay=0.0, maximize=1),
                                   dict(beta1=0.5, weight_decay=0.3)], ids=str)
def test_adamw_kernel_arithmetic(make_session, amsgrad, attrs):
    rng = np.random.default_rng(11)
    for k, n in enumerate(LENGTHS):
        shapes = [(n,), (LENGTHS[-1 - k],)]
        xs, gs, ms = ([rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3))
        vs, vmaxs = ([rng.random(s).astype(np.float32) for s in shapes] for _ in range(2))
        if n > 3:
            vmaxs[0][:3] = [np.nan, 0.0, 1e30]
        sess = make_session(adamw_model(shapes, amsgrad=amsgrad, **attrs))
        for t in (1, 7):
            got = sess.run(None, adamw_feeds(R, t, xs, gs, ms, vs, vmaxs if amsgrad else None))
            want = mirror_adamw(R, t, xs, gs, ms, vs, vmaxs if amsgrad else None, **attrs)
            assert len(got) == len(want)
            for j, (a, b) in enumerate(zip(got, want)):
                assert same(a, np.asarray(b, np.float32)), f"n = {n}, t = {t}, output {j}"
