"""The float32-only portable rewrite (``rewrite(float64=False)``, built for execution
providers without float64: WebGPU, DirectML, WebNN, JS) against the fused CPU kernels and
against float64 numpy.

What it computes (trainops.portable.ff, trainops.portable.fma.fma_split): AdamW's two
fmas by Dekker's product and TwoSums in float32, correctly rounded wherever a product is
zero or at least 2^-102 in magnitude; the per-call scalars (``lr / (1 - beta1^T)``, ...) in
float-float, the float64 value rounded to float32 but where it lies within about 2^-34
(relative) of a midpoint between two floats (then 1 ulp off); square roots native. So on a
runtime whose float32 ``Sqrt`` and ``Div`` are correctly rounded (onnxruntime 1.32's CPU EP)
the update is the fused kernel's but for those rare ties and for fmas whose product
underflows, each at most :data:`MAX_ULPS` off; elsewhere a native ``Sqrt`` / ``Div`` k ulps
off adds k ulps to the update term (:func:`adamw_reference` carries them as 1 ulp each
against float64 numpy).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers.checks import ulp_distance
from helpers.data import BF16, F16, F32
from test_portable import (G_SHAPES, SHAPES, STEPS, InPlace, compare_fma, feeds_for, halfway_cases,
                           libm_fma, optimizer_case, pairs_of, plain_session, random_floats,
                           special_cases, float_sqrt_is_correctly_rounded)
from trainops.models import (adagrad_model, adam_model, adamw_model, all_finite_model,
                             dynamic_loss_scale_model, mixed_precision_adam_model, momentum_model)
from trainops.onnx_defs import IR_VERSION
from trainops.portable import NO_FLOAT64, ExpansionError, has_float64, rewrite

U = 2.0 ** -24
DOUBLE = TensorProto.DOUBLE
# The most an output of the float32-only step was measured off the fused kernel's (a
# scalar's tie, 1 ulp of a coefficient; an fma whose product underflows): ulps.
MAX_ULPS = 2


def float64_uses(model) -> list[str]:
    """Every place ``model`` (its graph and subgraphs, and onnx's shape inference of them)
    holds or makes a float64 value: value types, initializers, Constant values and the
    ``to`` / ``dtype`` attributes of Cast, CastLike's targets, random and EyeLike ops."""
    found = []

    def tensor(t, where):
        if t.data_type == DOUBLE:
            found.append(f"{where}: {t.name or 'tensor'}")

    def graph(g, where):
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == DOUBLE:
                found.append(f"{where}: value {vi.name}")
        for init in g.initializer:
            tensor(init, f"{where}: initializer")
        for n in g.node:
            for a in n.attribute:
                if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == DOUBLE:
                    found.append(f"{where}: {n.op_type} {n.name} {a.name}=double")
                if a.type == onnx.AttributeProto.TENSOR:
                    tensor(a.t, f"{where}: {n.op_type} {n.name}")
                if a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g, f"{where}/{n.name}")

    graph(model.graph, "graph")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        graph(inferred.graph, "inferred")
    except Exception:  # noqa: BLE001 - inference is extra evidence; the declared types were checked
        pass
    return found


OPTIMIZERS = {
    "adam": lambda dt, gdt: adam_model(SHAPES, dt, F32, G_SHAPES, g_dtype=gdt, norm_coefficient=0.01),
    "adagrad": lambda dt, gdt: adagrad_model(SHAPES, dt, F32, G_SHAPES, g_dtype=gdt, decay_factor=0.1),
    "momentum": lambda dt, gdt: momentum_model(SHAPES, dt, F32, G_SHAPES, g_dtype=gdt, alpha=0.9,
                                               beta=0.9, mode="nesterov", norm_coefficient=0.0),
    "adamw": lambda dt, gdt: adamw_model(SHAPES, dt, F32, G_SHAPES, g_dtype=gdt),
    "adamw-amsgrad": lambda dt, gdt: adamw_model(SHAPES, dt, F32, G_SHAPES, g_dtype=gdt, amsgrad=1,
                                                 maximize=1, weight_decay=0.1, beta1=0.3, beta2=0.99),
}
GROUPS = {"adam": "XVH", "adagrad": "XH", "momentum": "XV", "adamw": ["X", "M", "V"],
          "adamw-amsgrad": ["X", "M", "V", "Vmax"]}
