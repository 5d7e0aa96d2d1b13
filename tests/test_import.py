"""Models as exported, piece by piece: the importer (initializers listed as
inputs, node order, external data, opset upgrade, shape folding), the default parameters,
trainops.losses, the coverage check and its command, BatchNorm state in checkpoints."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import exported as ex
from trainops import Trainer, losses, optim
from trainops.__main__ import main as cli
from trainops.autodiff import GradientError, infer
from trainops.onnx_defs import IR_VERSION
from trainops.train.importer import import_model
from trainops.train.params import default_params

F32 = TensorProto.FLOAT
rng = np.random.default_rng(0)


def mlp(opset=17, shuffle=False, inputs_too=False):
    """x[4,3] -> MatMul W -> Add b -> Relu -> MatMul W2 -> 'logits'[4,2]."""
    w = {"W": rng.standard_normal((3, 5)).astype(np.float32),
         "b": rng.standard_normal(5).astype(np.float32),
         "W2": rng.standard_normal((5, 2)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["logits"], name="mm2")]
    if shuffle:
        nodes = nodes[::-1]
    inputs = [helper.make_tensor_value_info("x", F32, [4, 3])]
    if inputs_too:
        inputs += [helper.make_tensor_value_info(k, F32, list(v.shape)) for k, v in w.items()]
    g = helper.make_graph(nodes, "mlp", inputs,
                          [helper.make_tensor_value_info("logits", F32, [4, 2])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 3 if inputs_too else IR_VERSION
    return m, w


def numpy_ce(w, x, y):
    logits = np.maximum(x @ w["W"] + w["b"], 0) @ w["W2"]
    return ex.cross_entropy(logits.astype(np.float64), y)


X = rng.standard_normal((4, 3)).astype(np.float32)
Y = np.array([0, 1, 1, 0])


@pytest.mark.parametrize("case", ["inputs_too", "shuffled", "opset9"])
def test_models_as_exporters_write_them_train(library_path, case, caplog):
    """Initializers also listed as inputs (IR 3), nodes in reverse order, an old opset: the
    same first loss as numpy, and the opset upgrade said in one log line."""
    m, w = mlp(opset=9 if case == "opset9" else 17, shuffle=case == "shuffled",
               inputs_too=case == "inputs_too")
    with caplog.at_level(logging.INFO, logger="trainops"):
        tr = Trainer(m, losses.cross_entropy("logits"), optim.Adam(lr=0.01), seed=0)
    ups = [r.message for r in caplog.records if "upgraded" in r.message]
    assert ups == (["upgraded the model from opset 9 to 13 for the gradient rules' operator "
                    "forms (13)"] if case == "opset9" else [])
    assert tr.param_names == ["W", "b", "W2"]
    assert sum("chosen by default" in r.message for r in caplog.records) == 1
    assert tr.input_names == ["x", "labels"]
    assert tr.step({"x": X, "labels": Y}) == pytest.approx(numpy_ce(w, X, Y), rel=1e-6)
    assert tr.step({"x": X, "labels": Y}) < numpy_ce(w, X, Y)
    exp = tr.export()
    assert [o.name for o in exp.graph.output] == ["logits"]
    assert not any("trainops" in n.op_type or n.op_type == "SoftmaxCrossEntropyLoss"
                   for n in exp.graph.node)


def test_external_data_is_loaded_from_the_path(library_path, tmp_path):
    m, w = mlp()
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    tr = Trainer(str(path), losses.cross_entropy("logits"), seed=0)
    assert tr.step({"x": X, "labels": Y}) == pytest.approx(numpy_ce(w, X, Y), rel=1e-6)
    unloaded = onnx.load(str(path), load_external_data=False)
    with pytest.raises(ValueError, match="external files that are not loaded"):
        Trainer(unloaded, losses.cross_entropy("logits"))


def test_shape_chains_are_folded_so_ranks_are_known():
    """The classic exporter's chains: onnx's inference alone loses the ranks."""
    model, *_ = ex.encoder_block()
    lost = {v.name for v in infer(model).graph.value_info
            if not v.type.tensor_type.HasField("shape")}
    assert "qkv" in lost and "q" in lost
    vi = {v.name: v for v in infer(import_model(model)).graph.value_info}
    assert [d.dim_value for d in vi["qkv"].type.tensor_type.shape.dim] == [3, 3, 2, 4]


def test_default_params_are_the_weights_of_ops():
    g = helper.make_graph(
        [helper.make_node("Transpose", ["Wt"], ["WtT"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "WtT"], ["a"]),
         helper.make_node("Mul", ["a", "eps"], ["a2"]),            # 0-d: a setting
         helper.make_node("Add", ["a2", "bias"], ["a3"]),          # [5]: a bias
         helper.make_node("Reshape", ["a3", "shape"], ["a4"]),     # int: a shape
         helper.make_node("Gather", ["emb", "ids"], ["e"]),         # an embedding table
         helper.make_node("BatchNormalization", ["x4", "s", "beta", "rm", "rv"], ["bn"]),
         helper.make_node("Dropout", ["a4", "ratio"], ["d"]),
         helper.make_node("Pow", ["d", "two"], ["p"]),              # an exponent
         # torch's RNN weights in ONNX's gate order, constants not folded
         helper.make_node("Slice", ["raw", "zero1", "one1"], ["r0"]),
         helper.make_node("Concat", ["r0", "raw"], ["rc"], axis=0),
         helper.make_node("MatMul", ["x", "rc"], ["q"])],
        "g", [helper.make_tensor_value_info(n, F32, None) for n in ("x", "x4")]
        + [helper.make_tensor_value_info("ids", TensorProto.INT64, None)], [],
        [numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in
         [("Wt", (5, 3)), ("eps", ()), ("bias", (5,)), ("emb", (7, 2)), ("s", (2,)),
          ("beta", (2,)), ("rm", (2,)), ("rv", (2,)), ("ratio", ()), ("two", (2,)),
          ("raw", (2, 3))]]
        + [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
           [("shape", [-1]), ("zero1", [0]), ("one1", [1])]])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert default_params(m) == ["Wt", "bias", "emb", "s", "beta", "raw"]


def test_losses_nll_and_mse_against_numpy(library_path):
    m, w = mlp()
    logsm = onnx.ModelProto()
    logsm.CopyFrom(m)
    logsm.graph.node.append(helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1))
    tr = Trainer(logsm, losses.nll("logp", labels="y", reduction="sum"), seed=0)
    assert tr.step({"x": X, "y": Y}) == pytest.approx(4 * numpy_ce(w, X, Y), rel=1e-6)
    target = rng.standard_normal((4, 2)).astype(np.float32)
    tr = Trainer(m, losses.mse(), seed=0)  # the first output
    logits = np.maximum(X @ w["W"] + w["b"], 0) @ w["W2"]
    want = ((logits.astype(np.float64) - target) ** 2).mean()
    assert tr.step({"x": X, "target": target}) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="reduction 'none'"):
        losses.mse(reduction="none")
    with pytest.raises(ValueError, match="already a tensor"):
        Trainer(m, losses.mse(target="x"))


def test_checkpoint_keeps_the_loss_and_the_running_stats(library_path, tmp_path):
    model, p, running, x, labels = ex.bn_cnn()
    feeds = {"x": x, "labels": labels}
    a = Trainer(model, losses.cross_entropy("logits"), optim.Adam(lr=0.01), seed=0)
    a.step(feeds)
    a.save(tmp_path / "ck.npz")
    b = Trainer.load(tmp_path / "ck.npz")
    assert b.loss == a.loss and b.batchnorm == "train"
    for k, v in a.running_stats().items():
        np.testing.assert_array_equal(b.running_stats()[k], v)
    assert b.step(feeds) == a.step(feeds)
    for k, v in a.running_stats().items():
        np.testing.assert_array_equal(b.running_stats()[k], v)


def test_shared_running_stats_are_unshared(library_path):
    """Exporters merge identical fresh initializers: two BatchNorms on one running mean."""
    model, *_ = ex.bn_cnn()
    g = model.graph
    g.node.insert(2, helper.make_node("BatchNormalization", ["y", "s", "beta", "rm", "rv"],
                                      ["y2"], training_mode=1, name="bn2"))
    g.node[3].input[0] = "y2"  # Relu reads the second BatchNorm
    tr = Trainer(model, losses.cross_entropy("logits"), seed=0)
    assert sorted(tr.running_stats()) == ["rm", "rm/1", "rv", "rv/1"]


def test_coverage_lists_every_missing_op(library_path, tmp_path, capsys):
    m, _ = mlp()
    g = m.graph
    g.node[2].op_type = "Acos"
    g.node.append(helper.make_node("Atan", ["logits"], ["c"], name="my_atan"))
    g.node.append(helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0))
    with pytest.raises(GradientError, match=r"2 op type\(s\).*Acos.*Acos node 'relu'.*Atan.*"
                                            r"Atan node 'my_atan'"):
        Trainer(m, "loss")
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    assert cli(["coverage", str(path), "--loss", "loss"]) == 1
    out = capsys.readouterr().out
    assert "Acos" in out and "NO RULE" in out and "MatMul" in out
    m2, _ = mlp()
    onnx.save(m2, str(path))
    assert cli(["coverage", str(path), "--loss", "cross_entropy"]) == 0
    # MatMul, Add, Relu, SoftmaxCrossEntropyLoss and the ops that form the mean over the
    # labels not ignored (ignore_index -100 by default: Div, ReduceSum, Where)
    assert "7 of 7 op types have a gradient rule" in capsys.readouterr().out
