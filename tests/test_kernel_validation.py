"""Attribute and shape validation of the com.trainops kernels, through onnxruntime.

- Gradient kernels: attributes whose arithmetic overflows (pads, dilations of 2^62) are
  errors naming the op and the attribute, never an abort or an "internal error"; values the
  arithmetic allows (huge pads with huge strides) give the convolution's exact result
  (a loop reference in Python integers); MaxPoolGradFromInput refuses a dY that is not
  MaxPool's output, and finds windows of 2^40 steps in closed form.
- Optimizers: one validation for every op of the family; every AdamW variant refuses what
  torch.optim.AdamW refuses, naming the op actually run.
- Shape inference: unknown dimensions are named per node (two MaxPoolGrad nodes of
  different sizes do not share a name), and no dimensions known leaves the output unset
  rather than a scalar (a Transpose after ConvInputGrad of unknown rank loads).

Cases that once aborted the process run in a child interpreter, so that a regression
fails its test instead of ending the run. Spec: docs/ops/*.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto, helper

from helpers.checks import same_bits
from trainops.onnx_defs import IR_VERSION, ONNX_OPSET, TRAINING_DOMAIN, TRAINOPS_DOMAIN

BIG = 2 ** 62
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, domains=(TRAINOPS_DOMAIN,)):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", ONNX_OPSET)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _error(fn):
    """(exception class name, message) of ``fn()``, which must raise."""
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value).__name__, str(info.value)


# -- running a case in a child interpreter ----------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, onnx, onnxruntime as ort
    lib, model_path, feeds_path = sys.argv[1:4]
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.log_severity_level = 4
    feeds = dict(np.load(feeds_path))
    try:
        sess = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])
        out = sess.run(None, feeds)
        print(json.dumps({"ok": [o.tolist() for o in out]}))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
""")


