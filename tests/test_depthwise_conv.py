"""com.trainops::DepthwiseConv / DepthwiseConvGrad (the CPU Trainer's depthwise convolution,
forward and gradients): against a numpy float64 depthwise convolution and its adjoint, within
the rounding bound of a float32 sum; finite differences of the float64 forward; threads
change no bit; bad inputs named; the fused Trainer (these ops) against the portable one
(onnxruntime's Conv, ConvTranspose) within a bound derived from the sums each computes.
Spec: docs/ops/gradients-depthwise.md."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainops import optim
from trainops.onnx_defs import IR_VERSION, ONNX_OPSET, TRAINOPS_DOMAIN
from trainops.train import Trainer

U = 2.0 ** -24  # float32's unit roundoff


def gamma(n) -> float:
    return n * U / (1 - n * U)


# -- numpy float64 reference ------------------------------------------------------------

def _windows(x_shape, k, s, d, p):
    """Output size and, per tap (kh, kw), the slices of the padded input it reads."""
    out = [(x_shape[2 + a] + p[a] + p[a + 2] - ((k[a] - 1) * d[a] + 1)) // s[a] + 1 for a in range(2)]
    taps = [((i, j), (slice(i * d[0], i * d[0] + s[0] * (out[0] - 1) + 1, s[0]),
                      slice(j * d[1], j * d[1] + s[1] * (out[1] - 1) + 1, s[1])))
            for i in range(k[0]) for j in range(k[1])]
    return out, taps


def _padded(x, p, mult):
    """x [N, C, H, W] repeated per filter (channel o reads o // mult) and zero-padded."""
    x = np.repeat(np.asarray(x, np.float64), mult, axis=1)
    return np.pad(x, [(0, 0), (0, 0), (p[0], p[2]), (p[1], p[3])])


def ref_forward(x, w, b, s, d, p):
    mult = w.shape[0] // x.shape[1]
    out, taps = _windows(x.shape, w.shape[2:], s, d, p)
    xp = _padded(x, p, mult)
    y = np.zeros([x.shape[0], w.shape[0]] + out)
    for (i, j), (si, sj) in taps:
        y += np.asarray(w, np.float64)[None, :, 0, i, j, None, None] * xp[:, :, si, sj]
    if b is not None:
        y += np.asarray(b, np.float64)[None, :, None, None]
    return y


def ref_input_grad(dy, w, x_shape, s, d, p):
    n, c, h, wd = x_shape
    mult = w.shape[0] // c
    _, taps = _windows(x_shape, w.shape[2:], s, d, p)
    dxp = np.zeros([n, w.shape[0], h + p[0] + p[2], wd + p[1] + p[3]])
    for (i, j), (si, sj) in taps:
        dxp[:, :, si, sj] += np.asarray(w, np.float64)[None, :, 0, i, j, None, None] * dy
    dx = dxp[:, :, p[0]:p[0] + h, p[1]:p[1] + wd]
    return dx.reshape(n, c, mult, h, wd).sum(axis=2)


def ref_weight_grad(x, dy, k, s, d, p):
    mult = dy.shape[1] // x.shape[1]
    _, taps = _windows(x.shape, k, s, d, p)
    xp = _padded(x, p, mult)
    dw = np.zeros([dy.shape[1], 1] + list(k))
    for (i, j), (si, sj) in taps:
        dw[:, 0, i, j] = (np.asarray(dy, np.float64) * xp[:, :, si, sj]).sum(axis=(0, 2, 3))
    return dw


# -- the ops in one-node models ---------------------------------------------------------

def _model(op, names, outs, attrs, types=None):
    types = types or [TensorProto.FLOAT] * len(names)
    vis = [helper.make_tensor_value_info(nm, t, None) for nm, t in zip(names, types)]
    node = helper.make_node(op, names, outs, domain=TRAINOPS_DOMAIN, **attrs)
    graph = helper.make_graph([node], op, vis, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                for o in outs if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET),
                                                    helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    model.ir_version = IR_VERSION
    return model


def _attrs(k, s, d, p, group):
    return dict(kernel_shape=list(k), strides=list(s), dilations=list(d), pads=list(p), group=group)


def run_forward(make_session, x, w, b, geo, threads=1):
    names = ["X", "W"] + (["B"] if b is not None else [])
    sess = make_session(_model("DepthwiseConv", names, ["Y"], _attrs(*geo)), threads=threads)
    feeds = {"X": x, "W": w} | ({"B": b} if b is not None else {})
    return sess.run(None, feeds)[0]


def run_grads(make_session, dy, x, w, geo, threads=1, outs=("dX", "dW")):
    sess = make_session(_model("DepthwiseConvGrad", ["dY", "X", "W"], list(outs), _attrs(*geo)),
                        threads=threads)
    return sess.run(None, {"dY": dy, "X": x, "W": w})


# (name, N, C, mult, [H, W], kernel, strides, dilations, pads [t, l, b, r])
CASES = [
    ("3x3 pad1", 2, 3, 1, [6, 5], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ("width 17", 2, 2, 1, [3, 17], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ("width 33 no pads", 1, 3, 1, [4, 33], [3, 3], [1, 1], [1, 1], [0, 0, 0, 0]),
    ("1x1 spatial", 3, 4, 1, [1, 1], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ("pads past the kernel", 2, 2, 1, [3, 4], [2, 2], [1, 1], [1, 1], [3, 4, 2, 5]),
    ("stride 2", 2, 5, 1, [9, 12], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
    ("stride 2 odd 5x5", 2, 3, 1, [11, 13], [5, 5], [2, 2], [1, 1], [2, 2, 2, 2]),
    ("dilation 2", 2, 3, 1, [9, 11], [3, 3], [1, 1], [2, 2], [2, 2, 2, 2]),
    ("asymmetric", 2, 2, 1, [7, 9], [3, 2], [2, 1], [1, 2], [0, 2, 1, 0]),
    ("multiplier 2", 2, 3, 2, [6, 7], [3, 3], [1, 2], [1, 1], [1, 1, 1, 1]),
    ("7x7 (ConvNeXt)", 2, 4, 1, [14, 14], [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),
    ("mobilenet 4x4 5x5", 4, 32, 1, [4, 4], [5, 5], [1, 1], [1, 1], [2, 2, 2, 2]),
    ("empty batch", 0, 3, 1, [5, 5], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ("threaded", 4, 24, 1, [32, 32], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
]
IDS = [c[0] for c in CASES]


def _data(case, rng):
    _, n, c, mult, sp, k, s, d, p = case
    x = rng.standard_normal([n, c] + sp).astype(np.float32)
    w = rng.standard_normal([c * mult, 1] + k).astype(np.float32)
    b = rng.standard_normal([c * mult]).astype(np.float32)
    out, _ = _windows([n, c] + sp, k, s, d, p)
    dy = rng.standard_normal([n, c * mult] + out).astype(np.float32)
    return x, w, b, dy, (k, s, d, p, c)


def _within(got, want, mag, terms):
    """|got - want| <= gamma(terms + 1) * sum|terms| per element: a float32 sum of
    ``terms`` rounded products, in any order."""
    assert got.shape == want.shape and got.dtype == np.float32
    bound = gamma(terms + 1) * mag
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"worst {err.max()} (bound there {bound.flat[err.argmax()]})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("threads", [1, 3])
def test_against_numpy_float64(make_session, rng, case, threads):
    x, w, b, dy, geo = _data(case, rng)
    k, s, d, p, _ = geo
    taps = k[0] * k[1]
    y = run_forward(make_session, x, w, b, geo, threads)
    _within(y, ref_forward(x, w, b, s, d, p), ref_forward(np.abs(x), np.abs(w), np.abs(b), s, d, p), taps + 1)
    dx, dw = run_grads(make_session, dy, x, w, geo, threads)
    mult = w.shape[0] // x.shape[1]
    _within(dx, ref_input_grad(dy, w, x.shape, s, d, p),
            ref_input_grad(np.abs(dy), np.abs(w), x.shape, s, d, p), mult * taps)
    _within(dw, ref_weight_grad(x, dy, k, s, d, p), ref_weight_grad(np.abs(x), np.abs(dy), k, s, d, p),
            max(dy.shape[0] * dy.shape[2] * dy.shape[3], 1))


def test_the_reference_is_the_adjoint(rng):
    """<conv(X, W), dY> = <X, dX> = <W, dW>: the float64 reference itself is right."""
    for case in CASES:
        x, w, _, dy, (k, s, d, p, _) = _data(case, rng)
        lhs = float((ref_forward(x, w, None, s, d, p) * dy).sum())
        via_x = float((ref_input_grad(dy, w, x.shape, s, d, p) * x).sum())
        via_w = float((ref_weight_grad(x, dy, k, s, d, p) * w).sum())
        assert np.isclose(lhs, via_x, rtol=1e-10, atol=1e-9) and np.isclose(lhs, via_w, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 0 and c[0] != "threaded"],
                         ids=[c[0] for c in CASES if c[1] > 0 and c[0] != "threaded"])
def test_finite_differences(make_session, rng, case):
    """dX and dW against central differences of sum(conv(X, W) * dY) (numpy float64
    forward) at a sample of entries: the function is bilinear, so the central difference
    is exact up to float64 rounding."""
    x, w, _, dy, geo = _data(case, rng)
    k, s, d, p, _ = geo
    dx, dw = run_grads(make_session, dy, x, w, geo)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)

    def f(xv, wv):
        return float((ref_forward(xv, wv, None, s, d, p) * dy).sum())

    h = 1e-3
    for arr, grad, which in ((x64, dx, 0), (w64, dw, 1)):
        for flat in rng.choice(arr.size, size=min(arr.size, 10), replace=False):
            idx = np.unravel_index(flat, arr.shape)
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += h
            minus[idx] -= h
            fp = f(plus, w64) if which == 0 else f(x64, plus)
            fm = f(minus, w64) if which == 0 else f(x64, minus)
            fd = (fp - fm) / (2 * h)
            assert abs(grad[idx] - fd) <= 1e-4 * (1 + abs(fd)), (case[0], which, idx, grad[idx], fd)


def test_threads_change_no_bit(make_session, rng):
    x, w, b, dy, geo = _data(CASES[-1], rng)
    one = [run_forward(make_session, x, w, b, geo, 1)] + run_grads(make_session, dy, x, w, geo, 1)
    two = [run_forward(make_session, x, w, b, geo, 2)] + run_grads(make_session, dy, x, w, geo, 2)
    for a, c in zip(one, two):
        assert np.array_equal(a.view(np.uint32), c.view(np.uint32))


def test_each_gradient_alone(make_session, rng):
    x, w, _, dy, geo = _data(CASES[5], rng)
    both = run_grads(make_session, dy, x, w, geo)
    (dx,) = run_grads(make_session, dy, x, w, geo, outs=("dX",))
    (dw,) = run_grads(make_session, dy, x, w, geo, outs=("", "dW"))
    assert np.array_equal(dx, both[0]) and np.array_equal(dw, both[1])


# -- bad inputs ---------------------------------------------------------------------------

def _err(fn):
    with pytest.raises(Exception) as e:
        fn()
    return str(e.value)


def test_bad_inputs(make_session, rng):
    geo = ([3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 3)
    x = rng.standard_normal([2, 3, 5, 5]).astype(np.float32)
    w = rng.standard_normal([3, 1, 3, 3]).astype(np.float32)
    dy = rng.standard_normal([2, 3, 5, 5]).astype(np.float32)
    msg = _err(lambda: run_forward(make_session, x, w, None, geo[:4] + (1,)))
    assert "DepthwiseConv" in msg and "group" in msg and "input channels (3)" in msg, msg
    msg = _err(lambda: run_forward(make_session, x, w[:, :, :2], None, geo))
    assert "DepthwiseConv" in msg and "(W)" in msg and "[3, 1, 3, 3]" in msg, msg
    msg = _err(lambda: run_forward(make_session, x, np.concatenate([w, w[:1]]), None, geo))
    assert "DepthwiseConv" in msg and "multiple of the input channels" in msg, msg
    msg = _err(lambda: run_forward(make_session, x, w, np.zeros(4, np.float32), geo))
    assert "DepthwiseConv" in msg and "(B)" in msg and "[3]" in msg, msg
    msg = _err(lambda: run_forward(make_session, x[0], w, None, geo))
    assert "DepthwiseConv" in msg and "(X)" in msg and "rank 4" in msg, msg
    msg = _err(lambda: run_forward(make_session, x[:, :, :1, :1], w, None, ([5, 5],) + geo[1:]))
    assert "DepthwiseConv" in msg and "does not fit" in msg, msg
    msg = _err(lambda: run_forward(make_session, x, w, None, (geo[0], [1, 0]) + geo[2:]))
    assert "DepthwiseConv" in msg and "strides" in msg, msg
    msg = _err(lambda: run_grads(make_session, dy[:, :, :4], x, w, geo))
    assert "DepthwiseConvGrad" in msg and "(dY)" in msg and "[2, 3, 5, 5]" in msg, msg
    attrs = _attrs(*geo)
    del attrs["group"]
    msg = _err(lambda: make_session(_model("DepthwiseConv", ["X", "W"], ["Y"], attrs)).run(None, {"X": x, "W": w}))
    assert "DepthwiseConv" in msg and "group" in msg and "required" in msg, msg
    attrs = dict(_attrs(*geo), auto_pad="SAME_UPPER")
    msg = _err(lambda: make_session(_model("DepthwiseConv", ["X", "W"], ["Y"], attrs)).run(None, {"X": x, "W": w}))
    assert "DepthwiseConv" in msg and "auto_pad" in msg, msg
    attrs = dict(_attrs(*geo), kernel_shape=[3, 3, 3], strides=[1, 1, 1], dilations=[1, 1, 1], pads=[0] * 6)
    msg = _err(lambda: make_session(_model("DepthwiseConv", ["X", "W"], ["Y"], attrs)).run(None, {"X": x, "W": w}))
    assert "DepthwiseConv" in msg and "kernel_shape" in msg, msg


# -- the Trainer: fused against portable ---------------------------------------------------

def _cnn(rng):
    """x [2, 4, 9, 10] -> depthwise 3x3 (+ bias) -> depthwise 3x3, multiplier 2, stride 2
    -> loss = sum(Y2 * t): linear in each weight, so each gradient is one float32 sum of
    products whose rounding bounds the two runs' difference."""
    p = dict(W1=rng.standard_normal([4, 1, 3, 3]), B1=rng.standard_normal([4]),
             W2=rng.standard_normal([8, 1, 3, 3]))
    p = {k: v.astype(np.float32) for k, v in p.items()}
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["y1"], group=4, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["y1", "W2"], ["y2"], group=4, kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[2, 2]),
        helper.make_node("Mul", ["y2", "t"], ["prod"]),
        helper.make_node("ReduceSum", ["prod"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "dwcnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 9, 10]),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 8, 5, 5])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in p.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = IR_VERSION
    feeds = dict(x=rng.standard_normal([2, 4, 9, 10]).astype(np.float32),
                 t=rng.standard_normal([2, 8, 5, 5]).astype(np.float32))
    return model, p, feeds


def _bounds(p, feeds):
    """The float64 gradients of the CNN and, per weight, how far ANY float32 evaluation of
    them (any order of every sum, either forward kernel) may be: the forward's y1 within
    e1 = gamma(10) (|W1| * |x| + |B1|), the backward's dy1 = conv2^T(t) within
    gamma(2 * 9) |W2|^T |t|, each gradient's sum within gamma(terms + 1) of its terms'
    magnitudes plus its inputs' bounds carried."""
    geo = ([1, 1], [1, 1], [1, 1, 1, 1])
    geo2 = ([2, 2], [1, 1], [1, 1, 1, 1])
    x, t = feeds["x"].astype(np.float64), feeds["t"].astype(np.float64)
    W1, B1, W2 = (p[k].astype(np.float64) for k in ("W1", "B1", "W2"))
    y1 = ref_forward(x, W1, B1, *geo)
    e1 = gamma(10) * ref_forward(np.abs(x), np.abs(W1), np.abs(B1), *geo)
    dy1 = ref_input_grad(t, W2, y1.shape, *geo2)
    edy1 = gamma(2 * 9 + 1) * ref_input_grad(np.abs(t), np.abs(W2), y1.shape, *geo2)
    n1, n2 = 2 * 9 * 10, 2 * 5 * 5
    g = dict(W1=ref_weight_grad(x, dy1, [3, 3], *geo), B1=dy1.sum(axis=(0, 2, 3)),
             W2=ref_weight_grad(y1, t, [3, 3], *geo2))
    E = dict(
        W1=ref_weight_grad(np.abs(x), edy1, [3, 3], *geo)
        + gamma(n1 + 1) * ref_weight_grad(np.abs(x), np.abs(dy1) + edy1, [3, 3], *geo),
        B1=edy1.sum(axis=(0, 2, 3)) + gamma(n1 + 1) * (np.abs(dy1) + edy1).sum(axis=(0, 2, 3)),
        W2=ref_weight_grad(e1, np.abs(t), [3, 3], *geo2)
        + gamma(n2 + 1) * ref_weight_grad(np.abs(y1) + e1, np.abs(t), [3, 3], *geo2))
    return g, E


def test_trainer_fused_matches_portable_within_the_rounding_bound(library_path, monkeypatch, rng):
    """One step of SGD (ONNX Momentum with alpha 0, beta 1, lr 1: W - g, one rounding) in
    the fused Trainer (DepthwiseConv forward, DepthwiseConvGrad) and the portable one
    (onnxruntime's Conv, ConvTranspose, the batch-as-channels Conv): each gradient within
    E of the float64 one (see _bounds), so the two new weights within E_a + E_b plus one
    rounding of each. A gradient off by 0.1% exceeds it in most elements."""
    model, p, feeds = _cnn(rng)
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1")
    opt = optim.Momentum(lr=1.0, alpha=0.0, beta=1.0)
    fused = Trainer(model, "loss", opt, threads=1)
    plain = Trainer(model, "loss", opt, threads=1, portable=True)
    ops = [(n.domain, n.op_type) for n in fused.training_model.graph.node]
    assert ops.count((TRAINOPS_DOMAIN, "DepthwiseConv")) == 2, ops
    assert ops.count((TRAINOPS_DOMAIN, "DepthwiseConvGrad")) == 2, ops
    assert ("", "Conv") not in ops and ("", "ConvTranspose") not in ops, ops
    pops = [(n.domain, n.op_type) for n in plain.training_model.graph.node]
    assert not any(d == TRAINOPS_DOMAIN and o.startswith("Depthwise") for d, o in pops), pops
    fused.step(feeds)
    plain.step(feeds)
    wa, wb = fused.parameters(), plain.parameters()
    g, E = _bounds(p, feeds)
    for k in p:
        bound = 2 * E[k] + U * (np.abs(wa[k]) + np.abs(wb[k]))
        diff = np.abs(wa[k].astype(np.float64) - wb[k])
        assert (diff <= bound).all(), (k, diff.max(), bound.flat[np.argmax(diff - bound)])
        # and each run is the float64 step within its own bound
        want = p[k].astype(np.float64) - g[k]
        assert (np.abs(wa[k] - want) <= E[k] + U * np.abs(wa[k])).all(), k
        # the bound is tight enough to mean something: a gradient 0.1% off exceeds it
        assert (1e-3 * np.abs(g[k]) > 2 * E[k] + U * 2 * np.abs(want)).mean() > 0.5, k


@pytest.mark.parametrize("attrs, channels, w_shape, swapped", [
    (dict(group=4, pads=[1, 1, 1, 1]), 4, [4, 1, 3, 3], True),
    (dict(group=4, auto_pad="VALID"), 4, [8, 1, 3, 3], True),
    (dict(group=4, auto_pad="SAME_UPPER"), 4, [4, 1, 3, 3], False),  # pads left to onnxruntime
    (dict(group=2, pads=[1, 1, 1, 1]), 4, [4, 2, 3, 3], False),  # two channels per group
    (dict(group=1, pads=[1, 1, 1, 1]), 1, [3, 1, 3, 3], False),  # one group: a plain Conv
], ids=["pads", "valid-mult2", "same-upper", "grouped", "one-channel"])
def test_which_forward_convs_become_depthwise(library_path, monkeypatch, rng, attrs, channels, w_shape,
                                              swapped):
    """The fused step's forward takes DepthwiseConv for one input channel per group
    (group > 1) with explicit or VALID pads; anything else stays onnxruntime's Conv."""
    w = rng.standard_normal(w_shape).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "W"], ["y"], **attrs)
    nodes = [conv, helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           [2, channels, 6, 7])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = IR_VERSION
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1")
    tr = Trainer(model, "loss", optim.Momentum(lr=0.0), threads=1)
    ops = [(n.domain, n.op_type) for n in tr.training_model.graph.node]
    assert ((TRAINOPS_DOMAIN, "DepthwiseConv") in ops) == swapped, ops
    assert (("", "Conv") in ops) != swapped, ops
    loss = tr.step({"x": rng.standard_normal([2, channels, 6, 7]).astype(np.float32)})
    assert np.isfinite(loss)
