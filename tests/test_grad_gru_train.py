"""com.trainops::GRUTrain (crates/trainops-kernels/src/grad/rnn/forward.rs), GRUGrad's saved
``gates`` input, and the fused GRU rule that runs the forward as GRUTrain
(trainops/autodiff/rules_rnn.py, merge_gru_train in trainops/autodiff/simplify.py).

References: onnx.reference's GRU and onnxruntime's GRU (Y, Y_h), numpy float64 gates
(tests/helpers/rnn_reference.py's equations, written out here to keep the gates), central
finite differences of the float64 forward (the gradients the Trainer applies), and the
Trainer under TRAINOPS_FUSED_GRADS=0 (the standard-op Scan form)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import rnn_reference as ref
from helpers import rounding
from helpers.adam_pair import assert_runs_agree, carried_difference, record
from helpers.exported import expanded_op_types, fd_grads
from trainops import optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

F32 = TensorProto.FLOAT
DIRS = ["forward", "reverse", "bidirectional"]
# Y and Y_h against the float64 forward (polynomial exp, float32 GEMMs): measured about 1e-6.
ATOL = 1e-5


def _case(seq, batch, inp, hid, direction, seed):
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1

    def rnd(*shape, scale=0.6):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return {"X": rnd(seq, batch, inp, scale=1.0), "W": rnd(nd, 3 * hid, inp),
            "R": rnd(nd, 3 * hid, hid), "B": rnd(nd, 6 * hid, scale=0.3),
            "initial_h": rnd(nd, batch, hid, scale=0.5)}


def _gates64(c, direction, lbr, use_b, use_h0):
    """float64 ``[dirs, seq, batch, 4 hidden]``: z, r, ĥ and ``h Rh^T + Rbh`` (lbr 1) or
    ``r ⊙ h`` (lbr 0) at every step, h the previous hidden state."""
    X, W, R = (c[k].astype(np.float64) for k in "XWR")
    nd, g3, _ = W.shape
    hid = g3 // 3
    seq, batch, _ = X.shape
    out = np.zeros((nd, seq, batch, 4 * hid))
    for d in range(nd):
        bias = c["B"][d].astype(np.float64) if use_b else np.zeros(2 * g3)
        wb, rb = bias[:g3], bias[g3:]
        h = c["initial_h"][d].astype(np.float64) if use_h0 else np.zeros((batch, hid))
        r = R[d]
        times = range(seq - 1, -1, -1) if (direction == "reverse" or d == 1) else range(seq)
        for t in times:
            gx = X[t] @ W[d].T + wb
            z = ref.sigmoid(gx[:, :hid] + h @ r[:hid].T + rb[:hid])
            rg = ref.sigmoid(gx[:, hid:2 * hid] + h @ r[hid:2 * hid].T + rb[hid:2 * hid])
            hr = h @ r[2 * hid:].T + rb[2 * hid:]
            hh = np.tanh(gx[:, 2 * hid:] + (rg * hr if lbr else (rg * h) @ r[2 * hid:].T
                                            + rb[2 * hid:]))
            out[d, t] = np.concatenate([z, rg, hh, hr if lbr else rg * h], axis=1)
            h = (1 - z) * hh + z * h
    return out


def _model(op, present, outputs, domain="", dtype=F32, **attrs):
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h"]
    ins = [n if n in present else "" for n in names]
    while not ins[-1]:
        ins.pop()
    node = helper.make_node(op, ins, outputs, domain=domain, **attrs)
    types = {"sequence_lens": TensorProto.INT32}
    graph = helper.make_graph(
        [node], "gru", [helper.make_tensor_value_info(n, types.get(n, dtype), None)
                        for n in ins if n],
        [helper.make_tensor_value_info(n, dtype, None) for n in outputs if n])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    return model


def _attrs(hid, direction, lbr):
    return {"hidden_size": hid, "linear_before_reset": lbr, "direction": direction}


# --- the op ------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("use_b,use_h0", [(True, True), (True, False), (False, True)])
def test_op_against_references(make_session, direction, lbr, use_b, use_h0):
    from onnx.reference import ReferenceEvaluator
    c = _case(5, 3, 4, 6, direction, seed=lbr + 10 * DIRS.index(direction))
    present = ["X", "W", "R"] + (["B"] if use_b else []) + (["initial_h"] if use_h0 else [])
    feeds = {k: c[k] for k in present}
    attrs = _attrs(6, direction, lbr)
    y, yh, g = make_session(_model("GRUTrain", present, ["Y", "Y_h", "gates"], TRAINOPS_DOMAIN,
                                   **attrs)).run(None, feeds)
    plain = _model("GRU", present, ["Y", "Y_h"], **attrs)
    ort_y, ort_yh = make_session(plain).run(None, feeds)
    y64, yh64, _ = ref.forward("GRU", c["X"], c["W"], c["R"], c["B"] if use_b else None,
                               c["initial_h"] if use_h0 else None, direction=direction,
                               linear_before_reset=lbr)
    refs = [("onnxruntime", (ort_y, ort_yh)), ("float64", (y64, yh64))]
    # onnx 1.16's reference GRU (the oldest-onnxruntime CI venv) runs "reverse" forward and
    # refuses "bidirectional"; 1.23's (checked here) does both.
    if direction == "forward" or tuple(int(v) for v in onnx.__version__.split(".")[:2]) >= (1, 23):
        refs.append(("onnx.reference", tuple(ReferenceEvaluator(plain).run(None, feeds))))
    for name, want in refs:
        np.testing.assert_allclose(y, want[0], rtol=0, atol=ATOL, err_msg=f"Y vs {name}")
        np.testing.assert_allclose(yh, want[1], rtol=0, atol=ATOL, err_msg=f"Y_h vs {name}")
    np.testing.assert_allclose(g, _gates64(c, direction, lbr, use_b, use_h0), rtol=0,
                               atol=ATOL * 4, err_msg="gates")


BENCH_INPUTS = ["X", "W", "R", "B", "initial_h"]


@functools.lru_cache(maxsize=None)
def _bench_forward_bound(lbr: int):
    """The bench-sized case at torch's scale: Y's float64 values and, per element, how far
    any float32 GRU may be from them (helpers/rounding.py's GRU rule, first order)."""
    c = _case(16, 64, 32, 64, "forward", seed=3)
    feeds = {k: (c[k] * 0.25 if k in "WR" else c[k]).astype(np.float32) for k in BENCH_INPUTS}
    model = _model("GRU", BENCH_INPUTS, ["Y"], **_attrs(64, "forward", lbr))
    vals, bounds = rounding.forward(model, {}, feeds, forward_errors="linear")
    return vals["Y"], bounds["Y"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lbr", [0, 1])
def test_bench_sized_and_outputs_left_out(make_session, threads, lbr):
    """The bench's sizes (16 steps, batch 64, input 32, hidden 64).

    Weights of torch's initial scale (about 1/sqrt(hidden)): Y within helpers/rounding.py's
    bound of float64, per element: every gate sum within gamma of its terms' magnitudes,
    each Sigmoid / Tanh GRU_ACT ulps of 1, the state's error passed on through the signed
    Jacobians of the exact steps. First order in the roundings (the terms left out, about
    2 rho^2 e^2 a step with |R|'s row sums rho near 10, are below a tenth of the bound
    here; the rule refuses a bound where they would not be); the bound is 2e-4 (median)
    to 5e-4, the float32 GRUs' distance about 2% of it.

    8x larger weights: rounding grows through the steps for every float32 GRU, and no
    bound is derived: the worst case overflows, and the first-order one reaches 0.3 by the
    last step, far out of its regime (rho near 40). Ours is held to twice onnxruntime's
    own distance to float64 there (both measured about 6e-5): a comparison with a peer,
    not a rounding bound."""
    present = BENCH_INPUTS
    attrs = _attrs(64, "forward", lbr)
    for scale in (0.25, 1.0):
        c = _case(16, 64, 32, 64, "forward", seed=3)
        feeds = {k: (c[k] * scale if k in "WR" else c[k]).astype(np.float32) for k in present}
        y, yh, g = make_session(_model("GRUTrain", present, ["Y", "Y_h", "gates"],
                                       TRAINOPS_DOMAIN, **attrs), threads=threads).run(None, feeds)
        if scale == 0.25:
            y64, bound = _bench_forward_bound(lbr)
            assert np.all(np.abs(y - y64) <= bound)
            assert np.all(np.abs(yh - y64[-1]) <= bound[-1])
            continue
        y64, yh64, _ = ref.forward("GRU", *(feeds[k] for k in present), linear_before_reset=lbr)
        ort_y = make_session(_model("GRU", present, ["Y"], **attrs)).run(None, feeds)[0]
        atol = 2 * np.abs(ort_y - y64).max() + 1e-6
        np.testing.assert_allclose(y, y64, rtol=0, atol=atol, err_msg=f"scale {scale}")
        np.testing.assert_allclose(yh, yh64, rtol=0, atol=atol, err_msg=f"scale {scale}")
        # Without Y and gates (the kernel then uses its own buffers): the same Y_h bits.
        (only_yh,) = make_session(_model("GRUTrain", present, ["", "Y_h"], TRAINOPS_DOMAIN,
                                         **attrs), threads=threads).run(None, feeds)
        assert only_yh.tobytes() == yh.tobytes()
        assert g.shape == (1, 16, 64, 256)


def _gru_grad(make_session, feeds, hid, direction, lbr, with_gates):
    names = ["X", "W", "R", "Y", "B", "initial_h", "dY", "dY_h"] + (["gates"] if with_gates else [])
    outs = ["dX", "dW", "dR", "dB", "d_initial_h"]
    node = helper.make_node("GRUGrad", names, outs, domain=TRAINOPS_DOMAIN,
                            **_attrs(hid, direction, lbr))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, F32, None) for n in names],
                              [helper.make_tensor_value_info(n, F32, None) for n in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    model.ir_version = IR_VERSION
    return make_session(model).run(None, {n: feeds[n] for n in names})


@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("lbr", [0, 1])
def test_grad_with_saved_gates_matches_recomputation(make_session, direction, lbr):
    """GRUGrad given GRUTrain's gates against GRUGrad recomputing them from the same Y: the
    forward's H R^T is one GEMM per step, the recomputation's one over all steps (another
    summation order in the gemm crate): within 2e-6 of each gradient's largest value."""
    c = _case(6, 5, 4, 17, direction, seed=7)
    rng = np.random.default_rng(1)
    y, g = make_session(_model("GRUTrain", list(c), ["Y", "", "gates"], TRAINOPS_DOMAIN,
                                  **_attrs(17, direction, lbr))).run(None, c)
    feeds = {**c, "Y": y, "gates": g, "dY": rng.standard_normal(y.shape).astype(np.float32),
             "dY_h": rng.standard_normal(c["initial_h"].shape).astype(np.float32)}
    saved = _gru_grad(make_session, feeds, 17, direction, lbr, True)
    recomputed = _gru_grad(make_session, feeds, 17, direction, lbr, False)
    for a, b in zip(saved, recomputed):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * max(1.0, np.abs(b).max()))


