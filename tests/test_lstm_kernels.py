"""com.trainops::LSTMTrain and LSTMGrad (crates/trainops-kernels/src/grad/rnn/lstm.rs), and
LSTM's fused rule (trainops/autodiff/rules_rnn.py, merge_gru_train in autodiff/simplify.py).

References: numpy float64 (tests/helpers/lstm_bound.py, itself checked here against central
finite differences of tests/helpers/rnn_reference.py's forward), onnxruntime's LSTM, and the
Trainer's standard-op form (``TRAINOPS_FUSED_GRADS=0``: LSTM + a reverse Scan). Every float32
result is held to helpers/lstm_bound.py's first-order rounding bound of the float64 value,
per element; two float32 results to the sum of their bounds."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import lstm_bound
from helpers import rnn_reference as ref
from helpers.exported import fd_grads
from helpers.rounding import U
from trainops import optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

F32 = TensorProto.FLOAT
DIRS = ["forward", "reverse", "bidirectional"]
IN_NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]


def _case(seq, batch, inp, hid, direction, seed, scale=0.5):
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1

    def rnd(*shape, s=scale):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    return {"X": rnd(seq, batch, inp, s=1.0), "W": rnd(nd, 4 * hid, inp), "R": rnd(nd, 4 * hid, hid),
            "B": rnd(nd, 8 * hid, s=0.3), "initial_h": rnd(nd, batch, hid), "initial_c": rnd(nd, batch, hid, s=1.0),
            "dY": rnd(seq, nd, batch, hid, s=1.0), "dY_h": rnd(nd, batch, hid, s=1.0),
            "dY_c": rnd(nd, batch, hid, s=1.0)}


def _model(op, ins, outs, domain="", **attrs):
    node = helper.make_node(op, ins, outs, domain=domain, **attrs)
    types = {"sequence_lens": TensorProto.INT32}
    graph = helper.make_graph([node], "lstm", [helper.make_tensor_value_info(n, types.get(n, F32), None)
                                               for n in ins if n],
                              [helper.make_tensor_value_info(n, F32, None) for n in outs if n])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    return model


def _ins(present):
    ins = [n if n in present else "" for n in IN_NAMES]
    while not ins[-1]:
        ins.pop()
    return ins


def _reference(c, direction, present):
    """float64 values and bounds of Y, Y_h, Y_c, the gates and the six gradients, every
    direction (rows of [dirs, ...] as the ops lay them out; dX summed over directions)."""
    nd = 2 if direction == "bidirectional" else 1
    seq, batch, _ = c["X"].shape
    out = {k: [] for k in ("Y", "Y_h", "Y_c", "gates", "dW", "dR", "dB", "d_initial_h", "d_initial_c")}
    err = {k: [] for k in out}
    dx, edx = 0.0, 0.0
    for d in range(nd):
        rev = direction == "reverse" or d == 1
        opt = {k: (c[k][d] if k in present else None) for k in ("B", "initial_h", "initial_c")}
        fv, fe = lstm_bound.forward(c["X"], c["W"][d], c["R"][d], opt["B"], opt["initial_h"],
                                    opt["initial_c"], reverse=rev)
        last = 0 if rev else seq - 1
        for k, v, e in (("Y", fv["h"], fe["h"]), ("Y_h", fv["h"][last], fe["h"][last]),
                        ("Y_c", fv["c"][last], fe["c"][last])):
            out[k].append(v)
            err[k].append(e)
        out["gates"].append(np.concatenate([fv[k] for k in ("i", "o", "f", "g", "c", "tc")], axis=-1))
        err["gates"].append(np.concatenate([fe[k] for k in ("i", "o", "f", "g", "c", "tc")], axis=-1))
        gv, ge = lstm_bound.backward(c["X"], c["W"][d], c["R"][d], fv, fe, c["dY"][:, d], c["dY_h"][d],
                                     c["dY_c"][d], reverse=rev)
        for k, q in (("dW", "w"), ("dR", "r"), ("dB", "b"), ("d_initial_h", "h0"), ("d_initial_c", "c0")):
            out[k].append(gv[q])
            err[k].append(ge[q])
        dx, edx = dx + gv["x"], edx + ge["x"]
    out = {k: np.stack(v, axis=1 if k == "Y" else 0) for k, v in out.items()}
    err = {k: np.stack(v, axis=1 if k == "Y" else 0) for k, v in err.items()}
    out["dX"], err["dX"] = dx, edx
    return out, err


def _within(got, want, bound, what):
    excess = np.abs(np.asarray(got, np.float64) - want) - bound
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(excess <= 0), f"{what}: {excess.max():.3g} past the bound (max bound {bound.max():.3g})"


def _train_and_grad(make_session, c, direction, present, threads=1):
    hid = c["R"].shape[-1]
    attrs = {"hidden_size": hid, "direction": direction}
    ins = _ins(present)
    y, yh, yc, gates = make_session(_model("LSTMTrain", ins, ["Y", "Y_h", "Y_c", "gates"], TRAINOPS_DOMAIN,
                                           **attrs), threads=threads).run(None, {k: c[k] for k in ins if k})
    gnames = ["X", "W", "R", "Y", "gates", "initial_h", "initial_c", "dY", "dY_h", "dY_c"]
    gins = [n if n in present or n in ("X", "W", "R", "Y", "gates") else "" for n in gnames]
    outs = ["dX", "dW", "dR", "dB", "d_initial_h", "d_initial_c"]
    feeds = {**c, "Y": y, "gates": gates}
    grads = make_session(_model("LSTMGrad", _trimmed(gins), outs, TRAINOPS_DOMAIN, **attrs),
                         threads=threads).run(None, {k: feeds[k] for k in gins if k})
    return {"Y": y, "Y_h": yh, "Y_c": yc, "gates": gates, **dict(zip(outs, grads))}


def _trimmed(names):
    names = list(names)
    while names and not names[-1]:
        names.pop()
    return names


# --- the ops -------------------------------------------------------------------------------------

ALL = ["X", "W", "R", "B", "initial_h", "initial_c", "dY", "dY_h", "dY_c"]


@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (5, 3, 4, 6), (3, 2, 0, 4), (7, 9, 5, 17)])
def test_ops_within_the_rounding_bound(make_session, direction, sizes):
    c = _case(*sizes, direction, seed=sum(sizes) + DIRS.index(direction))
    got = _train_and_grad(make_session, c, direction, ALL)
    want, bound = _reference(c, direction, ALL)
    for k in want:
        _within(got[k], want[k], bound[k], f"{k} {direction} {sizes}")
    # onnxruntime's LSTM: within the sum of both bounds (each within its own).
    if sizes[2]:  # onnxruntime refuses an input size of 0
        ort = make_session(_model("LSTM", _ins(ALL), ["Y", "Y_h", "Y_c"], hidden_size=sizes[3],
                                  direction=direction)).run(None, {k: c[k] for k in _ins(ALL) if k})
        for k, v in zip(("Y", "Y_h", "Y_c"), ort):
            np.testing.assert_array_less(np.abs(got[k] - v), 2 * bound[k] + 1e-30, err_msg=f"{k} vs onnxruntime")


@pytest.mark.parametrize("present", [["X", "W", "R"], ["X", "W", "R", "B", "dY"],
                                     ["X", "W", "R", "initial_c", "dY_h", "dY_c"],
                                     ["X", "W", "R", "initial_h", "dY"]])
def test_optional_inputs_absent_are_zeros(make_session, present):
    c = _case(4, 3, 3, 5, "bidirectional", seed=len(present))
    zeroed = {k: (v if k in present else np.zeros_like(v)) for k, v in c.items()}
    got = _train_and_grad(make_session, c, "bidirectional", present)
    want, bound = _reference(zeroed, "bidirectional", ALL)
    for k in want:
        _within(got[k], want[k], bound[k], f"{k} given {present}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bench_sized_same_bits_at_any_thread_count(make_session, threads):
    """The bench classifier's first layer (seq 64, batch 16, 128 -> 256), torch's weight
    scale: within the bound, and the same bits at 1, 2 and 3 threads."""
    c = _case(64, 16, 128, 256, "forward", seed=4, scale=1 / 16)
    got = _train_and_grad(make_session, c, "forward", ALL, threads=threads)
    want, bound = _reference(c, "forward", ALL)
    for k in want:
        _within(got[k], want[k], bound[k], f"{k} at {threads} threads")
    one = _train_and_grad(make_session, c, "forward", ALL, threads=1)
    for k in got:
        assert got[k].tobytes() == one[k].tobytes(), k


def test_float64_backward_against_finite_differences():
    for direction in DIRS:
        c = {k: v.astype(np.float64) for k, v in _case(3, 2, 2, 3, direction, seed=9).items()}
        want, _ = _reference(c, direction, ALL)

        def loss(p):
            y, yh, yc = ref.forward("LSTM", p["X"], p["W"], p["R"], p["B"], p["initial_h"],
                                    p["initial_c"], direction=direction)
            return np.sum(y * c["dY"]) + np.sum(yh * c["dY_h"]) + np.sum(yc * c["dY_c"])
        keys = ["X", "W", "R", "B", "initial_h", "initial_c"]
        fd = fd_grads(lambda q: loss({**c, **q}), {k: c[k].copy() for k in keys})
        for k in keys:
            np.testing.assert_allclose(want["d" + k if k in "XWRB" else "d_" + k], fd[k], rtol=1e-6,
                                       atol=1e-7, err_msg=f"{direction} {k}")


def _expect_error(run, needles):
    with pytest.raises(Exception) as info:
        run()
    msg = str(info.value)
    for n in needles:
        assert n.lower() in msg.lower(), f"{n!r} not in: {msg}"


def test_bad_inputs_and_attributes(make_session):
    c = _case(3, 2, 3, 4, "forward", seed=5)
    xwr = {k: c[k] for k in "XWR"}

    def run(ins, feeds, op="LSTMTrain", **attrs):
        attrs = {"hidden_size": 4, **attrs}
        return lambda: make_session(_model(op, ins, ["Y"] if op == "LSTMTrain" else ["dX"], TRAINOPS_DOMAIN,
                                           **attrs)).run(None, feeds)
    run(list("XWR"), xwr)()
    _expect_error(run(list("XWR"), {**xwr, "X": c["X"][0]}), ["LSTMTrain", "input 0 (X)", "rank 3"])
    _expect_error(run(list("XWR"), {**xwr, "W": c["W"][:, :6]}), ["LSTMTrain", "input 1 (W)", "[1, 16, 3]"])
    _expect_error(run(["X", "W", "R", "", "", "", "initial_c"], {**xwr, "initial_c": c["initial_c"][:, :1]}),
                  ["LSTMTrain", "input 6 (initial_c)", "[1, 2, 4]"])
    _expect_error(run(["X", "W", "R", "", "sequence_lens"], {**xwr, "sequence_lens": np.full(2, 3, np.int32)}),
                  ["LSTMTrain", "sequence_lens", "absent"])
    _expect_error(run(["X", "W", "R", "", "", "", "", "P"], {**xwr, "P": np.zeros((1, 12), np.float32)}),
                  ["LSTMTrain", "input 7 (P)", "peephole"])
    for attrs, needles in [({"layout": 1}, ["layout", "expected 0"]), ({"clip": 3.0}, ["clip"]),
                           ({"input_forget": 1}, ["input_forget"]), ({"hidden_size": 0}, ["hidden_size"]),
                           ({"direction": "sideways"}, ["direction", "sideways"])]:
        _expect_error(run(list("XWR"), xwr, **attrs), ["LSTMTrain"] + needles)
        _expect_error(run(["X", "W", "R", "Y", "gates"], {}, op="LSTMGrad", **attrs), ["LSTMGrad"] + needles)
    # LSTMGrad needs Y and the gates, of the node's shapes.
    y = np.zeros((3, 1, 2, 4), np.float32)
    _expect_error(run(["X", "W", "R", "Y", "gates"], {**xwr, "Y": y, "gates": np.zeros((1, 3, 2, 16), np.float32)},
                      op="LSTMGrad"), ["LSTMGrad", "input 4 (gates)", "[1, 3, 2, 24]"])
    _expect_error(run(["X", "W", "R", "Y"], {**xwr, "Y": y}, op="LSTMGrad"), ["LSTMGrad", "[min=5"])


# --- the rule, in the Trainer --------------------------------------------------------------------

def _lstm_model(c, direction, params, layout=0):
    """X -> LSTM (its weights and initial states initializers) -> loss = sum(Y dY) +
    sum(Y_h dY_h) + sum(Y_c dY_c) (dY... constant): the loss's gradient of Y, Y_h, Y_c is
    exactly dY, dY_h, dY_c, so the step's gradients are the op-level ones."""
    m = helper.make_node
    inits = [numpy_helper.from_array(c[k], k) for k in params + ["dY", "dY_h", "dY_c"]]
    ins = _ins(["X"] + params)
    nodes = [m("LSTM", ins, ["Y", "Y_h", "Y_c"], hidden_size=c["R"].shape[-1], direction=direction,
               layout=layout)]
    for k, g in (("Y", "dY"), ("Y_h", "dY_h"), ("Y_c", "dY_c")):
        nodes += [m("Mul", [k, g], [k + "_g"]), m("ReduceSum", [k + "_g"], [k + "_l"], keepdims=0)]
    nodes.append(m("Sum", ["Y_l", "Y_h_l", "Y_c_l"], ["loss"]))
    graph = helper.make_graph(nodes, "lstm", [helper.make_tensor_value_info("X", F32, list(c["X"].shape))],
                              [helper.make_tensor_value_info("loss", F32, [])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    return model


def _sgd_grads(monkeypatch, model, feeds, params, fused):
    """The gradients one plain SGD step (Momentum alpha 0, beta 1, lr 1: x -= g) applied,
    the step's op types, and the weights after it (the update rounds by U of them)."""
    from trainops import Trainer
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    tr = Trainer(model, "loss", optim.Momentum(lr=1.0, alpha=0.0, beta=1.0), params=params, threads=1, seed=1)
    ops = [(n.domain or "", n.op_type) for n in tr.training_model().graph.node]
    before = tr.parameters()
    tr.step(feeds)
    after = tr.parameters()
    return {k: before[k].astype(np.float64) - after[k] for k in params}, ops, after


@pytest.mark.parametrize("direction", DIRS)
def test_trainer_fused_and_standard_ops_within_the_bound(monkeypatch, library_path, direction):
    """One SGD step, fused (LSTMTrain + LSTMGrad) and standard-op (LSTM + Scan): each run's
    gradients within the bound of float64 (plus the update's rounding), so within the sum of
    both of each other; the float64 gradients are checked against finite differences above."""
    c = _case(5, 3, 4, 6, direction, seed=21)
    params = ["W", "R", "B", "initial_h", "initial_c"]
    model = _lstm_model(c, direction, params)
    want, bound = _reference(c, direction, ALL)
    runs = {}
    for fused in (True, False):
        g, ops, after = _sgd_grads(monkeypatch, model, {"X": c["X"]}, params, fused)
        runs[fused] = g
        if fused:
            assert (TRAINOPS_DOMAIN, "LSTMTrain") in ops and (TRAINOPS_DOMAIN, "LSTMGrad") in ops
            assert ("", "LSTM") not in ops and ("", "Scan") not in ops
        else:
            assert ("", "LSTM") in ops and ("", "Scan") in ops
        for k in params:
            key = "d" + k if k in "WRB" else "d_" + k
            _within(g[k], want[key], bound[key] + U * np.abs(after[k]), f"{k} fused={fused}")
    for k in params:
        key = "d" + k if k in "WRB" else "d_" + k
        assert np.all(np.abs(runs[True][k] - runs[False][k]) <= 2 * bound[key] + 2 * U * np.abs(c[k]) + 1e-30), k


def test_peepholes_and_portable_keep_the_scan_form(monkeypatch, library_path):
    from trainops import Trainer
    c = _case(3, 2, 3, 4, "forward", seed=2)
    c["P"] = np.full((1, 12), 0.1, np.float32)
    model = _lstm_model(c, "forward", ["W", "R", "B", "P"])
    for kw, env in (({}, "1"), ({"portable": True}, "1"), ({}, "0")):
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", env)
        params = ["W", "R", "B", "P"] if not kw else ["W", "R", "B"]
        m = model if not kw else _lstm_model(c, "forward", ["W", "R", "B"])
        tr = Trainer(m, "loss", optim.Adam(), params=params, threads=1, seed=1, **kw)
        ops = [n.op_type for n in tr.training_model().graph.node]
        assert "LSTM" in ops and "Scan" in ops and "LSTMTrain" not in ops and "LSTMGrad" not in ops


def test_layout1_runs_lstm_train_on_transposed_inputs():
    """Layout 1 (which onnxruntime's LSTM does not run: the step graph only): LSTMTrain over
    the transposed inputs beside the forward LSTM, LSTMGrad, gradients transposed back."""
    from trainops.train.graph import build_step_graph
    from trainops.train.spec import StepOptions
    c = _case(3, 2, 3, 4, "bidirectional", seed=3)
    for k in ("initial_h", "initial_c"):
        c[k] = np.ascontiguousarray(c[k].transpose(1, 0, 2))
    c["X"] = np.ascontiguousarray(c["X"].transpose(1, 0, 2))
    c["dY"] = np.ascontiguousarray(c["dY"].transpose(2, 0, 1, 3))
    for k in ("dY_h", "dY_c"):
        c[k] = np.ascontiguousarray(c[k].transpose(1, 0, 2))
    params = ["W", "R", "B", "initial_h", "initial_c"]
    step = build_step_graph(_lstm_model(c, "bidirectional", params, layout=1),
                            StepOptions("loss", optim.Adam(), params, fused=True))
    ops = [(n.domain or "", n.op_type) for n in step.model.graph.node]
    assert ("", "LSTM") in ops and (TRAINOPS_DOMAIN, "LSTMTrain") in ops and (TRAINOPS_DOMAIN, "LSTMGrad") in ops


def test_merge_pass_makes_the_lstm_node_the_lstm_train():
    from trainops.autodiff.simplify import merge_gru_train
    m = helper.make_node

    def train(y="y2", gates="g"):
        return m("LSTMTrain", ["X", "W", "R", "B"], [y, "", "", gates], domain=TRAINOPS_DOMAIN,
                 hidden_size=5, direction="forward")
    lstm = m("LSTM", ["X", "W", "R", "B", "", "", ""], ["Y", "", "Y_c"], name="lstm", hidden_size=5,
             activations=["Sigmoid", "Tanh", "Tanh"])
    grad = m("LSTMGrad", ["X", "W", "R", "y2", "g"], ["dX"], domain=TRAINOPS_DOMAIN)
    head = m("Relu", ["Y_c"], ["out"])
    out = merge_gru_train([lstm, head, train(), grad])
    assert [n.op_type for n in out] == ["LSTMTrain", "Relu", "LSTMGrad"]
    assert list(out[0].output) == ["Y", "", "Y_c", "g"] and out[0].name == "lstm"
    assert out[2].input[3] == "Y" and out[2].input[4] == "g"
    for other in [m("LSTM", ["X", "W", "R", "B"], ["Y"], hidden_size=5, input_forget=1),
                  m("LSTM", ["X", "W", "R", "B", "", "", "", "P"], ["Y"], hidden_size=5),
                  m("LSTM", ["X", "W", "R", "B"], ["Y"], hidden_size=5, activations=["Tanh"] * 3),
                  m("GRU", ["X", "W", "R", "B"], ["Y"], hidden_size=5)]:
        nodes = [other, train(), grad]
        assert merge_gru_train(nodes) == nodes


def _classifier(seq, batch, feat, hid, classes, seed):
    """The bench's LSTM classifier in ONNX (its exporter's graph without the batch-first
    transposes): X -> LSTM -> LSTM -> the last step -> Linear; torch's initial scales."""
    rng = np.random.default_rng(seed)

    def uni(shape, fan):
        return rng.uniform(-fan ** -0.5, fan ** -0.5, shape).astype(np.float32)
    w = {"W1": uni((1, 4 * hid, feat), hid), "R1": uni((1, 4 * hid, hid), hid), "B1": uni((1, 8 * hid), hid),
         "W2": uni((1, 4 * hid, hid), hid), "R2": uni((1, 4 * hid, hid), hid), "B2": uni((1, 8 * hid), hid),
         "Wl": uni((classes, hid), hid), "bl": uni((classes,), hid)}
    m = helper.make_node
    axes = [numpy_helper.from_array(np.array([k], np.int64), f"ax{k}") for k in (0, 1)]
    nodes = [m("LSTM", ["X", "W1", "R1", "B1"], ["Y1"], hidden_size=hid),
             m("Squeeze", ["Y1", "ax1"], ["X2"]),
             # Y named though unused, as torch's exporter does (the standard-op form of an
             # LSTM without Y fails to load in onnxruntime: a type mismatch, left for now).
             m("LSTM", ["X2", "W2", "R2", "B2"], ["Y2", "H2"], hidden_size=hid),
             m("Squeeze", ["H2", "ax0"], ["h"]),
             m("Gemm", ["h", "Wl", "bl"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "lstm_classifier",
                              [helper.make_tensor_value_info("X", F32, [seq, batch, feat])],
                              [helper.make_tensor_value_info("logits", F32, [batch, classes])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in w.items()] + axes)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    feeds = {"X": rng.standard_normal((seq, batch, feat)).astype(np.float32),
             "labels": rng.integers(0, classes, batch).astype(np.int64)}
    return model, feeds, w


def _classifier_bound(w, feeds):
    """float64 gradients of the mean cross-entropy and their first-order bounds: the LSTMs'
    from helpers/lstm_bound.py (the second layer's input carrying the first's errors, its
    dY_h the head's), the head's from its sums (gamma of their lengths) and the softmax's
    rounding (2 ELEMENTARY + C + 4 ulps of each probability, its argument's errors passed on
    through the softmax's Jacobian: at most p_i (e_i + sum_j p_j e_j))."""
    from helpers.rounding import ELEMENTARY, gamma
    X = feeds["X"]
    f = {k: v.astype(np.float64) for k, v in w.items()}
    v1, e1 = lstm_bound.forward(X, f["W1"][0], f["R1"][0], f["B1"][0], None, None)
    v2, e2 = lstm_bound.forward(v1["h"], f["W2"][0], f["R2"][0], f["B2"][0], None, None, eX=e1["h"])
    h, eh = v2["h"][-1], e2["h"][-1]
    n, classes = h.shape[0], f["Wl"].shape[0]
    aWl = np.abs(f["Wl"])
    z = h @ f["Wl"].T + f["bl"]
    ez = eh @ aWl.T + gamma(h.shape[1] + 2) * (np.abs(h) @ aWl.T + np.abs(f["bl"]))
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(classes)[feeds["labels"]]
    dz = (p - onehot) / n
    edz = (p * (ez + (p * ez).sum(1, keepdims=True)) + (2 * ELEMENTARY + classes + 4) * U * p
           + U * np.abs(p - onehot)) / n
    grads = {"Wl": dz.T @ h, "bl": dz.sum(0)}
    errs = {"Wl": edz.T @ np.abs(h) + np.abs(dz).T @ eh + gamma(n) * np.abs(dz).T @ np.abs(h),
            "bl": edz.sum(0) + gamma(n) * np.abs(dz).sum(0)}
    dh, edh = dz @ f["Wl"], edz @ aWl + gamma(classes) * np.abs(dz) @ aWl
    g2, ge2 = lstm_bound.backward(v1["h"], f["W2"][0], f["R2"][0], v2, e2, None, dh, None,
                                  eX=e1["h"], edYh=edh)
    g1, ge1 = lstm_bound.backward(X, f["W1"][0], f["R1"][0], v1, e1, g2["x"], None, None, edY=ge2["x"])
    for layer, g, ge in (("1", g1, ge1), ("2", g2, ge2)):
        for k in ("w", "r", "b"):
            grads[k.upper() + layer], errs[k.upper() + layer] = g[k][None], ge[k][None]
    return grads, errs


def test_bench_classifier_fused_and_standard_ops_within_the_bound(monkeypatch, library_path):
    """The bench's LSTM classifier (2 layers 128 -> 256, seq 64, batch 16, 10 classes),
    one SGD step of the mean cross-entropy, fused (LSTMTrain + LSTMGrad) and standard-op
    (LSTM + Scan): each run's gradients within the first-order bound of float64 (plus the
    update's rounding), so within the sum of both of each other."""
    from trainops import Trainer, losses
    model, feeds, w = _classifier(64, 16, 128, 256, 10, seed=5)
    want, bound = _classifier_bound(w, feeds)
    runs = {}
    for fused in (True, False):
        monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
        tr = Trainer(model, losses.cross_entropy("logits"), optim.Momentum(lr=1.0, alpha=0.0, beta=1.0),
                     params=list(w), threads=1, seed=1)
        ops = [n.op_type for n in tr.training_model().graph.node]
        assert ("LSTMGrad" in ops and "Scan" not in ops) if fused else ("Scan" in ops and "LSTMGrad" not in ops)
        before = tr.parameters()
        tr.step(feeds)
        after = tr.parameters()
        runs[fused] = {k: before[k].astype(np.float64) - after[k] for k in w}
        for k in w:
            _within(runs[fused][k], want[k], bound[k] + U * np.abs(after[k]), f"{k} fused={fused}")
    for k in w:
        assert np.all(np.abs(runs[True][k] - runs[False][k]) <= 2 * bound[k] + 2 * U * np.abs(w[k]) + 1e-30), k
