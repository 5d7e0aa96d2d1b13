"""Gradient accuracy on a deep zoo model, kept measured: the float32 gradients trainops'
backward graph computes in onnxruntime for SqueezeNet (26 convolutions, 3 overlapping max
pools) against a float64 numpy forward and backward of the same model
(helpers/numpy_graph.py).

Inputs are chosen without max-pool near-ties: where a window's top two inputs are closer than
float32 rounding, float32 may route the gradient to the other input, a valid gradient of
the float32 function that an accuracy test must not count (training-notes.md). Each pooling
window's relative top-two gap must exceed TIE_GAP, else the input is redrawn.

Stated bound: for every parameter tensor, ||g32 - g64|| / ||g64|| < REL_BOUND = 1e-5 (measured:
1.1e-6 at worst, fire3/squeeze1x1_w_0, with onnxruntime 1.32 and 1.17.3)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from helpers import numpy_graph
from helpers.zoo import light_model
from trainops import losses
from trainops.onnx_defs import TRAINING_DOMAIN
from trainops.train.importer import import_model
from trainops.train.params import default_params

TIE_GAP = 2e-5
REL_BOUND = 1e-5
SIZE = 64  # the convolutional trunk takes any size; fewer windows, fewer near-ties


def test_squeezenet_float32_gradients_match_float64(library_path):
    model, _, data, _ = light_model("squeezenet", seed=0, last_scale=1.0)
    g = model.graph
    for n in g.node:  # the same network without its Dropout (a random mask) or Softmax
        if n.op_type == "Dropout":
            n.op_type = "Identity"
            del n.input[1:], n.output[1:], n.attribute[:]
    soft = next(n for n in g.node if n.op_type == "Softmax")
    logits = soft.input[0]
    g.node.remove(soft)
    del g.output[:]
    g.output.append(helper.make_empty_tensor_value_info(logits))
    vi = next(i for i in g.input if i.name == data)
    vi.type.tensor_type.shape.dim[2].dim_value = SIZE
    vi.type.tensor_type.shape.dim[3].dim_value = SIZE

    m = import_model(model)
    params = default_params(m)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    ref_graph = onnx.ModelProto()
    ref_graph.CopyFrom(m)
    label = 3
    for seed in range(20):  # inputs without max-pool near-ties
        x = np.random.default_rng(seed).standard_normal((1, 3, SIZE, SIZE)).astype(np.float32)
        loss64, g64, gaps = numpy_graph.loss_and_grads(
            ref_graph, {p: inits[p] for p in params}, {data: x}, logits, label)
        if min(gaps.values()) > TIE_GAP:
            break
    else:
        raise AssertionError(f"no input without near-ties in 20 draws: {gaps}")

    t = losses.cross_entropy(logits).attach(m)
    t.graph.node.append(helper.make_node(
        "Gradient", params, [f"d/{p}" for p in params], domain=TRAINING_DOMAIN, xs=params,
        y=losses.cross_entropy(logits).name))
    t.graph.output.extend(helper.make_empty_tensor_value_info(f"d/{p}") for p in params)
    t.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    from trainops.autodiff import expand_gradients

    grad_model = expand_gradients(t)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(grad_model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    outs = sess.run(None, {data: x, "labels": np.array([label], np.int64).reshape(1, 1, 1)})
    loss32, g32 = outs[0], dict(zip(params, outs[1:]))
    assert abs(float(loss32) - loss64) < 1e-5 * abs(loss64)
    rel = {p: float(np.linalg.norm(g32[p] - g64[p]) / np.linalg.norm(g64[p])) for p in params
           if np.linalg.norm(g64[p]) > 0}
    worst = max(rel, key=rel.get)
    assert rel[worst] < REL_BOUND, (worst, rel[worst], min(gaps.values()))
    assert len(rel) == len(params)  # every parameter has a gradient here
