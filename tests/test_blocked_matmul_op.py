"""com.trainops::BlockedMatMul: Y = op(A) op(B) on trainops' blocked matrix product (a
weight's gradient and products over a deep axis in the fused CPU step). Against numpy in
float64 within float32's bound for a k-term dot product, threads bit for bit, bad inputs,
and the nodes the fused step emits it for, whose updates are checked against numpy."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_grad_batchnorm import _error
from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

U = 2.0 ** -24


def model(trans_a=0, trans_b=0, a_dims=None, b_dims=None):
    node = helper.make_node("BlockedMatMul", ["A", "B"], ["Y"], domain=TRAINOPS_DOMAIN,
                            transA=trans_a, transB=trans_b)
    g = helper.make_graph([node], "mm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, a_dims),
                                         helper.make_tensor_value_info("B", TensorProto.FLOAT, b_dims)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


# (A's shape, B's shape, transA, transB): edge sizes of the kernel's blocks (depth 256, rows
# 64, columns 1024, panels of 32, strips of 8), leading axes, an empty product and depth 0.
CASES = [((7, 13), (13, 45), 0, 0), ((3, 70, 600), (600, 33), 0, 0), ((600, 65), (1100, 600), 1, 1),
         ((257, 129), (257, 1030), 1, 0), ((9, 300), (40, 300), 0, 1), ((2, 0, 5), (5, 3), 0, 0),
         ((4, 0), (6, 0), 0, 1), ((1, 1), (1, 1), 0, 0)]


@pytest.mark.parametrize("a_shape,b_shape,ta,tb", CASES)
def test_within_the_float64_bound_and_the_same_at_two_threads(make_session, rng, a_shape, b_shape, ta, tb):
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    outs = [make_session(model(ta, tb), threads=t).run(None, {"A": a, "B": b})[0] for t in (1, 2)]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    op_a = a64.T if ta else a64
    op_b = b64.T if tb else b64
    want, mag = op_a @ op_b, np.abs(op_a) @ np.abs(op_b)
    k = op_b.shape[0]
    for got in outs:
        assert got.shape == want.shape and got.dtype == np.float32
        # k roundings of an FMA chain (the first exact from zero), each at most u of the
        # running sum's magnitude, itself at most the sum of the terms' magnitudes
        assert np.all(np.abs(got.astype(np.float64) - want) <= 1.01 * k * U * mag)
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_the_check_can_fail(make_session, rng):
    """Without the transposition the flag asks for, the result is another matrix."""
    a = rng.standard_normal((5, 5)).astype(np.float32)
    b = rng.standard_normal((5, 5)).astype(np.float32)
    got = make_session(model(1, 0)).run(None, {"A": a, "B": b})[0]
    assert np.abs(got - a @ b).max() > 1e-3
    assert np.abs(got - a.T @ b).max() < 1e-5


def test_bad_inputs_are_clear_errors(make_session):
    one = lambda *s: np.ones(s, np.float32)  # noqa: E731
    msg = _error(make_session, model(), {"A": one(2, 3), "B": one(4, 5)})
    assert "BlockedMatMul: input 1 (B): expected [k, n] with k = 3 (A's last axis), got shape [4, 5]" in msg, msg
    msg = _error(make_session, model(1, 1), {"A": one(2, 3), "B": one(4, 5)})
    assert "BlockedMatMul: input 1 (B): expected [n, k] with k = 2 (A's first axis), got shape [4, 5]" in msg, msg
    msg = _error(make_session, model(1, 0), {"A": one(2, 3, 4), "B": one(3, 5)})
    assert "BlockedMatMul: input 0 (A): expected rank 2 (attribute transA = 1), got shape [2, 3, 4]" in msg, msg
    msg = _error(make_session, model(), {"A": one(3), "B": one(3, 5)})
    assert "BlockedMatMul: input 0 (A): expected rank >= 2, got shape [3]" in msg, msg
    msg = _error(make_session, model(), {"A": one(2, 3), "B": one(3, 5, 1)})
    assert "BlockedMatMul: input 1 (B): expected rank 2, got shape [3, 5, 1]" in msg, msg
    msg = _error(make_session, model(2, 0), {"A": one(2, 3), "B": one(3, 5)})
    assert "BlockedMatMul" in msg and "transA" in msg and "expected 0 or 1, got 2" in msg, msg


def _language_head(rng, vocab, width):
    """h = x W0 ([2, 3, 5] x [5, width]), logits = h W1^T (W1 [vocab, width], torch's Linear),
    loss = sum(logits^2): W1's gradient is a large weight's, h's a product over the
    vocabulary, W0's a small weight's (left to Gemm)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5])
    w0 = rng.standard_normal((5, width)).astype(np.float32)
    w1 = (rng.standard_normal((vocab, width)) / 8).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h"]),
             helper.make_node("Transpose", ["W1"], ["W1t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "W1t"], ["logits"]),
             helper.make_node("Mul", ["logits", "logits"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "head", [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w0, "W0"), numpy_helper.from_array(w1, "W1")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m, w0, w1


def _updates(library_path, monkeypatch, m, feeds, params):
    """For the fused step and the standard one: the op counts and each parameter's change
    after one SGD step at lr 1 (minus its gradient)."""
    out = []
    for fused in (True, False):
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
        tr = Trainer(m, "loss", optim.Momentum(lr=1.0, alpha=0.0, beta=1.0), params=list(params), threads=2, seed=0)
        counts = Counter(n.op_type for n in tr.training_model().graph.node)
        tr.step(feeds)
        p = tr.parameters()
        out.append((counts, {k: v.astype(np.float64) - p[k].astype(np.float64) for k, v in params.items()}))
    return out


def test_the_fused_step_runs_large_weight_and_deep_gradients_on_it(library_path, monkeypatch, rng):
    """W1's gradient (2^19 elements) and h's over the 8192-entry vocabulary are BlockedMatMul
    in the fused step, W0's (small) a Gemm, none in the standard step; both steps' updates
    agree with numpy's float64 gradients within the products' bounds."""
    m, w0, w1 = _language_head(rng, 8192, 64)
    feeds = {"x": rng.standard_normal((2, 3, 5)).astype(np.float32)}
    x = feeds["x"].astype(np.float64)
    h = x @ w0
    logits = h @ w1.astype(np.float64).T
    dl = 2 * logits
    dh = dl @ w1
    want = {"W1": np.einsum("btv,btk->vk", dl, h), "W0": np.einsum("bti,btk->ik", x, dh)}
    # magnitudes: each product's terms in absolute value (the forward's roundings enter
    # through logits, bounded the same way)
    mag_h = np.abs(x) @ np.abs(w0)
    mag_l = mag_h @ np.abs(w1.astype(np.float64)).T
    mag_dh = (2 * mag_l) @ np.abs(w1)
    mags = {"W1": np.einsum("btv,btk->vk", 2 * mag_l, mag_h), "W0": np.einsum("bti,btk->ik", np.abs(x), mag_dh)}
    runs = _updates(library_path, monkeypatch, m, feeds, {"W0": w0, "W1": w1})
    for counts, got in runs:
        for name, w in (("W0", w0), ("W1", w1)):
            # the chain of products is at most 8192 + 64 + 5 + 6 terms deep: a generous
            # 2 (k + 80) u of the magnitudes, and the update's own rounding
            bound = 2 * (8192 + 80) * U * mags[name] + 2 * U * (np.abs(w) + np.abs(want[name]))
            assert np.all(np.abs(got[name] - want[name]) <= bound), name
    assert runs[0][0]["BlockedMatMul"] == 2 and runs[1][0]["BlockedMatMul"] == 0, [r[0] for r in runs]


def test_a_gemm_layers_weight_gradient_runs_on_it(library_path, monkeypatch, rng):
    """Gemm(x, W, transB=1) (torch's Linear as the classic exporter writes it) with W [1024,
    512]: its weight gradient is BlockedMatMul (transA) in the fused step, the update as
    numpy's float64 gradient."""
    w = (rng.standard_normal((1024, 512)) / 16).astype(np.float32)
    bias = rng.standard_normal(1024).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "W", "B"], ["y"], transB=1),
             helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 512])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(bias, "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal((6, 512)).astype(np.float32)}
    x = feeds["x"].astype(np.float64)
    y = x @ w.astype(np.float64).T + bias
    want = (2 * y).T @ x
    mag = (2 * (np.abs(x) @ np.abs(w.astype(np.float64)).T + np.abs(bias))).T @ np.abs(x)
    runs = _updates(library_path, monkeypatch, m, feeds, {"W": w})
    for counts, got in runs:
        bound = 2 * (512 + 8) * U * mag + 2 * U * (np.abs(w) + np.abs(want))
        assert np.all(np.abs(got["W"] - want) <= bound)
    assert runs[0][0]["BlockedMatMul"] == 1 and runs[1][0]["BlockedMatMul"] == 0, [r[0] for r in runs]