POSITIVE = {"adam": ("H",), "adagrad": ("H",), "momentum": (), "adamw": ("V",),
            "adamw-amsgrad": ("V", "Vmax")}
TYPES = [(F32, F32), (F16, F16), (BF16, BF16), (F32, F16)]
TYPE_IDS = ["f32", "f16", "bf16", "f32-g16"]


def test_the_eps_without_float64_get_the_float32_form():
    assert {"WebGpuExecutionProvider", "DmlExecutionProvider", "WebNNExecutionProvider",
            "JsExecutionProvider"} <= NO_FLOAT64
    assert has_float64(["CPUExecutionProvider"]) and has_float64(["CUDAExecutionProvider"])
    assert not has_float64(["WebGpuExecutionProvider", "CPUExecutionProvider"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=TYPE_IDS)
def test_no_float64_anywhere(name, dtype, g_dtype):
    """The float32 form holds no float64 value (the float64 form does but for Momentum,
    which has no per-call scalar), and uses none of the ops WebGPU lacks (Or, Xor, IsInf,
    IsNaN, Sum)."""
    model = OPTIMIZERS[name](dtype, g_dtype)
    assert bool(float64_uses(rewrite(model))) == (name != "momentum")
    portable = rewrite(model, float64=False)
    assert float64_uses(portable) == []
    onnx.checker.check_model(portable)
    ops = {n.op_type for n in portable.graph.node}
    assert not ops & {"Or", "Xor", "IsInf", "IsNaN", "Sum", "Pow"}, ops


@pytest.mark.parametrize("model", [
    mixed_precision_adam_model([(3,), (7,)], F16, 10, alpha=0.88, beta=0.99),
    dynamic_loss_scale_model(growth_interval=3),
    all_finite_model([F32, F16], [(3,), (5,)]),
], ids=["mixed_precision_adam", "dynamic_loss_scale", "all_finite"])
def test_no_float64_in_the_mixed_precision_ops(model):
    portable = rewrite(model, float64=False)
    assert float64_uses(portable) == []
    assert not {n.op_type for n in portable.graph.node} & {"Or", "Xor", "IsInf", "IsNaN", "Sum"}


def test_double_weights_or_rate_are_refused_without_float64():
    without = r"got tensor\(double\) \(float64=False, .*takes no double value\)"
    with pytest.raises(ExpansionError, match=r"AdamW node 'adamw': input X_1 .*" + without):
        rewrite(adamw_model([(3,)], np.float64, F32), float64=False)
    with pytest.raises(ExpansionError, match=r"Adam node 'adam': input R .*" + without):
        rewrite(adam_model([(3,)], F32, np.float64), float64=False)
    with pytest.raises(ExpansionError, match=r"AllFinite node .*input X_1 .*" + without):
        rewrite(all_finite_model([np.float64], [(3,)]), float64=False)


# --- fma in float32 against the C library's fmaf -------------------------------------------

def fma_session_f32():
    """A CPU session of :func:`trainops.portable.fma.fma_split` on floats, float32 only."""
    from trainops.portable.emit import FLOAT, Emitter
    from trainops.portable.fma import fma_split

    node = helper.make_node("Fma", ["a", "b", "c"], ["z"], name="fma")
    e = Emitter(node, {k: FLOAT for k in "abc"}, {"a", "b", "c", "z"}, float64=False)
    e.output(fma_split(e, "a", "b", "c", FLOAT), "z", FLOAT, FLOAT)
    nodes, inits = e.finish()
    vi = lambda n: helper.make_tensor_value_info(n, FLOAT, [None])  # noqa: E731
    model = helper.make_model(helper.make_graph(nodes, "fma", [vi("a"), vi("b"), vi("c")],
                                                [vi("z")], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(IR_VERSION, 8)
    assert float64_uses(model) == []
    sess = plain_session(model)
    return lambda a, b, c: sess.run(None, {"a": a, "b": b, "c": c})[0]


# Products below 2^-102 (a partial product of Dekker's split underflows): the most
# measured off fmaf (as the float64 form's FMA64_UNDERFLOW_ULPS below 2^-969).
FMA32_UNDERFLOW_ULPS = 2


def test_fma_split_float32_is_exact_in_dekkers_range_and_within_the_bound_below():
    """Bitwise fmaf for products of magnitude in [2^-102, 2^127) or zero (and an infinite
    c), over random operands, the halfway cases of a rounded sum and every pair of special
    values; where products underflow, within FMA32_UNDERFLOW_ULPS, mostly exact."""
    rng = np.random.default_rng(3232)
    ref, ours = libm_fma(F32), fma_session_f32()
    exact = [special_cases(F32)]
    for lo, hi in [(-10, 10), (-50, -40), (40, 60), (-50, 60)]:
        a, b = random_floats(rng, 40000, F32, lo, hi), random_floats(rng, 40000, F32, lo, hi)
        with np.errstate(over="ignore", under="ignore"):
            exact.append((a, b, (a.astype(np.float64) * b * rng.uniform(-2, 2, a.size)).astype(F32)))
        exact.append((a, b, random_floats(rng, a.size, F32, lo, hi)))
    for lo, hi in [(-10, 10), (-90, -60), (60, 120), (-100, 120)]:
        exact.append(halfway_cases(rng, 40000, F32, lo, hi))
    for a, b, c in exact:
        with np.errstate(all="ignore"):
            want = ref(a, b, c)
            p = np.abs(a.astype(np.float64) * b)
        bad, _ = compare_fma(ours(a, b, c), want)
        in_range = ((p >= 2.0 ** -102) | (a == 0) | (b == 0)) & ((p < 2.0 ** 127) | np.isinf(c))
        wrong = bad & in_range
        assert not wrong.any(), (a[wrong][:3], b[wrong][:3], c[wrong][:3], ours(a, b, c)[wrong][:3], want[wrong][:3])
    differ = total = 0
    for lo, hi in [(-149, -100), (-80, -40), (-149, 0)]:
        a, b = random_floats(rng, 40000, F32, lo, hi), random_floats(rng, 40000, F32, lo, hi)
        with np.errstate(all="ignore"):
            cs = ((a.astype(np.float64) * b * rng.uniform(-2, 2, a.size)).astype(F32),
                  random_floats(rng, a.size, F32, lo, hi))
        for c in cs:
            with np.errstate(all="ignore"):
                bad, ulps = compare_fma(ours(a, b, c), ref(a, b, c))
            assert ulps.max() <= FMA32_UNDERFLOW_ULPS, (a[bad][:3], b[bad][:3], c[bad][:3])
            differ, total = differ + int(bad.sum()), total + a.size
    assert differ <= total // 10, (differ, total)


# --- the optimizers against the fused kernels, 50 in-place steps -----------------------------

@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype,g_dtype", TYPES, ids=TYPE_IDS)
def test_float32_form_against_the_fused_kernels(make_session, rng, name, dtype, g_dtype):
    """From the fused kernel's state at every step: each output within MAX_ULPS of the
    kernel's, NaN where it has NaN, and (where this onnxruntime's float32 Sqrt is correctly
    rounded, which the float32 form uses as is) at most one element in a thousand off."""
    if not float_sqrt_is_correctly_rounded():
        pytest.skip("this onnxruntime's float32 Sqrt is not correctly rounded (1.17's is not): "
                    "the float32 form's native square root differs there by design")
    model = OPTIMIZERS[name](dtype, g_dtype)
    groups = GROUPS[name]
    state, grads = optimizer_case(rng, groups, dtype, g_dtype, positive=POSITIVE[name])
    pairs = pairs_of(groups, len(SHAPES))
    fused = InPlace(make_session(model), state, pairs)
    ours = InPlace(plain_session(rewrite(model, float64=False)), state, pairs)
    feeds_of = feeds_for(rng, grads, F32)
    differ = total = 0
    for step in range(STEPS):
        fused.step(feeds_of(step))
        ours.step(feeds_of(step))
        for k in state:
            got, want = ours.state[k], fused.state[k]
            wide_got, wide_want = got.astype(np.float64), want.astype(np.float64)
            assert np.array_equal(np.isnan(wide_got), np.isnan(wide_want)), (step, k)
            with np.errstate(over="ignore"):
                d = ulp_distance(np.where(np.isnan(wide_got), 0, got).astype(got.dtype),
                                 np.where(np.isnan(wide_want), 0, want).astype(want.dtype))
            assert d.max(initial=0) <= MAX_ULPS, (step, k, d.max())
            differ, total = differ + int(np.count_nonzero(d)), total + d.size
            np.copyto(got, want)  # the next step from the fused kernel's state
    assert differ <= total // 1000, (differ, total)


def scalar_session(attrs: dict):
    """A CPU session of AdamW's per-call scalars in float-float, element-wise over vectors
    ``lr`` and ``t`` (float32): outputs ``decay``, ``step``, ``bc2``."""
    from trainops.portable.adamw import _scalars_ff
    from trainops.portable.emit import FLOAT, Emitter

    node = helper.make_node("AdamW", ["lr", "t"], ["o"], name="scalars")
    e = Emitter(node, {"lr": FLOAT, "t": FLOAT}, {"lr", "t"}, float64=False)
    outs = dict(zip(("decay", "step", "bc2"), _scalars_ff(e, attrs, "lr", "t")))
    for name, value in outs.items():
        e.nodes.append(helper.make_node("Identity", [value], [name]))
    vi = lambda n: helper.make_tensor_value_info(n, FLOAT, [None])  # noqa: E731
    model = helper.make_model(helper.make_graph(e.nodes, "scalars", [vi("lr"), vi("t")],
                                                [vi(n) for n in outs], e.initializers),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(IR_VERSION, 8)
    assert float64_uses(model) == []
    sess = plain_session(model)
    return lambda lr, t: dict(zip(outs, sess.run(None, {"lr": lr, "t": t})))


@pytest.mark.parametrize("b1,b2,wd", [(0.9, 0.999, 0.01), (0.3, 0.99, 0.1), (0.95, 0.99999, 0.05)])
def test_per_call_scalars_are_the_float64_ones_rounded(b1, b2, wd):
    """``1 - lr * wd``, ``lr / (1 - beta1^T)`` and ``(1 - beta2^T) ** 0.5`` in float-float
    against the fused kernel's float64 computation rounded to float32, for every T up to
    2^17 and 20000 more up to 2^31: within 1 ulp (the float-float value is within about
    2^-34 of the exact one, so it rounds the other way only within that of a midpoint),
    and differing in at most 1 case in 500 (2^-34 / 2^-24 of midpoints' width, twice)."""
    from trainops.portable.adamw import as_written

    attrs = {"beta1": as_written(b1), "beta2": as_written(b2), "weight_decay": as_written(wd)}
    rng = np.random.default_rng(17)
    t = np.concatenate([np.arange(1, 2 ** 17), rng.integers(2 ** 17, 2 ** 31, 20000)])
    lr = (10.0 ** rng.uniform(-5, -1, t.size)).astype(F32)
    got = scalar_session(attrs)(lr, t.astype(F32))
    lr64, t64 = lr.astype(np.float64), t.astype(np.float64)
    want = {"decay": 1 - lr64 * attrs["weight_decay"],
            "step": lr64 / (1 - np.power(attrs["beta1"], t64)),
            "bc2": (1 - np.power(attrs["beta2"], t64)) ** 0.5}
    for name, value in want.items():
        d = ulp_distance(got[name], value.astype(F32))
        assert d.max() <= 1, (name, d.max(), t[d.argmax()])
        assert np.count_nonzero(d) <= d.size // 500, (name, np.count_nonzero(d))


# --- against float64 numpy, with a bound carried through each rounding -----------------------

class Bounded:
    """A value computed exactly in float64 (``v``) and a bound ``e`` on how far a float32
    evaluation may be from it: each operation rounds to nearest (relative ``U``, plus half
    the smallest subnormal), a native ``Sqrt`` / ``Div`` may be ``ULPS`` ulps off (faithful:
    1; relative 2U each), and the bounds of the operands propagate through it."""

    ULPS = 1
    TINY = 2.0 ** -150

    def __init__(self, v, e=0.0):
        self.v, self.e = np.asarray(v, np.float64), np.asarray(e, np.float64)

    @classmethod
    def const(cls, exact: float, ulps: float = 0.5):
        """A coefficient rounded to float32 (``ulps``: 0.5 rounded once, 1 for a float-float
        scalar that may round the other way in a tie)."""
        return cls(exact, abs(exact) * 2 * ulps * U)

    def _round(self, v, e, ulps=0.5):
        return Bounded(v, e + 2 * ulps * U * (np.abs(v) + e) + self.TINY)

    def __add__(self, o):
        return self._round(self.v + o.v, self.e + o.e)

    def __neg__(self):
        return Bounded(-self.v, self.e)

    def __sub__(self, o):
        return self + (-o)

    def __mul__(self, o):
        return self._round(self.v * o.v, np.abs(self.v) * o.e + np.abs(o.v) * self.e + self.e * o.e)

    def fma(self, b, c):
        """``self * b + c`` rounded once."""
        e = np.abs(self.v) * b.e + np.abs(b.v) * self.e + self.e * b.e + c.e
        return self._round(self.v * b.v + c.v, e)

    def __truediv__(self, o):
        v = self.v / o.v
        return self._round(v, (self.e + np.abs(v) * o.e) / (np.abs(o.v) - o.e), self.ULPS)

    def sqrt(self):
        v = np.sqrt(self.v)
        e = self.e / (v + np.sqrt(np.maximum(self.v - self.e, 0.0)) + 1e-300)
        return self._round(v, np.minimum(e, np.sqrt(self.e)), self.ULPS)


def adamw_reference(x, g, m, v, lr, t, a):
    """AdamW (the kernel's order) in float64 from the float32 inputs, as :class:`Bounded`
    values ``(x', m', v')``: the exact scalars, each float32 coefficient rounded once, the
    float-float scalars within 1 ulp."""
    B = Bounded
    decay = B.const(1 - lr * a["weight_decay"], 1)
    step = B.const(lr / (1 - a["beta1"] ** t), 1)
    bc2 = B.const((1 - a["beta2"] ** t) ** 0.5, 1)
    x1 = B(x) * decay
    m1 = B.const(1 - a["beta1"]).fma(B(g) - B(m), B(m))
    v1 = (B.const(1 - a["beta2"]) * B(g)).fma(B(g), B(v) * B.const(a["beta2"]))
    denom = v1.sqrt() / bc2 + B.const(a["epsilon"])
    return x1 - (step * m1) / denom, m1, v1


def test_adamw_float32_form_against_float64_within_the_bound():
    """One AdamW step of the float32 form from random float32 state (normal values, zeros,
    gradients over six decades), T from 1 to 10^4: x', m' and v' within the bound
    :func:`adamw_reference` carries from float64 numpy. The same bound holds on an EP
    whose float32 Sqrt and Div are faithful (1 ulp)."""
    from trainops.portable.adamw import ADAMW_DEFAULTS, as_written

    rng = np.random.default_rng(5)
    n = 4096
    model = adamw_model([(n,)], F32, F32, [(n,)], weight_decay=0.05)
    a = {k: as_written(v) for k, v in {**ADAMW_DEFAULTS, "weight_decay": 0.05}.items()}
    sess = plain_session(rewrite(model, float64=False))
    worst = 0.0
    for t in (1, 2, 3, 10, 100, 1000, 10000):
        x = rng.standard_normal(n).astype(F32)
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0, n)).astype(F32)
        m = (rng.standard_normal(n) * 0.1).astype(F32)
        v = (rng.random(n) * 0.01).astype(F32)
        x[:64] = g[64:128] = m[128:192] = v[192:256] = 0.0
        lr = np.float32(10.0 ** rng.uniform(-4, -1))
        got = sess.run(None, {"R": np.array(lr, F32), "T": np.array(t, np.int64), "X_1": x,
                              "G_1": g, "M_1": m, "V_1": v})
        for name, y, b in zip("xmv", got, adamw_reference(x, g, m, v, float(lr), t, a)):
            err = np.abs(y.astype(np.float64) - b.v)
            assert (err <= b.e).all(), (t, name, float(np.max(err / b.e)))
            worst = max(worst, float(np.max(err / b.e)))
    assert worst > 0.0  # the comparison saw rounding (a bound of 0 everywhere would be wrong)


# --- an MLP over training steps --------------------------------------------------------------

def test_mlp_training_float32_form_against_the_float64_form(monkeypatch):
    """20 AdamW steps of an MLP, the portable step graph with and without float64 (the same
    forward and backward, so only the optimizer's arithmetic differs): bitwise the same
    losses and parameters where this onnxruntime's float32 Sqrt is correctly rounded; else
    the losses within 1e-5 relative."""
    from trainops import Trainer, optim
    from trainops.demos.train import mlp_model
    import importlib

    rewrite_module = importlib.import_module("trainops.portable.rewrite")

    rng = np.random.default_rng(9)
    batches = []
    for _ in range(20):
        x = rng.standard_normal((16, 12)).astype(F32)
        batches.append({"x": x, "t": np.abs(x[:, :5]).argmax(1).astype(np.int64)})

    def train():
        tr = Trainer(mlp_model(seed=2, sizes=(12, 32, 32, 5)), "loss", seed=5, portable=True,
                     optimizer=optim.AdamW(lr=0.01, weight_decay=0.05))
        return tr, [tr.step(b) for b in batches]

    wide, wide_losses = train()
    assert float64_uses(wide.training_model())
    monkeypatch.setattr(rewrite_module, "NO_FLOAT64", frozenset({"CPUExecutionProvider"}))
    narrow, losses = train()
    assert float64_uses(narrow.training_model()) == []
    # host memory is the CPU EP's device: nothing crosses, state or data
    assert set(narrow.transfers.last_step.values()) == {0}
    assert set(narrow.transfers.total.values()) == {0}
    if float_sqrt_is_correctly_rounded():
        assert losses == wide_losses
        for k, w in wide.parameters().items():
            assert narrow.parameters()[k].tobytes() == w.tobytes(), k
    else:
        np.testing.assert_allclose(losses, wide_losses, rtol=1e-5)


def test_tensors_of_one_type_are_updated_together():
    """The float32 form's AdamW joins its tensors (a GPU runs each node as a dispatch): an
    extra tensor adds its loads, flattening and parts (under 60 nodes), not another
    update (a few hundred)."""
    def nodes(n):
        return len(rewrite(adamw_model([(5,)] * n, F32, F32), float64=False).graph.node)

    one, per_tensor = nodes(1), (nodes(20) - nodes(2)) / 18
    assert per_tensor < 60 and one > 5 * per_tensor, (one, per_tensor)


def test_joined_updates_are_cut_at_the_limit(monkeypatch, rng):
    """Tensors join up to flat.LIMIT elements (the transient memory): the parts, however
    cut, give the same values."""
    import importlib

    flat = importlib.import_module("trainops.portable.flat")
    model = adamw_model(SHAPES, F32, F32, G_SHAPES)
    groups = GROUPS["adamw"]
    state, grads = optimizer_case(rng, groups, F32, F32, positive=POSITIVE["adamw"])
    feeds = feeds_for(rng, grads, F32)(0)
    whole = rewrite(model, float64=False)
    monkeypatch.setattr(flat, "LIMIT", 8)  # SHAPES: [0, 1, 7], [33], [1027]
    cut = rewrite(model, float64=False)
    assert len(cut.graph.node) > len(whole.graph.node) + 300  # two more updates
    runs = [InPlace(plain_session(m), state, pairs_of(groups, len(SHAPES))) for m in (whole, cut)]
    for r in runs:
        r.step(feeds)
    for k in state:
        assert runs[0].state[k].tobytes() == runs[1].state[k].tobytes(), k