def _run_in_child(library_path, tmp_path, model, feeds, timeout=300):
    """Runs ``model`` on ``feeds`` in a fresh interpreter: ``{"ok": outputs}`` or
    ``{"error": class name, "message": ...}``; an abort fails the test with its output."""
    model_path, feeds_path = tmp_path / "m.onnx", tmp_path / "feeds.npz"
    model_path.write_bytes(model.SerializeToString())
    np.savez(feeds_path, **feeds)
    proc = subprocess.run([sys.executable, "-c", _CHILD, library_path, str(model_path), str(feeds_path)],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert proc.returncode == 0, f"the child ended with {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- convolution gradients ---------------------------------------------------------------

def _conv_out(size, k, s, d, pb, pe):
    return (size + pb + pe - ((k - 1) * d + 1)) // s + 1


def _ref_weight_grad(x, dy, kernel, strides, dilations, pads):
    """dW of a 2-D, one-group convolution by its definition, in Python integers and float64:
    dW[m, c, k] = sum_{n, o} dY[n, m, o] * X[n, c, o*s + k*d - p] (padding reads 0)."""
    n_, c_, h, w = x.shape
    m_, oh, ow = dy.shape[1], dy.shape[2], dy.shape[3]
    dw = np.zeros((m_, c_, kernel[0], kernel[1]))
    for k0 in range(kernel[0]):
        for k1 in range(kernel[1]):
            for o0 in range(oh):
                i0 = o0 * strides[0] + k0 * dilations[0] - pads[0]
                if not 0 <= i0 < h:
                    continue
                for o1 in range(ow):
                    i1 = o1 * strides[1] + k1 * dilations[1] - pads[1]
                    if not 0 <= i1 < w:
                        continue
                    xs = x[:, :, i0, i1].astype(np.float64)  # [n, c]
                    gs = dy[:, :, o0, o1].astype(np.float64)  # [n, m]
                    dw[:, :, k0, k1] += gs.T @ xs
    return dw


def _weight_grad_model(kernel, x_shape, dy_shape, **attrs):
    node = helper.make_node("ConvWeightGrad", ["X", "dY"], ["dW"], domain=TRAINOPS_DOMAIN,
                            kernel_shape=kernel, **attrs)
    return _model([node], [_vi("X", F, x_shape), _vi("dY", F, dy_shape)], [_vi("dW", F, None)])


@pytest.mark.parametrize("attrs, name, words", [
    # Once an abort (memory sized by the pads) and an "internal error".
    (dict(pads=[BIG, 0, BIG, 0], kernel=[3, 3]), "pads",
     f"dimension 0: the input (5) padded by {BIG} + {BIG} exceeds 2^63 - 1"),
    (dict(dilations=[BIG, 1], kernel=[5, 3]), "dilations",
     f"dimension 0: the dilated kernel ((5 - 1) * {BIG} + 1) exceeds 2^63 - 1"),
    (dict(strides=[1, 2 ** 63 - 1], pads=[0, 2 ** 63 - 1, 0, 2 ** 63 - 1], kernel=[3, 3]), "pads",
     "dimension 1: the input (5) padded by"),
])
def test_conv_weight_grad_refuses_overflowing_attributes(library_path, tmp_path, attrs, name, words):
    kernel = attrs.pop("kernel")
    rng = np.random.default_rng(0)
    feeds = {"X": rng.standard_normal((2, 3, 5, 5)).astype(np.float32),
             "dY": rng.standard_normal((2, 4, 3, 3)).astype(np.float32)}
    model = _weight_grad_model(kernel, [2, 3, 5, 5], [2, 4, 3, 3], **attrs)
    got = _run_in_child(library_path, tmp_path, model, feeds)
    assert got.get("error") == "InvalidArgument", got
    assert f"ConvWeightGrad: attribute '{name}': {words}" in got["message"], got["message"]
    assert "internal error" not in got["message"]


def test_conv_input_grad_refuses_overflowing_pads(library_path, tmp_path):
    node = helper.make_node("ConvInputGrad", ["dY", "W", "X_shape"], ["dX"], domain=TRAINOPS_DOMAIN,
                            pads=[BIG, 0, BIG, 0])
    model = _model([node], [_vi("dY", F, [2, 4, 3, 3]), _vi("W", F, [4, 3, 3, 3]), _vi("X_shape", I64, [4])],
                   [_vi("dX", F, None)])
    feeds = {"dY": np.ones((2, 4, 3, 3), np.float32), "W": np.ones((4, 3, 3, 3), np.float32),
             "X_shape": np.array([2, 3, 5, 5], np.int64)}
    got = _run_in_child(library_path, tmp_path, model, feeds)
    assert got.get("error") == "InvalidArgument", got
    want = f"ConvInputGrad: attribute 'pads': dimension 0: the input (5) padded by {BIG} + {BIG}"
    assert want in got["message"], got["message"]


@pytest.mark.parametrize("strides, pads, dilations", [
    # One window far in the padding of dimension 0: dW is all zeros.
    ([BIG, BIG], [BIG - 10, 0, 0, 0], [1, 1]),
    # Pads of 2^40 before a stride of 2^40: the second window of dimension 0 reads rows 0..2,
    # through a grid no padded copy could hold (im2col reads the input along the runs).
    ([2 ** 40, 1], [2 ** 40, 1, 0, 1], [1, 1]),
    # A dilation of 2^40 with pads of 2^40: the middle kernel row reads the input.
    ([1, 2], [2 ** 40, 0, 2 ** 40, 0], [2 ** 40, 1]),
])
def test_huge_attributes_the_arithmetic_allows_give_the_exact_gradient(library_path, tmp_path, strides, pads,
                                                                       dilations):
    kernel, x_shape = [3, 2], (2, 3, 5, 5)
    out = [_conv_out(x_shape[2 + j], kernel[j], strides[j], dilations[j], pads[j], pads[j + 2])
           for j in range(2)]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    dy = rng.standard_normal((2, 4, *out)).astype(np.float32)
    model = _weight_grad_model(kernel, list(x_shape), list(dy.shape), strides=strides, pads=pads,
                               dilations=dilations)
    got = _run_in_child(library_path, tmp_path, model, {"X": x, "dY": dy})
    assert "ok" in got, got
    dw = np.array(got["ok"][0], np.float32)
    want = _ref_weight_grad(x, dy, kernel, strides, dilations, pads)
    # Each element a float32 sum of at most N * prod(out) products: that many roundings.
    terms = x_shape[0] * out[0] * out[1]
    mag = _ref_weight_grad(np.abs(x), np.abs(dy), kernel, strides, dilations, pads)
    assert np.all(np.abs(dw - want) <= terms * np.finfo(np.float32).eps * mag)
    assert np.any(want != 0) or pads[0] == BIG - 10


# -- MaxPool gradient from its input -----------------------------------------------------

def _pool_model(kernel, gy_shape, x_shape, **attrs):
    node = helper.make_node("MaxPoolGradFromInput", ["dY", "X"], ["dX"], domain=TRAINOPS_DOMAIN,
                            kernel_shape=kernel, **attrs)
    return _model([node], [_vi("dY", F, gy_shape), _vi("X", F, x_shape)], [_vi("dX", F, None)])


def _ref_pool_grad(gy, x, kernel, strides, pads):
    """MaxPool's gradient by its definition in Python integers: each window's first maximum
    (row-major, strictly greater, as onnxruntime's Indices) gets its dY."""
    gx = np.zeros(x.shape, np.float64)
    nd = len(kernel)
    for plane in np.ndindex(*x.shape[:2]):
        for o in np.ndindex(*gy.shape[2:]):
            best, at = -np.inf, None
            ranges = []
            for j in range(nd):
                start = int(o[j]) * strides[j] - pads[j]
                ranges.append(range(max(start, 0), min(start + kernel[j], x.shape[2 + j])))
            for i in np.ndindex(*[len(r) for r in ranges]):
                pos = tuple(ranges[j][i[j]] for j in range(nd))
                if x[plane + pos] > best:
                    best, at = x[plane + pos], pos
            if at is not None:
                gx[plane + at] += gy[plane + o]
    return gx


def test_maxpool_grad_from_input_refuses_more_windows_than_maxpool_gives(make_session):
    # A 4x4 input, kernel 2, stride 2 gives a 2x2 output; [1, 2, 3, 2]
    # had its extra row of gradient dropped silently.
    sess = make_session(_pool_model([2, 2], [1, 2, 3, 2], [1, 2, 4, 4], strides=[2, 2]))
    gy, x = np.ones((1, 2, 3, 2), np.float32), np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    kind, msg = _error(lambda: sess.run(None, {"dY": gy, "X": x}))
    assert kind == "InvalidArgument"
    assert ("MaxPoolGradFromInput: input 0 (dY): expected spatial sizes [2, 2] (MaxPool's output over "
            "the input's [4, 4]), got shape [1, 2, 3, 2]") in msg, msg


@pytest.mark.parametrize("ceil_mode, sizes, ok", [
    (None, (2, 2), True), (None, (3, 3), True), (None, (3, 2), True), (None, (4, 3), False),
    (0, (2, 2), True), (0, (3, 3), False), (1, (3, 3), True), (1, (2, 2), False),
])
def test_maxpool_grad_from_input_takes_floor_or_ceil_mode_outputs(make_session, ceil_mode, sizes, ok):
    """A 5x5 input, kernel 2, stride 2: 2 windows per dimension (ceil_mode 0) or 3 (1);
    without the attribute either, per dimension; the gradient then is MaxPool's."""
    attrs = {} if ceil_mode is None else {"ceil_mode": ceil_mode}
    gy_shape = (1, 2, *sizes)
    sess = make_session(_pool_model([2, 2], list(gy_shape), [1, 2, 5, 5], strides=[2, 2], **attrs))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
    gy = rng.standard_normal(gy_shape).astype(np.float32)
    if not ok:
        kind, msg = _error(lambda: sess.run(None, {"dY": gy, "X": x}))
        assert kind == "InvalidArgument"
        assert "MaxPoolGradFromInput: input 0 (dY): expected spatial sizes" in msg, msg
        return
    (gx,) = sess.run(None, {"dY": gy, "X": x})
    want = _ref_pool_grad(gy, x, [2, 2], [2, 2], [0, 0])
    assert same_bits(gx, want.astype(np.float32))  # each element the sum of at most one dY


def test_maxpool_windows_of_2_to_the_40_steps_are_found_in_closed_form(library_path, tmp_path):
    """One window of 2^40 steps (pads 2^40 - 2 each side, stride 2^41) covers the first two
    elements of a length-4 input: the search once walked every step."""
    k = 2 ** 40
    model = _pool_model([k], [1, 1, 1], [1, 1, 4], strides=[2 * k], pads=[k - 2, k - 2])
    x = np.array([[[1.0, 5.0, 9.0, 4.0]]], np.float32)
    # A minute, not the hours the step-by-step search took.
    feeds = {"dY": np.array([[[2.0]]], np.float32), "X": x}
    got = _run_in_child(library_path, tmp_path, model, feeds, timeout=60)
    assert "ok" in got, got
    gx = np.array(got["ok"][0], np.float32)
    assert same_bits(gx, _ref_pool_grad(np.array([[[2.0]]]), x, [k], [2 * k], [k - 2]).astype(np.float32))
    assert gx.tolist() == [[[0.0, 2.0, 0.0, 0.0]]]


@pytest.mark.parametrize("attrs, name", [
    (dict(kernel_shape=[2], pads=[BIG, BIG]), "pads"),
    (dict(kernel_shape=[5], dilations=[BIG]), "dilations"),
    (dict(kernel_shape=[2], ceil_mode=2), "ceil_mode"),
])
def test_maxpool_grad_from_input_names_the_attribute(make_session, attrs, name):
    kernel = attrs.pop("kernel_shape")
    model = _pool_model(kernel, [1, 1, 2], [1, 1, 4], **attrs)

    def run():
        sess = make_session(model)
        sess.run(None, {"dY": np.ones((1, 1, 2), np.float32), "X": np.ones((1, 1, 4), np.float32)})

    kind, msg = _error(run)
    assert f"MaxPoolGradFromInput: attribute '{name}'" in msg, msg
    assert "internal error" not in msg


# -- GRU ---------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["GRUGrad", "GRUTrain"])
def test_gru_hidden_size_whose_tensors_overflow_is_named(library_path, tmp_path, op):
    h = BIG
    if op == "GRUGrad":
        ins = ["X", "W", "R", "Y"]
        outs = ["dX"]
    else:
        ins, outs = ["X", "W", "R"], ["Y"]
    node = helper.make_node(op, ins, outs, domain=TRAINOPS_DOMAIN, hidden_size=h)
    feeds = {"X": np.ones((2, 1, 3), np.float32), "W": np.ones((1, 3, 3), np.float32),
             "R": np.ones((1, 3, 1), np.float32), "Y": np.ones((2, 1, 1, 1), np.float32)}
    feeds = {k: feeds[k] for k in ins}
    model = _model([node], [_vi(k, F, list(v.shape)) for k, v in feeds.items()],
                   [_vi(o, F, None) for o in outs])
    got = _run_in_child(library_path, tmp_path, model, feeds)
    assert got.get("error") == "InvalidArgument", got
    want = f"{op}: attribute 'hidden_size': expected a size whose tensors fit in 64 bits, got {h}"
    assert want in got["message"], got["message"]


# -- axes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op, axis", [("SoftmaxGrad", -2 ** 63), ("LogSoftmaxGrad", 2 ** 63 - 1),
                                      ("LayerNormGrad", -2 ** 63)])
