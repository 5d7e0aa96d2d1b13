"""Training the models people bring, as exported: the light ONNX zoo models as
the onnx wheel ships them, and models built the way torch's exporters write them, each
against an independent numpy float64 reference of the same ONNX Adam steps."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from helpers import exported as ex
from helpers import rnn_reference as rnn
from helpers.zoo import LIGHT, light_model
from trainops import Trainer, losses, optim

BIG = {"vgg19"}
# The last layer's weights are scaled down so the softmax starts unsaturated (log 1000);
# inception_v1's logits are larger at 0.1.
LAST_SCALE = {"inception_v1": 0.01}  # 144M parameters: one step, and marked slow


def _zoo_params():
    out = []
    for name in LIGHT:
        marks = []
        if name in BIG:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(name, marks=marks))
    return out


def _run(model, feeds, outputs):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(outputs, feeds)


def _with_output(model, name):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return m


@pytest.mark.parametrize("name", _zoo_params())
def test_light_zoo_model_trains_as_shipped(library_path, name):
    """Opset 7-9, IR 3, weights listed as graph inputs: imported, upgraded and trained with
    a cross-entropy loss on its logits; the loss is finite and falls, and the exported
    model (plain onnxruntime, inference form) scores the batch better than at the start."""
    model, logits, data, shape = light_model(name)
    assert model.ir_version == 3 and model.opset_import[0].version <= 9
    inits = {i.name for i in model.graph.initializer}
    assert sum(i.name in inits for i in model.graph.input) > 10  # as shipped
    tr = Trainer(model, losses.cross_entropy(logits), optim.Adam(lr=1e-4), seed=0)
    assert tr.param_names and not set(tr.param_names) & set(tr.running_stats())
    label_vi = next(i for i in tr.training_model.graph.input if i.name == "labels")
    label_shape = [d.dim_value for d in label_vi.type.tensor_type.shape.dim]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    feeds = {data: x, "labels": np.full(label_shape, 7, np.int64)}
    before = tr.running_stats()
    steps = 1 if name in BIG else 3
    got = [tr.step(feeds) for _ in range(steps)]
    assert np.all(np.isfinite(got)), got
    assert abs(got[0] - np.log(1000)) < 1.0, got  # the softmax is not saturated
    assert all(b < a for a, b in zip(got, got[1:])), got
    for k, v in tr.running_stats().items():  # batchnorm="train": the statistics moved
        assert not np.array_equal(v, before[k]), k
    exp = tr.export()
    out = _run(_with_output(exp, logits), {data: x}, [logits])[0].reshape(shape[0], 1000)
    assert np.all(np.isfinite(out))
    if not tr.running_stats():
        # Without BatchNorm the exported model computes what the trainer did: it scores
        # the batch better than at the start. (With BatchNorm the exported model
        # normalises with running statistics that 3 steps of momentum 0.9 barely moved.)
        z = out.astype(np.float64) - out.max()
        assert -(z[:, 7] - np.log(np.exp(z).sum())).mean() < got[0]
    stats = {i.name: onnx.numpy_helper.to_array(i) for i in exp.graph.initializer}
    for k, v in tr.running_stats().items():
        np.testing.assert_array_equal(stats[k], v)


def _compare(tr, p, ref_losses, ref_params, got_losses, rtol=2e-5, atol=2e-6):
    np.testing.assert_allclose(got_losses, ref_losses, rtol=rtol)
    after = tr.parameters()
    assert set(after) == set(p)
    for k in p:
        np.testing.assert_allclose(after[k], ref_params[k], rtol=rtol, atol=atol, err_msg=k)


STEPS, LR = 3, 0.01


ORT = tuple(int(v) for v in ort.__version__.split(".")[:2])
# onnxruntime 1.17.3: with its basic graph optimizations on, two identical runs of the LSTM
# training graph give different gradients (the first is right; ORT_DISABLE_ALL makes them
# agree): state kept across runs in an optimized-away constant. Seen only there.
OLD_LSTM = pytest.mark.xfail(ORT < (1, 18), strict=False,
                             reason="onnxruntime 1.17's optimized LSTM training graph "
                                    "changes between identical runs")


@pytest.mark.parametrize("op", ["GRU", pytest.param("LSTM", marks=OLD_LSTM)])
def test_rnn_classifier_as_torch_exports_it(library_path, op):
    """Batch-first GRU/LSTM with the Shape/Expand chain for the initial state, a Gemm head
    and losses.cross_entropy: 3 Adam steps against numpy BPTT (float64)."""
    model, p, x, labels = ex.rnn_classifier(op)
    bptt = rnn.gru_bptt if op == "GRU" else rnn.lstm_bptt
    xt = x.astype(np.float64).transpose(1, 0, 2)

    def loss_and_grads(q):
        loss, g = bptt(xt, q["W"], q["R"], q["B"], q["Wh"], q["bh"], labels)
        return loss, {k: g[k] for k in q}

    opt = optim.Adam(lr=LR)
    want_losses, want = ex.adam_reference(p, loss_and_grads, STEPS, LR, **opt.attributes())
    tr = Trainer(model, losses.cross_entropy("logits"), opt, seed=0)
    assert set(tr.param_names) == set(p)
    got = [tr.step({"x": x, "labels": labels}) for _ in range(STEPS)]
    _compare(tr, p, want_losses, want, got)


def test_batchnorm_cnn_trains_like_model_train(library_path):
    """BatchNormalization(training_mode=1) as TrainingMode.TRAINING exports it: batch
    statistics in the forward and the gradient (numpy float64, central differences), the
    running statistics updated with PyTorch's rule (momentum, UNBIASED batch variance),
    never trained; export() runs the inference form with them."""
    model, p, (rm, rv), x, labels = ex.bn_cnn()
    x64 = x.astype(np.float64)
    stats = []

    def loss_and_grads(q):
        loss, mu, var = ex.bn_cnn_forward(q, x64, labels)
        stats.append((mu, var))
        return loss, ex.fd_grads(lambda r: ex.bn_cnn_forward(r, x64, labels)[0], q)

    opt = optim.Adam(lr=LR)
    want_losses, want = ex.adam_reference(p, loss_and_grads, STEPS, LR, **opt.attributes())
    tr = Trainer(model, losses.cross_entropy("logits"), opt, seed=0)
    assert set(tr.param_names) == set(p)
    assert set(tr.running_stats()) == {"rm", "rv"}
    got = [tr.step({"x": x, "labels": labels}) for _ in range(STEPS)]
    _compare(tr, p, want_losses, want, got)
    n = x.shape[0] * x.shape[2] * x.shape[3]
    for mu, var in stats:  # torch: running = (1 - 0.1) * running + 0.1 * batch (unbiased)
        rm, rv = 0.9 * rm + 0.1 * mu, 0.9 * rv + 0.1 * var * n / (n - 1)
    got_stats = tr.running_stats()
    np.testing.assert_allclose(got_stats["rm"], rm, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_stats["rv"], rv, rtol=1e-5)
    exp = tr.export()
    bn = next(nd for nd in exp.graph.node if nd.op_type == "BatchNormalization")
    assert len(bn.output) == 1 and not any(a.name == "training_mode" for a in bn.attribute)
    params64 = {k: v.astype(np.float64) for k, v in tr.parameters().items()}
    want_logits = ex.bn_cnn_forward(params64, x64, labels, running=(got_stats["rm"],
                                                                    got_stats["rv"]))
    np.testing.assert_allclose(_run(exp, {"x": x}, ["logits"])[0], want_logits, rtol=1e-4,
                               atol=1e-5)


def test_batchnorm_frozen_is_the_inference_form(library_path):
    """batchnorm="frozen": the running statistics normalise (fine-tuning) and stay."""
    model, p, running, x, labels = ex.bn_cnn()
    x64 = x.astype(np.float64)

    def loss(q):
        logits = ex.bn_cnn_forward(q, x64, labels, running=running)
        return ex.cross_entropy(logits, labels)

    opt = optim.Adam(lr=LR)
    want_losses, want = ex.adam_reference(
        p, lambda q: (loss(q), ex.fd_grads(loss, q)), STEPS, LR, **opt.attributes())
    tr = Trainer(model, losses.cross_entropy("logits"), opt, seed=0, batchnorm="frozen")
    assert tr.running_stats() == {}
    got = [tr.step({"x": x, "labels": labels}) for _ in range(STEPS)]
    _compare(tr, p, want_losses, want, got)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in tr.export().graph.initializer}
    np.testing.assert_array_equal(inits["rv"], running[1].astype(np.float32))


@pytest.mark.parametrize("batch_dim", [None, "batch"])
def test_encoder_block_with_classic_exporter_shape_chains(library_path, batch_dim):
    """A transformer encoder layer with the classic exporter's Shape/Slice/Mod/Concat
    chains and Unsqueeze/Transpose/Squeeze/Gather for q, k, v (ranks onnx's inference
    misses), static or symbolic batch: 3 Adam steps against numpy float64 (central
    differences)."""
    model, p, x, labels = ex.encoder_block(batch_dim=batch_dim)
    x64 = x.astype(np.float64)

    def loss_and_grads(q):
        f = lambda r: ex.encoder_forward(r, x64, labels)  # noqa: E731
        return f(q), ex.fd_grads(f, q)

    opt = optim.Adam(lr=LR)
    want_losses, want = ex.adam_reference(p, loss_and_grads, STEPS, LR, **opt.attributes())
    tr = Trainer(model, losses.cross_entropy("logits"), opt, seed=0)
    assert set(tr.param_names) == set(p)  # the 0-d attention scale is a setting
    got = [tr.step({"x": x, "labels": labels}) for _ in range(STEPS)]
    _compare(tr, p, want_losses, want, got, rtol=5e-5, atol=5e-6)


def test_finetune_zoo_example_runs(library_path, tmp_path):
    """docs/from-pytorch.md's example script on a light zoo model."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "finetune_zoo.py"),
                        "--model", "squeezenet", "--steps", "3", "--out",
                        str(tmp_path / "tuned.onnx")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss" in r.stdout and (tmp_path / "tuned.onnx").is_file()
