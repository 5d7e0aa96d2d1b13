"""com.trainops::SoftmaxCrossEntropy: ONNX SoftmaxCrossEntropyLoss without class weights
and without log_prob, on trainops' threaded kernel (the fused CPU step's loss,
autodiff/cross_entropy_forward.py).

Against numpy in float64 within the bound the kernel states
(``crates/trainops-kernels/src/grad/softmax.rs``: ``u (3.1 + ln C)`` per row before its
float32 rounding), against onnxruntime's own SoftmaxCrossEntropyLoss, threads bit for bit,
bad inputs, and which nodes the fused step turns into it.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_grad_batchnorm import _error
from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

U = 2.0 ** -24


def model(rows=None, classes=None, op="SoftmaxCrossEntropy", labels_type=TensorProto.INT64,
          **attrs):
    node = helper.make_node(op, ["scores", "labels"], ["loss"],
                            domain=TRAINOPS_DOMAIN if op == "SoftmaxCrossEntropy" else "", **attrs)
    g = helper.make_graph([node], "ce",
                          [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("labels", labels_type, None)],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def reference(scores, labels, ignore=None):
    """Each row's loss in float64 (0 where ignored) and the bound the kernel states on it
    before the float32 rounding."""
    x = scores.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    kept = labels != ignore if ignore is not None else np.ones(labels.shape, bool)
    safe = np.where(kept, labels, 0)
    loss = np.where(kept, lse - x[np.arange(len(labels)), safe], 0.0)
    c = scores.shape[1]
    bound = np.where(kept, U * (3.1 + math.log(c)) + 2.0 ** -45 * (2 * np.abs(x).max(axis=1) + np.abs(loss)), 0.0)
    return loss, bound, kept


def data(rng, rows, classes, spread=8.0, ignore=None):
    scores = (spread * (rng.random((rows, classes)) - 0.5)).astype(np.float32)
    labels = rng.integers(0, classes, rows).astype(np.int64)
    if ignore is not None:
        labels[::3] = ignore
    return scores, labels


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,classes,spread", [(1, 1, 8.0), (7, 33, 8.0), (64, 1000, 30.0),
                                                 (9, 49157, 30.0), (300, 37, 300.0)])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_against_numpy_float64_within_the_stated_bound(make_session, rows, classes, spread,
                                                       reduction, threads):
    rng = np.random.default_rng(rows * 7 + classes)
    ignore = -100 if rows > 3 else None
    scores, labels = data(rng, rows, classes, spread, ignore)
    attrs = {"reduction": reduction, **({"ignore_index": ignore} if ignore is not None else {})}
    (got,) = make_session(model(**attrs), threads=threads).run(None, {"scores": scores, "labels": labels})
    loss, bound, kept = reference(scores, labels, ignore)
    if reduction == "none":
        assert got.shape == (rows,)
        assert np.all(np.abs(got - loss) <= bound + U * np.abs(loss)), np.abs(got - loss).max()
        return
    total, tb = loss.sum(), bound.sum() + 2.0 ** -45 * np.abs(loss).sum()
    want, wb = (total, tb) if reduction == "sum" else (total / kept.sum(), tb / kept.sum())
    assert got.shape == () and abs(float(got) - want) <= wb + U * abs(want), (float(got), want)


def test_bits_do_not_depend_on_threads(make_session, rng):
    scores, labels = data(rng, 200, 4099, 20.0)
    feeds = {"scores": scores, "labels": labels}
    one = make_session(model(reduction="none"), threads=1).run(None, feeds)[0]
    two = make_session(model(reduction="none"), threads=2).run(None, feeds)[0]
    np.testing.assert_array_equal(one.view(np.int32), two.view(np.int32))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_against_onnxruntimes_own_loss(make_session, rng, reduction):
    """The same loss as onnxruntime's SoftmaxCrossEntropyLoss (its LogSoftmax in float32:
    within both bounds), ignored rows and all-ignored mean (NaN, 0/0) included."""
    scores, labels = data(rng, 40, 300, 12.0, ignore=5)
    feeds = {"scores": scores, "labels": labels}
    mine = make_session(model(reduction=reduction, ignore_index=5)).run(None, feeds)[0]
    theirs = make_session(model(op="SoftmaxCrossEntropyLoss", reduction=reduction,
                                ignore_index=5)).run(None, feeds)[0]
    loss, bound, _ = reference(scores, labels, 5)
    # onnxruntime's: x - max - log(sum) in float32 and the gathered value, a few roundings
    # of terms up to |x| + log C each
    theirs_bound = 4 * U * (2 * np.abs(scores).max() + math.log(300) + np.abs(loss).max())
    assert np.allclose(mine, theirs, rtol=0, atol=bound.max() + theirs_bound)
    feeds["labels"][:] = 5
    if reduction == "mean":
        a = make_session(model(reduction="mean", ignore_index=5)).run(None, feeds)[0]
        b = make_session(model(op="SoftmaxCrossEntropyLoss", reduction="mean",
                               ignore_index=5)).run(None, feeds)[0]
        assert np.isnan(a) and np.isnan(b)


def test_infinities_and_nan(make_session):
    scores = np.array([[-np.inf, 0, 1], [0, -np.inf, 2], [np.nan, 0, 0]], np.float32)
    (got,) = make_session(model(reduction="none")).run(None, {"scores": scores,
                                                              "labels": np.array([1, 1, 2])})
    assert abs(got[0] - math.log(1 + math.e)) < 1e-6 and got[1] == np.inf and np.isnan(got[2])


def test_bad_inputs_are_clear_errors(make_session, rng):
    scores, labels = data(rng, 4, 5)
    msg = _error(make_session, model(), {"scores": scores, "labels": np.array([0, 1, 5, 2])})
    assert "SoftmaxCrossEntropy: input 1 (labels): expected labels in [0, 5) or ignore_index, got label 5" in msg, msg
    msg = _error(make_session, model(), {"scores": scores[None], "labels": labels})
    assert "SoftmaxCrossEntropy: input 0 (scores): expected a 2-D tensor [N, C]" in msg, msg
    msg = _error(make_session, model(), {"scores": scores, "labels": labels[:3]})
    assert "input 1 (labels): expected an aligned 1-D tensor of 4 labels" in msg, msg
    msg = _error(make_session, model(labels_type=TensorProto.INT32),
                 {"scores": scores, "labels": labels.astype(np.int32)})
    assert "input 1 (labels): expected tensor(int64)" in msg, msg
    msg = _error(make_session, model(reduction="max"), {"scores": scores, "labels": labels})
    assert "reduction" in msg and "none, sum, mean" in msg, msg


def _classifier(weights: bool, C: int = 5000):
    """x @ w [8, C] -> SoftmaxCrossEntropyLoss (mean; with class weights when asked)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, C)).astype(np.float32), "w")]
    ins = ["logits", "labels"]
    if weights:
        inits.append(numpy_helper.from_array(np.linspace(0.5, 1.5, C).astype(np.float32), "cw"))
        ins.append("cw")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"]),
                           helper.make_node("SoftmaxCrossEntropyLoss", ins, ["loss"])], "clf",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
                           helper.make_tensor_value_info("labels", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m


@pytest.mark.parametrize("weights,classes", [(False, 5000), (True, 5000), (False, 4095)])
def test_the_fused_step_takes_the_common_form_only(library_path, monkeypatch, weights, classes):
    """Without class weights, over 4096 classes or more, the fused step's loss is
    SoftmaxCrossEntropy, and its loss equals the standard-op step's within both bounds;
    with weights, or fewer classes, onnxruntime's stays."""
    m = _classifier(weights, classes)
    taken = not weights and classes >= 4096
    feeds = {"x": np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8),
             "labels": np.array([3, 299, 0, 17 + classes // 2])}
    got = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", fused)
        tr = Trainer(m, "loss", optim.Adam(lr=1e-3), params=["w"], threads=1)
        ops = Counter(n.op_type for n in tr.training_model().graph.node)
        got[fused] = (ops, tr.step(feeds))
    ops, l1 = got["1"]
    assert ops["SoftmaxCrossEntropy"] == int(taken), ops
    assert ops["SoftmaxCrossEntropyLoss"] == int(not taken), ops
    assert got["0"][0]["SoftmaxCrossEntropy"] == 0
    # both within their bounds of the exact loss at the same first-step logits (the
    # MatMul's rounding is the same in both steps): this kernel's, and onnxruntime's
    # LogSoftmax in float32 (a few roundings of terms up to |x| + log C)
    w = next(numpy_helper.to_array(i) for i in m.graph.initializer if i.name == "w")
    logits = feeds["x"].astype(np.float64) @ w.astype(np.float64)
    big = np.abs(logits).max()
    lc = math.log(classes)
    tol = U * (3.1 + lc) + 4 * U * (2 * big + lc + abs(l1)) + 2 * U * abs(l1)
    assert abs(l1 - got["0"][1]) <= tol, (l1, got["0"][1], tol)