def test_axes_of_any_int64_are_named(make_session, op, axis):
    """-2^63 once overflowed working out the rank it asks for (an "internal error")."""
    if op == "LayerNormGrad":
        names = ["dY", "X", "Scale", "Mean", "InvStdDev"]
        outs = ["dX"]
    else:
        names, outs = ["dY", "Y"], ["dX"]
    node = helper.make_node(op, names, outs, domain=TRAINOPS_DOMAIN, axis=axis)
    sess = make_session(_model([node], [_vi(n, F, None) for n in names], [_vi("dX", F, None)]))
    feeds = {n: np.ones((2, 3), np.float32) for n in names}
    kind, msg = _error(lambda: sess.run(None, feeds))
    assert kind == "InvalidArgument"
    assert f"{op}: input 1 ({names[1]}): expected a tensor of rank > " in msg, msg
    assert f"(attribute axis = {axis}), got rank 2" in msg, msg


# -- optimizers: one validation for every op ----------------------------------------------

def _optimizer_model(op, attrs):
    """One node of optimizer ``op`` for one float32 tensor of 4 elements, its state in the
    op's types, with ``attrs``; outputs typed as the op writes them."""
    f, u8, bf16 = TensorProto.FLOAT, TensorProto.UINT8, TensorProto.BFLOAT16
    groups = {
        "Adam": [("X", f, [4]), ("G", f, [4]), ("V", f, [4]), ("H", f, [4])],
        "AdamW": [("X", f, [4]), ("G", f, [4]), ("M", f, [4]), ("V", f, [4])],
        "Adam8bit": [("X", f, [4]), ("G", f, [4]), ("M_q", u8, [4]), ("M_absmax", f, [1]), ("V_q", u8, [4]),
                     ("V_absmax", f, [1])],
        "AdamBf16State": [("X", f, [4]), ("G", f, [4]), ("M", bf16, [4]), ("V", bf16, [4])],
        "Adagrad": [("X", f, [4]), ("G", f, [4]), ("H", f, [4])],
        "Momentum": [("X", f, [4]), ("G", f, [4]), ("V", f, [4])],
        "MixedPrecisionAdam": [("X", f, [4]), ("G", f, [4]), ("V", f, [4]), ("H", f, [4])],
    }
    groups["AdamW8bit"] = groups["Adam8bit"]
    groups["AdamWBf16State"] = groups["AdamBf16State"]
    g = groups[op]
    inputs = [_vi("R", f, [1]), _vi("T", I64, [1])]
    if op == "MixedPrecisionAdam":
        inputs.append(_vi("loss_scale", f, [1]))
    inputs += [_vi(f"{name}_1", t, s) for name, t, s in g]
    outputs = [_vi("finite", TensorProto.BOOL, [])] if op == "MixedPrecisionAdam" else []
    outputs += [_vi(f"{name}_1_new", t, s) for name, t, s in g if name != "G"]
    domain = TRAINING_DOMAIN if op in ("Adam", "Adagrad", "Momentum") else TRAINOPS_DOMAIN
    node = helper.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain=domain, **attrs)
    return _model([node], inputs, outputs, domains=(domain,))


