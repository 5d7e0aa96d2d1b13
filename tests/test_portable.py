"""trainops.portable: the standard-op rewrite of the optimizer and mixed-precision nodes
has the fused kernels' bits.

Each case runs a one-node model with the library (the fused kernel) and its rewrite in a
plain onnxruntime session without the library, both on the CPU EP with the state updated in
place through IOBinding, for many steps on the same random data (odd lengths, zeros, huge
and tiny values, broadcast gradients, non-finite gradients for the mixed-precision step),
and compares every output bitwise after every step. AdamW's fused multiply-adds are
checked on their own against the C library's ``fmaf``/``fma``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

from helpers.checks import ulp_distance
from helpers.data import BF16, F16, F32, F64
from trainops.bfloat16 import from_ortvalue, to_ortvalue
from trainops.models import (adagrad_model, adam_model, adamw_model, all_finite_model,
                             dynamic_loss_scale_model, momentum_model, mixed_precision_adam_model,
                             node_model)
from trainops.onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN
from trainops.portable import ExpansionError, custom_nodes, rewrite

STEPS = 50
SHAPES = [(0,), (1,), (7,), (3, 11), (1027,)]
G_SHAPES = [(0,), (1,), (7,), (11,), (1027,)]  # (11,) broadcasts to (3, 11)
HUGE = {F32: 1e30, F64: 1e300, F16: 3e4, BF16: 1e36}
TINY = {F32: 1e-41, F64: 1e-310, F16: 1e-7, BF16: 1e-40}


def plain_session(model):
    """A CPU session WITHOUT the trainops library: the rewrite must run on stock ORT."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def spiky(rng, shape, dtype, scale=1.0, positive=False, tiny=True):
    """Normal values times ``scale`` with about 10% zeros (both signs), 3% huge and 3%
    tiny (subnormal) values of ``dtype`` (with ``tiny=False``: 6% huge)."""
    a = rng.standard_normal(shape) * scale
    u = rng.random(shape)
    a = np.where(u < 0.05, 0.0, a)
    a = np.where((u >= 0.05) & (u < 0.1), -0.0, a)
    a = np.where((u >= 0.1) & (u < 0.13), np.sign(a) * HUGE[np.dtype(dtype)], a)
    small = TINY[np.dtype(dtype)] if tiny else HUGE[np.dtype(dtype)]
    a = np.where((u >= 0.13) & (u < 0.16), np.sign(a) * small, a)
    if positive:
        a = np.abs(a)
    return a.astype(dtype)


def poison(rng, a, every=5):
    """A copy of ``a`` with a few Inf/-Inf/NaN elements (about one in ``every``)."""
    a = np.array(a, copy=True)
    if a.size:
        flat = a.reshape(-1)
        k = rng.random(flat.size) < 1.0 / every
        flat[k] = rng.choice(np.array([np.inf, -np.inf, np.nan]), size=int(k.sum())).astype(a.dtype)
    return a


class InPlace:
    """Runs ``session`` with each ``(output, input)`` of ``pairs`` bound to the input's own
    buffer (the arrays in ``state``, updated in place); other inputs are fed per step and
    the remaining outputs are returned."""

    def __init__(self, session, state: dict, pairs: dict):
        self.session = session
        self.state = {k: np.array(v, copy=True) for k, v in state.items()}
        self.values = {k: to_ortvalue(v) for k, v in self.state.items()}
        self.pairs = pairs

    def step(self, feeds: dict) -> dict:
        binding = self.session.io_binding()
        keep = []
        for name, value in self.values.items():
            binding.bind_ortvalue_input(name, value)
        for name, a in feeds.items():
            keep.append(to_ortvalue(a))
            binding.bind_ortvalue_input(name, keep[-1])
        outs = [o.name for o in self.session.get_outputs()]
        for name in outs:
            if name in self.pairs:
                binding.bind_ortvalue_output(name, self.values[self.pairs[name]])
            else:
                binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        got = {}
        for name, value in zip(outs, binding.get_outputs()):
            if name in self.pairs:
                assert value.data_ptr() == self.values[self.pairs[name]].data_ptr(), name
            else:
                got[name] = from_ortvalue(value)
        return got


def assert_same_bits(name, got, want, step, nan_bits=True):
    """Same dtype, shape and bytes; with ``nan_bits=False`` a NaN matches any NaN (the
    positions of NaN must still agree)."""
    got, want = np.asarray(got), np.asarray(want)
    if not nan_bits and got.dtype != np.bool_:
        nan = np.isnan(got.astype(np.float64))
        assert np.array_equal(nan, np.isnan(want.astype(np.float64))), f"step {step}, {name}: NaN at other places"
        got, want = np.where(nan, 0, got).astype(got.dtype), np.where(nan, 0, want).astype(want.dtype)
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape,
                                                                  want.dtype, want.shape)
    if got.tobytes() == want.tobytes():
        return
    g, w = got.reshape(-1), want.reshape(-1)
    gb, wb = g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}")
    diff = np.flatnonzero(gb != wb)
    k = int(diff[0])
    ulps = int(np.max(ulp_distance(g[diff], w[diff]))) if got.dtype != np.bool_ else None
    raise AssertionError(f"step {step}, {name}: {diff.size} of {g.size} elements differ; first at "
                         f"{k}: portable {g[k]!r} ({int(gb[k]):#x}) vs fused {w[k]!r} ({int(wb[k]):#x}); "
                         f"at most {ulps} ulps")


