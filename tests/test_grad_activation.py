"""com.trainops::ReluGrad, LeakyReluGrad and GeluGrad (the fused CPU backward kernels): the ops against numpy in
float64 and against finite differences of the forward activation, their errors, and the
Trainer that emits them (fused) against the same Trainer under ``TRAINOPS_FUSED_GRADS=0``.

Bounds: ReluGrad and LeakyReluGrad are exact (a select, one float32 product); GeluGrad is
within 1 float32 ulp of the exact ``dY * Gelu'(X)`` (numpy float64, rounded once).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.adam_pair import assert_runs_agree, record
from trainops import Trainer, optim
from trainops.bench.train_models import family
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

F32 = np.float32
SIZES = [0, 1, 7, 8, 9, 17, 1023, 70_001]  # edges around the lanes and the threading cut
SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40, 3e38, -3e38], F32)


def grad_model(op: str, **attrs):
    """``op(dY, X) -> dX`` with dY and X of any shape."""
    node = helper.make_node(op, ["dY", "X"], ["dX"], domain=TRAINOPS_DOMAIN, **attrs)
    dyn = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, None)  # noqa: E731
    g = helper.make_graph([node], op, [dyn("dY"), dyn("X")], [dyn("dX")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def data(rng, n, scale):
    v = (rng.standard_normal(n) * scale).astype(F32)
    k = min(n, SPECIALS.size)
    v[:k] = SPECIALS[:k]
    return v


def run(sess, gy, x):
    return sess.run(None, {"dY": gy, "X": x})[0]


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 ulps (order-preserving integers; +0 and -0 are 0 apart)."""
    def key(v):
        i = np.asarray(v, F32).view(np.int32).astype(np.int64)
        return np.where(i < 0, np.int64(-(2 ** 31)) - i, i)
    return np.abs(key(a) - key(b))


# -- references (numpy float64) ----------------------------------------------------------