def _expect_error(run, needles):
    with pytest.raises(Exception) as info:
        run()
    msg = str(info.value)
    for n in needles:
        assert n.lower() in msg.lower(), f"{n!r} not in: {msg}"


def test_bad_inputs_and_attributes(make_session):
    c = _case(3, 2, 3, 4, "forward", seed=5)
    ok = _attrs(4, "forward", 0)
    xwr = {k: c[k] for k in "XWR"}

    def run(present, feeds, **attrs):
        return lambda: make_session(_model("GRUTrain", present, ["Y", "Y_h", "gates"],
                                           TRAINOPS_DOMAIN, **attrs)).run(None, feeds)
    run(list("XWR"), xwr, **ok)()
    _expect_error(run(list("XWR"), {**xwr, "X": c["X"][0]}, **ok), ["GRUTrain", "input 0 (X)", "rank 3"])
    _expect_error(run(list("XWR"), {**xwr, "W": c["W"][:, :6]}, **ok),
                  ["GRUTrain", "input 1 (W)", "[1, 12, 3]", "[1, 6, 3]"])
    _expect_error(run(["X", "W", "R", "initial_h"], {**xwr, "initial_h": c["initial_h"][:, :1]}, **ok),
                  ["GRUTrain", "input 5 (initial_h)", "[1, 2, 4]"])
    lens = {**xwr, "sequence_lens": np.full(2, 3, np.int32)}
    _expect_error(run(["X", "W", "R", "sequence_lens"], lens, **ok),
                  ["GRUTrain", "sequence_lens", "absent"])
    for attrs, needles in [({"hidden_size": 4, "layout": 1}, ["layout", "expected 0"]),
                           ({"hidden_size": 4, "clip": 3.0}, ["clip"]),
                           ({}, ["hidden_size", "required"]),
                           ({"hidden_size": 4, "direction": "sideways"}, ["direction", "sideways"]),
                           ({"hidden_size": 4, "linear_before_reset": 2}, ["linear_before_reset"])]:
        _expect_error(run(list("XWR"), xwr, **attrs), ["GRUTrain"] + needles)
    double = _model("GRUTrain", list("XWR"), ["Y"], TRAINOPS_DOMAIN, dtype=TensorProto.DOUBLE, **ok)
    with pytest.raises(Exception) as info:
        make_session(double).run(None, {k: v.astype(np.float64) for k, v in xwr.items()})
    assert "GRUTrain" in str(info.value) or "type" in str(info.value).lower()
    # GRUGrad checks the gates' shape.
    y, g = make_session(_model("GRUTrain", list(c), ["Y", "", "gates"], TRAINOPS_DOMAIN,
                                  **ok)).run(None, c)
    feeds = {**c, "Y": y, "gates": g[:, :, :, :8], "dY": np.ones_like(y), "dY_h": c["initial_h"]}
    _expect_error(lambda: _gru_grad(make_session, feeds, 4, "forward", 0, True),
                  ["GRUGrad", "input 8 (gates)", "[1, 3, 2, 16]"])


