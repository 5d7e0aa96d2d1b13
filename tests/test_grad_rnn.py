"""com.trainops::GRUGrad (crates/trainops-kernels/src/grad/rnn.rs) and the GRU rule that
emits it (trainops/autodiff/rules_rnn.py, where the Trainer fuses).

References: a numpy float64 backpropagation through time written here (``_bptt``), itself
checked against central differences of the numpy forward of tests/helpers/rnn_reference.py;
the Trainer with the fused kernel against the same Trainer under TRAINOPS_FUSED_GRADS=0
(the standard-op Scan form, which test_autodiff_rnn.py checks against finite differences).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import rnn_reference as ref
from helpers.adam_pair import assert_runs_agree, carried_difference, record
from helpers.exported import expanded_op_types
from trainops import optim
from trainops.onnx_defs import IR_VERSION, TRAINOPS_DOMAIN

F32 = TensorProto.FLOAT
IN_NAMES = ["X", "W", "R", "Y", "B", "initial_h", "dY", "dY_h"]
OUT_NAMES = ["dX", "dW", "dR", "dB", "d_initial_h"]


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _bptt(X, W, R, B, h0, dY, dYh, direction="forward", lbr=0):
    """Gradients of ``sum(Y * dY) + sum(Y_h * dY_h)`` for ONNX's GRU in layout 0, float64:
    ``(dX, dW, dR, dB, d_initial_h)``. Absent B / h0 / dY / dY_h are zeros."""
    nd, g3, _ = W.shape
    seq, batch, _ = X.shape
    hid = g3 // 3
    B = np.zeros((nd, 2 * g3)) if B is None else B
    h0 = np.zeros((nd, batch, hid)) if h0 is None else h0
    Y = ref.forward("GRU", X, W, R, B, h0, direction=direction, linear_before_reset=lbr)[0]
    dY = np.zeros_like(Y) if dY is None else dY
    dYh = np.zeros((nd, batch, hid)) if dYh is None else dYh
    dX, dW, dR, dB = np.zeros(X.shape), np.zeros(W.shape), np.zeros(R.shape), np.zeros(B.shape)
    dh0 = np.zeros(h0.shape)
    for d in range(nd):
        w, r, wb, rb = W[d], R[d], B[d, :g3], B[d, g3:]
        rz, rr_, rh = r[:hid], r[hid:2 * hid], r[2 * hid:]
        times = list(range(seq))
        if direction == "reverse" or d == 1:
            times.reverse()
        carry = dYh[d].copy()
        for s in reversed(range(seq)):
            t = times[s]
            hp = h0[d] if s == 0 else Y[times[s - 1], d]
            gx = X[t] @ w.T + wb
            z = _sig(gx[:, :hid] + hp @ rz.T + rb[:hid])
            rg = _sig(gx[:, hid:2 * hid] + hp @ rr_.T + rb[hid:2 * hid])
            hr = hp @ rh.T + rb[2 * hid:]
            hh = np.tanh(gx[:, 2 * hid:] + (rg * hr if lbr else (rg * hp) @ rh.T + rb[2 * hid:]))
            dh = carry + dY[t, d]
            da_z = dh * (hp - hh) * z * (1 - z)
            da_h = dh * (1 - z) * (1 - hh ** 2)
            if lbr:
                d_hr = da_h * rg  # d(hp Rh^T + Rbh)
                da_r = da_h * hr * rg * (1 - rg)
                dhp = dh * z + d_hr @ rh
                dR[d, 2 * hid:] += d_hr.T @ hp
                dB[d, g3 + 2 * hid:] += d_hr.sum(0)
            else:
                d_rh = da_h @ rh  # d(r * hp)
                da_r = d_rh * hp * rg * (1 - rg)
                dhp = dh * z + d_rh * rg
                dR[d, 2 * hid:] += da_h.T @ (rg * hp)
                dB[d, g3 + 2 * hid:] += da_h.sum(0)
            dhp = dhp + da_z @ rz + da_r @ rr_
            da = np.concatenate([da_z, da_r, da_h], axis=1)
            dX[t] += da @ w
            dW[d] += da.T @ X[t]
            dB[d, :g3] += da.sum(0)
            dR[d, :2 * hid] += da[:, :2 * hid].T @ hp
            dB[d, g3:g3 + 2 * hid] += da[:, :2 * hid].sum(0)
            carry = dhp
        dh0[d] = carry
    return dX, dW, dR, dB, dh0


def _case(seq, batch, inp, hid, direction="forward", seed=0):
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1

    def rnd(*shape, scale=0.6):  # float64 values exactly representable in float32
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)
    return {"X": rnd(seq, batch, inp, scale=1.0), "W": rnd(nd, 3 * hid, inp), "R": rnd(nd, 3 * hid, hid),
            "B": rnd(nd, 6 * hid, scale=0.3), "initial_h": rnd(nd, batch, hid, scale=0.5),
            "dY": rnd(seq, nd, batch, hid, scale=1.0), "dY_h": rnd(nd, batch, hid, scale=1.0)}


def _op_model(present, outputs=OUT_NAMES, dtype=F32, **attrs):
    """One GRUGrad node; ``present``: the inputs given (others ""), graph inputs of any shape."""
    ins = [n if n in present else "" for n in IN_NAMES]
    while not ins[-1]:
        ins.pop()
    outs = [n if n in outputs else "" for n in OUT_NAMES]
    while not outs[-1]:
        outs.pop()
    node = helper.make_node("GRUGrad", ins, outs, domain=TRAINOPS_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], "gru_grad", [helper.make_tensor_value_info(n, dtype, None) for n in ins if n],
        [helper.make_tensor_value_info(n, F32, None) for n in outs if n])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(TRAINOPS_DOMAIN, 1)])
    model.ir_version = IR_VERSION
    return model


def _run_op(make_session, case, direction, lbr, present=IN_NAMES, outputs=OUT_NAMES, threads=1):
    hid = case["R"].shape[-1]
    attrs = {"hidden_size": hid, "linear_before_reset": lbr}
    if direction != "forward":
        attrs["direction"] = direction
    Y = ref.forward("GRU", case["X"], case["W"], case["R"], case["B"] if "B" in present else None,
                    case["initial_h"] if "initial_h" in present else None, direction=direction,
                    linear_before_reset=lbr)[0]
    feeds = {n: (Y if n == "Y" else case[n]).astype(np.float32) for n in present}
    sess = make_session(_op_model(present, outputs, **attrs), threads=threads)
    got = dict(zip([o for o in outputs], sess.run(list(outputs), feeds)))
    want = _bptt(case["X"], case["W"], case["R"], *(case[n] if n in present else None
                                                     for n in ("B", "initial_h", "dY", "dY_h")),
                 direction=direction, lbr=lbr)
    return got, dict(zip(OUT_NAMES, want))


def _close(got, want, what, rtol=2e-4):
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


# --- the numpy reference itself ---------------------------------------------------------------

@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
def test_numpy_bptt_against_finite_differences(direction, lbr):
    c = _case(3, 2, 2, 3, direction, seed=4)
    grads = _bptt(c["X"], c["W"], c["R"], c["B"], c["initial_h"], c["dY"], c["dY_h"], direction, lbr)
    names = ["X", "W", "R", "B", "initial_h"]

    def loss(v):
        y, yh, _ = ref.forward("GRU", v["X"], v["W"], v["R"], v["B"], v["initial_h"],
                               direction=direction, linear_before_reset=lbr)
        return float(np.sum(y * c["dY"]) + np.sum(yh * c["dY_h"]))
    eps = 1e-6
    for name, g in zip(names, grads):
        fd = np.zeros_like(g)
        for i in np.ndindex(g.shape):
            up, down = {**c, name: c[name].copy()}, {**c, name: c[name].copy()}
            up[name][i] += eps
            down[name][i] -= eps
            fd[i] = (loss(up) - loss(down)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=name)


# --- the op ----------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (3, 1, 2, 1), (1, 4, 3, 5), (5, 3, 7, 9)],
                         ids=["all1", "batch1-hidden1", "seq1", "odd"])
def test_op_against_numpy(make_session, direction, lbr, sizes):
    got, want = _run_op(make_session, _case(*sizes, direction, seed=sum(sizes)), direction, lbr)
    for n in OUT_NAMES:
        _close(got[n], want[n], f"{n} {direction} lbr={lbr} {sizes}")


@pytest.mark.parametrize("present", [
    ["X", "W", "R", "Y"],  # no cotangent at all: every gradient is zero
    ["X", "W", "R", "Y", "dY"],
    ["X", "W", "R", "Y", "B", "", "", "dY_h"],
    ["X", "W", "R", "Y", "initial_h", "dY", "dY_h"],
], ids=["nothing", "dY-only", "bias-dYh", "h0-no-bias"])
@pytest.mark.parametrize("lbr", [0, 1])
def test_optional_inputs(make_session, present, lbr):
    present = [p for p in present if p]
    got, want = _run_op(make_session, _case(4, 3, 2, 5, "bidirectional", seed=7), "bidirectional",
                        lbr, present)
    for n in OUT_NAMES:
        _close(got[n], want[n], f"{n} {present}")


def test_some_outputs_only(make_session):
    got, want = _run_op(make_session, _case(3, 2, 3, 4, seed=2), "forward", 1, outputs=["dW", "dB"])
    assert set(got) == {"dW", "dB"}
    for n in got:
        _close(got[n], want[n], n)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lbr", [0, 1])
def test_bench_sized_any_thread_count(make_session, threads, lbr):
    """The bench's sizes (GEMMs cut into tasks of the session's pool)."""
    got, want = _run_op(make_session, _case(16, 64, 32, 64, seed=11), "forward", lbr, threads=threads)
    for n in OUT_NAMES:
        _close(got[n], want[n], f"{n} threads={threads}", rtol=5e-4)


def _expect_error(make_session, model, feeds, needles):
    with pytest.raises(Exception) as info:
        make_session(model).run(None, feeds)
    msg = str(info.value)
    for n in needles:
        assert n.lower() in msg.lower(), f"{n!r} not in: {msg}"


def _good_feeds(c, lbr=0):
    Y = ref.forward("GRU", c["X"], c["W"], c["R"], linear_before_reset=lbr)[0]
    return {"X": c["X"].astype(np.float32), "W": c["W"].astype(np.float32),
            "R": c["R"].astype(np.float32), "Y": Y.astype(np.float32)}


def test_bad_inputs(make_session):
    c = _case(3, 2, 3, 4, seed=5)
    good = _good_feeds(c)
    model = _op_model(["X", "W", "R", "Y"], hidden_size=4)
    make_session(model).run(None, good)
    _expect_error(make_session, model, {**good, "X": good["X"][0]},
                  ["GRUGrad", "input 0 (X)", "rank 3"])
    _expect_error(make_session, model, {**good, "W": good["W"][:, :6]},
                  ["GRUGrad", "input 1 (W)", "[1, 12, 3]", "[1, 6, 3]"])
    _expect_error(make_session, model, {**good, "Y": good["Y"][:2]},
                  ["GRUGrad", "input 3 (Y)", "[3, 1, 2, 4]"])
    with_b = _op_model(["X", "W", "R", "Y", "B"], hidden_size=4)
    _expect_error(make_session, with_b, {**good, "B": np.zeros((1, 12), np.float32)},
                  ["GRUGrad", "input 4 (B)", "[1, 24]"])
    _expect_error(make_session, _op_model(["X", "W", "R", "Y"], hidden_size=4,
                                          direction="bidirectional"),
                  good, ["GRUGrad", "input 1 (W)", "[2, 12, 3]"])


def test_bad_type_and_attributes(make_session):
    c = _case(3, 2, 3, 4, seed=5)
    good = _good_feeds(c)
    double = _op_model(["X", "W", "R", "Y"], dtype=TensorProto.DOUBLE, hidden_size=4)
    with pytest.raises(Exception) as info:  # the signature refuses double at load or run
        make_session(double).run(None, {k: v.astype(np.float64) for k, v in good.items()})
    assert "GRUGrad" in str(info.value) or "type" in str(info.value).lower()
    for attrs, needles in [({}, ["hidden_size", "required"]),
                           ({"hidden_size": 0}, ["hidden_size", "positive"]),
                           ({"hidden_size": 4, "linear_before_reset": 2}, ["linear_before_reset"]),
                           ({"hidden_size": 4, "direction": "sideways"}, ["direction", "sideways"])]:
        with pytest.raises(Exception) as info:
            make_session(_op_model(["X", "W", "R", "Y"], **attrs)).run(None, good)
        for n in ["GRUGrad"] + needles:
            assert n in str(info.value), (n, str(info.value))


# --- the rule, in the Trainer -------------------------------------------------------------------

def _gru_model(direction="bidirectional", lbr=0, layout=0, seq=4, batch=3, inp=3, hid=5, seed=0):
    """X -> GRU (B and initial_h trainable) -> loss = mean(Y^2) + sum(Y_h) / 10."""
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1
    w = {"W": rng.standard_normal((nd, 3 * hid, inp)) * 0.5,
         "R": rng.standard_normal((nd, 3 * hid, hid)) * 0.5,
         "B": rng.standard_normal((nd, 6 * hid)) * 0.2,
         "h0": rng.standard_normal((batch, nd, hid) if layout else (nd, batch, hid)) * 0.3}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
    inits.append(numpy_helper.from_array(np.array(0.1, np.float32), "tenth"))
    m = helper.make_node
    nodes = [m("GRU", ["X", "W", "R", "B", "", "h0"], ["Y", "Y_h"], hidden_size=hid,
               linear_before_reset=lbr, direction=direction, layout=layout),
             m("Mul", ["Y", "Y"], ["y2"]), m("ReduceMean", ["y2"], ["l1"], keepdims=0),
             m("ReduceSum", ["Y_h"], ["s"], keepdims=0), m("Mul", ["s", "tenth"], ["l2"]),
             m("Add", ["l1", "l2"], ["loss"])]
    x_shape = [batch, seq, inp] if layout else [seq, batch, inp]
    graph = helper.make_graph(nodes, "gru", [helper.make_tensor_value_info("X", F32, x_shape)],
                              [helper.make_tensor_value_info("loss", F32, [])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    return model, feeds, list(w)


def _train(monkeypatch, model, feeds, params, fused, steps=3, **kw):
    """``(run, ops, trainer)``: helpers/adam_pair.py's record of ``steps`` Adam steps and the
    step graph's op types."""
    from trainops import Trainer
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "1" if fused else "0")
    tr = Trainer(model, "loss", optim.Adam(lr=1e-2), params=params, threads=1, seed=1, **kw)
    ops = [n.op_type for n in tr.training_model().graph.node]
    return record(tr, feeds, steps), ops, tr


