"""com.trainops::MaxPoolGrad (a fused CPU backward kernel): the scatter-add of dY at ONNX MaxPool's Indices,
against numpy (``np.add.at`` at the Indices onnxruntime's MaxPool returns) and finite
differences of the forward MaxPool, its errors, and the max_pool rule that emits it.
The result is exact: every element is a float32 sum in output order, as ``np.add.at``."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.adam_pair import assert_runs_agree, record
from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

F32 = np.float32


def vi(name, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, None)


def model(nodes, inputs, outputs, opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                            helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def grad_model():
    node = helper.make_node("MaxPoolGrad", ["dY", "Indices", "shape"], ["dX"], domain=TRAINOPS_DOMAIN)
    return model([node], [vi("dY"), vi("Indices", TensorProto.INT64), vi("shape", TensorProto.INT64)],
                 [vi("dX")])


def pool_model(**attrs):
    node = helper.make_node("MaxPool", ["X"], ["Y", "I"], **attrs)
    return model([node], [vi("X")], [vi("Y"), vi("I", TensorProto.INT64)])


CASES = [  # (X shape, MaxPool attributes); overlapping windows, pads, dilations, ceil, 1-3D
    ((2, 3, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ((2, 3, 9, 7), dict(kernel_shape=[3, 3], strides=[1, 1])),
    ((1, 4, 10, 10), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((3, 2, 11, 9), dict(kernel_shape=[2, 3], strides=[2, 1], dilations=[2, 1], ceil_mode=1)),
    ((2, 5, 17), dict(kernel_shape=[4], strides=[3])),
    ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2])),
    ((64, 32, 16, 16), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),  # threaded
    ((1, 1, 1, 1), dict(kernel_shape=[1, 1])),
    ((0, 3, 4, 4), dict(kernel_shape=[2, 2])),
]


def forward(make_session, x, attrs):
    return make_session(pool_model(**attrs)).run(None, {"X": x})


@pytest.mark.parametrize("shape,attrs", CASES)
def test_max_pool_grad_matches_numpy(make_session, rng, shape, attrs):
    x = rng.standard_normal(shape).astype(F32)
    _, idx = forward(make_session, x, attrs)
    gy = rng.standard_normal(idx.shape).astype(F32)
    want = np.zeros(x.size, F32)
    np.add.at(want, idx.reshape(-1), gy.reshape(-1))  # float32 sums in output order
    got = make_session(grad_model(), threads=2).run(
        None, {"dY": gy, "Indices": idx, "shape": np.array(shape, np.int64)})[0]
    assert got.dtype == F32 and got.shape == shape
    assert got.tobytes() == want.reshape(shape).tobytes()


def from_input_model(**attrs):
    node = helper.make_node("MaxPoolGradFromInput", ["dY", "X"], ["dX"], domain=TRAINOPS_DOMAIN, **attrs)
    return model([node], [vi("dY"), vi("X")], [vi("dX")])


def explicit(attrs, rank):
    """MaxPool's window attributes for MaxPoolGradFromInput (no ceil_mode: dY's sizes)."""
    return {k: v for k, v in attrs.items() if k != "ceil_mode"}


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape,attrs", CASES)
def test_from_input_matches_the_indices_route(make_session, rng, shape, attrs, relu):
    """The argmax found again in X is the one ORT's MaxPool returns as Indices, ties
    included (relu: many exact zeros, so many windows tie)."""
    x = rng.standard_normal(shape).astype(F32)
    if relu:
        x = np.maximum(x, 0)
    _, idx = forward(make_session, x, attrs)
    gy = rng.standard_normal(idx.shape).astype(F32)
    want = np.zeros(x.size, F32)
    np.add.at(want, idx.reshape(-1), gy.reshape(-1))
    got = make_session(from_input_model(**explicit(attrs, len(shape))), threads=2).run(None, {"dY": gy, "X": x})[0]
    assert got.shape == shape and got.tobytes() == want.reshape(shape).tobytes()


def test_from_input_bad_inputs(make_session):
    sess = make_session(from_input_model(kernel_shape=[2, 2], strides=[2, 2]))
    with pytest.raises(Exception, match=r"MaxPoolGradFromInput: input 0 \(dY\): expected rank 4"):
        sess.run(None, {"dY": np.ones((1, 1, 2), F32), "X": np.ones((1, 1, 4, 4), F32)})
    with pytest.raises(Exception, match=r"MaxPoolGradFromInput: input 1 \(X\): expected rank 4 with N, C = \[1, 1\]"):
        sess.run(None, {"dY": np.ones((1, 1, 2, 2), F32), "X": np.ones((1, 2, 4, 4), F32)})
    with pytest.raises(Exception, match=r"MaxPoolGradFromInput: attribute 'strides': expected 2 values >= 1"):
        make_session(from_input_model(kernel_shape=[2, 2], strides=[0, 2])).run(
            None, {"dY": np.ones((1, 1, 2, 2), F32), "X": np.ones((1, 1, 4, 4), F32)})


def test_max_pool_grad_matches_finite_differences(make_session, rng):
    """Independent of Indices: d/dx sum(gy * MaxPool(x)), by central differences in the
    forward (distinct values, so no tie moves under the step)."""
    shape, attrs = (1, 2, 6, 6), dict(kernel_shape=[3, 3], strides=[1, 1])
    x = rng.permutation(np.arange(72, dtype=np.float64)).reshape(shape).astype(F32)
    y, idx = forward(make_session, x, attrs)
    gy = rng.standard_normal(y.shape).astype(F32)
    pool = make_session(pool_model(**attrs))
    fd = np.zeros(x.size)
    for k in range(x.size):
        e = np.zeros(x.size, F32)
        e[k] = 0.25
        up = pool.run(None, {"X": x + e.reshape(shape)})[0]
        down = pool.run(None, {"X": x - e.reshape(shape)})[0]
        fd[k] = np.sum(gy.astype(np.float64) * (up - down)) / 0.5
    got = make_session(grad_model()).run(None, {"dY": gy, "Indices": idx,
                                                "shape": np.array(shape, np.int64)})[0]
    np.testing.assert_allclose(got.reshape(-1), fd, rtol=1e-5, atol=1e-5)


def run_grad(make_session, gy, idx, shape):
    return make_session(grad_model()).run(None, {"dY": np.asarray(gy, F32), "Indices": np.asarray(idx, np.int64),
                                                 "shape": np.asarray(shape, np.int64)})


@pytest.mark.parametrize("gy,idx,shape,match", [
    (np.ones((2, 3)), np.zeros((2, 3)), [2, 3], r"input 0 \(dY\): expected rank >= 3"),
    (np.ones((1, 1, 2)), np.zeros((1, 1, 3)), [1, 1, 4],
     r"input 1 \(Indices\): expected the shape of dY, \[1, 1, 2\], got shape \[1, 1, 3\]"),
    (np.ones((1, 2, 2)), np.zeros((1, 2, 2)), [1, 3, 4], r"input 2 \(shape\): expected a 1-D shape of rank 3 "
                                                         r"with N, C = \[1, 2\]"),
    (np.ones((1, 2, 2)), np.zeros((1, 2, 2)), [1, 2], r"input 2 \(shape\)"),
    (np.ones((1, 1, 2)), [[[0, 4]]], [1, 1, 4], r"input 1 \(Indices\): expected MaxPool's Indices .*element 1 "
                                                r"is 4, outside its \(batch, channel\) plane of the input, \[0, 4\)"),
    (np.ones((1, 2, 1)), [[[0], [1]]], [1, 2, 4], r"input 1 \(Indices\):.*element 1 is 1, outside .* \[4, 8\)"),
    (np.ones((1, 1, 1)), [[[-1]]], [1, 1, 4], r"input 1 \(Indices\):.*element 0 is -1"),
])
def test_bad_inputs_are_clear_errors(make_session, gy, idx, shape, match):
    with pytest.raises(Exception, match="MaxPoolGrad: " + match):
        run_grad(make_session, gy, idx, shape)


def test_float64_dy_is_refused(make_session):
    m = grad_model()
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(Exception, match=r"(?i)type|kernel|implementation"):
        make_session(m).run(None, {"dY": np.ones((1, 1, 1)), "Indices": np.zeros((1, 1, 1), np.int64),
                                   "shape": np.array([1, 1, 1], np.int64)})


# -- the rule ----------------------------------------------------------------------------

def pool_net(with_indices: bool, seed=0, ceil_mode=0):
    """x[N,2,4,4] -> Conv 3x3 -> MaxPool 3x3/2 (overlapping; its Indices as a second
    output when asked; ``ceil_mode`` 1: 3x3 windows where the floor gives 2x2) -> Flatten
    -> MatMul -> loss."""
    rng = np.random.default_rng(seed)
    side = 3 if ceil_mode else 2  # (4 + 2 - 3) / 2 + 1, rounded up or down
    w = {"conv.w": (rng.standard_normal((4, 2, 3, 3)) * 0.3).astype(F32),
         "fc.w": (rng.standard_normal((4 * side * side, 5)) * 0.3).astype(F32)}
    outs = ["p", "pi"] if with_indices else ["p"]
    nodes = [helper.make_node("Conv", ["x", "conv.w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["c"], outs, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                              ceil_mode=ceil_mode),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "fc.w"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    out_vis = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    if with_indices:
        out_vis.append(helper.make_tensor_value_info("pi", TensorProto.INT64, None))
    g = helper.make_graph(nodes, "pool_net",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4]),
                           helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
                          out_vis, [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal((5, 2, 4, 4)).astype(F32), "t": rng.integers(0, 5, 5).astype(np.int64)}
    return m, list(w), feeds


@pytest.mark.parametrize("with_indices,ceil_mode", [(False, 0), (True, 0), (False, 1)])
def test_rule_fused_matches_standard_ops(library_path, monkeypatch, with_indices, ceil_mode):
    m, params, feeds = pool_net(with_indices, ceil_mode=ceil_mode)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", fused)
        tr = Trainer(m, "loss", optim.Adam(lr=1e-2), params=params, threads=1)
        runs[fused] = (tr, record(tr, feeds, 4))  # losses; parameters and moments per step
    (a, ra), (b, rb) = runs["1"], runs["0"]
    ops_a = Counter(n.op_type for n in a.training_model().graph.node)
    ops_b = Counter(n.op_type for n in b.training_model().graph.node)
    fused = "MaxPoolGrad" if with_indices else "MaxPoolGradFromInput"
    assert ops_a[fused] == 1 and ops_b[fused] == 0
    # the standard form: the windows gathered from X, no scatter, no second MaxPool
    assert ops_b["Gather"] >= 1 and ops_b["ScatterElements"] == ops_a["ScatterElements"] == 0
    assert ops_b["MaxPool"] == 1
    nodes = a.training_model().graph.node
    pool = [n for n in nodes if n.op_type == "MaxPool"]
    grad = next(n for n in nodes if n.op_type == fused)
    assert len(pool) == 1
    if with_indices:  # the forward's own Indices are read
        assert grad.input[1] == "pi" == pool[0].output[1]
    else:  # the forward MaxPool keeps one output (onnxruntime's fast path)
        assert len([o for o in pool[0].output if o]) == 1 and grad.input[1] == pool[0].input[0]
        # MaxPool's rounding is passed on, so the op refuses a dY of the other one
        assert helper.get_node_attr_value(grad, "ceil_mode") == ceil_mode
    # The max-pool gradients are exact; the convolution's weight gradient sums in another
    # order than the standard form (MLAS, whose blocking depends on the CPU): losses,
    # weights and moments within helpers/adam_pair.py's bound after every step.
    assert_runs_agree(m, feeds, a.optimizer, ra, rb)
