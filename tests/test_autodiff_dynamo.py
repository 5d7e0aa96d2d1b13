"""Graphs as torch's dynamo exporter writes them: Constants in every attribute form
(``value_ints``, ``value_float``, ...), ``CastLike``, and Casts from a type to itself.

- :func:`trainops.autodiff.constants.constant_value` against onnx.reference's Constant
  (onnxruntime's for ``sparse_value``), and every reader of Constants (the Builder's
  constant axes, the shape folder, the step-graph simplifier, the float16 rewrite) given
  the non-``value`` forms;
- CastLike's gradient against numpy exactly (a cast back of the cotangent: no rounding
  but the one Cast); its ``target_type`` input out of the dependency walks;
- no Cast from a type to itself in an emitted backward: onnxruntime removes such a Cast,
  and where it comes before the ``Div(1, b)`` of a ``Mul(cast, Div(1, b))`` (Dropout's
  gradient scale) the removal leaves the Mul naming the removed output, an invalid model
  (onnxruntime 1.17.3 and 1.32.0; T5's classic export hit it);
- ``python -m trainops coverage`` failing with the Trainer's own error where every op type
  has a rule but the Trainer refuses the model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import AttributeProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from helpers.gradcheck import check, make_model, session
from helpers.rounding import gamma
from trainops import Trainer
from trainops.__main__ import main as cli
from trainops.autodiff import Builder, GradientError, expand_gradients, infer
from trainops.autodiff.constants import constant_type, constant_value
from trainops.autodiff.coverage import coverage, path_nodes
from trainops.autodiff.fold import fold_shape_constants
from trainops.autodiff.simplify_graph import simplify_backward, step_shapes
from trainops.onnx_defs import TRAINING_DOMAIN
from trainops.train.fp16 import to_fp16_graph

F32, F64, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64
rng = np.random.default_rng(5)


def node(op, ins, outs, **kw):
    return helper.make_node(op, list(ins), list(outs), **kw)


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def constant(out, name, value, attr_type=None):
    """A Constant node with ``value`` in attribute ``name`` (an empty list needs its
    ``attr_type``, which make_attribute cannot infer)."""
    n = helper.make_node("Constant", [], [out], name=f"const_{out}")
    if attr_type is not None:
        n.attribute.append(AttributeProto(name=name, type=attr_type))
    else:
        n.attribute.append(helper.make_attribute(name, value))
    return n


# --- Constant in every form -------------------------------------------------------------

FORMS = [
    ("value", numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "v"), None),
    ("value", numpy_helper.from_array(np.array(3, np.int32), "v"), None),
    ("value_float", 1.5, None),
    ("value_floats", [1.5, -2.25, 1e-3], None),
    ("value_floats", [], AttributeProto.FLOATS),
    ("value_int", -7, None),
    ("value_ints", [3, -1, 2 ** 40], None),
    ("value_ints", [], AttributeProto.INTS),
    ("value_string", "abc", None),
    ("value_strings", ["a", "bc"], None),
]


@pytest.mark.parametrize("name,value,attr_type", FORMS)
def test_constant_value_is_onnx_reference_constant(name, value, attr_type):
    n = constant("c", name, value, attr_type)
    m = helper.make_model(helper.make_graph([n], "c", [], [helper.make_empty_tensor_value_info("c")]),
                          opset_imports=[helper.make_opsetid("", 17)])
    want = ReferenceEvaluator(m).run(None, {})[0]
    got = constant_value(n)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_array_equal(got, want)
    strings = name in ("value_string", "value_strings")
    assert constant_type(n) == (TensorProto.STRING if strings else
                                helper.np_dtype_to_tensor_dtype(want.dtype))


@pytest.mark.parametrize("coordinates", [False, True])
def test_sparse_constant_is_onnxruntime_dense_value(coordinates):
    values = numpy_helper.from_array(np.array([1.5, -2.0, 4.0], np.float32), "vals")
    flat = np.array([1, 3, 5], np.int64)
    idx = np.stack(np.unravel_index(flat, (2, 3)), axis=1) if coordinates else flat
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(idx, "idx"), [2, 3])
    n = helper.make_node("Constant", [], ["c"], sparse_value=sparse)
    # read by a dense op (as an output onnxruntime returns the sparse tensor itself)
    m = make_model([n, node("Identity", ["c"], ["d"])], [], [vi("d", F32, [2, 3])])
    want = session(m).run(None, {})[0]
    got = constant_value(n)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_array_equal(got, want)
    assert constant_type(n) == F32


def test_malformed_constant_names_the_node():
    n = helper.make_node("Constant", [], ["c"], name="k", value_int=1, value_float=2.0)
    with pytest.raises(ValueError, match=r"Constant node 'k' \(output 'c'\): .* exactly one "
                                         r".*; it has value_(int|float), value_(float|int)$"):
        constant_value(n)
    bad = helper.make_node("Constant", [], ["c"], name="k")
    bad.attribute.append(helper.make_attribute("value_ints", 1.0))  # a FLOAT, not INTS
    with pytest.raises(ValueError, match=r"'value_ints' should be of type INTS, it is FLOAT"):
        constant_value(bad)


@pytest.mark.parametrize("op,opset", [("ReduceMean", 18), ("ReduceSum", 13)])
def test_reduction_axes_from_value_ints(op, opset):
    """The dynamo exporter's ReduceMean(x, Constant(value_ints=[-1])): a rule that needs
    constant axes reads them (it said 'must be a constant' before)."""
    check([constant("axes", "value_ints", [-1]), node(op, ["x", "axes"], ["y"], keepdims=1)],
          {"x": rng.standard_normal((3, 4))}, ["x"], opset=opset)


def test_fold_reads_value_int_and_value_ints():
    nodes = [constant("a", "value_int", 2), constant("b", "value_ints", [3, 4]),
             node("Mul", ["a", "b"], ["shape"]), node("Reshape", ["x", "shape"], ["y"])]
    m = make_model(nodes, [vi("x", F32, [48])], [vi("y", F32, None)])
    want = ReferenceEvaluator(m).run(None, {"x": np.zeros(48, np.float32)})[0].shape
    assert fold_shape_constants(m) == 1
    folded = m.graph.node[2]
    assert folded.op_type == "Constant" and folded.output[0] == "shape"
    assert list(constant_value(folded)) == list(want) == [6, 8]


def test_simplifier_reads_value_float():
    """``x * Constant(value_float=1)`` is x (aliased away); ``* 2`` stays."""
    nodes = [constant("one", "value_float", 1.0), constant("two", "value_floats", [2.0]),
             node("Mul", ["x", "one"], ["a"]), node("Mul", ["a", "two"], ["b"]),
             node("Relu", ["b"], ["y"])]
    m = make_model(nodes, [vi("x", F32, [3])], [vi("y", F32, [3])])
    out = simplify_backward(nodes, step_shapes(m, nodes), keep={"y"})
    assert [n.op_type for n in out] == ["Constant", "Mul", "Relu"]
    assert list(out[1].input) == ["x", "two"]


def test_float16_rewrite_converts_value_float_constants():
    nodes = [constant("s", "value_float", 0.1), constant("v", "value_floats", [0.1, 3.0]),
             constant("i", "value_ints", [1]),
             node("Mul", ["x", "s"], ["a"]), node("Mul", ["a", "v"], ["y"])]
    g = make_model(nodes, [vi("x", F32, [2])], [vi("y", F32, [2])]).graph
    to_fp16_graph(g, [], ["x"])
    got = {n.output[0]: constant_value(n) for n in g.node if n.op_type == "Constant"}
    assert got["s"].dtype == np.float16 and got["s"] == np.float16(np.float32(0.1))
    np.testing.assert_array_equal(got["v"], np.array([0.1, 3.0], np.float32).astype(np.float16))
    assert got["i"].dtype == np.int64  # not a float: as it was


# --- CastLike ---------------------------------------------------------------------------

def _gradient_model(nodes, inputs, inits, loss, xs):
    g = helper.make_node("Gradient", xs, [f"d_{x}" for x in xs], name="grad",
                         domain=TRAINING_DOMAIN, xs=xs, y=loss)
    outs = [vi(f"d_{x}", F32, None) for x in xs]
    return make_model(list(nodes) + [g], inputs, outs, inits, opset=17)


@pytest.mark.parametrize("target", [np.float64, np.float32, np.int64])
def test_cast_like_gradient_is_the_cotangent_cast_back(target):
    """loss = sum(float(CastLike(x, t)) * R): d x = R cast to x's type, exactly (the one
    rounding numpy's astype also makes); an integer target stops the gradient: zeros."""
    x = rng.standard_normal((3, 4)).astype(np.float32)
    R = rng.standard_normal((3, 4))
    tt = helper.np_dtype_to_tensor_dtype(np.dtype(target))
    nodes = [node("CastLike", ["x", "t"], ["u"]), node("Cast", ["u"], ["u64"], to=F64),
             node("Mul", ["u64", "R"], ["v"]), node("ReduceSum", ["v"], ["loss"], keepdims=0)]
    m = _gradient_model(nodes, [vi("x", F32, [3, 4]), vi("t", tt, [1])],
                        [numpy_helper.from_array(R, "R")], "loss", ["x"])
    expanded = expand_gradients(m)
    got = session(expanded).run(["d_x"], {"x": x, "t": np.zeros(1, target)})[0]
    want = np.zeros_like(x) if target == np.int64 else R.astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    _assert_no_identity_cast(expanded, nodes)


