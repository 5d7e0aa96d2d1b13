"""com.trainops::ConvWeightGrad / ConvInputGrad (fused CPU backward kernels): the convolution's gradients,
against a numpy float64 adjoint and finite differences of a numpy float64 convolution; the
Trainer with them against the same Trainer on standard ops (TRAINOPS_FUSED_GRADS=0); bad
inputs. Spec: docs/ops/gradients-conv.md."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers.adam_pair import assert_runs_agree, record
from trainops import optim
from trainops.onnx_defs import IR_VERSION, ONNX_OPSET, TRAINOPS_DOMAIN
from trainops.train import Trainer

F32_EPS = float(np.finfo(np.float32).eps)


# -- numpy float64 reference ------------------------------------------------------------

def _windows(x_shape, kernel, strides, dilations, pads):
    """(padded input shape, output spatial shape, [(kernel index, slices into the padded
    input)]) of a convolution."""
    d = len(kernel)
    sp = x_shape[2:]
    padded = [sp[j] + pads[j] + pads[j + d] for j in range(d)]
    out = [(padded[j] - ((kernel[j] - 1) * dilations[j] + 1)) // strides[j] + 1 for j in range(d)]
    wins = []
    for kk in itertools.product(*[range(k) for k in kernel]):
        sl = tuple(slice(kk[j] * dilations[j], kk[j] * dilations[j] + strides[j] * (out[j] - 1) + 1,
                         strides[j]) for j in range(d))
        wins.append((kk, sl))
    return padded, out, wins


def _pad(x, pads):
    d = x.ndim - 2
    return np.pad(x, [(0, 0), (0, 0)] + [(pads[j], pads[j + d]) for j in range(d)])


def ref_forward(x, w, strides, dilations, pads, group):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    mg = m // group
    _, out, wins = _windows(x.shape, w.shape[2:], strides, dilations, pads)
    xp = _pad(x, pads)
    y = np.zeros([n, m] + out)
    for kk, sl in wins:
        patch = xp[(slice(None), slice(None)) + sl]  # [n, c, out..]
        for g in range(group):
            wk = w[(slice(g * mg, (g + 1) * mg), slice(None)) + kk]  # [mg, cg]
            y[:, g * mg:(g + 1) * mg] += np.einsum("mc,nc...->nm...", wk, patch[:, g * cg:(g + 1) * cg])
    return y


def ref_weight_grad(x, dy, kernel, strides, dilations, pads, group):
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    c, m = x.shape[1], dy.shape[1]
    cg, mg = c // group, m // group
    _, _, wins = _windows(x.shape, kernel, strides, dilations, pads)
    xp = _pad(x, pads)
    dw = np.zeros([m, cg] + list(kernel))
    for kk, sl in wins:
        patch = xp[(slice(None), slice(None)) + sl]
        for g in range(group):
            dyg = dy[:, g * mg:(g + 1) * mg].reshape(dy.shape[0], mg, int(np.prod(dy.shape[2:])))
            pg = patch[:, g * cg:(g + 1) * cg].reshape(x.shape[0], cg, int(np.prod(dy.shape[2:])))
            dw[(slice(g * mg, (g + 1) * mg), slice(None)) + kk] = np.einsum("nmp,ncp->mc", dyg, pg)
    return dw


def ref_input_grad(dy, w, x_shape, strides, dilations, pads, group):
    dy, w = np.asarray(dy, np.float64), np.asarray(w, np.float64)
    m, cg = w.shape[:2]
    mg = m // group
    d = len(x_shape) - 2
    padded, _, wins = _windows(x_shape, w.shape[2:], strides, dilations, pads)
    dxp = np.zeros(list(x_shape[:2]) + padded)
    for kk, sl in wins:
        for g in range(group):
            wk = w[(slice(g * mg, (g + 1) * mg), slice(None)) + kk]
            dxp[(slice(None), slice(g * cg, (g + 1) * cg)) + sl] += np.einsum(
                "mc,nm...->nc...", wk, dy[:, g * mg:(g + 1) * mg])
    crop = tuple(slice(pads[j], pads[j] + x_shape[2 + j]) for j in range(d))
    return dxp[(slice(None), slice(None)) + crop]


# -- the ops in a one-node model ---------------------------------------------------------

def _model(op, inputs, attrs, in_types=None):
    names = {"ConvWeightGrad": ["X", "dY"], "ConvInputGrad": ["dY", "W", "X_shape"]}[op]
    out = "dW" if op == "ConvWeightGrad" else "dX"
    types = in_types or [TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT64]
    vis = [helper.make_tensor_value_info(nm, t, None) for nm, t in zip(names, types)]
    node = helper.make_node(op, names, [out], domain=TRAINOPS_DOMAIN, **attrs)
    graph = helper.make_graph([node], op, vis, [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET),
                                                    helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    model.ir_version = IR_VERSION
    return model


def _attrs(kernel, strides, dilations, pads, group):
    return dict(kernel_shape=list(kernel), strides=list(strides), dilations=list(dilations),
                pads=list(pads), group=group)


def run_weight_grad(make_session, x, dy, geo, threads=1):
    sess = make_session(_model("ConvWeightGrad", ["X", "dY"], _attrs(*geo)), threads=threads)
    return sess.run(None, {"X": x, "dY": dy})[0]


def run_input_grad(make_session, dy, w, x_shape, geo, threads=1):
    sess = make_session(_model("ConvInputGrad", None, _attrs(*geo)), threads=threads)
    return sess.run(None, {"dY": dy, "W": w, "X_shape": np.asarray(x_shape, np.int64)})[0]


# (name, N, C, M, input spatial, kernel, strides, dilations, pads, group)
CASES = [
    ("3x3 pad1", 2, 3, 4, [6, 5], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
    ("1x1", 2, 5, 3, [4, 3], [1, 1], [1, 1], [1, 1], [0, 0, 0, 0], 1),
    ("1x1 stride2", 3, 4, 6, [7, 5], [1, 1], [2, 2], [1, 1], [0, 0, 0, 0], 1),
    ("stride2", 2, 3, 5, [9, 8], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 1),
    ("dilation2", 2, 2, 3, [9, 7], [3, 2], [1, 1], [2, 2], [2, 1, 2, 1], 1),
    ("asym pads", 2, 3, 2, [6, 5], [3, 3], [2, 1], [1, 1], [0, 2, 1, 0], 1),
    ("rows no window reads", 2, 2, 2, [8, 7], [2, 2], [3, 3], [1, 1], [0, 0, 0, 0], 1),
    ("groups2", 2, 4, 6, [6, 6], [3, 3], [1, 2], [1, 1], [1, 1, 1, 1], 2),
    ("depthwise", 2, 5, 5, [7, 6], [3, 3], [2, 1], [1, 2], [1, 2, 1, 0], 5),
    ("batch1 odd", 1, 3, 7, [11, 13], [5, 3], [3, 2], [1, 1], [2, 1, 2, 1], 1),
    ("empty batch", 0, 3, 4, [5, 5], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
    ("1d", 3, 4, 5, [17], [3], [2], [1], [1, 2], 1),
    ("3d", 2, 2, 3, [4, 5, 3], [2, 3, 2], [1, 2, 1], [1, 1, 2], [1, 0, 1, 0, 1, 1], 1),
    ("chunked samples", 6, 4, 8, [8, 8], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
    ("chunked grouped", 5, 4, 4, [8, 8], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 2),
    ("resnet-like", 4, 16, 32, [16, 16], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1),
]
IDS = [c[0] for c in CASES]


def _data(case, rng):
    _, n, c, m, sp, k, s, d, p, g = case
    x = rng.standard_normal([n, c] + sp).astype(np.float32)
    w = rng.standard_normal([m, c // g] + k).astype(np.float32)
    y_shape = ref_forward(x[:0], w, s, d, p, g).shape[2:]
    dy = rng.standard_normal([n, m] + list(y_shape)).astype(np.float32)
    return x, w, dy, (k, s, d, p, g)


def _within(got, want, mag, terms):
    """|got - want| <= terms * eps32 * sum|terms| per element (float32 sums, any order)."""
    assert got.shape == want.shape and got.dtype == np.float32
    bound = max(terms, 1) * F32_EPS * mag + 1e-30
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"worst {err.max()} (bound there {bound.flat[err.argmax()]})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("threads", [1, 3])
def test_against_numpy_float64(make_session, rng, case, threads):
    x, w, dy, geo = _data(case, rng)
    k, s, d, p, g = geo
    want = ref_weight_grad(x, dy, *geo)
    mag = ref_weight_grad(np.abs(x), np.abs(dy), *geo)
    got = run_weight_grad(make_session, x, dy, geo, threads)
    _within(got, want, mag, x.shape[0] * int(np.prod(dy.shape[2:])))
    want = ref_input_grad(dy, w, x.shape, s, d, p, g)
    mag = ref_input_grad(np.abs(dy), np.abs(w), x.shape, s, d, p, g)
    got = run_input_grad(make_session, dy, w, x.shape, geo, threads)
    _within(got, want, mag, (w.shape[0] // g) * int(np.prod(k)))


def test_threads_change_no_bit(make_session, rng):
    x, w, dy, geo = _data(CASES[-1], rng)
    one = run_weight_grad(make_session, x, dy, geo, 1), run_input_grad(make_session, dy, w, x.shape, geo, 1)
    two = run_weight_grad(make_session, x, dy, geo, 2), run_input_grad(make_session, dy, w, x.shape, geo, 2)
    for a, b in zip(one, two):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_numpy_reference_is_the_adjoint(rng):
    """<conv(X, W), dY> = <X, dX> = <W, dW>: the reference itself is right."""
    for case in CASES:
        x, w, dy, (k, s, d, p, g) = _data(case, rng)
        lhs = float((ref_forward(x, w, s, d, p, g) * dy).sum())
        via_x = float((ref_input_grad(dy, w, x.shape, s, d, p, g) * x).sum())
        via_w = float((ref_weight_grad(x, dy, k, s, d, p, g) * w).sum())
        assert np.isclose(lhs, via_x, rtol=1e-10, atol=1e-9) and np.isclose(lhs, via_w, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 0], ids=[c[0] for c in CASES if c[1] > 0])
def test_finite_differences(make_session, rng, case):
    """The ops' dX and dW against central differences of sum(conv(X, W) * dY) (numpy
    float64 forward), at a sample of entries."""
    x, w, dy, geo = _data(case, rng)
    k, s, d, p, g = geo
    dx = run_input_grad(make_session, dy, w, x.shape, geo)
    dw = run_weight_grad(make_session, x, dy, geo)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)

    def f(xv, wv):
        return float((ref_forward(xv, wv, s, d, p, g) * dy).sum())

    h = 1e-4
    for arr, grad, which in ((x64, dx, 0), (w64, dw, 1)):
        for flat in rng.choice(arr.size, size=min(arr.size, 12), replace=False):
            idx = np.unravel_index(flat, arr.shape)
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += h
            minus[idx] -= h
            args_p = (plus, w64) if which == 0 else (x64, plus)
            args_m = (minus, w64) if which == 0 else (x64, minus)
            fd = (f(*args_p) - f(*args_m)) / (2 * h)
            assert abs(grad[idx] - fd) <= 1e-4 * (1 + abs(fd)), (case[0], which, idx, grad[idx], fd)


# -- bad inputs ---------------------------------------------------------------------------

def _err(fn):
    with pytest.raises(Exception) as e:
        fn()
    return str(e.value)


def test_bad_inputs(make_session, rng):
    geo = ([3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 1)
    x = rng.standard_normal([2, 3, 5, 5]).astype(np.float32)
    dy = rng.standard_normal([2, 4, 5, 5]).astype(np.float32)
    w = rng.standard_normal([4, 3, 3, 3]).astype(np.float32)
    # dY of the wrong spatial shape.
    msg = _err(lambda: run_weight_grad(make_session, x, dy[:, :, :4], geo))
    assert "ConvWeightGrad" in msg and "dY" in msg and "[2, 4, 5, 5]" in msg, msg
    # X of the wrong rank.
    msg = _err(lambda: run_weight_grad(make_session, x[0], dy, geo))
    assert "ConvWeightGrad" in msg and "(X)" in msg and "rank" in msg, msg
    # A group that does not divide the channels.
    msg = _err(lambda: run_weight_grad(make_session, x, dy, geo[:4] + (2,)))
    assert "ConvWeightGrad" in msg and "group 2 must divide" in msg, msg
    # A kernel larger than the padded input.
    msg = _err(lambda: run_weight_grad(make_session, x[:, :, :1, :1], dy, ([5, 5],) + geo[1:]))
    assert "ConvWeightGrad" in msg and "does not fit" in msg, msg
    # ConvInputGrad: X_shape of the wrong length, W not matching, dY not matching.
    msg = _err(lambda: run_input_grad(make_session, dy, w, [2, 3, 5], geo))
    assert "ConvInputGrad" in msg and "X_shape" in msg and "4 elements" in msg, msg
    msg = _err(lambda: run_input_grad(make_session, dy, w[:, :2], x.shape, geo))
    assert "ConvInputGrad" in msg and "(W)" in msg and "[4, 3, 3, 3]" in msg, msg
    msg = _err(lambda: run_input_grad(make_session, dy[:, :, 1:], w, x.shape, geo))
    assert "ConvInputGrad" in msg and "(dY)" in msg, msg
    msg = _err(lambda: run_input_grad(make_session, dy, w, [2, 3, 5, -1], geo))
    assert "ConvInputGrad" in msg and "non-negative" in msg, msg
    # Attributes: a missing kernel_shape, a zero stride, auto_pad.
    attrs = _attrs(*geo)
    del attrs["kernel_shape"]
    msg = _err(lambda: make_session(_model("ConvWeightGrad", None, attrs)).run(None, {"X": x, "dY": dy}))
    assert "ConvWeightGrad" in msg and "kernel_shape" in msg, msg
    msg = _err(lambda: run_weight_grad(make_session, x, dy, (geo[0], [1, 0]) + geo[2:]))
    assert "ConvWeightGrad" in msg and "strides" in msg, msg
    attrs = dict(_attrs(*geo), auto_pad="SAME_UPPER")
    msg = _err(lambda: make_session(_model("ConvWeightGrad", None, attrs)).run(None, {"X": x, "dY": dy}))
    assert "ConvWeightGrad" in msg and "auto_pad" in msg, msg
    # A double X: no kernel takes it.
    dbl = _model("ConvWeightGrad", None, _attrs(*geo), [TensorProto.DOUBLE, TensorProto.FLOAT])
    msg = _err(lambda: make_session(dbl).run(None, {"X": x.astype(np.float64), "dY": dy}))
    assert "ConvWeightGrad" in msg, msg


# -- the Trainer: fused against standard ops -----------------------------------------------

def _families():
    from trainops.bench.train_models import family
    from trainops.demos.train import cnn_model, digits

    res = family("resnet", 2)
    x, t = digits(16, seed=1)
    return [("resnet", res.model, res.params, res.feeds), ("demo-cnn", cnn_model(), None, {"x": x, "t": t})]


def _trainer(model, params, monkeypatch, fused, **kw):
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    return Trainer(model, "loss", optim.Adam(lr=1e-3), params=params, threads=1, **kw)


def _conv_grad_ops(tr):
    return sorted(n.op_type for n in tr.training_model.graph.node
                  if n.domain == TRAINOPS_DOMAIN and n.op_type.startswith("Conv"))


@pytest.mark.parametrize("which", [0, 1], ids=["resnet", "demo-cnn"])
def test_trainer_fused_matches_standard_ops(library_path, monkeypatch, which):
    name, model, params, feeds = _families()[which]
    fused = _trainer(model, params, monkeypatch, True)
    plain = _trainer(model, params, monkeypatch, False)
    ops = _conv_grad_ops(fused)
    # These grids (8x8 and up) keep ConvTranspose for dX (measured faster there,
    # docs/ops/gradients-conv.md).
    assert "ConvWeightGrad" in ops and "ConvInputGrad" not in ops, ops
    assert _conv_grad_ops(plain) == []
    # ConvWeightGrad sums N x OH x OW products in another order than the standard form's
    # Conv (MLAS, whose blocking depends on the CPU): each within gamma(n) sum|terms| of the
    # exact gradient; Adam moves a weight by about lr (gradient difference / gradient RMS)
    # per step. Losses, weights and moments within helpers/adam_pair.py's bound after
    # every step. On the demo CNN a gradient 1% off in any tensor exceeds it; on the
    # residual CNN only from block2 on: six BatchNorms compound the worst-case bound
    # until the stem's exceeds its gradient (the BN CNN of test_grad_batchnorm.py and
    # test_grad_activation.py covers the same kernels at 1%).
    assert_runs_agree(model, feeds, fused.optimizer, record(fused, feeds, 4),
                      record(plain, feeds, 4), what=f"{name}: ")


def _small_grid_net(seed=0):
    """x [8, 8, 4, 4] -> Conv 8->128 (3x3, pad 1) -> Relu -> Conv 128->8 (3x3, pad 1) ->
    GlobalAveragePool -> Flatten -> Gemm -> loss: the second Conv's dX has 16 positions per
    sample and a column of 128 x 9 = 1152 rows, where the rule picks ConvInputGrad; its
    8 x 8 x 1152 x 16 multiply-adds (over 2^20) make the kernel cut the channels into
    blocks, the batch being one chunk of samples."""
    from onnx import numpy_helper

    rng = np.random.default_rng(seed)
    w = {"w1": rng.standard_normal((128, 8, 3, 3)) / 8.5, "w2": rng.standard_normal((8, 128, 3, 3)) / 34,
         "fc": rng.standard_normal((5, 8)) / 2.8, "fb": np.zeros(5)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    g = helper.make_graph(nodes, "small_grid",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8, 4, 4]),
                           helper.make_tensor_value_info("t", TensorProto.INT64, [8])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal((8, 8, 4, 4)).astype(np.float32), "t": rng.integers(0, 5, 8).astype(np.int64)}
    return m, list(w), feeds


def test_trainer_small_grid_uses_input_grad_kernel(library_path, monkeypatch):
    """Few positions per sample and a long column: dX from ConvInputGrad, the run within
    helpers/adam_pair.py's bound of the standard-op step's after every step."""
    model, params, feeds = _small_grid_net()
    fused = _trainer(model, params, monkeypatch, True)
    plain = _trainer(model, params, monkeypatch, False)
    assert _conv_grad_ops(fused) == ["ConvInputGrad", "ConvWeightGrad", "ConvWeightGrad"]
    assert "ConvTranspose" not in {n.op_type for n in fused.training_model.graph.node}
    assert_runs_agree(model, feeds, fused.optimizer, record(fused, feeds, 4), record(plain, feeds, 4))


def _pointwise_net(side, seed=0):
    """x [4, 6, side, side] -> Conv 6->10 (1x1) -> Relu -> Conv 10->6 (1x1) ->
    GlobalAveragePool -> Flatten -> Gemm -> loss: pointwise convolutions' gradients."""
    from onnx import numpy_helper

    rng = np.random.default_rng(seed)
    w = {"w1": rng.standard_normal((10, 6, 1, 1)) / 2.5, "w2": rng.standard_normal((6, 10, 1, 1)) / 3.2,
         "fc": rng.standard_normal((5, 6)) / 2.5, "fb": np.zeros(5)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]), helper.make_node("GlobalAveragePool", ["c2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]), helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    g = helper.make_graph(nodes, "pointwise",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, side, side]),
                           helper.make_tensor_value_info("t", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    feeds = {"x": rng.standard_normal((4, 6, side, side)).astype(np.float32),
             "t": rng.integers(0, 5, 4).astype(np.int64)}
    return m, list(w), feeds


@pytest.mark.parametrize("side", [5, 8])
def test_trainer_pointwise_gradients_are_matmuls(library_path, monkeypatch, side):
    """A pointwise convolution's dX is W^T dY per sample and, over 64 positions or more,
    its dW is sum_n dY[n] X[n]^T: onnxruntime's MatMul in the fused step (it threads where
    ConvTranspose does not; ConvWeightGrad is slow on short columns), the run within
    helpers/adam_pair.py's bound of the standard-op step's after every step."""
    model, params, feeds = _pointwise_net(side)
    fused = _trainer(model, params, monkeypatch, True)
    plain = _trainer(model, params, monkeypatch, False)
    ops = {n.op_type for n in fused.training_model.graph.node}
    assert "ConvTranspose" not in ops and "MatMul" in ops, sorted(ops)
    assert _conv_grad_ops(fused) == ([] if side * side >= 64 else ["ConvWeightGrad"] * 2)
    assert "ConvTranspose" in {n.op_type for n in plain.training_model.graph.node}
    assert_runs_agree(model, feeds, fused.optimizer, record(fused, feeds, 4), record(plain, feeds, 4))


def test_portable_has_no_fused_ops(library_path, monkeypatch):
    """portable=True keeps the standard-op backward (ConvTranspose and Conv), fused or not."""
    _, model, params, _ = _families()[1]
    tr = _trainer(model, params, monkeypatch, True, portable=True)
    assert _conv_grad_ops(tr) == []
    ops = {n.op_type for n in tr.training_model.graph.node}
    assert "ConvTranspose" in ops and "Conv" in ops, sorted(ops)