ADAMW_OPS = ["AdamW", "AdamW8bit", "AdamWBf16State"]
TORCH = " (as torch.optim.AdamW)"


@pytest.mark.parametrize("op", ADAMW_OPS)
@pytest.mark.parametrize("attrs, name, expected", [
    (dict(beta1=1.0), "beta1", "expected a value in [0, 1)" + TORCH + ", got 1"),
    (dict(beta2=1.0), "beta2", "expected a value in [0, 1)" + TORCH + ", got 1"),
    (dict(beta1=1.5), "beta1", "expected a value in [0, 1)" + TORCH + ", got 1.5"),
    (dict(beta1=-0.1), "beta1", "expected a value in [0, 1)" + TORCH + ", got -0.1"),
    (dict(beta2=float("nan")), "beta2", "expected a value in [0, 1)" + TORCH + ", got NaN"),
    (dict(epsilon=-1e-3), "epsilon", "expected a value >= 0" + TORCH + ", got -0.001"),
    (dict(weight_decay=-0.5), "weight_decay", "expected a value >= 0" + TORCH + ", got -0.5"),
    (dict(maximize=2), "maximize", "expected 0 or 1, got 2"),
])
def test_every_adamw_variant_refuses_what_torch_refuses_naming_itself(make_session, op, attrs, name,
                                                                       expected):
    """AdamW8bit checked none of its attributes (beta1 = 1 turned every weight NaN after
    one step) and AdamWBf16State's errors named AdamW: one table and one check for all."""
    kind, msg = _error(lambda: make_session(_optimizer_model(op, attrs)))
    assert f"{op}: attribute '{name}': {expected}" in msg, msg
    assert kind in ("Fail", "InvalidArgument", "RuntimeException")