def _attention_scale(scale_op):
    """q = x @ W; y = q * scale_op(CastLike(0.25, q)), the dynamo exporter's attention
    scale (a constant cast to q's type); loss = sum(y)."""
    nodes = [node("MatMul", ["x", "W"], ["q"]), constant("d", "value_float", 0.25),
             node("CastLike", ["d", "q"], ["dq"]), node(scale_op, ["dq"], ["s"]),
             node("Mul", ["q", "s"], ["y"]), node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    W = rng.standard_normal((4, 3)).astype(np.float32)
    return nodes, W


@pytest.mark.parametrize("scale_op", ["Sqrt", "Acos"])
def test_cast_like_target_is_out_of_the_walks(scale_op):
    """The scale depends on W only through CastLike's target_type, i.e. not at all: the
    coverage walk leaves CastLike and the scale's ops out (an Acos without a rule
    included), and the backward differentiates q * s with s a constant."""
    nodes, W = _attention_scale(scale_op)
    m = _gradient_model(nodes, [vi("x", F32, [2, 4])], [numpy_helper.from_array(W, "W")],
                        "loss", ["W"])
    types = {v.name: v.type.tensor_type.elem_type for v in infer(m).graph.value_info}
    assert [n.op_type for n in path_nodes(m.graph, "loss", ["W"], types)] == \
        ["MatMul", "Mul", "ReduceSum"]
    assert all(r.rule for r in coverage(m, "loss", ["W"]))
    m.graph.output.append(vi("s", F32, []))
    x = rng.standard_normal((2, 4)).astype(np.float32)
    got, s = session(expand_gradients(m)).run(["d_W", "s"], {"x": x})
    # d W = x^T @ (ones * s): two products summed per element, float32 against float64
    terms = np.abs(x.astype(np.float64)).T @ np.full((2, 3), abs(float(s)))
    want = x.astype(np.float64).T @ np.full((2, 3), float(s))
    assert np.all(np.abs(got - want) <= gamma(3) * terms)


# --- no identity Cast in a backward -----------------------------------------------------

def _assert_no_identity_cast(model, forward):
    """No Cast of ``model``'s backward (its nodes but those writing ``forward``'s outputs)
    converts a tensor to the type it has."""
    skip = {o for n in forward for o in n.output}
    inferred = infer(model).graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(inferred.value_info) + list(inferred.input) + list(inferred.output)}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    for n in model.graph.node:
        if n.op_type == "Cast" and n.output[0] not in skip:
            to = next(a.i for a in n.attribute if a.name == "to")
            assert types.get(n.input[0]) != to, f"{n.name}: a Cast of {n.input[0]} to its type"