# --- the rule, in the Trainer --------------------------------------------------------------------

def _gru_model(direction="forward", lbr=0, layout=0, h0=True, use_y=True, use_yh=True,
               y_output=False, seq=4, batch=3, inp=3, hid=5, seed=0):
    """X -> GRU (B trainable, initial_h trainable or absent) -> loss = mean(Y^2) (use_y) +
    sum(Y_h) / 10 (use_yh); ``y_output``: Y is also a graph output. Returns the model, the
    feeds, the params and the float64 loss of given weights (for finite differences)."""
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1
    w = {"W": rng.standard_normal((nd, 3 * hid, inp)) * 0.5,
         "R": rng.standard_normal((nd, 3 * hid, hid)) * 0.5,
         "B": rng.standard_normal((nd, 6 * hid)) * 0.2}
    if h0:
        w["h0"] = rng.standard_normal((batch, nd, hid) if layout else (nd, batch, hid)) * 0.3
    w = {k: v.astype(np.float32) for k, v in w.items()}
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()]
    inits.append(numpy_helper.from_array(np.array(0.1, np.float32), "tenth"))
    m = helper.make_node
    nodes = [m("GRU", ["X", "W", "R", "B", "", "h0" if h0 else ""],
               ["Y" if use_y or y_output else "", "Y_h" if use_yh else ""], hidden_size=hid,
               linear_before_reset=lbr, direction=direction, layout=layout)]
    terms = []
    if use_y:
        nodes += [m("Mul", ["Y", "Y"], ["y2"]), m("ReduceMean", ["y2"], ["l1"], keepdims=0)]
        terms.append("l1")
    if use_yh:
        nodes += [m("ReduceSum", ["Y_h"], ["s"], keepdims=0), m("Mul", ["s", "tenth"], ["l2"])]
        terms.append("l2")
    nodes.append(m("Sum", terms, ["loss"]))
    x_shape = [batch, seq, inp] if layout else [seq, batch, inp]
    outs = [helper.make_tensor_value_info("loss", F32, [])]
    if y_output:
        outs.append(helper.make_tensor_value_info("Y", F32, None))
    graph = helper.make_graph(nodes, "gru", [helper.make_tensor_value_info("X", F32, x_shape)],
                              outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}

    def loss64(p):
        y, yh, _ = ref.forward("GRU", feeds["X"], p["W"], p["R"], p["B"], p.get("h0"),
                               direction=direction, linear_before_reset=lbr, layout=layout)
        return (np.mean(y ** 2) if use_y else 0.0) + (np.sum(yh) / 10 if use_yh else 0.0)
    return model, feeds, list(w), {k: v.astype(np.float64) for k, v in w.items()}, loss64