@pytest.mark.parametrize("op, why", [("AdamW8bit", "8-bit"), ("AdamWBf16State", "bfloat16")])
def test_amsgrad_is_refused_by_the_variants_without_it(make_session, op, why):
    _, msg = _error(lambda: make_session(_optimizer_model(op, {"amsgrad": 1})))
    want = f"{op}: attribute 'amsgrad': amsgrad is not supported with {why} state (use com.trainops::AdamW)"
    assert want in msg, msg


@pytest.mark.parametrize("op", ["Adam", "Adam8bit", "AdamBf16State", "MixedPrecisionAdam"])
@pytest.mark.parametrize("attrs, name, expected", [
    (dict(alpha=1.0), "alpha", "expected a value in [0, 1), got 1"),
    (dict(beta=1.5), "beta", "expected a value in [0, 1), got 1.5"),
    (dict(epsilon=float("inf")), "epsilon", "expected a finite value >= 0, got inf"),
    (dict(norm_coefficient=-0.1), "norm_coefficient", "expected a finite value >= 0, got -0.1"),
    (dict(norm_coefficient_post=float("nan")), "norm_coefficient_post",
     "expected a finite value >= 0, got NaN"),
])
def test_every_adam_variant_refuses_what_breaks_its_math(make_session, op, attrs, name, expected):
    _, msg = _error(lambda: make_session(_optimizer_model(op, attrs)))
    assert f"{op}: attribute '{name}': {expected}" in msg, msg