def assert_standard_only(model):
    """Only default-domain nodes, no custom domain imported, and a model onnx accepts."""
    domains = {n.domain for n in model.graph.node}
    assert domains <= {"", "ai.onnx"}, domains
    imported = {o.domain for o in model.opset_import}
    assert TRAINING_DOMAIN not in imported and TRAINOPS_DOMAIN not in imported, imported
    assert not custom_nodes(model)
    onnx.checker.check_model(model)


def run_pair(make_session, model, state, pairs, feeds_of, steps=STEPS, nan_bits=True):
    """Steps the fused model and its rewrite in place with the same feeds; compares every
    state array and every other output bitwise after each step. Returns the rewrite."""
    portable = rewrite(model)
    assert_standard_only(portable)
    assert [i.name for i in portable.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in portable.graph.output] == [o.name for o in model.graph.output]
    fused = InPlace(make_session(model), state, pairs)
    plain = InPlace(plain_session(portable), state, pairs)
    for step in range(steps):
        feeds = feeds_of(step)
        want, got = fused.step(feeds), plain.step(feeds)
        for name in want:
            assert_same_bits(name, got[name], want[name], step, nan_bits)
        for name in state:
            assert_same_bits(name, plain.state[name], fused.state[name], step, nan_bits)
    return portable, fused.state


def optimizer_case(rng, groups, dtype, g_dtype, shapes=SHAPES, g_shapes=G_SHAPES,
                   positive=("H",), tiny=True):
    """Initial state for streams ``groups`` (the first is X; those in ``positive``, the
    second moments, >= 0); ``tiny=False`` leaves out subnormals."""
    state = {}
    for p in groups:
        for i, s in enumerate(shapes):
            state[f"{p}_{i + 1}"] = spiky(rng, s, dtype, 0.1 if p != "X" else 1.0,
                                          positive=p in positive, tiny=tiny)
    grads = [[spiky(rng, s, g_dtype, tiny=tiny) for s in g_shapes] for _ in range(4)]
    return state, grads


def feeds_for(rng, grads, r_dtype, t0=1, extra=None):
    rates = 10.0 ** rng.uniform(-4, -1, size=STEPS)

    def feeds(step):
        f = {"R": np.array(rates[step], dtype=r_dtype), "T": np.array(t0 + step, dtype=np.int64)}
        f.update({f"G_{i + 1}": g for i, g in enumerate(grads[step % len(grads)])})
        if extra:
            f.update(extra(step))
        return f

    return feeds


TYPES = [(F32, F32), (F64, F64), (F16, F16), (BF16, BF16), (F32, F16), (F32, BF16)]
TYPE_IDS = ["f32", "f64", "f16", "bf16", "f32-g16", "f32-gbf16"]


def pairs_of(groups, n):
    return {f"{p}_{i}_new": f"{p}_{i}" for p in groups for i in range(1, n + 1)}


@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("attrs,r_dtype,t0", [
    ({}, F32, 1),
    (dict(alpha=0.85, beta=0.995, epsilon=1e-7, norm_coefficient=0.01,
          norm_coefficient_post=0.02), F64, 0),
], ids=["defaults", "all-attributes"])
def test_adam_bitwise(make_session, rng, dtype, g_dtype, attrs, r_dtype, t0):
    model = adam_model(SHAPES, dtype, r_dtype, G_SHAPES, g_dtype=g_dtype, **attrs)
    state, grads = optimizer_case(rng, "XVH", dtype, g_dtype)
    run_pair(make_session, model, state, pairs_of("XVH", len(SHAPES)),
             feeds_for(rng, grads, r_dtype, t0))


@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("attrs,r_dtype", [
    ({}, F32),
    (dict(decay_factor=0.1, epsilon=1e-7, norm_coefficient=0.01), F64),
], ids=["defaults", "all-attributes"])
def test_adagrad_bitwise(make_session, rng, dtype, g_dtype, attrs, r_dtype):
    model = adagrad_model(SHAPES, dtype, r_dtype, G_SHAPES, g_dtype=g_dtype, **attrs)
    state, grads = optimizer_case(rng, "XH", dtype, g_dtype)
    run_pair(make_session, model, state, pairs_of("XH", len(SHAPES)),
             feeds_for(rng, grads, r_dtype, 0))


@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("mode,r_dtype", [("standard", F64), ("nesterov", F32)])
def test_momentum_bitwise(make_session, rng, dtype, g_dtype, mode, r_dtype):
    model = momentum_model(SHAPES, dtype, r_dtype, G_SHAPES, g_dtype=g_dtype, alpha=0.9,
                           beta=0.7, mode=mode, norm_coefficient=0.01)
    state, grads = optimizer_case(rng, "XV", dtype, g_dtype)
    run_pair(make_session, model, state, pairs_of("XV", len(SHAPES)),
             feeds_for(rng, grads, r_dtype, 0))


