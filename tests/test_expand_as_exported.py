"""``expand_gradients`` on models as exporters and the ONNX zoo write them: old
opsets (upgraded where a rule refuses them), initializers listed as inputs (kept: the
model's interface), nodes in any order, external data passed by path, the classic
exporter's Squeeze/Gather shape chains. Gradients are checked against float64 numpy
finite differences, or (the zoo's squeezenet) central differences of the shipped model
run by onnxruntime."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import exported as ex
from helpers import numpy_graph
from helpers.zoo import light_model
from trainops.autodiff import GradientError, expand_gradients
from trainops.onnx_defs import TRAINING_DOMAIN

F32 = TensorProto.FLOAT
ORT_VERSION = tuple(int(v) for v in ort.__version__.split(".")[:2])


def gradient(xs, y, outs):
    return helper.make_node("Gradient", xs, outs, domain=TRAINING_DOMAIN, xs=xs, y=y,
                            name="grad")


def run(model, feeds, outputs=None):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(outputs or [o.name for o in model.graph.output], sess.run(outputs, feeds)))


def mlp9(seed=0):
    """The classic exporter at opset 9, IR 3: Gemm(transB) -> Relu -> Gemm ->
    LogSoftmax -> a cross-entropy with a one-hot target; every initializer also a graph
    input; the nodes in reverse order; a Gradient node for W1 and b2."""
    rng = np.random.default_rng(seed)
    w = {"W1": rng.standard_normal((5, 3)), "b1": rng.standard_normal(5) * 0.1,
         "W2": rng.standard_normal((2, 5)), "b2": rng.standard_normal(2) * 0.1}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    x = rng.standard_normal((4, 3)).astype(np.float32)
    labels = np.array([0, 1, 1, 0])
    onehot = np.eye(2, dtype=np.float32)[labels]
    inits = {**w, "onehot": onehot, "minus_quarter": np.array(-0.25, np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1, name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"], transB=1, name="fc2"),
             helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1, name="logsm"),
             helper.make_node("Mul", ["logp", "onehot"], ["picked"], name="pick"),
             helper.make_node("ReduceSum", ["picked"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Mul", ["s", "minus_quarter"], ["loss"], name="mean")][::-1]
    nodes.append(gradient(["W1", "b2"], "loss", ["dW1", "db2"]))
    inputs = [helper.make_tensor_value_info("x", F32, [4, 3])] + [
        helper.make_tensor_value_info(k, F32, list(v.shape)) for k, v in inits.items()]
    outputs = [helper.make_tensor_value_info("loss", F32, []),
               helper.make_tensor_value_info("dW1", F32, [5, 3]),
               helper.make_tensor_value_info("db2", F32, [2])]
    g = helper.make_graph(nodes, "mlp9", inputs, outputs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9),
                                            helper.make_opsetid(TRAINING_DOMAIN, 1)])
    m.ir_version = 3
    return m, w, x, labels


def mlp_loss(p, x, labels):
    h = np.maximum(x @ p["W1"].T + p["b1"], 0)
    return ex.cross_entropy(h @ p["W2"].T + p["b2"], labels)


def check_mlp(expanded, w, x, labels, feeds=None):
    got = run(expanded, {"x": x, **(feeds or {})})
    w = {**w, **(feeds or {})}
    p64 = {k: v.astype(np.float64) for k, v in w.items()}
    want = ex.fd_grads(lambda q: mlp_loss({**p64, **q}, x, labels),
                       {"W1": p64["W1"].copy(), "b2": p64["b2"].copy()})
    assert got["loss"] == pytest.approx(mlp_loss(p64, x, labels), rel=1e-5)
    np.testing.assert_allclose(got["dW1"], want["W1"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["db2"], want["b2"], rtol=1e-4, atol=1e-5)


def test_opset9_weights_as_inputs_nodes_shuffled(caplog):
    """LogSoftmax's rule refuses opset 9 (2-D coercion): upgraded to 13 in one log line;
    the weights stay listed as (overridable) inputs, which onnxruntime runs."""
    m, w, x, labels = mlp9()
    with caplog.at_level(logging.INFO, logger="trainops"):
        e = expand_gradients(m)
    ups = [r.message for r in caplog.records if "upgraded" in r.message]
    assert ups == ["upgraded the model from opset 9 to 13 for the gradient rules' operator "
                   "forms (13)"]
    assert [i.name for i in e.graph.input] == [i.name for i in m.graph.input]
    assert [o.name for o in e.graph.output] == ["loss", "dW1", "db2"]
    assert e.ir_version >= 7 and [(o.domain, o.version) for o in e.opset_import] == [("", 13)]
    assert not any(n.domain == TRAINING_DOMAIN for n in e.graph.node)
    onnx.checker.check_model(e)
    check_mlp(e, w, x, labels)
    # the listed weights are overridable inputs: fed, the gradients are at the fed values
    check_mlp(e, w, x, labels, {"W1": -0.5 * w["W1"], "b2": w["b2"] + 1})


def test_serialized_bytes_and_external_data_by_path(tmp_path):
    m, w, x, labels = mlp9(seed=1)
    check_mlp(expand_gradients(m.SerializeToString()), w, x, labels)
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    check_mlp(expand_gradients(path), w, x, labels)
    check_mlp(expand_gradients(str(path)), w, x, labels)
    with pytest.raises(ValueError, match="external files that are not loaded"):
        expand_gradients(onnx.load(str(path), load_external_data=False))
    with pytest.raises(TypeError, match="ModelProto, bytes or a path"):
        expand_gradients(42)


def test_a_cycle_is_a_clear_error():
    m, *_ = mlp9()
    relu = next(n for n in m.graph.node if n.name == "relu")
    relu.input[0] = "logits"  # fc1 no longer feeds it: relu -> fc2 -> relu
    with pytest.raises(GradientError, match="cycle"):
        expand_gradients(m)


def test_classic_exporter_shape_chains():
    """encoder_block's Squeeze/Gather chains lose ranks in onnx's inference alone: the
    folding brings them back; gradients of the packed in-projection and a LayerNorm scale."""
    model, p, x, labels = ex.encoder_block()
    g = model.graph
    g.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, [len(labels)]))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]))
    g.node.append(gradient(["in_w", "ln1_g"], "loss", ["d_in_w", "d_ln1_g"]))
    g.output.extend([helper.make_tensor_value_info(n, F32, None)
                     for n in ("loss", "d_in_w", "d_ln1_g")])
    model.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    e = expand_gradients(model)
    got = run(e, {"x": x, "labels": labels})
    want = ex.fd_grads(lambda q: ex.encoder_forward({**p, **q}, x.astype(np.float64), labels),
                       {"in_w": p["in_w"].copy(), "ln1_g": p["ln1_g"].copy()})
    assert got["loss"] == pytest.approx(ex.encoder_forward(p, x.astype(np.float64), labels),
                                        rel=1e-5)
    np.testing.assert_allclose(got["d_in_w"], want["in_w"], rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(got["d_ln1_g"], want["ln1_g"], rtol=1e-3, atol=1e-5)


SIZE = 64  # squeezenet's trunk takes any size: a small image keeps the test fast
TIE_GAP = 2e-5


def test_zoo_squeezenet_as_shipped():
    """The onnx wheel's light squeezenet as the zoo ships it (opset 9, IR 3, weights listed
    as inputs), a cross entropy written in opset-9 ops and a Gradient node for the first
    Conv's weight and the last Conv's bias: expanded (upgraded: Concat's and LogSoftmax's
    rules need 13) and run; against the float64 numpy forward and backward of the shipped
    graph (helpers.numpy_graph, written from the operators' definitions)."""
    model, logits, data, _ = light_model("squeezenet", seed=0, last_scale=1.0)
    g = model.graph
    for n in g.node:  # Dropout: the identity in inference (numpy_graph has no Dropout)
        if n.op_type == "Dropout":
            n.op_type = "Identity"
            del n.input[1:], n.output[1:], n.attribute[:]
    vi = next(i for i in g.input if i.name == data)
    for k in (2, 3):
        vi.type.tensor_type.shape.dim[k].dim_value = SIZE
    soft = next(n for n in g.node if n.op_type == "Softmax")
    g.node.remove(soft)
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    convs = [n for n in g.node if n.op_type == "Conv"]
    params = [convs[0].input[1], convs[-1].input[2]]
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    label = 3
    for seed in range(20):  # an input without MaxPool near-ties
        x = np.random.default_rng(seed).standard_normal((1, 3, SIZE, SIZE)).astype(np.float32)
        loss64, g64, gaps = numpy_graph.loss_and_grads(
            ref, {p: inits[p] for p in params}, {data: x}, logits, label)
        if min(gaps.values()) > TIE_GAP:
            break
    else:
        raise AssertionError(f"no input without near-ties in 20 draws: {gaps}")

    onehot = np.zeros((1, 1000), np.float32)
    onehot[0, label] = 1
    g.initializer.append(numpy_helper.from_array(onehot, "onehot"))
    g.input.append(helper.make_tensor_value_info("onehot", F32, [1, 1000]))
    g.node.extend([helper.make_node("Flatten", [logits], ["z"], axis=1),
                   helper.make_node("LogSoftmax", ["z"], ["logp"], axis=1),
                   helper.make_node("Mul", ["logp", "onehot"], ["picked"]),
                   helper.make_node("ReduceSum", ["picked"], ["s"], keepdims=0),
                   helper.make_node("Neg", ["s"], ["loss"]),
                   gradient(params, "loss", ["d0", "d1"])])
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info("loss", F32, [])]
                    + [helper.make_empty_tensor_value_info(n) for n in ("d0", "d1")])
    model.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    assert model.ir_version == 3 and model.opset_import[0].version == 9

    e = expand_gradients(model)
    assert [i.name for i in e.graph.input] == [i.name for i in model.graph.input]
    got = run(e, {data: x})
    assert float(got["loss"]) == pytest.approx(loss64, rel=1e-5)
    for p, out in zip(params, ("d0", "d1")):
        assert got[out].shape == g64[p].shape
        rel = np.linalg.norm(got[out] - g64[p]) / np.linalg.norm(g64[p])
        assert rel < 1e-4, (p, rel)
