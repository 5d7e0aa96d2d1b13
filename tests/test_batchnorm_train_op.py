"""com.trainops::BatchNormTrain: ONNX BatchNormalization with training_mode=1 on trainops'
threaded kernel (the fused CPU step's forward, autodiff/batchnorm_forward.py).

Against numpy in float64 (the batch statistics, Y and the running statistics, within the
bound the kernel states in ``crates/trainops-kernels/src/grad/batchnorm/forward.rs``),
against onnxruntime's own training-mode BatchNormalization (the same op: Y within the
bound, the running statistics as ONNX defines them), threads bit for bit, bad inputs, and
which nodes the fused step turns into it.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from test_grad_batchnorm import _error
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

U = 2.0 ** -24  # float32's unit roundoff
INS = ("X", "scale", "B", "input_mean", "input_var")
OUTS = ("Y", "running_mean", "running_var")


def model(x_dims, op="BatchNormTrain", outputs=OUTS, dtype=TensorProto.FLOAT, chan_dims=None, **attrs):
    """One node of ``op`` (``BatchNormTrain``, or onnxruntime's ``BatchNormalization`` with
    ``training_mode=1``); ``outputs``: the node's output names ("" leaves one out)."""
    chan_dims = [x_dims[1]] if chan_dims is None else chan_dims
    if op == "BatchNormalization":
        attrs["training_mode"] = 1
    node = helper.make_node(op, list(INS), list(outputs),
                            domain=TRAINOPS_DOMAIN if op == "BatchNormTrain" else "", **attrs)
    inputs = [helper.make_tensor_value_info("X", dtype, x_dims)]
    inputs += [helper.make_tensor_value_info(n, dtype, chan_dims) for n in INS[1:]]
    outs = [helper.make_tensor_value_info(n, dtype, None) for n in outputs if n]
    m = helper.make_model(helper.make_graph([node], "bn", inputs, outs),
                          opset_imports=[helper.make_opsetid("", 17),
                                         helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def data(rng, shape, offset=1.5):
    c = shape[1]
    chan = (1, c) + (1,) * (len(shape) - 2)
    x = (rng.standard_normal(shape) + offset * np.arange(c).reshape(chan)).astype(np.float32)
    per = lambda lo, hi: (lo + (hi - lo) * rng.random(c)).astype(np.float32)  # noqa: E731
    return {"X": x, "scale": per(-1.5, 1.5), "B": per(-1, 1), "input_mean": per(-1, 1),
            "input_var": per(0.5, 1.5)}


def reference(feeds, eps=1e-5, momentum=0.9):
    """float64: the outputs, and the per-element bound the kernel states on each (its
    float64 sums' error, 2^-30 of the terms' mean magnitude, included)."""
    x, scale, bias, im, iv = (np.asarray(feeds[n], np.float64) for n in INS)
    axes = (0,) + tuple(range(2, x.ndim))
    chan = (1, -1) + (1,) * (x.ndim - 2)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    k = scale.reshape(chan) / np.sqrt(var + eps)
    y = (x - mean) * k + bias.reshape(chan)
    a = 2.0 ** -30 * np.abs(x).mean(axis=axes, keepdims=True)
    q = 2.0 ** -30 * var
    bound = 4 * U * (np.abs(k) * (np.abs(x - mean) + np.abs(mean)) + np.abs(bias.reshape(chan))) + 2 * np.abs(k) * a
    m = np.float64(np.float32(momentum))
    out = {"Y": (y, bound)}
    for name, old, stat, sums in (("running_mean", im, mean.ravel(), a.ravel()),
                                  ("running_var", iv, var.ravel(), 2 * q.ravel())):
        exact = old * m + stat * (1 - m)
        out[name] = (exact, U * np.abs(exact) + 2.0 ** -30 * np.abs(old) * m + (1 - m) * sums)
    return out


def _within(got, ref):
    for name, value in got.items():
        want, bound = ref[name]
        assert value.dtype == np.float32 and value.shape == want.shape, name
        err = np.abs(value.astype(np.float64) - want)
        assert (err <= bound).all(), f"{name}: worst {err.max()} over bound {bound.ravel()[err.argmax()]}"


SHAPES = [(2, 1), (2, 3), (7, 70), (1, 3, 2, 1), (1, 1, 8), (3, 2, 7), (5, 3, 9), (4, 5, 3, 3),
          (2, 3, 2, 3, 4), (9, 4, 8, 8), (64, 16, 4, 4), (8, 64, 16, 16), (16, 576, 4, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("threads", [1, 2])
def test_against_numpy_float64_within_the_stated_bound(make_session, rng, shape, threads):
    feeds = data(rng, shape)
    got = dict(zip(OUTS, make_session(model(list(shape)), threads=threads).run(None, feeds)))
    _within(got, reference(feeds))


def test_attributes(make_session, rng):
    feeds = data(rng, (3, 2, 5))
    feeds["X"][:, 1] = 0.25  # a constant channel: Y = B exactly
    sess = make_session(model([3, 2, 5], epsilon=0.5, momentum=0.25))
    got = dict(zip(OUTS, sess.run(None, feeds)))
    _within(got, reference(feeds, eps=0.5, momentum=0.25))
    np.testing.assert_array_equal(got["Y"][:, 1], np.full((3, 5), feeds["B"][1]))


def test_threads_do_not_change_the_bits(make_session, rng):
    feeds = data(rng, (16, 96, 16, 16))  # large enough to be cut into tasks
    one = make_session(model([16, 96, 16, 16]), threads=1).run(None, feeds)
    two = make_session(model([16, 96, 16, 16]), threads=2).run(None, feeds)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("shape", [(4, 3, 5), (8, 16, 6, 6), (2, 7)])
def test_same_op_as_onnxruntimes_batchnormalization(make_session, rng, shape):
    """onnxruntime's own kernel is the op this replaces: its outputs within the bound of
    the exact values too, the running statistics ONNX's (biased batch variance)."""
    feeds = data(rng, shape)
    ours = dict(zip(OUTS, make_session(model(list(shape))).run(None, feeds)))
    theirs = dict(zip(OUTS, make_session(model(list(shape), op="BatchNormalization")).run(None, feeds)))
    ref = reference(feeds)
    x = feeds["X"].astype(np.float64)
    axes = (0,) + tuple(range(2, x.ndim))
    chan = (1, -1) + (1,) * (x.ndim - 2)
    n = x.size // x.shape[1]
    g = n * U / (1 - n * U)  # gamma_n: a float32 sum of n terms, any order (Higham)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    mabs, msq = np.abs(x).mean(axis=axes, keepdims=True), (x * x).mean(axis=axes, keepdims=True)
    k = np.abs(feeds["scale"].astype(np.float64).reshape(chan)) / np.sqrt(var + 1e-5)
    # onnxruntime's float32 statistics: the mean within g mean|X|, the variance (however
    # it is formed from sums of X and X^2) within 3 g mean(X^2); Y moves by k times the
    # mean's error plus |X - mean| times the relative change of 1/sqrt(var + eps), and
    # rounds a few times more.
    theirs_err = {
        "Y": k * (g * mabs + np.abs(x - mean) * 1.5 * g * msq / (var + 1e-5)) + ref["Y"][1],
        "running_mean": 0.1 * g * mabs.ravel() + ref["running_mean"][1],
        "running_var": 0.1 * 3 * g * msq.ravel() + ref["running_var"][1],
    }
    for name in OUTS:
        want, bound = ref[name]
        assert (np.abs(theirs[name] - want) <= theirs_err[name]).all(), name
        assert (np.abs(ours[name] - want) <= bound).all(), name


@pytest.mark.parametrize("outputs", [("Y",), ("Y", "running_mean"), ("Y", "", "running_var")])
def test_optional_outputs_equal_their_part_of_all_three(make_session, rng, outputs):
    feeds = data(rng, (5, 4, 3, 3))
    full = dict(zip(OUTS, make_session(model([5, 4, 3, 3])).run(None, feeds)))
    got = make_session(model([5, 4, 3, 3], outputs=outputs)).run(None, feeds)
    names = [n for n in outputs if n]
    assert len(got) == len(names)
    for name, value in zip(names, got):
        np.testing.assert_array_equal(value, full[name])


def test_no_channel_gives_empty_outputs(make_session, rng):
    feeds = data(rng, (2, 3, 4))
    feeds = {k: (v[:, :0] if k == "X" else v[:0]) for k, v in feeds.items()}
    got = make_session(model(["a", "b", "c"], chan_dims=["d"])).run(None, feeds)
    assert [o.shape for o in got] == [(2, 0, 4), (0,), (0,)]


def test_bad_inputs_are_clear_errors(make_session, rng):
    feeds = data(rng, (2, 3, 4))
    dyn = model(["a", "b", "c"], chan_dims=["d"])
    msg = _error(make_session, dyn, {**feeds, "B": feeds["B"][:2]})
    assert "BatchNormTrain: input 2 (B): expected shape [3]" in msg and "[2]" in msg, msg
    msg = _error(make_session, dyn, {**feeds, "X": feeds["X"][:0]})
    assert "input 0 (X): expected at least one element per channel" in msg, msg
    rank1 = model(["a"], chan_dims=["b"])
    msg = _error(make_session, rank1, {**feeds, "X": feeds["X"][0, 0]})
    assert "input 0 (X): expected a tensor of rank >= 2" in msg, msg
    for attr, value in (("epsilon", -1.0), ("momentum", float("nan"))):
        msg = _error(make_session, model([2, 3, 4], **{attr: value}), feeds)
        assert f"BatchNormTrain: attribute '{attr}'" in msg, msg
    d = model([2, 3, 4], dtype=TensorProto.DOUBLE)
    msg = _error(make_session, d, {k: v.astype(np.float64) for k, v in feeds.items()})
    assert "BatchNormTrain" in msg and "tensor(double)" in msg, msg  # refused at load


# -- which nodes the fused step turns into BatchNormTrain -------------------------------

def _step_ops(monkeypatch, fused=True, **kw):
    from trainops import optim
    from trainops.bench.train_models import family
    from trainops.train import Trainer

    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    fam = family("bncnn", 4)
    tr = Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params, threads=1, **kw)
    bns = sum(n.op_type == "BatchNormalization" for n in fam.model.graph.node)
    return [n.op_type for n in tr.training_model().graph.node], bns


def test_fused_step_runs_batchnorm_on_the_kernel(monkeypatch, library_path):
    ops, bns = _step_ops(monkeypatch)
    assert bns > 0 and ops.count("BatchNormTrain") == bns and "BatchNormalization" not in ops
    for kw in ({"portable": True}, {"batchnorm": "frozen"}):
        ops, _ = _step_ops(monkeypatch, **kw)
        assert "BatchNormTrain" not in ops and "BatchNormalization" in ops, kw
    ops, _ = _step_ops(monkeypatch, fused=False)
    assert "BatchNormTrain" not in ops and "BatchNormalization" in ops
