"""A tiny two-layer MLP classifier (x [N,4] -> 6 -> Relu [-> Dropout] -> 3 logits ->
SoftmaxCrossEntropyLoss vs t), written the way the Trainer's placement tests need it."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from trainops.onnx_defs import IR_VERSION, ONNX_OPSET


def mlp(dropout: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    drop = [helper.make_node("Dropout", ["a0", "ratio"], ["a1"], name="drop")] if dropout else []
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["a0" if dropout else "a1"]), *drop,
             helper.make_node("MatMul", ["a1", "w2"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in [("w1", (4, 6)), ("w2", (6, 3))]]
    if dropout:
        inits.append(numpy_helper.from_array(np.array(0.25, np.float32), "ratio"))
    g = helper.make_graph(nodes, "mlp", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
        helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    return m