def float_sqrt_is_correctly_rounded() -> bool:
    """Whether this onnxruntime's CPU ``Sqrt`` on float32 rounds correctly (1.17's does
    not: Eigen's fast path), probed on values where an approximation shows."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Sqrt", ["a"], ["z"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    a = np.random.default_rng(0).random(4096).astype(F32) * 100
    a[:3] = [np.inf, 1e-41, -0.0]
    z = plain_session(model).run(None, {"a": a})[0]
    return z.tobytes() == np.sqrt(a).tobytes()


@pytest.mark.parametrize("dtype,g_dtype", TYPES[:1] + TYPES[2:], ids=TYPE_IDS[:1] + TYPE_IDS[2:])
def test_native_sqrt_is_bitwise_where_sqrt_rounds_correctly(make_session, rng, dtype, g_dtype):
    """``sqrt="native"`` (float32 Sqrt, for EPs without float64) is bitwise too on a
    runtime whose float Sqrt is correctly rounded."""
    if not float_sqrt_is_correctly_rounded():
        pytest.skip("this onnxruntime's float32 Sqrt is not correctly rounded (1.17's is not)")
    model = adam_model(SHAPES, dtype, F32, G_SHAPES, g_dtype=g_dtype, norm_coefficient=0.01)
    portable = rewrite(model, sqrt="native")
    casts = lambda m: sum(n.op_type == "Cast" for n in m.graph.node)  # noqa: E731
    assert casts(portable) < casts(rewrite(model))  # no float64 round trip per tensor
    state, grads = optimizer_case(rng, "XVH", dtype, g_dtype)
    fused = InPlace(make_session(model), state, pairs_of("XVH", len(SHAPES)))
    plain = InPlace(plain_session(portable), state, pairs_of("XVH", len(SHAPES)))
    feeds_of = feeds_for(rng, grads, F32)
    for step in range(STEPS):
        fused.step(feeds_of(step))
        plain.step(feeds_of(step))
        for name in state:
            assert_same_bits(name, plain.state[name], fused.state[name], step)


@pytest.mark.parametrize("make_model,groups", [
    (lambda s, dt, gdt: adam_model(s, dt, F32, s, g_dtype=gdt, norm_coefficient=0.01), "XVH"),
    (lambda s, dt, gdt: adagrad_model(s, dt, F32, s, g_dtype=gdt, decay_factor=0.1), "XH"),
    (lambda s, dt, gdt: momentum_model(s, dt, F32, s, g_dtype=gdt, alpha=0.9, beta=0.9,
                                       mode="nesterov", norm_coefficient=0.0), "XV"),
], ids=["adam", "adagrad", "momentum"])
@pytest.mark.parametrize("dtype,g_dtype", [(F32, F32), (F32, F16)], ids=["f32", "f32-g16"])
def test_threaded_kernels_and_threaded_runtime_agree(make_session, rng, make_model, groups,
                                                     dtype, g_dtype):
    """Tensors large enough for the kernels' threaded chunks (and onnxruntime's), two
    threads in both sessions."""
    shapes = [(3 * 65536 + 17,)]
    model = make_model(shapes, dtype, g_dtype)
    portable = rewrite(model)
    state, grads = optimizer_case(rng, groups, dtype, g_dtype, shapes, shapes)
    pairs = pairs_of(groups, 1)
    fused = InPlace(make_session(model, threads=2), state, pairs)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    plain = InPlace(ort.InferenceSession(portable.SerializeToString(), so,
                                         providers=["CPUExecutionProvider"]), state, pairs)
    feeds_of = feeds_for(rng, grads, F32)
    for step in range(5):
        fused.step(feeds_of(step))
        plain.step(feeds_of(step))
        for name in state:
            assert_same_bits(name, plain.state[name], fused.state[name], step)


@pytest.mark.parametrize("dtype", [F32, F64, F16])
def test_optimizers_on_non_finite_gradients(make_session, rng, dtype):
    """Inf and NaN gradients: Inf and NaN land in the same places and every other value
    has the same bits. A NaN's own bits may differ: where two NaNs meet in one Add or Mul,
    x86 returns the first operand's, and which operand comes first is the compiler's choice
    (in onnxruntime's Add, in the kernels' SIMD code)."""
    model = adam_model(SHAPES, dtype, F32, G_SHAPES, norm_coefficient=0.01)
    state, grads = optimizer_case(rng, "XVH", dtype, dtype)
    grads = [[poison(rng, g, 50) for g in gs] for gs in grads]
    run_pair(make_session, model, state, pairs_of("XVH", len(SHAPES)),
             feeds_for(rng, grads, F32), steps=10, nan_bits=False)


MIXED_SHAPES = [(0,), (1,), (7,), (1027,)]


@pytest.mark.parametrize("g_dtype", [F16, BF16, F32])
@pytest.mark.parametrize("copy_dtype", [0, 10, 16])
def test_mixed_precision_adam_bitwise(make_session, rng, g_dtype, copy_dtype):
    """Skipped steps (Inf/NaN gradients, or a finite float32 gradient that overflows once
    divided by a loss scale below 1) leave the state alone in both."""
    n = len(MIXED_SHAPES)
    model = mixed_precision_adam_model(MIXED_SHAPES, g_dtype, copy_dtype or None,
                                       alpha=0.88, beta=0.99, norm_coefficient=0.001)
    state, grads = optimizer_case(rng, "XVH", F32, g_dtype, MIXED_SHAPES, MIXED_SHAPES)
    grads = [[(np.where(np.abs(g.astype(F32)) > 100, 1, g.astype(F32)) * 64).astype(g_dtype)
              for g in gs] for gs in grads]  # scaled by the loss scale, finite
    bad = [[poison(rng, g, 200) for g in gs] for gs in grads]
    scales = [64.0, 0.5, 1.0, 2.0 ** 20]
    base = feeds_for(rng, grads, F32)

    def feeds(step):
        f = base(step)
        f["loss_scale"] = np.array(scales[step % 4], np.float32)
        if step % 7 == 3:
            f.update({f"G_{i + 1}": g for i, g in enumerate(bad[step % 4])})
        if step % 11 == 5 and g_dtype == F32:
            f["G_4"] = np.full(MIXED_SHAPES[3], 3e38, np.float32)
            f["loss_scale"] = np.array(0.25, np.float32)
        return f

    flags = []
    portable, _ = run_pair(make_session, model, state, pairs_of("XVH", n), feeds)
    sess = InPlace(plain_session(portable), state, pairs_of("XVH", n))
    for step in range(STEPS):
        flags.append(bool(sess.step(feeds(step))["finite"]))
    assert not all(flags) and any(flags), flags  # both kinds of step were exercised


def test_dynamic_loss_scale_bitwise(make_session, rng):
    model = dynamic_loss_scale_model(growth_interval=3, growth_factor=2.0, backoff_factor=0.25,
                                     min_scale=2.0 ** -20)
    finite = rng.random(STEPS) < 0.8
    starts = [(65536.0, 0), (3.0e38, 2), (2.0 ** -19, 0), (1.0, 2 ** 63 - 1), (-0.0, 0),
              (np.nan, 1), (np.inf, 0)]
    for scale, good in starts:
        state = {"scale": np.array(scale, np.float32), "good_steps": np.array(good, np.int64)}
        pairs = {"new_scale": "scale", "new_good_steps": "good_steps"}
        run_pair(make_session, model, state, pairs,
                 lambda step: {"finite": np.array(finite[step])})


def test_dynamic_loss_scale_keeps_shapes(make_session):
    model = dynamic_loss_scale_model(shape=(1, 1))
    portable = rewrite(model)
    feeds = {"scale": np.full((1, 1), 8.0, np.float32), "good_steps": np.full((1, 1), 5),
             "finite": np.full((1, 1), False)}
    got = plain_session(portable).run(None, feeds)
    want = make_session(model).run(None, feeds)
    assert [a.shape for a in got] == [(1, 1), (1, 1)]
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes() and g.dtype == w.dtype


@pytest.mark.parametrize("dtypes", [[F32], [F64, F16], [BF16, F32, F16], [F16, F16]])
def test_all_finite_bitwise(make_session, rng, dtypes):
    shapes = [(1027,), (5, 3), (0,), (1,)][:len(dtypes)]
    model = all_finite_model(dtypes, shapes)
    portable = rewrite(model)
    assert_standard_only(portable)
    fused, plain = make_session(model), plain_session(portable)
    seen = set()
    for step in range(STEPS):
        xs = [spiky(rng, s, dt) for s, dt in zip(shapes, dtypes)]
        if step % 2:
            k = step % len(dtypes)
            xs[k] = poison(rng, xs[k], 100)
        feeds = {f"x_{i + 1}": x for i, x in enumerate(xs)}
        want = InPlace(fused, {}, {}).step(feeds)["finite"]
        got = InPlace(plain, {}, {}).step(feeds)["finite"]
        assert got.dtype == want.dtype == np.bool_ and got.shape == want.shape == ()
        assert got == want, step
        seen.add(bool(want))
    assert seen == {True, False}


def test_double_pow_is_the_platform_pow():
    """The bias corrections rely on onnxruntime's double ``Pow`` being the C library's
    ``pow`` (what ``f64::powf`` calls; Python's ``math.pow`` calls it too), for the
    float32-rounded betas and update counts a training run meets."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Pow", ["b", "t"], ["z"])], "g",
                              [helper.make_tensor_value_info("b", TensorProto.DOUBLE, []),
                               helper.make_tensor_value_info("t", TensorProto.DOUBLE, [])],
                              [helper.make_tensor_value_info("z", TensorProto.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = plain_session(model)
    rng = np.random.default_rng(5)
    betas = [0.9, 0.99, 0.999, 0.9999, 0.95, 0.5, 0.3] + list(rng.uniform(0, 1, 40))
    ts = list(range(1, 60)) + list(rng.integers(60, 10 ** 7, 40))
    for b in betas:
        b = float(np.float32(b))
        for t in ts:
            z = sess.run(None, {"b": np.array(b), "t": np.array(float(t))})[0]
            assert z.item() == math.pow(b, float(t)), (b, t)


# --- AdamW: the fused op's arithmetic (torch's), fma included -----------------------------

ADAMW_ATTRS = [
    {},  # torch's defaults: weight_decay 0.01
    {"weight_decay": 0.0},
    {"maximize": 1, "weight_decay": 0.1, "beta1": 0.3, "beta2": 0.99, "epsilon": 1e-6},
]


def adamw_groups(amsgrad):
    return ["X", "M", "V"] + (["Vmax"] if amsgrad else [])


@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("amsgrad", [0, 1])
@pytest.mark.parametrize("attrs", ADAMW_ATTRS, ids=["defaults", "no-decay", "maximize-betas"])
def test_adamw_matches_the_fused_op(make_session, rng, dtype, g_dtype, amsgrad, attrs):
    """Bitwise, 50 in-place steps, every type: the fma of lerp and addcmul is exact in
    float32 (so for float32, float16, bfloat16 and 16-bit gradients) and in float64 for the
    products here (no product below 2^-969: float64 data without subnormals; see the
    fma tests below for those)."""
    r_dtype = F64 if dtype == F64 else F32
    model = adamw_model(SHAPES, dtype, r_dtype, G_SHAPES, g_dtype=g_dtype, amsgrad=amsgrad, **attrs)
    groups = adamw_groups(amsgrad)
    state, grads = optimizer_case(rng, groups, dtype, g_dtype, positive=("V", "Vmax"),
                                  tiny=dtype != F64)
    run_pair(make_session, model, state, pairs_of(groups, len(SHAPES)),
             feeds_for(rng, grads, r_dtype))


def test_adamw_float64_subnormals_within_the_bound(make_session, rng):
    """float64 state and gradients with subnormals (products below Dekker's range): one
    step from the fused op's state at a time, every output within FMA64_UNDERFLOW_ULPS of
    the fused op's and most of them bitwise."""
    model = adamw_model(SHAPES, F64, F64, G_SHAPES, amsgrad=1)
    groups = adamw_groups(1)
    state, grads = optimizer_case(rng, groups, F64, F64, positive=("V", "Vmax"))
    pairs = pairs_of(groups, len(SHAPES))
    fused = InPlace(make_session(model), state, pairs)
    plain = InPlace(plain_session(rewrite(model)), state, pairs)
    feeds_of = feeds_for(rng, grads, F64)
    differ = total = 0
    for step in range(STEPS):
        fused.step(feeds_of(step))
        plain.step(feeds_of(step))
        for name in state:
            got, want = plain.state[name], fused.state[name]
            assert np.array_equal(np.isnan(got), np.isnan(want)), (step, name)
            with np.errstate(over="ignore"):  # ulp_distance's int64 sign mask
                d = ulp_distance(np.nan_to_num(got), np.nan_to_num(want))
            assert d.max(initial=0) <= FMA64_UNDERFLOW_ULPS, (step, name, d.max())
            differ, total = differ + int(np.count_nonzero(d)), total + d.size
            np.copyto(got, want)  # the next step from the fused op's state
    assert differ <= total // 1000, (differ, total)


# --- fma from standard ops, against the C library's fmaf / fma ------------------------------

# The most a float64 fma whose product underflows (below 2^-969) was measured off (README:
# 2.5e6 such cases, 0 to 4% of them off by 1 or 2 ulps).
FMA64_UNDERFLOW_ULPS = 2


def libm_fma(dtype):
    """The C library's ``fmaf`` / ``fma`` (correctly rounded) as a numpy function."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("m")
    if name is None:
        pytest.skip("no C math library to compare with")
    f = getattr(ctypes.CDLL(name), "fmaf" if dtype == F32 else "fma")
    ct = ctypes.c_float if dtype == F32 else ctypes.c_double
    f.restype, f.argtypes = ct, [ct] * 3
    ufunc = np.frompyfunc(f, 3, 1)
    return lambda a, b, c: ufunc(a, b, c).astype(dtype)


def fma_session(dtype):
    """A session computing ``trainops.portable.fma`` of three 1-D inputs ``a, b, c``."""
    from onnx import helper

    from trainops.onnx_defs import IR_VERSION
    from trainops.portable.emit import DOUBLE, FLOAT, Emitter
    from trainops.portable.fma import fma

    elem = FLOAT if dtype == F32 else DOUBLE
    node = helper.make_node("Fma", ["a", "b", "c"], ["z"], name="fma")
    e = Emitter(node, {k: elem for k in "abc"}, {"a", "b", "c", "z"})
    e.output(fma(e, "a", "b", "c", elem), "z", elem, elem)
    nodes, inits = e.finish()
    vi = lambda n: helper.make_tensor_value_info(n, elem, [None])  # noqa: E731
    graph = helper.make_graph(nodes, "fma", [vi("a"), vi("b"), vi("c")], [vi("z")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(IR_VERSION, 8)
    sess = plain_session(model)
    return lambda a, b, c: sess.run(None, {"a": a, "b": b, "c": c})[0]


def random_floats(rng, n, dtype, lo, hi):
    """``n`` values of ``dtype`` of either sign, exponents uniform in ``[lo, hi)``."""
    with np.errstate(over="ignore", under="ignore"):
        v = rng.uniform(1, 2, n) * np.exp2(rng.uniform(lo, hi, n)) * rng.choice([-1.0, 1.0], n)
        return v.astype(dtype)


def halfway_cases(rng, n, dtype, lo, hi):
    """``(a, b, c)`` with ``a * b`` near half an ulp of ``c`` and not a power of two: the
    sum rounded to the wider precision often lands exactly halfway between two values of
    ``dtype`` while the exact sum does not (double rounding's failure case)."""
    c = random_floats(rng, n, dtype, lo, hi)
    fi = np.finfo(dtype)
    ulp = np.spacing(np.abs(c)).astype(np.float64 if dtype == F32 else dtype)
    a = random_floats(rng, n, dtype, -20, 20)
    with np.errstate(all="ignore"):
        half = ulp / 2 * rng.choice([-1.0, 1.0], n)
        b = (half / a.astype(half.dtype)).astype(dtype)
    ok = np.isfinite(b) & (np.abs(c) < fi.max)
    return a[ok], b[ok], c[ok]


SPECIALS = {F32: [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38,
                  3.4028235e38, -3.4028235e38, 1.8446744e19, 2.0 ** -75, 0.5 + 2.0 ** -24],
            F64: [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 5e-324, -5e-324,
                  2.2250738585072014e-308, 1.7976931348623157e308, -1.7976931348623157e308, 1.3e154, 2.0 ** -540,
                  1.0 + 2.0 ** -52]}


def special_cases(dtype):
    v = np.array(SPECIALS[dtype], dtype)
    a, b, c = (x.reshape(-1) for x in np.meshgrid(v, v, v, indexing="ij"))
    return a, b, c


def compare_fma(got, want):
    """(positions where the bits differ, NaN aside; their ulp distances)."""
    nan = np.isnan(got) & np.isnan(want)
    bits = f"u{got.itemsize}"
    bad = ~nan & (got.view(bits) != want.view(bits))
    with np.errstate(over="ignore"):
        return bad, ulp_distance(np.where(bad, got, 0), np.where(bad, want, 0))


def test_fma32_is_exact():
    """Random operands over the whole float range (subnormals and overflow included),
    halfway cases where a double sum rounded to float goes wrong, and every combination of
    special values: bitwise the C library's fmaf."""
    rng = np.random.default_rng(32)
    ref, ours = libm_fma(F32), fma_session(F32)
    cases = [special_cases(F32)]
    for lo, hi in [(-10, 10), (-149, -100), (60, 128), (-149, 128)]:
        a, b = random_floats(rng, 40000, F32, lo, hi), random_floats(rng, 40000, F32, lo, hi)
        with np.errstate(over="ignore"):
            cases.append((a, b, (a.astype(F64) * b * rng.uniform(-2, 2, a.size)).astype(F32)))
        cases.append((a, b, random_floats(rng, a.size, F32, lo, hi)))
    for lo, hi in [(-10, 10), (-140, -100), (100, 127), (-126, 127)]:
        cases.append(halfway_cases(rng, 40000, F32, lo, hi))
    naive_wrong = 0
    for a, b, c in cases:
        with np.errstate(all="ignore"):
            want, naive = ref(a, b, c), (a.astype(F64) * b + c).astype(F32)
        bad, _ = compare_fma(ours(a, b, c), want)
        assert not bad.any(), (a[bad][:3], b[bad][:3], c[bad][:3])
        naive_wrong += int(compare_fma(naive, want)[0].sum())
    assert naive_wrong > 1000  # the halfway cases are there: double rounding misses them


def test_fma64_is_exact_in_dekkers_range_and_within_the_bound_below():
    """Bitwise the C library's fma for products of magnitude in [2^-969, 2^1023) or zero,
    and for an infinite c (an overflowing a*b with a finite c is a*b + c: c may cancel it);
    where products underflow, within FMA64_UNDERFLOW_ULPS."""
    rng = np.random.default_rng(64)
    ref, ours = libm_fma(F64), fma_session(F64)
    exact = [(special_cases(F64))]
    for lo, hi in [(-10, 10), (-480, -450), (400, 495), (-480, 495)]:
        a, b = random_floats(rng, 40000, F64, lo, hi), random_floats(rng, 40000, F64, lo, hi)
        with np.errstate(over="ignore"):
            exact.append((a, b, a * b * rng.uniform(-2, 2, a.size)))
        exact.append((a, b, random_floats(rng, a.size, F64, lo, hi)))
    for lo, hi in [(-10, 10), (-900, -800), (800, 1000), (-1000, 1000)]:
        exact.append(halfway_cases(rng, 40000, F64, lo, hi))
    naive_wrong = 0
    for a, b, c in exact:
        with np.errstate(all="ignore"):
            want, naive = ref(a, b, c), a * b + c
            p = np.abs(a * b)
        bad, _ = compare_fma(ours(a, b, c), want)
        in_range = ((p >= 2.0 ** -969) | (a == 0) | (b == 0)) & ((p < 2.0 ** 1023) | (c == p))
        assert not (bad & in_range).any(), (a[bad][:3], b[bad][:3], c[bad][:3])
        naive_wrong += int(compare_fma(naive, want)[0].sum())
    assert naive_wrong > 10000
    # Products below 2^-969 (subnormal parts): within the bound, mostly exact.
    differ = total = 0
    for lo, hi in [(-1074, -900), (-600, -400), (-1074, 0)]:
        a, b = random_floats(rng, 40000, F64, lo, hi), random_floats(rng, 40000, F64, lo, hi)
        for c in (a * b * rng.uniform(-2, 2, a.size), random_floats(rng, a.size, F64, lo, hi)):
            bad, ulps = compare_fma(ours(a, b, c), ref(a, b, c))
            assert ulps.max() <= FMA64_UNDERFLOW_ULPS, (a[bad][:3], b[bad][:3], c[bad][:3])
            differ, total = differ + int(bad.sum()), total + a.size
    assert differ <= total // 10, (differ, total)


def test_adamw_step_count_below_one_and_bad_attributes():
    """T < 1 fails at run time in a node that says so; attributes as the fused op checks."""
    model = adamw_model([(3,)], F32)
    state = {f"{p}_1": np.full(3, 0.5, F32) for p in "XMV"}
    sess = InPlace(plain_session(rewrite(model)), state, pairs_of("XMV", 1))
    feeds = {"R": np.array(0.1, F32), "G_1": np.ones(3, F32)}
    for t in (0, -3):
        with pytest.raises(Exception, match="T_must_be_at_least_1"):
            sess.step({**feeds, "T": np.array(t, np.int64)})
        assert all(np.array_equal(sess.state[k], v) for k, v in state.items())  # untouched
    sess.step({**feeds, "T": np.array(1, np.int64)})
    assert all(np.isfinite(v).all() and not np.array_equal(v, state[k])
               for k, v in sess.state.items())
    for attrs, message in [({"beta1": 1.0}, r"'beta1': expected a value in \[0, 1\)"),
                           ({"epsilon": -1.0}, "'epsilon': expected a value >= 0"),
                           ({"maximize": 2}, "'maximize': expected 0 or 1, got 2"),
                           ({"beta2": 1}, "'beta2': expected a float, got INT")]:
        with pytest.raises(ExpansionError, match=message):
            rewrite(adamw_model([(3,)], F32, **attrs))


# --- the rewrite itself -----------------------------------------------------------------

@pytest.mark.parametrize("policy", ["float32", "float64", "mixed_float16", "mixed_bfloat16"])
def test_rewrite_of_a_whole_optimizer_step(make_session, rng, policy):
    """trainops.mixed_precision's step models (step counter, Adam or MixedPrecisionAdam,
    its finite flag into DynamicLossScale) rewritten: standard ops only, and every output
    bitwise the fused graph's over many in-place steps, some with non-finite gradients."""
    from trainops.mixed_precision import Policy, optimizer_model

    policy = Policy(policy)
    shapes = {"w": (3, 4), "b": (5,), "e": (0,)}
    extra = {"growth_interval": 4} if policy.uses_loss_scaling else {}
    model = optimizer_model(list(shapes.items()), policy, **extra)
    inputs = {vi.name: vi for vi in model.graph.input}
    pairs = {o.name: o.name[:-len(".new")] for o in model.graph.output
             if o.name.endswith(".new") and o.name[:-len(".new")] in inputs}
    variable, compute = policy.variable_np_dtype, policy.compute_np_dtype
    state = {"step": np.array(0, np.int64)}
    for name, shape in shapes.items():
        state[name] = spiky(rng, shape, variable)
        state[f"{name}.m"] = spiky(rng, shape, variable, 0.1)
        state[f"{name}.v"] = spiky(rng, shape, variable, 0.01, positive=True)
    if "loss_scale" in inputs:
        state["loss_scale"] = np.array(2.0 ** 15, np.float32)
        state["good_steps"] = np.array(0, np.int64)
    lr_dtype = onnx.helper.tensor_dtype_to_np_dtype(inputs["lr"].type.tensor_type.elem_type)

    def feeds(step):
        f = {"lr": np.array(10.0 ** rng.uniform(-4, -2), lr_dtype)}
        for name, shape in shapes.items():
            g = rng.standard_normal(shape) * (2.0 ** 10 if policy.uses_loss_scaling else 1.0)
            f[f"{name}.grad"] = (poison(rng, g, 3) if step % 6 == 5 else g).astype(compute)
        return f

    portable, _ = run_pair(make_session, model, state, pairs, feeds,
                           nan_bits=policy.is_mixed)
    assert {o.name for o in portable.graph.output} == {o.name for o in model.graph.output}


def test_untyped_input_and_bad_attribute_are_clear_errors():
    model = adam_model(1, F32)
    model.graph.input[2].type.tensor_type.elem_type = 0  # X_1 untyped
    with pytest.raises(ExpansionError, match=r"Adam node 'adam': input X_1 \('X_1'\) has no "
                                             r"known element type"):
        rewrite(model)
    rewrite(model, types={"X_1": onnx.TensorProto.FLOAT})  # types= supplies it
    with pytest.raises(ExpansionError, match="attribute 'alpha': expected a float, got INT"):
        rewrite(adam_model(1, F32, alpha=1))
    with pytest.raises(ExpansionError, match="expected 2 \\+ 4n inputs"):
        m = adam_model(1, F32)
        m.graph.node[0].input.pop()
        rewrite(m)
    old = adam_model(1, F32)
    old.opset_import[0].version = 12
    with pytest.raises(ExpansionError, match="opset 12 of the default domain; the expansion "
                                             "needs 13 or newer"):
        rewrite(old)
    with pytest.raises(ExpansionError, match="'mode'"):
        rewrite(momentum_model(1, F32, alpha=0.9, beta=0.1, mode="heavy", norm_coefficient=0.0))


# --- PhiloxDropout as Dropout with a seed -----------------------------------------------

def dropout_model(dtype, shape, ratio=True, training=True):
    inputs = [("data", dtype, shape), ("ratio", F32, ()), ("training_mode", np.bool_, ()),
              ("state", np.uint32, (6,))]
    outputs = [("output", dtype, shape), ("mask", np.bool_, shape), ("state_out", np.uint32, (6,))]
    model = node_model("PhiloxDropout", inputs, outputs, domain=TRAINOPS_DOMAIN)
    node = model.graph.node[0]
    for k, keep in ((2, training), (1, ratio)):
        if not keep:
            node.input[k] = ""
            del model.graph.input[k]
    return model


STATES = [np.array([0, 0, 0, 0, 7, 9], np.uint32),
          np.array([0xFFFFFFF0, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 1, 2], np.uint32),  # wraps
          np.array([0xFFFFFFFF, 5, 0xFFFFFFFF, 3, 0xDEADBEEF, 0xCAFEF00D], np.uint32)]


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 333)])
def test_dropout_state_advances_as_philox_dropout_does(make_session, rng, dtype, shape):
    """state_out (in place) has the fused op's bits after every step, in training mode and
    out of it; the output is ``data * scale * keep`` (within 1 ulp where kept) (IEEE: -0 for a dropped negative),
    ``scale = 1 / (1 - ratio)`` in the data's precision (float32 for 16-bit data)."""
    model = dropout_model(dtype, shape)
    data = spiky(rng, shape, dtype)
    data = np.where(np.abs(data.astype(F64)) > 1e4, 1, data.astype(F64)).astype(dtype)
    for state in STATES:
        def feeds(step):
            return {"data": data, "ratio": np.array(0.3, np.float32),
                    "training_mode": np.array(step % 3 != 2)}

        portable = rewrite(model)
        assert_standard_only(portable)
        fused = InPlace(make_session(model), {"state": state}, {"state_out": "state"})
        plain = InPlace(plain_session(portable), {"state": state}, {"state_out": "state"})
        for step in range(12):
            want, got = fused.step(feeds(step)), plain.step(feeds(step))
            assert_same_bits("state", plain.state["state"], fused.state["state"], step)
            if step % 3 == 2:  # not training: the data, all kept, both
                for name in ("output", "mask"):
                    assert_same_bits(name, got[name], want[name], step)
                continue
            wide = F64 if dtype == F64 else F32
            scale = wide.type(1) / (wide.type(1) - wide.type(np.float32(0.3)))
            expect = (data.astype(wide) * scale * got["mask"].astype(wide)).astype(dtype)
            out = got["output"]
            assert out.dtype == expect.dtype and out.shape == expect.shape
            dropped = ~got["mask"]
            assert_same_bits("dropped", out[dropped], expect[dropped], step)
            # Kept: onnxruntime's Dropout scales in its own order (within 1 ulp).
            with np.errstate(over="ignore"):  # ulp_distance's int64 sign mask
                assert np.all(ulp_distance(out[~dropped], expect[~dropped]) <= 1), step
        counter = int.from_bytes(state[:4].astype("<u4").tobytes(), "little")
        words = -(-data.size // 4) * sum(s % 3 != 2 for s in range(12))
        new = plain.state["state"]
        assert int.from_bytes(new[:4].astype("<u4").tobytes(), "little") == (counter + words) % 2**128
        assert list(new[4:]) == list(state[4:])


def test_dropout_masks_repeat_per_session_and_keep_about_one_minus_ratio(rng):
    model = rewrite(dropout_model(F32, (4000,)))
    feeds = {"data": np.ones(4000, F32), "ratio": np.array(0.25, F32),
             "training_mode": np.array(True), "state": STATES[0]}
    a, b = plain_session(model), plain_session(model)
    masks_a = [a.run(None, feeds)[1] for _ in range(3)]
    masks_b = [b.run(None, feeds)[1] for _ in range(3)]
    for ma, mb in zip(masks_a, masks_b):
        assert np.array_equal(ma, mb)  # run k of any session of the model: the same mask
        assert abs(ma.mean() - 0.75) < 0.03
    assert not np.array_equal(masks_a[0], masks_a[1])  # each run draws anew
    other = plain_session(rewrite(dropout_model(F32, (4000,)), dropout_seed=1)).run(None, feeds)[1]
    assert not np.array_equal(other, masks_a[0])


def test_dropout_without_ratio_or_training_mode_is_the_identity(make_session, rng):
    model = dropout_model(F32, (5, 7), ratio=False, training=False)
    portable = rewrite(model)
    assert_standard_only(portable)
    feeds = {"data": spiky(rng, (5, 7), F32), "state": STATES[1]}
    for name, g, w in zip(["output", "mask", "state_out"], plain_session(portable).run(None, feeds),
                          make_session(model).run(None, feeds)):
        assert_same_bits(name, g, w, 0)


def _depends_on(model) -> dict[str, set[str]]:
    """For each graph output, the graph inputs it depends on (subgraph captures counted)."""
    from trainops.autodiff.graph import node_inputs

    reach = {i.name: {i.name} for i in model.graph.input}
    for n in model.graph.node:  # the rewrite keeps the nodes topologically ordered
        deps = set().union(*(reach.get(x, set()) for x in node_inputs(n)))
        for o in n.output:
            reach[o] = deps
    return {o.name: reach[o.name] for o in model.graph.output}


@pytest.mark.parametrize("make", [
    lambda: adam_model([(3,), (2, 2), (5,)]),
    lambda: adagrad_model([(3,), (4,)]),
    lambda: momentum_model([(3,), (4,)], alpha=0.9, beta=1.0, mode="nesterov",
                           norm_coefficient=0.0),
    lambda: adamw_model([(3,), (4,)], amsgrad=1),
    lambda: adamw_model([(3,), (4,)], F16, r_dtype=F32),
    lambda: mixed_precision_adam_model([(3,), (4,)], F16, copy_dtype=onnx.TensorProto.FLOAT16),
], ids=["Adam", "Adagrad", "Momentum", "AdamW-amsgrad", "AdamW-float16", "MixedPrecisionAdam"])
def test_every_output_waits_for_every_input(make):
    """As the fused node, which reads all its inputs before it writes: with in-place
    IOBinding, an output written before some input is read (another tensor's gradient,
    computed from the old weights) would change that input."""
    model = make()
    inputs = {i.name for i in model.graph.input}
    for out, deps in _depends_on(rewrite(model)).items():
        assert deps == inputs, (out, sorted(inputs - deps))