def _models():
    from trainops.bench.train_models import family
    fam = family("gru", 4)
    yield "bench-gru", fam.model, fam.feeds, fam.params
    # onnxruntime's GRU runs layout 0 only.
    for direction, lbr, layout in [("bidirectional", 0, 0), ("reverse", 1, 0), ("forward", 0, 0)]:
        model, feeds, params = _gru_model(direction, lbr, layout)
        yield f"{direction}-lbr{lbr}-layout{layout}", model, feeds, params


@pytest.mark.parametrize("name", ["bench-gru", "bidirectional-lbr0-layout0", "reverse-lbr1-layout0",
                                  "forward-lbr0-layout0"])
def test_trainer_fused_matches_standard_ops(monkeypatch, library_path, name):
    """Three Adam steps, fused (GRUTrain + GRUGrad) against standard ops (onnxruntime's
    GRU + the Scan backward). The forwards differ too, so each run's whole step is bounded
    against the float64 step at its own weights, the forward's errors carried into the
    backward (helpers/rounding.py's GRU rule: gamma of the terms of every gate sum, each
    Sigmoid / Tanh GRU_ACT ulps of 1 as measured for onnxruntime's and ours, the state's
    error passed on from step to step), and helpers/adam_pair.py carries the difference
    ``E_a + E_b + |g64(x_a) - g64(x_b)|`` through Adam's moments and updates: losses,
    weights and moments after every step. A theorem for the small GRUs (a gradient 1% off
    moves V past the bound: each run's E / |g| has medians of 4e-4 to 2e-3). The bench
    GRU (16 steps, hidden 64) compounds the worst case out of use (|R|'s row sums are 6),
    so there the state's errors pass through the signed Jacobians of the exact steps
    (first order in the roundings): E / |g| has medians near 0.1 for the GRU's own
    weights (a 1% error there is within it), near 3e-3 for its output layer (caught)."""
    _, model, feeds, params = next(m for m in _models() if m[0] == name)
    fused, fops, tr = _train(monkeypatch, model, feeds, params, True)
    plain, pops, _ = _train(monkeypatch, model, feeds, params, False)
    assert "GRUGrad" in fops and "Scan" not in fops
    assert "GRUGrad" not in pops and "Scan" in pops
    mode = "linear" if name == "bench-gru" else True
    assert_runs_agree(None, None, tr.optimizer, fused, plain,
                      grads=carried_difference(model, feeds, mode), what=f"{name}: ")


def test_portable_trainer_keeps_the_scan_form(monkeypatch, library_path):
    model, feeds, params = _gru_model("forward", 1, 0)
    _, ops, _ = _train(monkeypatch, model, feeds, params, True, steps=1, portable=True)
    assert "GRUGrad" not in ops and "Scan" in ops


def test_expand_gradients_never_fuses():
    """expand_gradients (no Trainer) keeps the standard-op form."""
    model, _, params = _gru_model("forward", 1, 0)
    ops = expanded_op_types(model, ["X"] + params)
    assert "Scan" in ops and "GRUGrad" not in ops
