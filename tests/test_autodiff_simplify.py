"""trainops.autodiff.simplify: the Trainer's post-pass that merges a backward node
recomputing a forward one (MaxPool with Indices, LayerNormalization with Mean and
InvStdDev) into it. The step is bit for bit the step without the pass; the gradient
of LayerNormalization's float32 form (its own statistics) agrees with finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.checks import same_bits
from helpers.gradcheck import check
from trainops import Trainer, optim
from trainops.autodiff.simplify import merge_recomputations
from trainops.onnx_defs import IR_VERSION

rng = np.random.default_rng(7)


def _model(kind):
    n = helper.make_node
    if kind == "pool":
        w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
        fc = rng.standard_normal((4 * 3 * 3, 3)).astype(np.float32)
        nodes = [n("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                 # overlapping windows (ScatterElements add) and a plain one
                 n("MaxPool", ["c"], ["p"], kernel_shape=[3, 3], strides=[2, 2]),
                 n("Flatten", ["p"], ["f"]), n("MatMul", ["f", "fc"], ["z"])]
        inits = {"w": w, "fc": fc}
        x_shape = [5, 1, 7, 7]
    else:
        nodes = [n("MatMul", ["x", "w"], ["h"]),
                 n("LayerNormalization", ["h", "s", "b"], ["y"], axis=-1, epsilon=1e-5),
                 n("MatMul", ["y", "fc"], ["z"])]
        inits = {"w": rng.standard_normal((6, 8)).astype(np.float32),
                 "s": rng.uniform(0.5, 1.5, 8).astype(np.float32),
                 "b": rng.standard_normal(8).astype(np.float32),
                 "fc": rng.standard_normal((8, 3)).astype(np.float32)}
        x_shape = [5, 6]
    nodes.append(n("SoftmaxCrossEntropyLoss", ["z", "t"], ["loss"]))
    g = helper.make_graph(
        nodes, kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
         helper.make_tensor_value_info("t", TensorProto.INT64, [x_shape[0]])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "t": rng.integers(0, 3, x_shape[0]).astype(np.int64)}
    return m, feeds


@pytest.mark.parametrize("kind,op", [("pool", "MaxPool"), ("ln", "LayerNormalization")])
def test_merged_step_is_bitwise_the_unmerged_one(library_path, monkeypatch, kind, op):
    import trainops.train.backward as tb

    # The recomputations are the standard-op forms' (the fused MaxPool gradient has none).
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "0")
    model, feeds = _model(kind)
    merged = Trainer(model, "loss", optim.Adam(lr=0.01), threads=1)
    ops = [nd.op_type for nd in merged.training_model.graph.node]
    assert ops.count(op) == 1  # the backward's recomputation went into the forward node
    monkeypatch.setattr(tb, "merge_recomputations", lambda f, b: (list(f), list(b)))
    plain = Trainer(model, "loss", optim.Adam(lr=0.01), threads=1)
    # MaxPool's standard-op gradient asks no MaxPool for Indices: nothing to merge there
    assert [nd.op_type for nd in plain.training_model.graph.node].count(op) == \
        (1 if kind == "pool" else 2)
    for _ in range(3):
        assert same_bits(merged.step(feeds), plain.step(feeds))
    for k, v in plain.parameters().items():
        assert same_bits(merged.parameters()[k], v), k


def test_merge_leaves_different_nodes_and_the_inputs_alone():
    n = helper.make_node
    fwd = [n("MaxPool", ["x"], ["y"], kernel_shape=[2, 2])]
    bwd = [n("MaxPool", ["x"], ["y2", "i"], kernel_shape=[2, 2]),
           n("MaxPool", ["x"], ["y3", "i3"], kernel_shape=[3, 3]),  # other attributes
           n("Relu", ["y2"], ["r"]), n("Identity", ["i"], ["j"])]
    f2, b2 = merge_recomputations(fwd, bwd)
    assert list(fwd[0].output) == ["y"] and len(bwd) == 4  # inputs untouched
    assert list(f2[0].output) == ["y", "i"]
    assert [list(x.input) for x in b2] == [["x"], ["y"], ["i"]]
    assert list(b2[0].output) == ["y3", "i3"]


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_float32_gradient(axis):
    norm = (4,) if axis == -1 else (3, 4)
    r = rng.standard_normal
    ins = {"x": r((2, 3, 4)), "s": r(norm), "b": r(norm)}
    assert check([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=axis,
                                   epsilon=1e-3)], ins, ["x", "s", "b"],
                 dtypes=(np.float32,)) == np.float32