_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def gelu64(x, approximate):
    x = np.asarray(x, np.float64)
    if approximate == "none":
        return 0.5 * x * _erfc(-x / math.sqrt(2))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_derivative64(x, approximate):
    """Gelu'(x) in float64, by a route of its own: the erf form through erfc (accurate in
    the left tail), the tanh form through logistic functions of 2u."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if approximate == "none":
            d = 0.5 * _erfc(-x / math.sqrt(2)) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        else:
            k, c = math.sqrt(2 / math.pi), 0.044715
            u = k * (x + c * x ** 3)
            s = 0.5 * (1 + np.tanh(u))          # sigmoid(2u), fine away from the far left
            s_left = np.exp(2 * u) / (1 + np.exp(2 * u))  # the far left, no cancellation
            s = np.where(u < -5, s_left, s)
            one_minus_s = np.where(u > 0, 1 / (1 + np.exp(2 * u)), 1 - s)
            d = s + 2 * x * s * one_minus_s * k * (1 + 3 * c * x * x)
    d = np.where(np.isposinf(x), 1.0, np.where(np.isneginf(x), 0.0, d))
    return d


# -- the ops ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
def test_relu_grad_exact(make_session, rng, n):
    sess = make_session(grad_model("ReluGrad"), threads=2)
    gy, x = data(rng, n, 3.0), data(rng, n, 1.0)[::-1].copy()
    want = np.where(x.astype(np.float64) > 0, gy, F32(0)).astype(F32)
    got = run(sess, gy, x)
    assert got.dtype == F32 and got.shape == x.shape
    assert got.tobytes() == want.tobytes()
    # Relu's output stands for its input: relu(x) > 0 exactly when x > 0.
    assert run(sess, gy, np.maximum(x, F32(0))).tobytes() == want.tobytes()


def test_relu_grad_keeps_shapes_and_bits(make_session):
    sess = make_session(grad_model("ReluGrad"))
    x = np.array([[1.0, 0.0, -0.0], [-2.0, np.nan, 1e-45]], F32)
    gy = np.array([[-0.0, 5.0, 5.0], [5.0, 5.0, np.nan]], F32)
    got = run(sess, gy, x)
    want = np.array([[-0.0, 0.0, 0.0], [0.0, 0.0, np.nan]], F32)
    assert got.shape == (2, 3) and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("alpha", [0.01, 0.2, 0.0, -0.5])
@pytest.mark.parametrize("n", [0, 9, 70_001])
def test_leaky_relu_grad_exact(make_session, rng, alpha, n):
    sess = make_session(grad_model("LeakyReluGrad", alpha=alpha), threads=2)
    gy, x = data(rng, n, 3.0), data(rng, n, 1.0)
    # float64 product of two float32 values rounded once = the float32 product.
    with np.errstate(invalid="ignore"):  # 0 * inf
        want = np.where(x > 0, gy, (np.float64(F32(alpha)) * gy).astype(F32)).astype(F32)
    assert run(sess, gy, x).tobytes() == want.tobytes()


def test_leaky_relu_grad_default_alpha(make_session):
    got = run(make_session(grad_model("LeakyReluGrad")), np.ones(2, F32), np.array([1, -1], F32))
    np.testing.assert_array_equal(got, np.array([1, F32(0.01)], F32))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n", SIZES)
def test_gelu_grad_within_one_ulp_of_float64(make_session, rng, approximate, n):
    attrs = {} if approximate == "none" and n % 2 else {"approximate": approximate}
    sess = make_session(grad_model("GeluGrad", **attrs), threads=2)
    gy, x = data(rng, n, 2.0), data(rng, n, 4.0)
    got = run(sess, gy, x)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (gy.astype(np.float64) * gelu_derivative64(x, approximate)).astype(F32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert ulps(got[~nan], want[~nan]).max(initial=0) <= 1


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_grad_tails_and_specials(make_session, approximate):
    sess = make_session(grad_model("GeluGrad", approximate=approximate))
    x = np.array([-30, -12, -8, -5, -0.7518, 0, 1e-30, 5, 12, np.inf, -np.inf], F32)
    got = run(sess, np.ones_like(x), x)
    want = gelu_derivative64(x, approximate).astype(F32)
    assert ulps(got, want).max() <= 1, (got, want)
    assert got[-2] == 1 and got[-1] == 0 and got[5] == 0.5


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_grad_matches_finite_differences(make_session, rng, approximate):
    """Independent of any derivative formula: central differences of the float64 forward."""
    sess = make_session(grad_model("GeluGrad", approximate=approximate))
    x = (rng.standard_normal(200) * 3).astype(F32)
    h = 1e-5
    x64 = x.astype(np.float64)
    fd = (gelu64(x64 + h, approximate) - gelu64(x64 - h, approximate)) / (2 * h)
    got = run(sess, np.ones_like(x), x)
    np.testing.assert_allclose(got, fd, rtol=1e-5, atol=1e-7)


def test_relu_grad_matches_finite_differences(make_session, rng):
    x = rng.standard_normal(100).astype(F32)
    x = x[np.abs(x) > 1e-3]
    gy = rng.standard_normal(x.size).astype(F32)
    h = 1e-4
    fd = (np.maximum(x.astype(np.float64) + h, 0) - np.maximum(x.astype(np.float64) - h, 0)) / (2 * h)
    np.testing.assert_allclose(run(make_session(grad_model("ReluGrad")), gy, x), gy * fd, rtol=1e-6)


# -- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReluGrad", "LeakyReluGrad", "GeluGrad"])
def test_shape_mismatch_is_a_clear_error(make_session, op):
    sess = make_session(grad_model(op))
    with pytest.raises(Exception, match=rf"{op}: input 1 \(X\): expected the shape of dY, "
                                        r"\[2, 3\], got shape \[3, 2\]"):
        run(sess, np.ones((2, 3), F32), np.ones((3, 2), F32))


@pytest.mark.parametrize("op", ["ReluGrad", "GeluGrad"])
def test_double_inputs_are_refused(make_session, op):
    m = grad_model(op)
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(Exception, match=r"(?i)type|kernel|implementation"):
        sess = make_session(m)
        run(sess, np.ones(3), np.ones(3))


def test_bad_attributes_are_clear_errors(make_session):
    with pytest.raises(Exception, match=r"GeluGrad: attribute 'approximate': expected \"none\" "
                                        r"or \"tanh\", got \"fast\""):
        run(make_session(grad_model("GeluGrad", approximate="fast")), np.ones(2, F32), np.ones(2, F32))
    with pytest.raises(Exception, match=r"LeakyReluGrad: attribute 'alpha': expected a float"):
        run(make_session(grad_model("LeakyReluGrad", alpha=2)), np.ones(2, F32), np.ones(2, F32))


# -- the Trainer -------------------------------------------------------------------------

def fused_ops(tr) -> Counter:
    return Counter(n.op_type for n in tr.training_model().graph.node if n.domain == TRAINOPS_DOMAIN
                   and "Grad" in n.op_type)


def train(model, params, feeds, monkeypatch, fused: bool, steps=4, **kw):
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    tr = Trainer(model, "loss", optim.Adam(lr=1e-3), params=params, threads=1, seed=0, **kw)
    return tr, record(tr, feeds, steps)  # (losses, parameters and moments after each step)


def compare(model, params, feeds, monkeypatch, expect: set[str]):
    """The fused step against the standard-op step, after every step, within the bound of
    helpers/adam_pair.py: the two backwards sum in different orders (onnxruntime's MLAS
    kernels, whose blocking depends on the CPU, against trainops' kernels), each within
    gamma(n) sum|terms| of the exact gradient (helpers/rounding.py, from a float64
    reference of the model), and Adam turns a gradient difference D of an element whose
    gradients have RMS S into a parameter difference of about lr D / S per step. Elements
    whose gradient is a sum that cancels (a BatchNorm bias) have a small S and may differ
    by far more than a relative tolerance on the parameter allows: a fixed rtol of 1e-6
    passed on the CPU it was tuned on and failed on another (conv1.bn.b off by 3.2e-8,
    2.7e-5 relative). The moments V are checked too: a gradient 1% off in any tensor of
    these models moves V past its bound (Adam's update alone hides a uniform scale)."""
    a, ra = train(model, params, feeds, monkeypatch, True)
    b, rb = train(model, params, feeds, monkeypatch, False)
    assert set(fused_ops(a)) >= expect, fused_ops(a)
    assert not fused_ops(b)
    assert_runs_agree(model, feeds, a.optimizer, ra, rb)
    return a, b


@pytest.mark.parametrize("name,batch,expect", [
    ("bncnn", 4, {"ReluGrad", "MaxPoolGradFromInput"}),
    ("cnn", 8, {"ReluGrad", "MaxPoolGradFromInput"}),
    ("mlp", 4, {"GeluGrad"}),
])
def test_trainer_fused_matches_standard_ops(library_path, monkeypatch, name, batch, expect):
    """Relu and MaxPool grads are bit-exact; BatchNorm, the convolution's weight gradient,
    LayerNorm, Gelu (1 ulp from exact, where the standard form rounds ten times) and the
    loss's gradient round differently: compare()'s bound."""
    fam = family(name, batch)
    compare(fam.model, fam.params, fam.feeds, monkeypatch, expect)


def act_mlp(seed=0):
    """x[N,8] -> MatMul -> LeakyRelu(0.1) -> MatMul -> Gelu(tanh) -> MatMul -> loss."""
    rng = np.random.default_rng(seed)
    w = {f"w{i}": (rng.standard_normal(s) / math.sqrt(s[0])).astype(F32)
         for i, s in enumerate([(8, 16), (16, 16), (16, 5)])}
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"]),
             helper.make_node("LeakyRelu", ["h0"], ["a0"], alpha=0.1),
             helper.make_node("MatMul", ["a0", "w1"], ["h1"]),
             helper.make_node("Gelu", ["h1"], ["a1"], approximate="tanh"),
             helper.make_node("MatMul", ["a1", "w2"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    g = helper.make_graph(nodes, "act_mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
                           helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 9
    feeds = {"x": rng.standard_normal((6, 8)).astype(F32), "t": rng.integers(0, 5, 6).astype(np.int64)}
    return m, list(w), feeds


def test_trainer_leaky_relu_and_tanh_gelu(library_path, monkeypatch):
    m, params, feeds = act_mlp()
    a, _ = compare(m, params, feeds, monkeypatch, {"LeakyReluGrad", "GeluGrad"})
    node = next(n for n in a.training_model().graph.node if n.op_type == "GeluGrad")
    assert helper.get_attribute_value(node.attribute[0]) == b"tanh"


def test_portable_trainer_has_no_fused_grads(library_path, monkeypatch):
    fam = family("bncnn", 4)
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1")
    tr = Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params, portable=True)
    assert not fused_ops(tr)
    assert {n.domain for n in tr.training_model().graph.node} <= {"", "ai.onnx"}