def test_builder_emits_no_cast_to_the_same_type():
    g = helper.make_graph([], "g", [vi("x", F32, [2]), vi("h", TensorProto.FLOAT16, [2])], [])
    b = Builder(g, 17)
    assert b.op("Cast", ["x"], to=F32) == "x" and b.nodes == []
    y = b.op("Cast", ["x"], to=F64)
    assert len(b.nodes) == 1 and b.op("Cast", [y], to=F64) == y  # its type is known now
    assert b.op("Cast", ["h"], to=F32) != "h"


def test_backward_of_same_type_casts_has_no_cast():
    """Cast(x, float), CastLike(., x) and a Cast to double and back: only the last two
    change a type, so the backward holds only their two Casts back."""
    nodes = [node("Cast", ["x"], ["a"], to=F32), node("CastLike", ["a", "x"], ["b"]),
             node("Cast", ["b"], ["c"], to=F64), node("Mul", ["c", "R"], ["d"]),
             node("Cast", ["d"], ["e"], to=F32), node("ReduceSum", ["e"], ["loss"], keepdims=0)]
    R = rng.standard_normal(5)
    m = _gradient_model(nodes, [vi("x", F32, [5])], [numpy_helper.from_array(R, "R")],
                        "loss", ["x"])
    expanded = expand_gradients(m)
    _assert_no_identity_cast(expanded, nodes)
    backward = expanded.graph.node[len(nodes):]
    assert sum(n.op_type == "Cast" for n in backward) == 2
    got = session(expanded).run(["d_x"], {"x": np.ones(5, np.float32)})[0]
    np.testing.assert_array_equal(got, R.astype(np.float32))  # 1 * R exactly, cast once