def _trainer(monkeypatch, model, params, fused, opt=None, **kw):
    from trainops import Trainer
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    return Trainer(model, "loss", opt or optim.Adam(lr=1e-2), params=params, threads=1, seed=1,
                   **kw)


def _ops(trainer):
    return [(n.domain or "", n.op_type) for n in trainer.training_model().graph.node]


CASES = {
    "bidirectional-lbr0": dict(direction="bidirectional", lbr=0),
    "reverse-lbr1": dict(direction="reverse", lbr=1),
    "forward-lbr1-no-h0": dict(lbr=1, h0=False),
    "forward-lbr0-yh-only": dict(use_y=False),
    "forward-lbr1-y-only": dict(lbr=1, use_yh=False),
    "y-graph-output": dict(lbr=1, use_y=False, y_output=True),
}


@pytest.mark.parametrize("name", ["bench-gru"] + list(CASES))
def test_trainer_fused_matches_standard_ops(monkeypatch, library_path, name):
    """Five Adam steps: the fused step (GRUTrain + GRUGrad with its gates) against the
    standard-op step (GRU + Scan). Losses, weights and Adam's moments after every step
    within helpers/adam_pair.py's bound, its step 1 from helpers/rounding.py with the
    forward's errors carried (``carried_difference``): the two forwards differ (GRUTrain
    against onnxruntime's GRU), so each run's whole step is bounded against the float64
    step at its own weights (gamma of the terms of every gate sum, GRU_ACT ulps of 1 for
    each Sigmoid / Tanh as measured on onnxruntime's and ours, the state's error passed on
    through time, forward and backward). A theorem for the small GRUs, where a gradient
    1% off moves V past the bound; for the bench GRU (16 steps, hidden 64), whose worst
    case compounds out of use, first order in the roundings (the state's errors through
    the signed Jacobians of the exact steps): a 1% error in its output layer's gradient
    is caught, in the GRU's own weights (each run's E / |g| has medians near 0.1) not."""
    if name == "bench-gru":
        from trainops.bench.train_models import family
        fam = family("gru", 4)
        model, feeds, params = fam.model, fam.feeds, fam.params
    else:
        model, feeds, params, _, _ = _gru_model(**CASES[name])
    runs = {}
    for fused in (True, False):
        tr = _trainer(monkeypatch, model, params, fused)
        runs[fused] = (_ops(tr), record(tr, feeds, 5))
    fops, pops = runs[True][0], runs[False][0]
    assert (TRAINOPS_DOMAIN, "GRUTrain") in fops and ("", "GRU") not in fops
    assert ("", "Scan") not in fops
    assert (TRAINOPS_DOMAIN, "GRUTrain") not in pops and ("", "GRU") in pops
    mode = "linear" if name == "bench-gru" else True
    assert_runs_agree(None, None, tr.optimizer, runs[True][1], runs[False][1],
                      grads=carried_difference(model, feeds, mode), what=f"{name}: ")


