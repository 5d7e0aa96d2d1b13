"""Gradient rules of RNN, GRU and LSTM (trainops/autodiff/rules_rnn.py).

onnxruntime runs these ops in float32 only, so the reference is a numpy float64
re-implementation of the forward (tests/helpers/rnn_reference.py, checked against
onnxruntime's forward in every case) differentiated by central finite differences; the
expanded backward graph runs in onnxruntime (float32) and in onnx.reference (float64, tight
tolerance) where that implements the ops. The end-to-end classifiers are checked against
hand-written numpy backpropagation through time.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.gradcheck import make_model, session
from helpers import rnn_reference as ref
from trainops.autodiff import GradientError, expand_gradients
from trainops.onnx_defs import TRAINING_DOMAIN

F32 = TensorProto.FLOAT
OUT_NAMES = ("Y", "Y_h", "Y_c")


def _case(op, direction, seq, *, batch=2, inp=3, hid=3, bias=True, init=True, peep=False,
          layout=0, seed=0):
    """Random inputs (float64 values exactly representable in float32)."""
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1
    g = ref.GATES[op]

    def rnd(*shape, scale=0.6):
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)

    x_shape = (batch, seq, inp) if layout else (seq, batch, inp)
    s_shape = (batch, nd, hid) if layout else (nd, batch, hid)
    feeds = {"X": rnd(*x_shape, scale=1.0), "W": rnd(nd, g * hid, inp), "R": rnd(nd, g * hid, hid)}
    if bias:
        feeds["B"] = rnd(nd, 2 * g * hid, scale=0.3)
    if init:
        feeds["initial_h"] = rnd(*s_shape, scale=0.5)
        if op == "LSTM":
            feeds["initial_c"] = rnd(*s_shape, scale=0.5)
    if peep:
        feeds["P"] = rnd(nd, 3 * hid, scale=0.5)
    return feeds


def _node_inputs(op, feeds):
    names = ["X", "W", "R", "B" if "B" in feeds else "", "",
             "initial_h" if "initial_h" in feeds else ""]
    if op == "LSTM":
        names += ["initial_c" if "initial_c" in feeds else "", "P" if "P" in feeds else ""]
    while names and not names[-1]:
        names.pop()
    return names


def _ref_outputs(op, feeds, attrs):
    return ref.forward(op, feeds["X"], feeds["W"], feeds["R"], feeds.get("B"),
                       feeds.get("initial_h"), feeds.get("initial_c"), feeds.get("P"),
                       direction=attrs.get("direction", "forward"),
                       linear_before_reset=attrs.get("linear_before_reset", 0),
                       layout=attrs.get("layout", 0))


def _model(op, feeds, attrs, used, wrt, opset=17, symbolic=None, cotangents=None,
           elem=F32, node_outputs=None):
    """The op, loss = sum_k sum(out_k * C_k) over the used outputs, a Gradient node."""
    last = OUT_NAMES.index(used[-1])
    outs = node_outputs or [n if n in used else "" for n in OUT_NAMES[:last + 1]]
    nodes = [helper.make_node(op, _node_inputs(op, feeds), outs, name=f"my_{op.lower()}", **attrs)]
    inits, terms = [], []
    for k, name in enumerate(used):
        cot = cotangents[name].astype(helper.tensor_dtype_to_np_dtype(elem))
        inits.append(numpy_helper.from_array(cot, f"C_{name}"))
        nodes.append(helper.make_node("Mul", [name, f"C_{name}"], [f"m_{name}"]))
        nodes.append(helper.make_node("ReduceSum", [f"m_{name}"], [f"s_{name}"], keepdims=0))
        terms.append(f"s_{name}")
    total = terms[0]
    for k, t in enumerate(terms[1:]):  # Add, not Sum: no rule for Sum is assumed here
        nodes.append(helper.make_node("Add", [total, t], [f"acc_{k}"]))
        total = f"acc_{k}"
    nodes.append(helper.make_node("Identity", [total], ["loss"]))
    grads = [f"d_{x}" for x in wrt]
    nodes.append(helper.make_node("Gradient", list(wrt), grads, name="grad", domain=TRAINING_DOMAIN,
                                  xs=list(wrt), y="loss"))
    symbolic = symbolic or {}
    inputs = [helper.make_tensor_value_info(k, elem, symbolic.get(k, list(v.shape)))
              for k, v in feeds.items()]
    outputs = [helper.make_tensor_value_info("loss", elem, [])]
    outputs += [helper.make_tensor_value_info(gname, elem, symbolic.get(x, list(feeds[x].shape)))
                for gname, x in zip(grads, wrt)]
    shapes = dict(zip(OUT_NAMES, (None if y is None else y.shape
                                  for y in _ref_outputs(op, feeds, attrs))))
    outputs += [helper.make_tensor_value_info(n, elem, list(shapes[n])) for n in outs if n]
    return make_model(nodes, inputs, outputs, inits, opset)


def _fd(op, feeds, attrs, used, cot, wrt, eps=1e-6):
    def loss(fd):
        y = dict(zip(OUT_NAMES, _ref_outputs(op, fd, attrs)))
        return sum(float(np.sum(y[n] * cot[n])) for n in used)
    out = {}
    for x in wrt:
        g = np.zeros_like(feeds[x])
        for i in np.ndindex(g.shape):
            vals = []
            for sgn in (1, -1):
                moved = {**feeds, x: feeds[x].copy()}
                moved[x][i] += sgn * eps
                vals.append(loss(moved))
            g[i] = (vals[0] - vals[1]) / (2 * eps)
        out[x] = g
    return out


def _compare(got, want, rtol, atol, what):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale, err_msg=what)


def check(op, direction="forward", seq=3, used=("Y",), *, attrs=None, wrt=None, opset=17,
          symbolic=None, node_outputs=None, f32=True, **case):
    """Gradients of ``sum_k sum(out_k * C_k)`` (k over ``used``) with respect to ``wrt``
    (default: every input) from the expanded graph, against central differences of the
    numpy float64 forward, twice: the whole graph in onnxruntime in float32 (when ``f32``),
    and in float64 with the recurrent node's outputs fed from the numpy forward (onnxruntime
    has no float64 RNN kernels; the backward graph itself is all float64 ops)."""
    attrs = dict(attrs or {})
    attrs.setdefault("hidden_size", case.get("hid", 3))
    if direction != "forward":  # forward: the attribute's default
        attrs["direction"] = direction
    feeds = _case(op, direction, seq, **case)
    used = list(used)
    want_out = dict(zip(OUT_NAMES, _ref_outputs(op, feeds, attrs)))
    rng = np.random.default_rng(1)
    cot = {n: rng.standard_normal(want_out[n].shape) for n in used}
    wrt = list(wrt or feeds)
    want = _fd(op, feeds, attrs, used, cot, wrt)
    names = [f"d_{x}" for x in wrt]
    y_names = [n for n in (node_outputs or used) if n]
    for elem in (F32, TensorProto.DOUBLE):
        if elem == F32 and not f32:
            continue
        model = _model(op, feeds, attrs, used, wrt, opset, symbolic, cot, elem=elem,
                       node_outputs=node_outputs)
        expanded = expand_gradients(model)
        onnx.checker.check_model(expanded)
        assert not any(n.op_type == "Gradient" for n in expanded.graph.node)
        if elem == F32:
            f32_feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
            res = session(expanded).run(names + y_names, f32_feeds)
            for n, y in zip(y_names, res[len(names):]):  # the numpy forward is the op's
                _compare(y, want_out[n], 1e-5, 1e-5, f"forward {n}")
            tol = (2e-4, 2e-4)
            f32_model = expanded
        else:
            fed, extra = _recurrence_fed(expanded, feeds)
            res = _session_unoptimised(fed).run(names, {**feeds, **extra})
            tol = (1e-6, 1e-7)
        for x, g in zip(wrt, res):
            assert g.shape == feeds[x].shape, (x, g.shape, feeds[x].shape)
            _compare(g, want[x], *tol,
                     f"d loss / d {x} ({op} {direction}, seq {seq}, {used}, {np.dtype(g.dtype)})")
    return f32_model if f32 else expanded


def _session_unoptimised(model):
    """A session without graph optimisations: onnxruntime 1.17 fuses Transpose + MatMul
    into com.microsoft.FusedMatMul, which has no float64 kernel."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _recurrence_fed(model, feeds):
    """``model`` with every RNN/GRU/LSTM node replaced by graph inputs holding its outputs
    as the numpy forward computes them (all its inputs must be graph inputs)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    keep, extra = [], {}
    for n in g.node:
        if n.op_type not in ref.GATES:
            keep.append(n)
            continue
        args = dict(zip(["X", "W", "R", "B", "", "h0", "c0", "P"], n.input))
        val = {k: feeds[v] for k, v in args.items() if k and v}
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        direction = attrs.get("direction", b"forward")
        ys = ref.forward(n.op_type, val["X"], val["W"], val["R"], val.get("B"), val.get("h0"),
                         val.get("c0"), val.get("P"), direction=direction.decode(),
                         linear_before_reset=attrs.get("linear_before_reset", 0),
                         layout=attrs.get("layout", 0))
        for name, y in zip(n.output, ys):
            if name:
                extra[name] = y
                g.input.append(helper.make_tensor_value_info(name, TensorProto.DOUBLE,
                                                             list(y.shape)))
    del g.node[:]
    g.node.extend(keep)
    return out, extra


OPS = [("RNN", {}), ("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {})]
OP_IDS = ["RNN", "GRU", "GRU-lbr", "LSTM"]


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("seq", [1, 4])
@pytest.mark.parametrize("op,attrs", OPS, ids=OP_IDS)
def test_all_outputs_bias_and_initial_state(op, attrs, seq, direction):
    used = OUT_NAMES if op == "LSTM" else OUT_NAMES[:2]
    check(op, direction, seq, used, attrs=attrs)


ONE_OUTPUT = [pytest.param(op, attrs, out, id=f"{name}-{out}")
              for (op, attrs), name in zip(OPS, OP_IDS)
              for out in (OUT_NAMES if op == "LSTM" else OUT_NAMES[:2])]


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("seq", [1, 4])
@pytest.mark.parametrize("op,attrs,out", ONE_OUTPUT)
def test_one_output_no_bias_no_initial_state(op, attrs, out, seq, direction):
    check(op, direction, seq, (out,), attrs=attrs, bias=False, init=False)


@pytest.mark.parametrize("op,attrs", OPS, ids=OP_IDS)
def test_bias_without_initial_state_and_initial_state_without_bias(op, attrs):
    check(op, "forward", 3, ("Y", "Y_h"), attrs=attrs, bias=True, init=False)
    check(op, "bidirectional", 3, ("Y_h",), attrs=attrs, bias=False, init=True)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm_peepholes(direction):
    check("LSTM", direction, 4, OUT_NAMES, peep=True)
    check("LSTM", direction, 1, ("Y_c",), peep=True, init=False, bias=False)


@pytest.mark.parametrize("op,attrs", OPS, ids=OP_IDS)
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_layout_1(op, attrs, direction):
    used = OUT_NAMES if op == "LSTM" else OUT_NAMES[:2]
    # onnxruntime runs no layout-1 recurrences: float64, the node's outputs fed, only.
    check(op, direction, 3, used, attrs={**attrs, "layout": 1}, layout=1, f32=False)
    check(op, direction, 3, ("Y_h",), attrs={**attrs, "layout": 1}, layout=1, init=False,
          f32=False)


@pytest.mark.parametrize("op,acts", [("RNN", ["Tanh"]), ("GRU", ["Sigmoid", "Tanh"]),
                                     ("LSTM", ["Sigmoid", "Tanh", "Tanh"])])
def test_explicit_default_activations(op, acts):
    check(op, "bidirectional", 3, ("Y",), attrs={"activations": acts * 2})
    if op != "RNN":  # onnxruntime's RNN takes only the capitalised names
        check(op, "forward", 3, ("Y",), attrs={"activations": [a.lower() for a in acts]})


def test_some_inputs_only_and_declared_unused_outputs():
    # Only W and initial_h; Y_h declared but the loss reads only Y.
    check("GRU", "reverse", 3, ("Y",), wrt=["W", "initial_h"], node_outputs=["Y", "Y_h"])
    check("LSTM", "forward", 3, ("Y_h",), wrt=["R", "initial_c"], node_outputs=["Y", "Y_h", "Y_c"])


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_sequence_and_batch_known_only_at_run_time(op):
    check(op, "bidirectional", 4, ("Y", "Y_h"),
          symbolic={"X": ["S", "N", 3], "initial_h": [2, "N", 3], "initial_c": [2, "N", 3]})


@pytest.mark.parametrize("opset", [10, 13, 14, 20])
def test_opsets(opset):
    check("LSTM", "bidirectional", 3, ("Y", "Y_c"), opset=opset)
    check("GRU", "forward", 3, ("Y_h",), opset=opset, attrs={"linear_before_reset": 1})


def test_graph_size_does_not_grow_with_sequence_length():
    short = check("LSTM", "forward", 2, ("Y",))
    long = check("LSTM", "forward", 9, ("Y",), init=False)
    assert len(long.graph.node) <= len(short.graph.node)


# --- what the rule refuses ------------------------------------------------------------

def _refused(op, attrs, feeds_extra=None, inputs=None):
    feeds = _case(op, "forward", 3)
    ins = inputs or _node_inputs(op, feeds)
    node = helper.make_node(op, ins, ["Y"], name="the_rnn", hidden_size=3, **attrs)
    nodes = [node, helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0),
             helper.make_node("Gradient", ["W"], ["dW"], domain=TRAINING_DOMAIN, xs=["W"],
                              y="loss")]
    vis = [helper.make_tensor_value_info(k, F32, list(v.shape)) for k, v in feeds.items()]
    vis += [helper.make_tensor_value_info(k, TensorProto.INT32, list(v.shape))
            for k, v in (feeds_extra or {}).items()]
    model = make_model(nodes, vis, [helper.make_tensor_value_info("dW", F32, None)])
    with pytest.raises(GradientError) as err:
        expand_gradients(model)
    assert "the_rnn" in str(err.value) and op in str(err.value)
    return str(err.value)


def test_refuses_sequence_lens():
    msg = _refused("GRU", {}, {"lens": np.array([3, 3], np.int32)},
                   ["X", "W", "R", "B", "lens", "initial_h"])
    assert "sequence_lens" in msg


@pytest.mark.parametrize("op,attrs,word", [
    ("RNN", {"activations": ["Relu"]}, "activations"),
    ("GRU", {"activations": ["Tanh", "Tanh"]}, "activations"),
    ("LSTM", {"activations": ["Sigmoid", "Tanh"]}, "activations"),
    ("LSTM", {"clip": 5.0}, "clip"),
    ("LSTM", {"input_forget": 1}, "input_forget"),
    ("RNN", {"activations": ["Tanh"], "activation_alpha": [0.5]}, "activation_alpha"),
])
def test_refuses(op, attrs, word):
    assert word in _refused(op, attrs)


# --- end to end: classifiers as torch's exporter writes them -------------------------

def _classifier(op, seq=5, batch=4, inp=3, hid=6, classes=3, seed=3):
    """X [seq, batch, input] -> op (initializers, zero initial state by Expand of a constant
    to [1, batch, hidden] as torch does) -> Squeeze -> Gather(-1) -> Gemm -> SCE loss."""
    rng = np.random.default_rng(seed)
    g = ref.GATES[op]
    p = {"W": rng.standard_normal((1, g * hid, inp)) * 0.5,
         "R": rng.standard_normal((1, g * hid, hid)) * 0.5,
         "B": rng.standard_normal((1, 2 * g * hid)) * 0.2,
         "Wh": rng.standard_normal((classes, hid)) * 0.7, "bh": rng.standard_normal(classes) * 0.1}
    p = {k: v.astype(np.float32).astype(np.float64) for k, v in p.items()}
    x = rng.standard_normal((seq, batch, inp)).astype(np.float32).astype(np.float64)
    labels = rng.integers(0, classes, batch)
    c = helper.make_node
    nodes = [
        c("Constant", [], ["zero"], value=numpy_helper.from_array(np.zeros([1], np.float32))),
        c("Shape", ["X"], ["xs"]),
        c("Gather", ["xs", "one_i"], ["n"], axis=0),
        c("Unsqueeze", ["n", "ax0"], ["n1"]),
        c("Concat", ["ones1", "n1", "hid1"], ["h_shape"], axis=0),
        c("Expand", ["zero", "h_shape"], ["h0"]),
    ]
    state = ["h0"] + (["h0"] if op == "LSTM" else [])
    attrs = {"hidden_size": hid}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    nodes += [c(op, ["X", "W", "R", "B", ""] + state, ["Y", "Y_h"], name="rnn", **attrs),
              c("Squeeze", ["Y", "ax1"], ["Ys"]),
              c("Gather", ["Ys", "last"], ["h_last"], axis=0),
              c("Gemm", ["h_last", "Wh", "bh"], ["logits"], transB=1),
              c("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]),
              c("Gradient", ["X", "W", "R", "B", "Wh", "bh", "labels"],
                ["dX", "dW", "dR", "dB", "dWh", "dbh"],
                domain=TRAINING_DOMAIN, xs=["X", "W", "R", "B", "Wh", "bh"], zs=["labels"],
                y="loss")]
    consts = {"one_i": np.array(1, np.int64), "ax0": np.array([0], np.int64),
              "ones1": np.array([1], np.int64), "hid1": np.array([hid], np.int64),
              "ax1": np.array([1], np.int64), "last": np.array(-1, np.int64)}
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(v.astype(np.float32), k) for k, v in p.items()]
    vis = [helper.make_tensor_value_info("X", F32, list(x.shape)),
           helper.make_tensor_value_info("labels", TensorProto.INT64, [batch])]
    outs = [helper.make_tensor_value_info("loss", F32, [])]
    shapes = {"dX": x.shape, **{"d" + k: v.shape for k, v in p.items()}}
    outs += [helper.make_tensor_value_info(n, F32, list(v)) for n, v in shapes.items()]
    model = make_model(nodes, vis, outs, inits, opset=17)
    return model, x, labels, p


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_classifier_end_to_end_against_numpy_bptt(op):
    model, x, labels, p = _classifier(op)
    bptt = ref.gru_bptt if op == "GRU" else ref.lstm_bptt
    loss, want = bptt(x, p["W"], p["R"], p["B"], p["Wh"], p["bh"], labels)

    # The hand-written BPTT is itself checked against finite differences of the forward.
    def f(W):
        y, _, _ = ref.forward(op, x, W, p["R"], p["B"], linear_before_reset=1)
        return ref.head_loss(y[-1, 0], p["Wh"], p["bh"], labels)[0]
    eps, k = 1e-6, (0, 1, 2)
    Wp, Wm = p["W"].copy(), p["W"].copy()
    Wp[k] += eps
    Wm[k] -= eps
    assert abs((f(Wp) - f(Wm)) / (2 * eps) - want["W"][k]) < 1e-7
    assert abs(f(p["W"]) - loss) < 1e-12

    expanded = expand_gradients(model)
    onnx.checker.check_model(expanded)
    names = ["loss", "dX", "dW", "dR", "dB", "dWh", "dbh"]
    feeds = {"X": x.astype(np.float32), "labels": labels}
    got = dict(zip(names, session(expanded).run(names, feeds)))
    assert abs(float(got["loss"]) - loss) < 1e-5
    for n in ("X", "W", "R", "B", "Wh", "bh"):
        _compare(got["d" + n], want[n], 1e-4, 1e-5, f"d loss / d {n}")


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_trainer_momentum_step_against_numpy_bptt(op):
    """The Trainer (build_backward) on the classifier: one SGD step (Momentum, V from 0)
    moves every weight by -lr * the numpy BPTT gradient."""
    from trainops import Trainer, optim
    model, x, labels, p = _classifier(op)
    g = model.graph
    keep = [n for n in g.node if n.op_type != "Gradient"]
    del g.node[:]
    g.node.extend(keep)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", F32, []))
    _, want = (ref.gru_bptt if op == "GRU" else ref.lstm_bptt)(
        x, p["W"], p["R"], p["B"], p["Wh"], p["bh"], labels)
    lr = 0.5
    trainer = Trainer(model, loss="loss", optimizer=optim.Momentum(lr=lr), seed=1)
    trainer.step({"X": x.astype(np.float32), "labels": labels})
    after = trainer.parameters()
    assert set(after) == set(p)
    for n in p:
        _compare((p[n] - after[n]) / lr, want[n], 1e-4, 1e-5, f"step of {n}")


@pytest.mark.parametrize("minimal", [False, True])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_trainer_step_when_the_node_leaves_y_out(op, portable, minimal):
    """The classifier reading Y_h instead of Y (the recurrent node's first output left
    out, so the rule recomputes Y): one Momentum step (V from 0) moves every weight by
    -lr * the numpy BPTT gradient, with trainops' kernels and in standard ops alike (the
    standard-op step once failed to load: the copy computing Y beside the forward node)."""
    from trainops import Trainer, optim
    model, x, labels, p = _classifier(op)
    g = model.graph
    nodes = []
    for n in g.node:
        if n.op_type == "Gradient" or n.output[0] in ("Ys", "h_last"):
            if n.output[0] == "h_last":
                nodes.append(helper.make_node("Squeeze", ["Y_h", "ax0"], ["h_last"]))
            continue
        if n.op_type == op:
            n.output[0] = ""
            if minimal:  # X, W, R only: no bias, zero initial state
                del n.input[3:]
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", F32, []))
    if minimal:
        keep = [i for i in g.initializer if i.name != "B"]
        del g.initializer[:]
        g.initializer.extend(keep)
        p["B"] = np.zeros_like(p["B"])
    _, want = (ref.gru_bptt if op == "GRU" else ref.lstm_bptt)(
        x, p["W"], p["R"], p["B"], p["Wh"], p["bh"], labels)
    if minimal:
        del p["B"]
    lr = 0.5
    trainer = Trainer(model, loss="loss", optimizer=optim.Momentum(lr=lr), seed=1,
                      portable=portable)
    trainer.step({"X": x.astype(np.float32), "labels": labels})
    after = trainer.parameters()
    for n in p:
        _compare((p[n] - after[n]) / lr, want[n], 1e-4, 1e-5, f"step of {n}")
