"""trainops.Trainer against independent references: numpy float64 backprop plus the ONNX
optimizer formulas (tests/helpers/references.py), convergence, export() in plain
onnxruntime, checkpoints."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.checks import same_bits
from helpers.references import adagrad_step, adam_step, momentum_step
from trainops import optim
from trainops.autodiff import GradientError
from trainops.onnx_defs import IR_VERSION, ONNX_OPSET
from trainops import Trainer

D, H, C, N = 5, 8, 3, 16


def mlp_model(seed=0, extra_nodes=(), hidden_op="Relu", dropout=None, training_mode=False,
              opset=ONNX_OPSET):
    """x -> MatMul w1 -> Add b1 -> hidden_op -> [Dropout] -> Gemm w2 b2 -> mean softmax
    cross-entropy. ``dropout``: a Dropout (node 3) with that ratio (initializer ``ratio``);
    ``training_mode``: with a constant true training_mode input (initializer ``on``)."""
    rng = np.random.default_rng(seed)
    drop = []
    if dropout is not None:
        drop = [helper.make_node("Dropout", ["a0", "ratio"] + (["on"] if training_mode else []),
                                 ["a1"], name="drop")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["h1"]),
             helper.make_node(hidden_op, ["h1"], ["a0" if drop else "a1"]),
             *drop,
             *extra_nodes,
             helper.make_node("Gemm", ["a1", "w2", "b2"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in [("w1", (D, H)), ("b1", (H,)), ("w2", (C, H)), ("b2", (C,))]]
    if drop:
        inits.append(numpy_helper.from_array(np.array(dropout, np.float32), "ratio"))
    if training_mode:
        inits.append(numpy_helper.from_array(np.array(True), "on"))
    g = helper.make_graph(nodes, "mlp", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D]),
        helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", C])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = IR_VERSION
    return m


def data(seed=1, n=N):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D)).astype(np.float32)
    t = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64)
    return {"x": x, "t": t}


def numpy_loss_and_grads(p, feeds, keep=1.0, scale=1.0):
    """float64 forward and backprop of mlp_model (mean softmax cross-entropy); with a
    Dropout, its fixed ``keep`` mask and ``scale``."""
    x = feeds["x"].astype(np.float64)
    t = feeds["t"]
    w1, b1, w2, b2 = (p[k].astype(np.float64) for k in ("w1", "b1", "w2", "b2"))
    h = x @ w1 + b1
    a = np.maximum(h, 0) * scale * keep
    z = a @ w2.T + b2
    z = z - z.max(1, keepdims=True)
    sm = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    n = len(t)
    loss = -np.mean(np.log(sm[np.arange(n), t]))
    dz = sm.copy()
    dz[np.arange(n), t] -= 1
    dz /= n
    da = dz @ w2
    dh = da * keep * scale * (h > 0)
    return loss, {"w2": dz.T @ a, "b2": dz.sum(0), "w1": x.T @ dh, "b1": dh.sum(0)}


def initial_params(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_two_adam_steps_match_numpy_backprop_and_onnx_adam(library_path):
    model = mlp_model()
    opt = optim.Adam(lr=0.01, norm_coefficient=0.01)
    tr = Trainer(model, "loss", opt, threads=1)
    feeds = data()
    p = initial_params(model)
    state = {k: (np.zeros_like(v, np.float64), np.zeros_like(v, np.float64)) for k, v in p.items()}
    for t in (1, 2):
        ref_loss, grads = numpy_loss_and_grads(p, feeds)
        loss = tr.step(feeds)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        got = tr.parameters()
        st = tr.optimizer_state()
        for k in p:
            x_new, v_new, h_new = adam_step(0.01, t, p[k], grads[k], *state[k],
                                            norm_coefficient=0.01)
            assert got[k].dtype == np.float32
            np.testing.assert_allclose(got[k], x_new, rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(st[f"trainops/V/{k}"], v_new, rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(st[f"trainops/H/{k}"], h_new, rtol=1e-4, atol=1e-9)
        # Next step from the trainer's own values, so errors do not compound.
        p = got
        state = {k: (st[f"trainops/V/{k}"], st[f"trainops/H/{k}"]) for k in p}


@pytest.mark.parametrize("opt", [optim.Adagrad(lr=0.1, decay_factor=0.1, norm_coefficient=0.01),
                                 optim.Momentum(lr=0.1, alpha=0.9, beta=0.5, mode="nesterov"),
                                 optim.Momentum(lr=0.1)])
def test_adagrad_and_momentum_steps(library_path, opt):
    model = mlp_model()
    tr = Trainer(model, "loss", opt, threads=1)
    feeds = data()
    p = initial_params(model)
    state = {k: np.zeros_like(v, np.float64) for k, v in p.items()}
    for t in (1, 2):
        _, grads = numpy_loss_and_grads(p, feeds)
        tr.step(feeds)
        got = tr.parameters()
        st = tr.optimizer_state()
        for k in p:
            if opt.op_type == "Adagrad":
                x_new, s_new = adagrad_step(0.1, t, p[k], grads[k], state[k], **opt.attributes())
                name = f"trainops/H/{k}"
            else:
                x_new, s_new = momentum_step(0.1, t, p[k], grads[k], state[k], **opt.attributes())
                name = f"trainops/V/{k}"
            np.testing.assert_allclose(got[k], x_new, rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(st[name], s_new, rtol=1e-4, atol=1e-7, err_msg=k)
        p = got
        state = {k: st[f"trainops/{opt.state[0]}/{k}"] for k in p}


def test_training_converges_and_export_runs_without_the_library(library_path):
    model = mlp_model()
    tr = Trainer(model, "loss", optim.Adam(lr=0.05), threads=1)
    feeds = data(n=128)
    losses = [tr.step(feeds) for _ in range(150)]
    assert losses[-1] < 0.25 * losses[0]
    exported = tr.export()
    assert {n.domain for n in exported.graph.node} == {""}
    assert [i.name for i in exported.graph.input] == ["x", "t"]
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, logits = sess.run(["loss", "logits"], feeds)
    ref_loss, _ = numpy_loss_and_grads(tr.parameters(), feeds)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-4)
    assert (logits.argmax(1) == feeds["t"]).mean() > 0.9


def test_learning_rate_changes_between_steps(library_path):
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.05), threads=1)
    feeds = data()
    tr.step(feeds)
    before = tr.parameters()
    tr.learning_rate = 0.0
    tr.step(feeds)
    assert same_bits(list(before.values()), list(tr.parameters().values()))
    assert tr.T == 3  # two updates counted
    tr.learning_rate = 0.05
    tr.step(feeds)
    assert not np.array_equal(before["w1"], tr.parameters()["w1"])


def test_checkpoint_resumes_bit_for_bit(library_path, tmp_path):
    feeds = [data(seed=s) for s in range(6)]
    straight = Trainer(mlp_model(), "loss", optim.Adam(lr=0.02), threads=1)
    for f in feeds:
        straight.step(f)
    first = Trainer(mlp_model(), "loss", optim.Adam(lr=0.02), threads=1)
    for f in feeds[:3]:
        first.step(f)
    path = tmp_path / "ckpt.npz"
    first.save(path)
    resumed = Trainer.load(path, threads=1)
    assert resumed.T == 4 and resumed.optimizer == optim.Adam(lr=0.02)
    for f in feeds[3:]:
        resumed.step(f)
    assert same_bits(list(straight.parameters().values()), list(resumed.parameters().values()))
    assert same_bits(list(straight.optimizer_state().values()),
                     list(resumed.optimizer_state().values()))


def test_params_subset_leaves_the_others_alone(library_path):
    model = mlp_model()
    tr = Trainer(model, "loss", optim.Adam(lr=0.05), params=["w2", "b2"], threads=1)
    tr.step(data())
    assert sorted(tr.parameters()) == ["b2", "w2"]
    exported = {i.name: numpy_helper.to_array(i) for i in tr.export().graph.initializer}
    assert same_bits(exported["w1"], initial_params(model)["w1"])
    assert not np.array_equal(exported["w2"], initial_params(model)["w2"])


def test_mixed_float16_trains_with_float32_master_weights(library_path):
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.05), policy="mixed_float16", threads=1)
    feeds = data(n=128)
    losses = [tr.step(feeds) for _ in range(100)]
    assert losses[-1] < 0.3 * losses[0]
    assert all(v.dtype == np.float32 for v in tr.parameters().values())
    assert tr.loss_scale == 2.0 ** 15 and tr.skipped == 0
    ops = {n.op_type for n in tr.training_model.graph.node}
    assert {"MixedPrecisionAdam", "DynamicLossScale"} <= ops
    sess = ort.InferenceSession(tr.export().SerializeToString(), providers=["CPUExecutionProvider"])
    assert float(sess.run(["loss"], feeds)[0]) < 0.3 * losses[0]


def test_mixed_float16_with_the_exporters_float32_value_info(library_path):
    """torch's dynamo exporter records every intermediate's type in value_info. Under
    mixed_float16 those tensors are float16, and the stale float32 entries made onnxruntime
    refuse the step graph; the same model without them is the reference, bit for bit."""
    plain = mlp_model()
    recorded = mlp_model()
    recorded.graph.value_info.extend([
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", H]) for n in ("h", "h1", "a1")])
    feeds = data(n=32)
    runs = [Trainer(m, "loss", optim.Adam(lr=0.05), policy="mixed_float16", threads=1)
            for m in (plain, recorded)]
    losses = [[t.step(feeds) for _ in range(3)] for t in runs]
    assert losses[0] == losses[1]
    for name, value in runs[0].parameters().items():
        np.testing.assert_array_equal(runs[1].parameters()[name], value)


def test_mixed_float16_skips_overflowing_steps(library_path):
    # A loss times 1e4 overflows float16 gradients at the initial scale 2**15.
    big = helper.make_node("Mul", ["a1", "k"], ["a1k"])
    model = mlp_model()
    model.graph.node.insert(3, big)
    model.graph.node[4].input[0] = "a1k"
    model.graph.initializer.append(numpy_helper.from_array(np.array(1e3, np.float32), "k"))
    tr = Trainer(model, "loss", optim.Adam(lr=0.01), params=["w1", "b1", "w2", "b2"],
                 policy="mixed_float16", threads=1)
    before = tr.parameters()
    tr.step(data())
    assert tr.skipped == 1 and tr.loss_scale == 2.0 ** 14
    assert same_bits(list(before.values()), list(tr.parameters().values()))


def test_unsupported_op_is_a_clear_error(library_path):
    model = mlp_model(hidden_op="Acos")
    model.graph.node[2].name = "my_acos"
    with pytest.raises(GradientError, match=r"Acos node 'my_acos'"):
        Trainer(model, "loss", optim.Adam())


def test_bad_arguments(library_path):
    with pytest.raises(ValueError, match="not a tensor"):
        Trainer(mlp_model(), "nope", optim.Adam())
    with pytest.raises(ValueError, match="not float initializers"):
        Trainer(mlp_model(), "loss", optim.Adam(), params=["x"])
    with pytest.raises(ValueError, match="must be Adam"):
        Trainer(mlp_model(), "loss", optim.Momentum(), policy="mixed_float16")
    tr = Trainer(mlp_model(), "loss", optim.Adam())
    with pytest.raises(ValueError, match=r"lack model inputs \['t'\]"):
        tr.step({"x": data()["x"]})


def test_model_from_a_path(library_path, tmp_path):
    import onnx

    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(path))
    a = Trainer(path, "loss", optim.Adam(lr=0.01), threads=1)
    b = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1)
    assert a.step(data()) == b.step(data())


def test_float64_model(library_path):
    model = mlp_model()
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    for o in model.graph.output:
        o.type.tensor_type.elem_type = TensorProto.DOUBLE
    tr = Trainer(model, "loss", optim.Adam(lr=0.01), policy="float64", threads=1)
    feeds = {"x": data()["x"].astype(np.float64), "t": data()["t"]}
    p = initial_params(model)
    ref_loss, grads = numpy_loss_and_grads(p, feeds)
    assert tr.step(feeds) == pytest.approx(ref_loss, rel=1e-12)
    for k, v in tr.parameters().items():
        assert v.dtype == np.float64
        x_new, _, _ = adam_step(0.01, 1, p[k], grads[k], 0 * p[k], 0 * p[k])
        np.testing.assert_allclose(v, x_new, rtol=1e-9, atol=1e-12)