def test_gru_grad_reads_the_forward_gates(monkeypatch, library_path):
    model, _, params, _, _ = _gru_model("bidirectional", 1)
    g = _trainer(monkeypatch, model, params, True).training_model().graph
    (train,) = [n for n in g.node if n.op_type == "GRUTrain"]
    (grad,) = [n for n in g.node if n.op_type == "GRUGrad"]
    assert list(train.output[:2]) == ["Y", "Y_h"]  # the forward's own names
    assert grad.input[3] == "Y" and grad.input[8] == train.output[2]


@pytest.mark.parametrize("name", ["bidirectional-lbr0", "forward-lbr1-no-h0", "forward-lbr0-yh-only"])
def test_trainer_gradients_against_finite_differences(monkeypatch, library_path, name):
    """One plain SGD step (Momentum with alpha 0, beta 1, lr 1: X -= G) gives the gradient
    the fused step computed; against central differences of the float64 forward."""
    model, feeds, params, w64, loss64 = _gru_model(**CASES[name])
    opt = optim.Momentum(lr=1.0, alpha=0.0, beta=1.0)
    tr = _trainer(monkeypatch, model, params, True, opt)
    assert (TRAINOPS_DOMAIN, "GRUTrain") in _ops(tr)
    before = tr.parameters()
    tr.step(feeds)
    after = tr.parameters()
    fd = fd_grads(lambda q: loss64({**w64, **q}), {k: w64[k].copy() for k in params})
    for k in params:
        got = before[k].astype(np.float64) - after[k]
        # float32 step against float64 differences; the update rounds to the weights' ulp.
        np.testing.assert_allclose(got, fd[k], rtol=1e-4, atol=2e-6, err_msg=k)


def test_portable_and_layout1_and_expand_keep_their_graphs(monkeypatch, library_path):
    model, feeds, params, _, _ = _gru_model("forward", 1)
    ops = _ops(_trainer(monkeypatch, model, params, True, portable=True))
    assert ("", "GRU") in ops and ("", "Scan") in ops
    assert not any(d == TRAINOPS_DOMAIN and t.startswith("GRU") for d, t in ops)
    # Layout 1 (which onnxruntime's GRU does not run: the step graph only): GRUGrad between
    # Transposes recomputes the gates; the forward stays GRU.
    from trainops.train.graph import build_step_graph
    from trainops.train.spec import StepOptions
    model1, _, params1, _, _ = _gru_model("bidirectional", 0, layout=1)
    step = build_step_graph(model1, StepOptions("loss", optim.Adam(), params1, fused=True))
    ops = [(n.domain or "", n.op_type) for n in step.model.graph.node]
    assert ("", "GRU") in ops and (TRAINOPS_DOMAIN, "GRUGrad") in ops
    assert (TRAINOPS_DOMAIN, "GRUTrain") not in ops
    ops = expanded_op_types(model, ["X"] + params)
    assert "GRU" in ops and "GRUTrain" not in ops and "GRUGrad" not in ops