def _t5_like(ratio):
    """A Dropout in training mode, then T5's `hidden.to(float32)` of a float32 tensor:
    the Cast's gradient comes before Dropout's Mul(it, Div(1, 1 - ratio)), the pattern
    onnxruntime breaks when it removes the Cast."""
    W = rng.standard_normal((4, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(W, "W"),
             numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "training")]
    nodes = [node("MatMul", ["x", "W"], ["h"]),
             node("Dropout", ["h", "ratio", "training"], ["d", "mask"]),
             node("Cast", ["d"], ["y"], to=F32), node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    return nodes, inits, W


def test_t5_like_backward_runs_with_onnxruntime_optimisations():
    """onnxruntime's default graph optimisations (ORT_ENABLE_ALL) accept the backward, and
    d W = x^T @ (mask / (1 - ratio)) up to the float32 rounding of that product."""
    nodes, inits, W = _t5_like(0.25)
    m = _gradient_model(nodes, [vi("x", F32, [6, 4])], inits, "loss", ["W"])
    m.graph.output.append(vi("mask", TensorProto.BOOL, [6, 3]))
    expanded = expand_gradients(m)
    so = ort.SessionOptions()
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    x = rng.standard_normal((6, 4)).astype(np.float32)
    got, mask = ort.InferenceSession(expanded.SerializeToString(), so,
                                     providers=["CPUExecutionProvider"]).run(
        ["d_W", "mask"], {"x": x})
    _assert_no_identity_cast(expanded, nodes)
    g = mask / (1 - np.float64(np.float32(0.25)))
    want = x.astype(np.float64).T @ g
    # the scale and the product round once each, then 6 products are summed
    assert np.all(np.abs(got - want) <= gamma(6 + 2) * (np.abs(x.astype(np.float64)).T @ g))


def test_t5_like_model_trains(library_path):
    """The Trainer's session (its PhiloxDropout, onnxruntime's default optimisations)
    builds; with ratio 0 the first step's loss is the plain forward's."""
    nodes, inits, W = _t5_like(0.0)
    m = make_model(nodes, [vi("x", F32, [6, 4])], [vi("loss", F32, [])], inits)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    want = x.astype(np.float64) @ W.astype(np.float64)
    bound = gamma(4 + 18) * float(np.sum(np.abs(x.astype(np.float64)) @ np.abs(W)))
    loss = Trainer(m, "loss", seed=0, threads=1).step({"x": x})
    assert abs(loss - want.sum()) <= bound


# --- the coverage command builds the Trainer ----------------------------------------------

def _reduce_mean_model(axes_node):
    """x @ W, ReduceMean over axes (a Constant, or an input known only at run time), sum."""
    nodes = [node("MatMul", ["x", "W"], ["h"]), node("ReduceMean", ["h", "axes"], ["r"]),
             node("ReduceSum", ["r"], ["loss"], keepdims=0)]
    inputs = [vi("x", F32, [2, 4])]
    if axes_node:
        nodes.insert(0, constant("axes", "value_ints", [-1]))
    else:
        inputs.append(vi("axes", I64, [1]))
    W = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    m = make_model(nodes, inputs, [vi("loss", F32, [])], [W], opset=18)
    return m


def test_coverage_fails_with_the_trainers_error(library_path, tmp_path, capsys):
    """Every op type has a rule, but ReduceMean's rule needs constant axes: the command
    prints its table, then the Trainer's error, and exits 1; with the axes a
    Constant(value_ints) it exits 0."""
    bad = tmp_path / "bad.onnx"
    onnx.save(_reduce_mean_model(axes_node=False), str(bad))
    with pytest.raises(GradientError) as refused:
        Trainer(str(bad), "loss", seed=0, threads=1)
    assert cli(["coverage", str(bad), "--loss", "loss"]) == 1
    out, err = capsys.readouterr()
    assert "ReduceMean" in out and "NO RULE" not in out
    assert out.splitlines()[-1] == "3 of 3 op types have a gradient rule"
    assert err == f"error: trainops.Trainer refuses the model: {refused.value}\n"
    assert "must be a constant" in err

    good = tmp_path / "good.onnx"
    onnx.save(_reduce_mean_model(axes_node=True), str(good))
    assert cli(["coverage", str(good), "--loss", "loss"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[-1] == "3 of 3 op types have a gradient rule"
