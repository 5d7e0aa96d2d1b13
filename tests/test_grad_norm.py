"""``com.trainops::LayerNormGrad``, ``SoftmaxGrad``, ``LogSoftmaxGrad`` and
``SoftmaxCrossEntropyLossGrad`` (fused CPU backward kernels): the
ops against numpy float64 (the backward written out) and against central finite
differences of the forward in float64; the Trainer with the fused kernels against the same
Trainer under ``TRAINOPS_FUSED_GRADS=0`` on the bench's transformer and MLP; the ops present
in the fused step graph and absent from the portable one; bad inputs refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers.adam_pair import assert_runs_agree, record
from trainops import optim
from trainops.bench.train_models import family
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN
from trainops.train import Trainer

F = TensorProto.FLOAT


def _model(op, inputs, outputs, **attrs):
    node = helper.make_node(op, [n for n, _ in inputs], list(outputs), domain=TRAINOPS_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
        [helper.make_tensor_value_info(o, F, None) for o in outputs if o])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


# -- LayerNormGrad ---------------------------------------------------------------------

def ln_forward(x, scale, bias, axis, eps):
    """LayerNormalization in float64 numpy."""
    axes = tuple(range(axis, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias, mu, 1 / np.sqrt(var + eps)


def ln_backward(dy, x, scale, axis, eps):
    """The textbook backward of LayerNormalization in float64 numpy."""
    axes = tuple(range(axis, x.ndim))
    _, mu, r = ln_forward(x, scale, 0.0, axis, eps)
    xh = (x - mu) * r
    g = dy * scale
    dx = r * (g - g.mean(axis=axes, keepdims=True) - xh * (g * xh).mean(axis=axes, keepdims=True))
    lead = tuple(range(axis))
    return dx, (dy * xh).sum(axis=lead), dy.sum(axis=lead)


def run_ln(make_session, dy, x, scale, axis, eps=1e-5, outputs=("dX", "dScale", "dBias")):
    _, mu, r = ln_forward(x.astype(np.float64), scale.astype(np.float64), 0.0, axis % x.ndim, eps)
    m = _model("LayerNormGrad", [(n, F) for n in ("dY", "X", "Scale", "Mean", "InvStdDev")],
               outputs, axis=axis)
    feeds = {"dY": dy, "X": x, "Scale": scale, "Mean": mu.astype(np.float32),
             "InvStdDev": r.astype(np.float32)}
    return make_session(m).run(None, feeds)


@pytest.mark.parametrize("shape,axis", [((4, 8), 1), ((3, 5, 7), -1), ((2, 3, 4, 5), 2),
                                        ((6, 33), -1), ((1, 1), 1), ((2, 1024), 1), ((64, 64, 16), 1)])
def test_layer_norm_grad_matches_float64(make_session, rng, shape, axis):
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    a = axis % len(shape)
    scale = (1 + 0.5 * rng.standard_normal(shape[a:])).astype(np.float32)
    got = run_ln(make_session, dy, x, scale, axis)
    want = ln_backward(dy.astype(np.float64), x.astype(np.float64), scale.astype(np.float64), a, 1e-5)
    for name, g, w in zip(("dX", "dScale", "dBias"), got, want):
        assert g.shape == w.shape and g.dtype == np.float32, name
        # float32 inputs of the statistics and float32 arithmetic: a few ulp of the terms
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * (np.abs(w).max() + 1), err_msg=name)


def test_layer_norm_grad_matches_finite_differences(make_session, rng):
    shape, axis, eps = (3, 4, 5), 1, 1e-5
    x = rng.standard_normal(shape)
    scale, bias = 1 + 0.3 * rng.standard_normal(shape[1:]), rng.standard_normal(shape[1:])
    R = rng.standard_normal(shape)

    def loss(x_, s_, b_):
        return float((ln_forward(x_, s_, b_, axis, eps)[0] * R).sum())

    def fd(which):
        args = [x.copy(), scale.copy(), bias.copy()]
        g = np.zeros_like(args[which])
        h = 1e-6
        for i in np.ndindex(g.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][i] += h
            minus[which][i] -= h
            g[i] = (loss(*plus) - loss(*minus)) / (2 * h)
        return g

    dx, ds, db = run_ln(make_session, R.astype(np.float32), x.astype(np.float32),
                        scale.astype(np.float32), axis, eps)
    for name, g, which in (("dX", dx, 0), ("dScale", ds, 1), ("dBias", db, 2)):
        np.testing.assert_allclose(g, fd(which), rtol=1e-4, atol=1e-4, err_msg=name)


def test_layer_norm_grad_optional_outputs(make_session, rng):
    x = rng.standard_normal((5, 6)).astype(np.float32)
    dy = rng.standard_normal((5, 6)).astype(np.float32)
    scale = rng.standard_normal(6).astype(np.float32)
    full = run_ln(make_session, dy, x, scale, 1)
    only_dx = run_ln(make_session, dy, x, scale, 1, outputs=("dX",))
    assert len(only_dx) == 1
    np.testing.assert_array_equal(only_dx[0], full[0])
    with_bias = run_ln(make_session, dy, x, scale, 1, outputs=("dX", "", "dBias"))
    np.testing.assert_array_equal(with_bias[1], full[2])


@pytest.mark.parametrize("case,message", [
    ("rank", "input 1 (X): expected a tensor of rank > 2"),
    ("scale", "input 2 (Scale): expected 6 elements"),
    ("mean", "input 3 (Mean): expected 5 elements"),
    ("dy", "input 0 (dY): expected the shape of X"),
])
def test_layer_norm_grad_refuses_bad_inputs(make_session, case, message):
    x = np.ones((5, 6), np.float32)
    feeds = {"dY": x, "X": x, "Scale": np.ones(6, np.float32), "Mean": np.zeros(5, np.float32),
             "InvStdDev": np.ones(5, np.float32)}
    axis = 1
    if case == "rank":
        axis = 2
    elif case == "scale":
        feeds["Scale"] = np.ones(5, np.float32)
    elif case == "mean":
        feeds["Mean"] = np.zeros(4, np.float32)
    else:
        feeds["dY"] = np.ones((6, 5), np.float32)
    m = _model("LayerNormGrad", [(n, F) for n in feeds], ["dX", "dScale"], axis=axis)
    with pytest.raises(Exception, match="LayerNormGrad") as err:
        make_session(m).run(None, feeds)
    assert message in str(err.value)


def test_layer_norm_grad_refuses_double(make_session):
    m = _model("LayerNormGrad", [(n, TensorProto.DOUBLE) for n in ("dY", "X", "Scale", "Mean", "InvStdDev")],
               ["dX"])
    with pytest.raises(Exception, match="LayerNormGrad|tensor\\(double\\)|Type"):
        make_session(m)


# -- SoftmaxGrad, LogSoftmaxGrad ----------------------------------------------------------

def log_softmax64(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def run_softmax_grad(make_session, op, dy, y, axis):
    m = _model(op, [("dY", F), ("Y", F)], ["dX"], axis=axis)
    return make_session(m).run(None, {"dY": dy, "Y": y})[0]


@pytest.mark.parametrize("op", ["SoftmaxGrad", "LogSoftmaxGrad"])
@pytest.mark.parametrize("shape,axis", [((4, 10), -1), ((2, 3, 5), 1), ((2, 3, 4, 5), 0),
                                        ((32, 4, 32, 32), -1), ((1,), 0), ((3, 17), 1)])
def test_softmax_grads_match_float64(make_session, rng, op, shape, axis):
    x = 3 * rng.standard_normal(shape)
    ls = log_softmax64(x, axis)
    y64 = np.exp(ls) if op == "SoftmaxGrad" else ls
    y = y64.astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    d, v = dy.astype(np.float64), y.astype(np.float64)
    if op == "SoftmaxGrad":
        want = v * (d - (d * v).sum(axis=axis, keepdims=True))
    else:
        want = d - np.exp(v) * d.sum(axis=axis, keepdims=True)
    got = run_softmax_grad(make_session, op, dy, y, axis)
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["SoftmaxGrad", "LogSoftmaxGrad"])
def test_softmax_grads_match_finite_differences(make_session, rng, op):
    shape, axis = (3, 4, 5), 1
    x, R = rng.standard_normal(shape), rng.standard_normal(shape)
    def f(z):
        return np.exp(log_softmax64(z, axis)) if op == "SoftmaxGrad" else log_softmax64(z, axis)
    h, fd = 1e-6, np.zeros(shape)
    for i in np.ndindex(shape):
        p, m = x.copy(), x.copy()
        p[i] += h
        m[i] -= h
        fd[i] = ((f(p) - f(m)) * R).sum() / (2 * h)
    got = run_softmax_grad(make_session, op, R.astype(np.float32), f(x).astype(np.float32), axis)
    np.testing.assert_allclose(got, fd, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["SoftmaxGrad", "LogSoftmaxGrad"])
def test_softmax_grads_refuse_bad_inputs(make_session, op):
    y = np.full((2, 3), 1 / 3, np.float32)
    with pytest.raises(Exception, match=f"{op}: input 0 \\(dY\\): expected the shape of Y"):
        run_softmax_grad(make_session, op, np.ones((3, 2), np.float32), y, -1)
    with pytest.raises(Exception, match=f"{op}: input 1 \\(Y\\): expected a tensor of rank > 2"):
        run_softmax_grad(make_session, op, y, y, 2)
    with pytest.raises(Exception, match=f"{op}: input 1 \\(Y\\): expected a tensor of rank > 2"):
        run_softmax_grad(make_session, op, y, y, -3)


# -- SoftmaxCrossEntropyLossGrad ------------------------------------------------------------

def sce_loss64(x, labels, reduction, ignore_index):
    """SoftmaxCrossEntropyLoss (no weights) in float64 numpy."""
    lp = log_softmax64(x, 1)
    keep = labels != ignore_index if ignore_index is not None else np.ones(len(labels), bool)
    safe = np.where(keep, labels, 0)
    per = -lp[np.arange(len(labels)), safe] * keep
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / keep.sum()


def run_sce_grad(make_session, dy, x, labels, **attrs):
    m = _model("SoftmaxCrossEntropyLossGrad", [("dY", F), ("scores", F), ("labels", TensorProto.INT64)],
               ["dX"], **attrs)
    return make_session(m).run(None, {"dY": dy, "scores": x, "labels": labels})[0]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2, -1])
def test_cross_entropy_grad_matches_finite_differences(make_session, rng, reduction, ignore_index):
    n, c = 7, 5
    x = 2 * rng.standard_normal((n, c))
    labels = rng.integers(0, c, n)
    labels[1] = ignore_index if ignore_index is not None else labels[1]
    labels[4] = 2
    dy = rng.standard_normal(n) if reduction == "none" else np.asarray(1.7)
    h, fd = 1e-6, np.zeros_like(x)
    for i in np.ndindex(x.shape):
        p, m = x.copy(), x.copy()
        p[i] += h
        m[i] -= h
        diff = sce_loss64(p, labels, reduction, ignore_index) - sce_loss64(m, labels, reduction, ignore_index)
        fd[i] = (diff * dy).sum() / (2 * h)
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    got = run_sce_grad(make_session, dy.astype(np.float32), x.astype(np.float32),
                       labels.astype(np.int64), **attrs)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, fd, rtol=1e-4, atol=1e-6)
    if ignore_index is not None:
        assert not got[1].any()  # the ignored row has no gradient


def test_cross_entropy_grad_refuses_bad_inputs(make_session):
    x, one = np.zeros((3, 4), np.float32), np.ones((), np.float32)
    sce = "SoftmaxCrossEntropyLossGrad"
    with pytest.raises(Exception, match=f"{sce}: input 2 \\(labels\\): expected labels in \\[0, 4\\)"):
        run_sce_grad(make_session, one, x, np.array([0, 4, 1], np.int64))
    with pytest.raises(Exception, match="input 2 \\(labels\\): expected an aligned 1-D tensor of 3 labels"):
        run_sce_grad(make_session, one, x, np.array([0, 1], np.int64))
    with pytest.raises(Exception, match="input 1 \\(scores\\): expected a 2-D tensor"):
        run_sce_grad(make_session, one, np.zeros((3, 4, 2), np.float32), np.array([0, 1, 1], np.int64))
    with pytest.raises(Exception, match="input 0 \\(dY\\): expected 3 element"):
        run_sce_grad(make_session, one, x, np.array([0, 1, 1], np.int64), reduction="none")
    with pytest.raises(Exception, match="attribute 'reduction': expected one of none, sum, mean"):
        run_sce_grad(make_session, one, x, np.array([0, 1, 1], np.int64), reduction="max")


# -- the Trainer -------------------------------------------------------------------------

FUSED_OPS = {"LayerNormGrad", "SoftmaxGrad", "SoftmaxCrossEntropyLossGrad"}


def _train(fam, steps, monkeypatch, fused=True, portable=False):
    if fused:
        monkeypatch.delenv("TRAINOPS_FUSED_GRADS", raising=False)
    else:
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "0")
    tr = Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params, threads=1,
                 portable=portable)
    return tr, record(tr, fam.feeds, steps)  # losses; parameters and moments per step


def _trainops_ops(tr):
    return {n.op_type for n in tr.training_model().graph.node if n.domain == TRAINOPS_DOMAIN}


@pytest.mark.parametrize("name,batch,expect", [("transformer", 2, FUSED_OPS),
                                               ("mlp", 4, {"LayerNormGrad", "SoftmaxCrossEntropyLossGrad"})])
def test_trainer_fused_matches_standard_ops(library_path, monkeypatch, name, batch, expect):
    fam = family(name, batch)
    fused, rf = _train(fam, 4, monkeypatch, fused=True)
    plain, rp = _train(fam, 4, monkeypatch, fused=False)
    assert expect <= _trainops_ops(fused)
    assert not _trainops_ops(plain) & FUSED_OPS
    # Rounding differs (f64 row sums, one kernel) but not the math: losses, weights and
    # Adam's moments within helpers/adam_pair.py's bound after every step (each gradient
    # within gamma(n) sum|terms| of the exact one; Adam divides by each element's gradient
    # RMS, so an element whose gradient is rounding noise, as the attention's key bias, may
    # move by up to lr a step either way). A gradient 1% off exceeds the bound in every
    # tensor of the mlp; in the transformer only from layer1's out_proj on (the worst
    # case compounds through four LayerNorms and two attentions).
    assert_runs_agree(fam.model, fam.feeds, fused.optimizer, rf, rp, what=f"{name}: ")
    pf = fused.parameters()
    moved = 0
    for k in pf:
        moved += int((pf[k] != fam.weights[k]).any())
    assert moved == len(pf)  # every weight trained


def test_portable_trainer_has_no_fused_grad_ops(library_path, monkeypatch):
    fam = family("transformer", 2)
    tr, _ = _train(fam, 1, monkeypatch, fused=True, portable=True)
    assert not _trainops_ops(tr)
    ops = {n.op_type for n in tr.training_model().graph.node}
    assert not ops & FUSED_OPS


def _small_model():
    """x[N, 3, 4] -> LayerNorm(axis=1) -> Softmax(axis=1) -> [N, 12] @ W ->
    SoftmaxCrossEntropyLoss(sum, ignore_index=-1): axes other than the last, Bias not trained
    (LayerNormGrad without dBias), no gradient for x."""
    rng = np.random.default_rng(5)
    w = {"g": (1 + 0.2 * rng.standard_normal((3, 4))).astype(np.float32),
         "b": (0.1 * rng.standard_normal((3, 4))).astype(np.float32),
         "W": rng.standard_normal((12, 5)).astype(np.float32),
         "shape": np.array([-1, 12], np.int64)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["h"], axis=1),
             helper.make_node("Softmax", ["h"], ["p"], axis=1),
             helper.make_node("Reshape", ["p", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "W"], ["z"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["z", "t"], ["loss"], reduction="sum",
                              ignore_index=-1)]
    graph = helper.make_graph(
        nodes, "small", [helper.make_tensor_value_info("x", F, [6, 3, 4]),
                         helper.make_tensor_value_info("t", TensorProto.INT64, [6])],
        [helper.make_tensor_value_info("loss", F, [])],
        [helper.make_tensor(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape, v.flatten().tolist())
         for k, v in w.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = IR_VERSION
    x = rng.standard_normal((6, 3, 4)).astype(np.float32)
    return m, {"x": x, "t": np.array([0, 4, -1, 2, 1, -1], np.int64)}, w


def test_trainer_fused_on_other_axes_without_dbias(library_path, monkeypatch):
    m, feeds, w = _small_model()
    runs = {}
    for fused in (True, False):
        if fused:
            monkeypatch.delenv("TRAINOPS_FUSED_GRADS", raising=False)
        else:
            monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "0")
        tr = Trainer(m, "loss", optim.Adam(lr=1e-2), params=["g", "W"], threads=1)
        runs[fused] = (tr, record(tr, feeds, 3))  # losses; parameters and moments per step
    (tf, rf), (tp, rp) = runs[True], runs[False]
    nodes = [n for n in tf.training_model().graph.node if n.domain == TRAINOPS_DOMAIN]
    assert {n.op_type for n in nodes} >= FUSED_OPS
    ln = next(n for n in nodes if n.op_type == "LayerNormGrad")
    assert len(ln.output) == 2 and all(ln.output)  # dX (always) and dScale; no dBias
    assert not _trainops_ops(tp) & FUSED_OPS
    # losses, weights and moments within helpers/adam_pair.py's bound after every step
    assert_runs_agree(m, feeds, tf.optimizer, rf, rp)
    for k in ("g", "W"):
        assert (tf.parameters()[k] != w[k]).any(), k


def test_trainer_fused_log_softmax(library_path, monkeypatch):
    """x @ W -> LogSoftmax -> NegativeLogLikelihoodLoss: the rule emits LogSoftmaxGrad."""
    rng = np.random.default_rng(9)
    w0 = rng.standard_normal((8, 5)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["z"]),
         helper.make_node("LogSoftmax", ["z"], ["lp"], axis=-1),
         helper.make_node("NegativeLogLikelihoodLoss", ["lp", "t"], ["loss"])],
        "lsm", [helper.make_tensor_value_info("x", F, [4, 8]),
                helper.make_tensor_value_info("t", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("loss", F, [])],
        [helper.make_tensor("W", F, w0.shape, w0.flatten().tolist())])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "t": np.array([0, 3, 4, 1], np.int64)}
    out = {}
    for fused in (True, False):
        if fused:
            monkeypatch.delenv("TRAINOPS_FUSED_GRADS", raising=False)
        else:
            monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "0")
        tr = Trainer(m, "loss", optim.Adam(lr=1e-2), params=["W"], threads=1)
        out[fused] = (tr, record(tr, feeds, 3))  # losses; parameters and moments per step
    assert "LogSoftmaxGrad" in _trainops_ops(out[True][0])
    assert "LogSoftmaxGrad" not in _trainops_ops(out[False][0])
    # losses, weights and moments within helpers/adam_pair.py's bound after every step
    assert_runs_agree(m, feeds, out[True][0].optimizer, out[True][1], out[False][1])
    assert (out[True][0].parameters()["W"] != w0).any()
