"""trainops.autodiff.simplify_graph: the exact clean-up of the step graph's nodes. Each
rewrite on a small graph: onnxruntime's outputs bit for bit the same before and after
(with -0.0, NaN and infinities among the values), the node counts it must reach, and a
second call changing nothing; then the Trainer with and without the pass, bit for bit,
on every bench family and on a zoo model with static shapes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.checks import same_bits
from trainops.autodiff.simplify_graph import simplify_backward, step_shapes
from trainops.onnx_defs import IR_VERSION

n = helper.make_node
rng = np.random.default_rng(3)


def _const(name, value):
    return n("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _ints(name, values):
    return _const(name, np.asarray(values, np.int64))


def _special(shape, dtype=np.float32):
    x = rng.standard_normal(shape).astype(dtype).reshape(-1)
    x[:4] = [-0.0, np.nan, np.inf, -np.inf][: min(4, x.size)]
    return x.reshape(shape)


def _model(nodes, inputs, outputs):
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
                                       for k, v in inputs.items()],
                          [helper.make_empty_tensor_value_info(o) for o in outputs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m


def _run(m, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _simplified(nodes, inputs, outputs):
    """The model, the simplified model, and the simplified node list."""
    m = _model(nodes, inputs, outputs)
    out = simplify_backward(list(m.graph.node), step_shapes(m, list(m.graph.node)), set(outputs))
    again = simplify_backward(out, step_shapes(m, out), set(outputs))
    assert [x.SerializeToString() for x in again] == [x.SerializeToString() for x in out]
    s = _model(out, inputs, outputs)
    assert same_bits(_run(m, inputs), _run(s, inputs))
    return out


def _ops(nodes):
    return [x.op_type for x in nodes if x.op_type != "Constant"]


def test_transposes_cancel_and_compose():
    x = {"x": _special((2, 3, 4))}
    nodes = [n("Transpose", ["x"], ["a"], perm=[1, 2, 0]),
             n("Transpose", ["a"], ["b"], perm=[2, 0, 1]),   # cancels: x
             n("Relu", ["b"], ["y0"]),
             n("Transpose", ["x"], ["c"], perm=[1, 0, 2]),
             n("Transpose", ["c"], ["d"], perm=[0, 2, 1]),   # one Transpose (c read once)
             n("Transpose", ["d"], ["e"], perm=[0, 1, 2]),   # identity permutation
             n("Sigmoid", ["e"], ["y1"]),
             # a is read twice, then (b gone) once: the pair becomes one Transpose
             n("Transpose", ["a"], ["y2"], perm=[0, 2, 1])]
    out = _simplified(nodes, x, ["y0", "y1", "y2"])
    assert _ops(out) == ["Relu", "Transpose", "Sigmoid", "Transpose"]
    y2 = next(o for o in out if o.output[0] == "y2")
    assert list(y2.input) == ["x"] and y2.attribute[0].ints == [1, 0, 2]
    assert next(o for o in out if o.op_type == "Relu").input[0] == "x"
    d = next(o for o in out if o.output[0] == "d")
    assert list(d.input) == ["x"] and d.attribute[0].ints == [1, 2, 0]
    assert next(o for o in out if o.op_type == "Sigmoid").input[0] == "d"


def test_reshape_chains_and_squeeze_pairs():
    x = {"x": _special((2, 3, 4))}
    nodes = [_ints("s1", [6, 4]), _ints("s2", [4, -1]), _ints("s3", [2, 3, 4]), _ints("ax", [1]),
             n("Reshape", ["x", "s1"], ["a"]),
             n("Reshape", ["a", "s2"], ["y0"]),       # reads x directly
             n("Reshape", ["x", "s3"], ["b"]),        # to its own shape: x
             n("Unsqueeze", ["b", "ax"], ["c"]),
             n("Squeeze", ["c", "ax"], ["d"]),        # the pair cancels: x
             n("Exp", ["d"], ["y1"]),
             _ints("ax0", [0]),
             n("Reshape", ["x", "s1"], ["e"]),
             n("Unsqueeze", ["e", "ax0"], ["f"]),
             n("Squeeze", ["f", "ax0"], ["g"]),
             n("Neg", ["g"], ["y2"])]
    out = _simplified(nodes, x, ["y0", "y1", "y2"])
    assert _ops(out) == ["Reshape", "Exp", "Reshape", "Neg"]
    assert next(o for o in out if o.op_type == "Exp").input[0] == "x"
    assert next(o for o in out if "y0" in o.output).input[0] == "x"


def test_reductions_over_size_one_axes_and_expand():
    """Integer reductions over size-1 axes go; float ones stay (onnxruntime's kernel turns
    the -0.0 of x into +0.0 there, which the tests of _simplified would catch)."""
    x = {"x": _special((3, 1, 4, 1))}
    nodes = [_ints("a13", [1, 3]), _ints("a1", [-3]), _ints("none", []), _ints("shape", [3, 1, 4, 1]),
             _ints("grow", [2, 3, 1, 4, 1]),
             n("ReduceSum", ["x", "a13"], ["y0"], keepdims=1),
             n("ReduceSum", ["x", "a1"], ["y1"], keepdims=0),       # a Squeeze
             n("ReduceSum", ["x", "none"], ["nz"], noop_with_empty_axes=1),  # x
             n("Sigmoid", ["nz"], ["y2"]),
             n("ReduceMean", ["x"], ["y3"], axes=[1], keepdims=1),
             n("Expand", ["x", "shape"], ["y4"]),
             n("Expand", ["x", "grow"], ["y5"]),                    # a new axis: kept
             n("ReduceSum", ["x", "a13"], ["r"], keepdims=1),
             n("Abs", ["r"], ["y6"]),
             n("ReduceSum", ["x"], ["y7"], keepdims=1),            # over size-3 and 4 axes
             n("Cast", ["x"], ["xi"], to=TensorProto.INT32),
             n("ReduceSum", ["xi", "a13"], ["ri"], keepdims=1),
             n("Neg", ["ri"], ["ni"]),
             n("ReduceMean", ["xi"], ["rm"], axes=[-1], keepdims=0),
             n("Cast", ["ni"], ["y8"], to=TensorProto.FLOAT),
             n("Cast", ["rm"], ["y9"], to=TensorProto.FLOAT)]
    x["x"] = np.where(np.isfinite(x["x"]), x["x"] * 100, 0).astype(np.float32)
    x["x"].reshape(-1)[0] = -0.0
    out = _simplified(nodes, x, [f"y{i}" for i in range(10)])
    assert _ops(out) == ["ReduceSum", "ReduceSum", "Sigmoid", "ReduceMean", "Expand",
                         "Expand", "ReduceSum", "Abs", "ReduceSum", "Cast", "Neg", "Squeeze",
                         "Cast", "Cast"]
    assert next(o for o in out if o.op_type == "Neg").input[0] == "xi"
    assert next(o for o in out if o.op_type == "Sigmoid").input[0] == "x"


def test_shape_chains_fold_to_constants():
    x = {"x": _special((2, 3, 4))}
    nodes = [n("Shape", ["x"], ["s"]), _ints("i0", 0), _ints("ax", [0]), _ints("m1", [-1]),
             n("Gather", ["s", "i0"], ["b"], axis=0),
             n("Unsqueeze", ["b", "ax"], ["bu"]),
             n("Concat", ["bu", "m1"], ["t"], axis=0),
             n("Reshape", ["x", "t"], ["y0"]),
             n("Size", ["x"], ["z"]),
             n("Cast", ["z"], ["y1"], to=TensorProto.FLOAT)]       # a float: not folded
    out = _simplified(nodes, x, ["y0", "y1"])
    assert _ops(out) == ["Reshape", "Cast"]
    target = next(o for o in out if o.output[0] == "t")
    assert numpy_helper.to_array(target.attribute[0].t).tolist() == [2, -1]


def test_identity_arithmetic_and_identity_nodes():
    x = {"x": _special((2, 3))}
    ones = np.ones((1, 3), np.float32)
    nodes = [_const("one", ones), _const("negz", np.array(-0.0, np.float32)),
             _const("posz", np.array(0.0, np.float32)), _ints("sh", [2, 3]),
             _const("big", np.ones((4, 2, 3), np.float32)),
             n("ConstantOfShape", ["sh"], ["cos"], value=numpy_helper.from_array(np.ones(1, np.float32))),
             n("Mul", ["x", "one"], ["a"]),
             n("Mul", ["cos", "a"], ["b"]),
             n("Div", ["b", "one"], ["c"]),
             n("Add", ["c", "negz"], ["d"]),
             n("Sub", ["d", "posz"], ["e"]),
             n("Identity", ["e"], ["f"]),
             n("Relu", ["f"], ["y0"]),
             n("Add", ["x", "posz"], ["y1"]),        # -0.0 + 0.0 is +0.0: kept
             n("Mul", ["x", "big"], ["y2"]),         # broadcasts x to [4, 2, 3]: kept
             n("Identity", ["x"], ["y3"])]           # an output: kept
    out = _simplified(nodes, x, ["y0", "y1", "y2", "y3"])
    assert _ops(out) == ["Relu", "Add", "Mul", "Identity"]
    assert next(o for o in out if o.op_type == "Relu").input[0] == "x"


def test_loss_log_prob_replaces_the_gradient_log_softmax():
    """The SoftmaxCrossEntropyLoss gradient's LogSoftmax of the scores is the loss node's
    log_prob output: bit for bit onnxruntime's LogSoftmax (scores with -0.0, inf, NaN)."""
    x = {"x": _special((5, 7))}
    x["x"][1, :] = [-np.inf] + [0.0] * 6
    g = helper.make_graph(
        [n("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss"]),
         n("LogSoftmax", ["x"], ["lp"], axis=1), n("Exp", ["lp"], ["p"]),
         n("LogSoftmax", ["x"], ["lp0"], axis=0)],  # another axis: kept
        "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 7]),
              helper.make_tensor_value_info("t", TensorProto.INT64, [5])],
        [helper.make_empty_tensor_value_info(o) for o in ("loss", "p", "lp0")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    out = simplify_backward(list(m.graph.node), step_shapes(m, list(m.graph.node)),
                            {"loss", "p", "lp0"})
    assert [o.op_type for o in out] == ["SoftmaxCrossEntropyLoss", "Exp", "LogSoftmax"]
    assert list(out[0].output) == ["loss", "lp"]
    s = helper.make_model(helper.make_graph(out, "t", list(g.input), list(g.output)),
                          opset_imports=[helper.make_opsetid("", 17)])
    s.ir_version = IR_VERSION
    feeds = dict(x, t=np.array([0, 3, 6, 2, 1], np.int64))
    assert same_bits(_run(m, feeds), _run(s, feeds))


def test_dead_nodes_go_and_kept_values_stay():
    x = {"x": _special((2, 3))}
    nodes = [n("Exp", ["x"], ["unused"]), n("Neg", ["unused"], ["unused2"]),
             n("Relu", ["x"], ["y0"]), n("Abs", ["x"], ["kept"]), n("Sigmoid", ["x"], ["y1"])]
    m = _model(nodes, x, ["y0", "y1"])
    out = simplify_backward(list(m.graph.node), step_shapes(m, list(m.graph.node)),
                            {"y0", "y1", "kept"})
    assert _ops(out) == ["Relu", "Abs", "Sigmoid"]


# -- the Trainer, with and without the pass ------------------------------------------------

def _no_pass(nodes, *args, **kwargs):
    return list(nodes)


@pytest.mark.parametrize("name", ["mlp", "bncnn", "transformer", "gru", "resnet"])
def test_trainer_steps_are_bitwise_the_unsimplified_ones(library_path, monkeypatch, name):
    import trainops.train.backward as tb
    from trainops import Trainer, optim
    from trainops.bench.train_models import family

    fam = family(name, 2)

    def make():
        return Trainer(fam.model, "loss", optim.Adam(lr=1e-3), params=fam.params, threads=1)

    simple = make()
    monkeypatch.setattr(tb, "simplify_backward", _no_pass)
    plain = make()
    assert len(simple.training_model.graph.node) <= len(plain.training_model.graph.node)
    for _ in range(3):
        assert same_bits(simple.step(fam.feeds), plain.step(fam.feeds))
    for k, v in plain.parameters().items():
        assert same_bits(simple.parameters()[k], v), k


def test_zoo_model_steps_are_bitwise_the_unsimplified_ones(library_path, monkeypatch,
                                                           standard_grads):
    """Static shapes (squeezenet as shipped): the shape chains fold, bit for bit (the
    standard-op backward: the Shape/Concat chains of its Reshapes and Expands)."""
    import trainops.train.backward as tb
    from helpers.zoo import light_model
    from trainops import Trainer, losses, optim

    model, logits, data, shape = light_model("squeezenet")

    def make():
        return Trainer(model, losses.cross_entropy(logits), optim.Adam(lr=1e-4), seed=0)

    simple = make()
    monkeypatch.setattr(tb, "simplify_backward", _no_pass)
    plain = make()
    ops = [x.op_type for x in simple.training_model.graph.node]
    before = [x.op_type for x in plain.training_model.graph.node]
    assert len(ops) < len(before) and ops.count("Shape") < before.count("Shape")
    assert ops.count("Concat") < before.count("Concat")
    label_vi = next(i for i in plain.training_model.graph.input if i.name == "labels")
    labels = np.full([d.dim_value for d in label_vi.type.tensor_type.shape.dim], 7, np.int64)
    feeds = {data: np.random.default_rng(1).standard_normal(shape).astype(np.float32),
             "labels": labels}
    for _ in range(2):
        assert same_bits(simple.step(feeds), plain.step(feeds))
    for k, v in plain.parameters().items():
        assert same_bits(simple.parameters()[k], v), k
