"""com.trainops::HardSigmoidGrad, HardSwishGrad and SiluGrad (the fused CPU backward of
mobilenet_v3's and efficientnet's activations): the ops against onnxruntime running the
standard-op rules (HardSigmoidGrad and HardSwishGrad: the same float32 operations, so the
same bits), against numpy in float64 and finite differences (SiluGrad, in float32: within
the bound ``crates/trainops-kernels/src/grad/silu.rs`` states), their
errors, and the Trainer that emits them against the same Trainer under
``TRAINOPS_FUSED_GRADS=0``.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.adam_pair import assert_runs_agree, record
from test_grad_activation import grad_model, run
from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

F32 = np.float32
SIZES = [0, 1, 7, 17, 1023, 70_001]  # edges around the lanes and the threading cut
SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40, 3.0, -3.0, 3e38, -3e38], F32)


def _model(nodes, name):
    dyn = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, None)  # noqa: E731
    g = helper.make_graph(nodes, name, [dyn("dY"), dyn("X")], [dyn("dX")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def _const(name, v):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v, F32), name))


def standard_hard_sigmoid(alpha, beta):
    """What the HardSigmoid rule emits without the fused kernels."""
    return _model([_const("a", alpha), _const("b", beta), _const("z", 0.0), _const("o", 1.0),
                   helper.make_node("Mul", ["X", "a"], ["xa"]), helper.make_node("Add", ["xa", "b"], ["u"]),
                   helper.make_node("Greater", ["u", "z"], ["gt"]), helper.make_node("Less", ["u", "o"], ["lt"]),
                   helper.make_node("And", ["gt", "lt"], ["in"]), helper.make_node("Mul", ["dY", "a"], ["ga"]),
                   helper.make_node("Where", ["in", "ga", "z"], ["dX"])], "hs")


def standard_hard_swish():
    """What the HardSwish rule emits without the fused kernels."""
    return _model([_const("three", 3.0), _const("m3", -3.0), _const("half", 0.5), _const("z", 0.0),
                   helper.make_node("Div", ["X", "three"], ["d"]), helper.make_node("Add", ["d", "half"], ["s"]),
                   helper.make_node("Mul", ["dY", "s"], ["mid"]),
                   helper.make_node("Greater", ["X", "three"], ["gt"]),
                   helper.make_node("Where", ["gt", "dY", "mid"], ["up"]),
                   helper.make_node("Less", ["X", "m3"], ["lt"]),
                   helper.make_node("Where", ["lt", "z", "up"], ["dX"])], "hw")


def data(rng, n, scale):
    v = (rng.standard_normal(n) * scale).astype(F32)
    k = min(n, SPECIALS.size)
    v[:k] = SPECIALS[:k]
    return v


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 2])
def test_hard_grads_equal_the_standard_op_rules(make_session, rng, n, threads):
    """The same float32 values (NaNs included); one zero's sign aside: onnxruntime's Where
    with a scalar third input gives +0 where its chosen branch holds -0 (dY = -0 in
    HardSigmoid's linear piece), the kernel keeps -0."""
    gy, x = data(rng, n, 2.0), data(rng, n, 4.0)
    for op, attrs, standard in (("HardSwishGrad", {}, standard_hard_swish()),
                                ("HardSigmoidGrad", {"alpha": 0.2, "beta": 0.5}, standard_hard_sigmoid(0.2, 0.5)),
                                ("HardSigmoidGrad", {"alpha": 1 / 6, "beta": 0.5},
                                 standard_hard_sigmoid(1 / 6, 0.5))):
        got = run(make_session(grad_model(op, **attrs), threads=threads), gy, x)
        want = run(make_session(standard), gy, x)
        np.testing.assert_array_equal(got, want, err_msg=f"{op} {attrs}")
        nonzero = want != 0
        np.testing.assert_array_equal(got.view(np.uint32)[nonzero], want.view(np.uint32)[nonzero])


def test_hard_grads_match_finite_differences(make_session, rng):
    """Away from the kinks (|x| = 3; HardSigmoid's u = 0, 1): central differences of the
    float64 forwards."""
    x = (rng.standard_normal(400) * 4).astype(F32)
    x = x[(np.abs(np.abs(x) - 3) > 1e-2) & (np.abs(np.abs(x) - 2.5) > 1e-2)]
    gy = rng.standard_normal(x.size).astype(F32)
    x64, h = x.astype(np.float64), 1e-6
    swish = lambda v: v * np.clip(v + 3, 0, 6) / 6  # noqa: E731
    sig = lambda v: np.clip(0.2 * v + 0.5, 0, 1)  # noqa: E731
    for op, f, attrs in (("HardSwishGrad", swish, {}), ("HardSigmoidGrad", sig, {})):
        fd = (f(x64 + h) - f(x64 - h)) / (2 * h)
        np.testing.assert_allclose(run(make_session(grad_model(op, **attrs)), gy, x), gy * fd,
                                   rtol=1e-5, atol=1e-6, err_msg=op)


def sigmoid64(x):
    """The logistic function in float64 through numpy's exp, in the form that keeps its
    relative precision in both tails."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def silu_bound(gy, x):
    """The kernel's stated bound (crates/trainops-kernels/src/grad/silu.rs): float32
    throughout, 11 u of the terms' magnitudes, 2^-100 |dY| beyond |x| = 87."""
    s = sigmoid64(x)
    return 11 * 2.0 ** -24 * np.abs(gy) * (s + 2 * np.abs(x) * s * (1 - s)) + 2.0 ** -100 * np.abs(gy)


def silu_derivative64(x):
    """SiLU'(x) in float64 by a route of its own: s + x s (1 - s) with numpy's exp."""
    x = np.asarray(x, np.float64)
    s = sigmoid64(x)
    return s + x * s * (1 - s)


@pytest.mark.parametrize("n", SIZES)
def test_silu_grad_within_the_stated_bound_of_float64(make_session, rng, n):
    gy, x = data(rng, n, 2.0), data(rng, n, 8.0)
    got = run(make_session(grad_model("SiluGrad"), threads=2), gy, x).astype(np.float64)
    fin = np.isfinite(x) & (np.abs(x) < 1e30)
    g, x64 = gy.astype(np.float64)[fin], x.astype(np.float64)[fin]
    exact = g * silu_derivative64(x64)
    bound = silu_bound(g, x64)
    err = np.abs(got[fin] - exact)
    assert (err <= bound).all(), f"worst {(err / bound).max()} of the bound"


def test_silu_grad_limits(make_session):
    """SiLU'(+inf) = 1, SiLU'(-inf) = 0, NaN stays NaN; far tails round to gy and 0."""
    x = np.array([np.inf, -np.inf, np.nan, 1e30, -1e30, 0.0], F32)
    got = run(make_session(grad_model("SiluGrad")), np.full(6, 2.0, F32), x)
    np.testing.assert_array_equal(got, [2.0, 0.0, np.nan, 2.0, 0.0, 1.0])


def test_silu_grad_sweep_through_the_root(make_session):
    """SiLU' has its root near -1.2785, where s (1 + x (1 - s)) cancels: a dense sweep."""
    x = np.linspace(-1.3, -1.25, 50_001, dtype=F32)
    got = run(make_session(grad_model("SiluGrad")), np.ones_like(x), x).astype(np.float64)
    x64 = x.astype(np.float64)
    exact = silu_derivative64(x64)
    bound = silu_bound(1.0, x64)
    assert (np.abs(got - exact) <= bound).all()


def test_silu_grad_matches_finite_differences(make_session, rng):
    """Central differences of the float64 forward, independent of any derivative formula:
    within the kernel's bound plus the differences' own error (truncation h^2/6 times the
    third derivative, at most 0.6: below 1e-11; rounding 2^-52 |SiLU(x)| / h: below 1e-9
    for |x| <= 40)."""
    x = (rng.standard_normal(300) * 4).astype(F32)
    gy = rng.standard_normal(300).astype(F32)
    x64, h = x.astype(np.float64), 1e-5
    f = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    fd = (f(x64 + h) - f(x64 - h)) / (2 * h)
    got = run(make_session(grad_model("SiluGrad")), gy, x).astype(np.float64)
    g = gy.astype(np.float64)
    assert (np.abs(got - g * fd) <= silu_bound(g, x64) + 1e-9 * np.abs(g)).all()


@pytest.mark.parametrize("op", ["HardSigmoidGrad", "HardSwishGrad", "SiluGrad"])
def test_shape_mismatch_is_a_clear_error(make_session, op):
    with pytest.raises(Exception, match=rf"{op}: input 1 \(X\): expected the shape of dY, "
                                        r"\[2, 3\], got shape \[3, 2\]"):
        run(make_session(grad_model(op)), np.ones((2, 3), F32), np.ones((3, 2), F32))


def test_bad_attributes_are_clear_errors(make_session):
    for name in ("alpha", "beta"):
        with pytest.raises(Exception, match=rf"HardSigmoidGrad: attribute '{name}': expected a finite value"):
            run(make_session(grad_model("HardSigmoidGrad", **{name: float("inf")})), np.ones(2, F32), np.ones(2, F32))


# -- the Trainer -------------------------------------------------------------------------

def act_net(seed=0, se=False):
    """x[N,8] -> MatMul -> HardSwish -> MatMul -> SiLU (Mul(Sigmoid(h), h)) -> MatMul ->
    HardSigmoid -> MatMul -> loss. ``se``: the SiLU's Sigmoid output read by a second Mul
    too (a squeeze-excitation-like gate), so its gradient also flows through the Sigmoid."""
    rng = np.random.default_rng(seed)
    w = {f"w{i}": (rng.standard_normal(s) / math.sqrt(s[0])).astype(F32)
         for i, s in enumerate([(8, 16), (16, 16), (16, 16), (16, 5)])}
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"]),
             helper.make_node("HardSwish", ["h0"], ["a0"]),
             helper.make_node("MatMul", ["a0", "w1"], ["h1"]),
             helper.make_node("Sigmoid", ["h1"], ["s1"]),
             helper.make_node("Mul", ["s1", "h1"], ["a1"])]
    if se:
        nodes += [helper.make_node("Mul", ["a1", "s1"], ["a1g"])]
    nodes += [helper.make_node("MatMul", ["a1g" if se else "a1", "w2"], ["h2"]),
              helper.make_node("HardSigmoid", ["h2"], ["a2"], alpha=1 / 6, beta=0.5),
              helper.make_node("MatMul", ["a2", "w3"], ["logits"]),
              helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    g = helper.make_graph(nodes, "act_net",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
                           helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    feeds = {"x": (rng.standard_normal((6, 8)) * 3).astype(F32), "t": rng.integers(0, 5, 6).astype(np.int64)}
    return m, list(w), feeds


def _train(m, params, feeds, monkeypatch, fused):
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    tr = Trainer(m, "loss", optim.Adam(lr=1e-3), params=params, threads=1, seed=0)
    ops = Counter(n.op_type for n in tr.training_model().graph.node if n.domain == TRAINOPS_DOMAIN)
    return tr, ops, record(tr, feeds, 4)


@pytest.mark.parametrize("se", [False, True])
def test_trainer_fused_matches_standard_ops(library_path, monkeypatch, se):
    """Within helpers/adam_pair.py's bound after every step (SiluGrad's float32 error is
    within what the rounding helper allows the standard ops' six nodes); with ``se`` the Sigmoid's other reader still sends its
    gradient through the Sigmoid rule."""
    m, params, feeds = act_net(se=se)
    a, ops, ra = _train(m, params, feeds, monkeypatch, True)
    _, plain, rb = _train(m, params, feeds, monkeypatch, False)
    assert ops["HardSwishGrad"] == ops["SiluGrad"] == ops["HardSigmoidGrad"] == 1, ops
    assert not any(k.endswith("Grad") for k in plain), plain
    assert_runs_agree(m, feeds, a.optimizer, ra, rb)
