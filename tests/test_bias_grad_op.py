"""com.trainops::BiasGrad: a bias's gradient, the sum of dY over its leading axes (what
onnxruntime's ReduceSum with keepdims 0 gives), on trainops' threaded kernel with float64
partial sums. Against numpy in float64 within the kernel's bound, threads bit for bit,
bad inputs, and which nodes the fused step emits it for."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_grad_batchnorm import _error
from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

U = 2.0 ** -24


def model(leading=1, dims=None):
    node = helper.make_node("BiasGrad", ["dY"], ["dB"], domain=TRAINOPS_DOMAIN, leading=leading)
    g = helper.make_graph([node], "bg", [helper.make_tensor_value_info("dY", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info("dB", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


@pytest.mark.parametrize("shape,leading", [((8, 32, 32, 96), 3), ((1025, 513), 1), ((3, 5, 7), 2),
                                           ((4, 6), 2), ((0, 5), 1), ((2, 3, 0), 1), ((1, 1), 1)])
def test_within_the_float64_bound_and_the_same_at_two_threads(make_session, rng, shape, leading):
    dy = (100 * rng.standard_normal(shape)).astype(np.float32)
    outs = [make_session(model(leading), threads=t).run(None, {"dY": dy})[0] for t in (1, 2)]
    want = dy.astype(np.float64).sum(axis=tuple(range(leading)))
    absum = np.abs(dy.astype(np.float64)).sum(axis=tuple(range(leading)))
    rows = int(np.prod(shape[:leading]))
    bound = U * np.abs(want) + 2 * rows * 2.0 ** -53 * absum
    for got in outs:
        assert got.shape == shape[leading:] and got.dtype == np.float32
        assert np.all(np.abs(got.astype(np.float64) - want) <= bound)
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_the_check_can_fail(make_session, rng):
    """Summing one axis too few is not the bias's gradient."""
    dy = rng.standard_normal((6, 5, 4)).astype(np.float32)
    got = make_session(model(1)).run(None, {"dY": dy})[0]
    assert got.shape != dy.sum(axis=(0, 1)).shape


def test_bad_inputs_are_clear_errors(make_session):
    msg = _error(make_session, model(3), {"dY": np.ones((2, 3), np.float32)})
    assert "BiasGrad: input 0 (dY): expected rank >= 3 (attribute leading), got shape [2, 3]" in msg, msg
    msg = _error(make_session, model(0), {"dY": np.ones((2, 3), np.float32)})
    assert "BiasGrad" in msg and "leading" in msg, msg


def test_the_fused_step_sums_biases_with_it(library_path, monkeypatch, rng):
    """A linear layer over a batch of sequences: the bias's gradient (leading axes) is
    BiasGrad in the fused step, ReduceSum in the standard one, and the two steps' biases
    agree within both bounds."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, 5])
    w = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["y2"]), helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "lin", [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal((4, 6, 5)).astype(np.float32)}
    biases, counts = [], []
    for fused in (True, False):
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
        tr = Trainer(m, "loss", optim.Momentum(lr=1.0, alpha=0.0, beta=1.0), params=["W", "B"], threads=2, seed=0)
        counts.append(Counter(n.op_type for n in tr.training_model().graph.node))
        tr.step(feeds)
        biases.append(b.astype(np.float64) - tr.parameters()["B"].astype(np.float64))
    assert counts[0]["BiasGrad"] == 1 and counts[1]["BiasGrad"] == 0, counts
    y = feeds["x"].astype(np.float64) @ w + b
    want = (2 * y).sum(axis=(0, 1))
    for got in biases:  # 24 terms summed, each within a few roundings of 2y
        bound = 64 * U * (2 * np.abs(y)).sum(axis=(0, 1)) + 2 * U * np.abs(b)
        assert np.all(np.abs(got - want) <= bound)