@pytest.mark.parametrize("op, attrs, name", [
    ("Adagrad", dict(decay_factor=float("nan")), "decay_factor"),
    ("Adagrad", dict(epsilon=float("inf")), "epsilon"),
    ("Momentum", dict(alpha=0.9, beta=float("-inf"), mode="standard", norm_coefficient=0.0), "beta"),
])
def test_adagrad_and_momentum_refuse_non_finite_values(make_session, op, attrs, name):
    _, msg = _error(lambda: make_session(_optimizer_model(op, attrs)))
    assert f"{op}: attribute '{name}': expected a finite value, got" in msg, msg


def test_adamw8bit_at_the_edges_of_its_ranges_still_steps(make_session):
    """beta1 = 0, epsilon = 0, weight_decay = 0 are torch's closed ends: accepted."""
    sess = make_session(_optimizer_model("AdamW8bit", dict(beta1=0.0, epsilon=0.0, weight_decay=0.0)))
    feeds = {"R": np.array([0.1], np.float32), "T": np.array([1], np.int64),
             "X_1": np.ones(4, np.float32), "G_1": np.full(4, 0.5, np.float32),
             "M_q_1": np.zeros(4, np.uint8), "M_absmax_1": np.zeros(1, np.float32),
             "V_q_1": np.zeros(4, np.uint8), "V_absmax_1": np.zeros(1, np.float32)}
    x_new = sess.run(None, feeds)[0]
    assert np.all(np.isfinite(x_new)) and np.all(x_new < 1.0)


# -- shape inference ----------------------------------------------------------------------

def test_unknown_dimensions_are_named_per_node(make_session):
    """Two MaxPoolGrad nodes whose outputs' spatial sizes differ: each unknown dimension
    has a name of its node's own (a name per op made ONNX Runtime's planner take the two
    sizes for one); the results are the scatter of dY at Indices."""
    nodes = [helper.make_node("MaxPoolGrad", [f"dY{k}", f"I{k}", f"S{k}"], [f"dX{k}"], domain=TRAINOPS_DOMAIN)
             for k in range(2)]
    inputs = [_vi(f"dY{k}", F, [1, 2, 2, 2]) for k in range(2)]
    inputs += [_vi(f"I{k}", I64, [1, 2, 2, 2]) for k in range(2)]
    inputs += [_vi(f"S{k}", I64, [4]) for k in range(2)]
    sess = make_session(_model(nodes, inputs, [_vi(f"dX{k}", F, None) for k in range(2)]))
    shapes = [o.shape for o in sess.get_outputs()]
    assert shapes[0][:2] == [1, 2] and shapes[1][:2] == [1, 2], shapes
    unknown = [d for s in shapes for d in s[2:]]
    assert all(isinstance(d, str) for d in unknown) and len(set(unknown)) == 4, shapes
    rng = np.random.default_rng(3)
    feeds, want = {}, []
    for k, (h, w) in enumerate([(4, 4), (6, 5)]):
        gy = rng.standard_normal((1, 2, 2, 2)).astype(np.float32)
        picks = [p * h * w + rng.choice(h * w, 4, replace=False) for p in range(2)]
        idx = np.stack(picks).reshape(1, 2, 2, 2)
        gx = np.zeros(2 * h * w)
        np.add.at(gx, idx.ravel(), gy.ravel().astype(np.float64))
        feeds.update({f"dY{k}": gy, f"I{k}": idx.astype(np.int64), f"S{k}": np.array([1, 2, h, w], np.int64)})
        want.append(gx.reshape(1, 2, h, w).astype(np.float32))
    got = sess.run(None, feeds)
    assert all(same_bits(g, w) for g, w in zip(got, want))


def test_no_dimension_known_leaves_the_output_unset_not_a_scalar(make_session):
    """ConvInputGrad with dY of unknown rank once declared its output a scalar, and a
    Transpose of 4 axes reading it failed the session's creation."""
    nodes = [helper.make_node("ConvInputGrad", ["dY", "W", "X_shape"], ["dX"], domain=TRAINOPS_DOMAIN),
             helper.make_node("Transpose", ["dX"], ["T"], perm=[0, 1, 3, 2])]
    model = _model(nodes, [_vi("dY", F, None), _vi("W", F, [1, 1, 1, 1]), _vi("X_shape", I64, [4])],
                   [_vi("T", F, None)])
    sess = make_session(model)
    dy = np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)
    (t,) = sess.run(None, {"dY": dy, "W": np.full((1, 1, 1, 1), 2.0, np.float32),
                           "X_shape": np.array([1, 1, 2, 3], np.int64)})
    assert same_bits(t, (2.0 * dy).transpose(0, 1, 3, 2))