def test_exported_models_keep_onnx_gru(monkeypatch, library_path, tmp_path):
    """export() and the eval/inference artifacts are for stock onnxruntime: ONNX's GRU,
    no com.trainops op; the training artifact has GRUTrain."""
    import onnxruntime as ort
    model, feeds, params, _, _ = _gru_model("reverse", 1, y_output=True)
    tr = _trainer(monkeypatch, model, params, True)
    tr.step(feeds)
    exported = tr.export()
    assert [n.op_type for n in exported.graph.node].count("GRU") == 1
    assert all(n.domain in ("", "ai.onnx") for n in exported.graph.node)
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, y = sess.run(["loss", "Y"], feeds)
    assert np.isfinite(loss) and y.shape == (4, 1, 3, 5)
    tr.save_artifacts(tmp_path)
    for name in ("eval.onnx", "inference.onnx"):
        m = onnx.load(str(tmp_path / name))
        assert "GRU" in [n.op_type for n in m.graph.node], name
        assert not any(n.domain == TRAINOPS_DOMAIN for n in m.graph.node), name
    training = onnx.load(str(tmp_path / "training.onnx"))
    assert "GRUTrain" in [n.op_type for n in training.graph.node]


def test_merge_gru_train_pass():
    """merge_gru_train on node lists: the GRU becomes the GRUTrain at the earlier position
    with its own output names, readers of the GRUTrain's Y read the GRU's; a GRU with other
    attributes or inputs never merges."""
    from trainops.autodiff.simplify import merge_gru_train
    m = helper.make_node

    def train(y="y2", gates="g", **kw):
        return m("GRUTrain", ["X", "W", "R", "B"], [y, "", gates], domain=TRAINOPS_DOMAIN,
                 hidden_size=5, linear_before_reset=1, direction="forward", **kw)
    gru = m("GRU", ["X", "W", "R", "B", "", ""], ["Y", "Y_h"], name="gru", hidden_size=5,
            linear_before_reset=1, activations=["Sigmoid", "Tanh"])
    grad = m("GRUGrad", ["X", "W", "R", "y2", "", "", "dY", "", "g"], ["dX"], domain=TRAINOPS_DOMAIN)
    head = m("Relu", ["Y_h"], ["out"])
    out = merge_gru_train([gru, head, train(), grad])
    assert [n.op_type for n in out] == ["GRUTrain", "Relu", "GRUGrad"]
    assert list(out[0].output) == ["Y", "Y_h", "g"] and out[0].name == "gru"
    assert out[2].input[3] == "Y" and out[2].input[8] == "g"
    # The GRUTrain first (a sort may put it there): merged at its place.
    out = merge_gru_train([train(), gru, grad, head])
    assert [n.op_type for n in out] == ["GRUTrain", "GRUGrad", "Relu"]
    # A GRU without Y output takes the GRUTrain's.
    no_y = m("GRU", ["X", "W", "R", "B"], ["", "Y_h"], hidden_size=5, linear_before_reset=1)
    out = merge_gru_train([no_y, train(), grad])
    assert list(out[0].output) == ["y2", "Y_h", "g"] and out[1].input[3] == "y2"
    # Different attributes or inputs: left alone.
    for other in [m("GRU", ["X", "W", "R", "B"], ["Y"], hidden_size=5, linear_before_reset=1, clip=2.0),
                  m("GRU", ["X", "W", "R", "B"], ["Y"], hidden_size=5),
                  m("GRU", ["X", "W", "R"], ["Y"], hidden_size=5, linear_before_reset=1),
                  m("GRU", ["X", "W", "R", "B"], ["Y"], hidden_size=5, linear_before_reset=1,
                    activations=["Tanh", "Tanh"])]:
        nodes = [other, train(), grad]
        assert merge_gru_train(nodes) == nodes
    assert merge_gru_train([gru, head]) == [gru, head]
