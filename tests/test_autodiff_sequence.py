"""Tensor sequences (SplitToSequence, SequenceAt, SequenceConstruct, ConcatFromSequence,
SequenceLength, SequenceEmpty/Insert/Erase) as torch's dynamo exporter writes them:
trainops.autodiff.sequences rewrites those whose elements are known statically into
Split/Concat/Identity when a model is imported. Checked: the rewritten graph computes
what the sequence ops computed (onnxruntime, bit for bit: copies and slices), gradients
through it against central finite differences of the original forward graph
(helpers.gradcheck), the sequences it must leave alone, the refusal of a gradient through
one of those, and a Trainer run of a tiny gated model against numpy float64."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.gradcheck import check, make_model, session
from trainops.autodiff import GradientError, expand_gradients
from trainops.autodiff.sequences import unsequence
from trainops.onnx_defs import TRAINING_DOMAIN

rng = np.random.default_rng(7)
OPSETS = [13, 17]


def node(op, ins, outs=("y",), **kw):
    return helper.make_node(op, list(ins), list(outs), name=f"{op}_{outs[0]}", **kw)


def ints(name, values):
    return helper.make_node("Constant", [], [name], name=name,
                            value=numpy_helper.from_array(np.asarray(values, np.int64), name))


def gpt2_qkv(split, axis=2, keepdims=None, positions=(0, 1, 2)):
    """x -> SplitToSequence -> SequenceAt at ``positions`` -> q * k + v (GPT-2's c_attn)."""
    kw = {} if keepdims is None else {"keepdims": keepdims}
    nodes = [node("SplitToSequence", ["x"] + (["s"] if split is not None else []), ["seq"],
                  axis=axis, **kw)]
    if split is not None:
        nodes.insert(0, ints("s", split))
    for k, p in enumerate(positions):
        nodes += [ints(f"p{k}", p), node("SequenceAt", ["seq", f"p{k}"], [f"e{k}"])]
    nodes += [node("Mul", ["e0", "e1"], ["m"]), node("Add", ["m", "e2"], ["y"])]
    return nodes


def forward_both(nodes, feeds, opset, out="y"):
    """``out`` from the graph as given and from unsequence's rewrite of it; the rewrite."""
    vis = [helper.make_tensor_value_info(k, TensorProto.DOUBLE, list(v.shape))
           for k, v in feeds.items()]
    m = make_model(nodes, vis, [helper.make_tensor_value_info(out, TensorProto.DOUBLE, None)],
                   opset=opset)
    want = session(m).run([out], feeds)[0]
    r = onnx.ModelProto()
    r.CopyFrom(m)
    changed = unsequence(r)
    return want, session(r).run([out], feeds)[0], r, changed


SPLITS = [([4, 4, 4], 2, None, (0, 1, 2)),      # a 1-D split, as torch.split with sizes
          ([1, 4, 4, 3], -1, 0, (2, -3, 1)),    # negative positions, one part read twice
          (4, 2, None, (0, 2, 1)),              # a scalar split (torch.chunk)
          (5, 2, None, (0, 1, -1)),             # a scalar split with a shorter last part
          ]


@pytest.mark.parametrize("split,axis,keepdims,positions", SPLITS, ids=str)
@pytest.mark.parametrize("opset", OPSETS)
def test_split_to_sequence_at_constant_positions(split, axis, keepdims, positions, opset):
    nodes = gpt2_qkv(split, axis, keepdims, positions)
    if split == 5:  # parts of 5, 5 and 2: the short last part summed to broadcast
        nodes[-1:] = [node("ReduceSum", ["e2"], ["e2s"], keepdims=1),
                      node("Add", ["m", "e2s"], ["y"])]
    x = rng.standard_normal((2, 3, 12))
    want, got, r, changed = forward_both(nodes, {"x": x}, opset)
    assert changed == 1 + len(positions)  # the SplitToSequence and each SequenceAt
    assert not any(n.op_type in ("SplitToSequence", "SequenceAt") for n in r.graph.node)
    np.testing.assert_array_equal(got, want)
    check(nodes, {"x": x}, ["x"], opset=opset)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_split_to_sequence_without_split_unbinds(keepdims):
    """No split: parts of length 1 along the axis, which keepdims=0 drops (torch.unbind)."""
    nodes = [node("SplitToSequence", ["x"], ["seq"], axis=1, keepdims=keepdims),
             ints("p0", 0), ints("p1", -1),
             node("SequenceAt", ["seq", "p0"], ["a"]), node("SequenceAt", ["seq", "p1"], ["b"]),
             node("Mul", ["a", "b"], ["y"])]
    x = rng.standard_normal((2, 3, 4))
    want, got, _, _ = forward_both(nodes, {"x": x}, 17)
    np.testing.assert_array_equal(got, want)
    assert got.shape == ((2, 4) if keepdims == 0 else (2, 1, 4))
    check(nodes, {"x": x}, ["x"], opset=17)


@pytest.mark.parametrize("new_axis", [0, 1])
@pytest.mark.parametrize("opset", OPSETS)
def test_construct_insert_erase_concat(new_axis, opset):
    """SequenceEmpty, SequenceInsert (at the end and at a position), SequenceErase,
    SequenceConstruct, ConcatFromSequence (stacking with new_axis=1) and SequenceLength."""
    nodes = [helper.make_node("SequenceEmpty", [], ["s0"], dtype=TensorProto.DOUBLE),
             node("SequenceInsert", ["s0", "a"], ["s1"]),
             node("SequenceInsert", ["s1", "b"], ["s2"]),
             ints("p", 0), node("SequenceInsert", ["s2", "c", "p"], ["s3"]),  # c, a, b
             ints("q", 1), node("SequenceErase", ["s3", "q"], ["s4"]),  # c, b
             node("Sigmoid", ["a"], ["sa"]),
             node("SequenceConstruct", ["sa", "b"], ["t"]),
             node("ConcatFromSequence", ["s4"], ["u"], axis=1, new_axis=new_axis),
             node("ConcatFromSequence", ["t"], ["v"], axis=1, new_axis=new_axis),
             node("SequenceLength", ["s4"], ["n"]),
             node("Cast", ["n"], ["nf"], to=TensorProto.DOUBLE),
             node("Mul", ["u", "v"], ["uv"]),
             node("Mul", ["uv", "nf"], ["y"])]
    feeds = {k: rng.standard_normal((2, 3)) for k in "abc"}
    want, got, r, _ = forward_both(nodes, feeds, opset)
    np.testing.assert_array_equal(got, want)
    assert not any(n.op_type.startswith("Sequence") or n.op_type == "ConcatFromSequence"
                   for n in r.graph.node)
    check(nodes, feeds, ["a", "b", "c"], opset=opset)


def test_runtime_split_sizes_of_static_length():
    """A 1-D split computed at run time but of a known length: Split reads it as is."""
    nodes = [node("Shape", ["w"], ["ws"]),  # [4, 8]: parts of 4 and 8
             node("SplitToSequence", ["x", "ws"], ["seq"], axis=1),
             ints("p0", 0), ints("p1", 1),
             node("SequenceAt", ["seq", "p0"], ["a"]), node("SequenceAt", ["seq", "p1"], ["b"]),
             node("ReduceSum", ["b"], ["bs"], keepdims=1),
             node("Mul", ["a", "bs"], ["y"])]
    feeds = {"x": rng.standard_normal((3, 12)), "w": np.zeros((4, 8))}
    want, got, r, _ = forward_both(nodes, feeds, 17)
    np.testing.assert_array_equal(got, want)
    assert [n.op_type for n in r.graph.node].count("Split") == 1
    check(nodes, feeds, ["x"], opset=17)


def test_unread_parts_and_untouched_models():
    """Parts nobody reads cost no Squeeze; a model without sequences is left alone."""
    nodes = [node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0), ints("p", 2),
             node("SequenceAt", ["seq", "p"], ["y"])]
    x = rng.standard_normal((4, 3))
    want, got, r, _ = forward_both(nodes, {"x": x}, 17)
    np.testing.assert_array_equal(got, want)
    assert [n.op_type for n in r.graph.node].count("Squeeze") == 1
    plain = make_model([node("Relu", ["x"])], [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2])], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                      [2])])
    before = plain.SerializeToString()
    assert unsequence(plain) == 0 and plain.SerializeToString() == before


def _runtime_position_model():
    nodes = [node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
             ints("p0", 0), node("SequenceAt", ["seq", "p0"], ["a"]),
             node("SequenceAt", ["seq", "i"], ["b"]),       # position known at run time
             node("Add", ["a", "b"], ["s"]),
             node("ReduceSum", ["s"], ["loss"], keepdims=0),
             helper.make_node("Gradient", ["x"], ["dx"], name="g", domain=TRAINING_DOMAIN,
                              xs=["x"], y="loss")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2]),
                              helper.make_tensor_value_info("i", TensorProto.INT64, [])],
                      [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3, 2])])


def test_a_sequence_read_at_a_runtime_position_stays_and_its_gradient_is_refused():
    m = _runtime_position_model()
    fwd = onnx.ModelProto()
    fwd.CopyFrom(m)
    del fwd.graph.node[-1]
    assert unsequence(fwd) == 0  # the sequence stays, and so do its readers
    with pytest.raises(GradientError, match=r"no gradient rule for SequenceAt node"):
        expand_gradients(m)


def test_a_sequence_graph_output_keeps_its_makers():
    nodes = [node("SequenceConstruct", ["a", "b"], ["seq"]), ints("p", 1),
             node("SequenceAt", ["seq", "p"], ["y"])]
    vi = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [2]) for k in "ab"]
    seq_out = helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, [2])
    m = make_model(nodes, vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                               seq_out])
    assert unsequence(m) == 1
    ops = [n.op_type for n in m.graph.node]
    assert "SequenceConstruct" in ops and "SequenceAt" not in ops
    onnx.checker.check_model(m)
    a, b = np.ones(2, np.float32), np.arange(2, dtype=np.float32)
    y, seq = session(m).run(["y", "seq"], {"a": a, "b": b})
    np.testing.assert_array_equal(y, b)
    assert len(seq) == 2


# --- a Trainer over SplitToSequence/SequenceAt ------------------------------------------------

D, H, C, N = 5, 4, 3, 16


def glu_model(seed=0):
    """x -> MatMul w1 [D, 2H] -> SplitToSequence (torch.chunk) -> a * Sigmoid(g) -> Gemm w2
    -> mean softmax cross-entropy: a gated unit as the dynamo exporter writes it."""
    r = np.random.default_rng(seed)
    nodes = [node("MatMul", ["x", "w1"], ["h"]),
             ints("halves", [H, H]),
             node("SplitToSequence", ["h", "halves"], ["seq"], axis=-1),
             ints("p0", 0), ints("p1", 1),
             node("SequenceAt", ["seq", "p0"], ["a"]), node("SequenceAt", ["seq", "p1"], ["g"]),
             node("Sigmoid", ["g"], ["sg"]), node("Mul", ["a", "sg"], ["u"]),
             node("Gemm", ["u", "w2"], ["logits"], transB=1),
             node("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"])]
    inits = [numpy_helper.from_array((r.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in [("w1", (D, 2 * H)), ("w2", (C, H))]]
    g = helper.make_graph(nodes, "glu", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D]),
        helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def glu_numpy(p, x, t):
    """float64 loss and gradients of glu_model."""
    w1, w2 = p["w1"].astype(np.float64), p["w2"].astype(np.float64)
    h = x.astype(np.float64) @ w1
    a, g = h[:, :H], h[:, H:]
    sg = 1 / (1 + np.exp(-g))
    u = a * sg
    z = u @ w2.T
    z = z - z.max(1, keepdims=True)
    sm = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    n = len(t)
    loss = -np.mean(np.log(sm[np.arange(n), t]))
    dz = sm.copy()
    dz[np.arange(n), t] -= 1
    dz /= n
    du = dz @ w2
    dh = np.concatenate([du * sg, du * a * sg * (1 - sg)], axis=1)
    return loss, {"w1": x.T.astype(np.float64) @ dh, "w2": dz.T @ u}


def test_trainer_trains_through_split_to_sequence(library_path):
    from helpers.references import momentum_step
    from trainops import Trainer, optim

    model = glu_model()
    opt = optim.Momentum(lr=0.1)
    tr = Trainer(model, "loss", opt, threads=1)
    r = np.random.default_rng(1)
    x = r.standard_normal((N, D)).astype(np.float32)
    t = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64)
    p = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    ref_loss, grads = glu_numpy(p, x, t)
    first = tr.step({"x": x, "t": t})
    assert first == pytest.approx(ref_loss, rel=1e-5)
    got = tr.parameters()
    for k in p:
        want, _ = momentum_step(0.1, 1, p[k], grads[k], np.zeros_like(p[k], np.float64),
                                **opt.attributes())
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
    for _ in range(40):
        last = tr.step({"x": x, "t": t})
    assert last < 0.5 * first


@pytest.mark.parametrize("opset", [11, 12])
def test_opset_11_and_12_forms(opset):
    """Before opset 13 Split, Squeeze and Unsqueeze take attributes; the rewrite writes
    those forms (the backward then upgrades the model where a rule needs 13)."""
    nodes = [node("SplitToSequence", ["x"], ["seq"], axis=1, keepdims=0),
             ints("p0", 0), ints("p1", 2),
             node("SequenceAt", ["seq", "p0"], ["a"]), node("SequenceAt", ["seq", "p1"], ["b"]),
             node("Mul", ["a", "b"], ["ab"]),
             node("SequenceConstruct", ["ab", "a"], ["s2"]),
             node("ConcatFromSequence", ["s2"], ["y"], axis=-1, new_axis=1),
             ints("sz", [1, 2]),
             node("SplitToSequence", ["x", "sz"], ["seq2"], axis=1)]
    x = rng.standard_normal((2, 3, 4))
    want, got, r, _ = forward_both(nodes, {"x": x}, opset)
    np.testing.assert_array_equal(got, want)
    assert {n.op_type for n in r.graph.node} >= {"Split", "Squeeze", "Unsqueeze", "Concat"}
    check(nodes, {"x": x}, ["x"], opset=opset)


def test_positions_in_any_constant_form_and_parts_of_a_kept_split():
    """A position written as Constant(value_int=...) (torch's dynamo exporter writes the
    scalar forms too) is a constant; a part of a SplitToSequence whose sequence is a graph
    output, read through a SequenceInsert, stays a SequenceAt (the parts are not split out
    twice), and the model computes what it did."""
    nodes = [node("SplitToSequence", ["x"], ["seq"], axis=0),
             helper.make_node("Constant", [], ["p"], value_int=-1),
             node("SequenceAt", ["seq", "p"], ["a"]),
             node("SequenceInsert", ["seq", "a"], ["seq2"]),
             helper.make_node("Constant", [], ["q"], value_int=1),
             node("SequenceAt", ["seq2", "q"], ["y"])]
    x = rng.standard_normal((3, 2)).astype(np.float32)
    vi = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)]
    m = make_model(nodes, vi, outs)
    want = session(m).run(["y"], {"x": x})[0]
    assert unsequence(m) == 0
    np.testing.assert_array_equal(session(m).run(["y"], {"x": x})[0], want)
    m2 = make_model(nodes, vi, outs[:1])  # the sequence no graph output: all of it goes
    assert unsequence(m2) == 4  # SplitToSequence, SequenceInsert, both SequenceAt
    assert [n.op_type for n in m2.graph.node if "Sequence" in n.op_type] == []
    np.testing.assert_array_equal(session(m2).run(["y"], {"x": x})[0], want)


def test_sizes_and_positions_computed_from_static_shapes():
    """torch.chunk of a dimension: the split size is Shape -> Gather -> Div, the position
    an integer Sub; both are folded into constants before the rewrite."""
    nodes = [node("Shape", ["x"], ["sh"]), ints("ax", 1),
             node("Gather", ["sh", "ax"], ["d"], axis=0), ints("two", 2),
             node("Div", ["d", "two"], ["half"]),
             node("SplitToSequence", ["x", "half"], ["seq"], axis=1),
             ints("one", 1), node("Sub", ["one", "one"], ["p0"]),
             node("SequenceAt", ["seq", "p0"], ["a"]), node("SequenceAt", ["seq", "one"], ["b"]),
             node("Tanh", ["b"], ["tb"]), node("Mul", ["a", "tb"], ["y"])]
    x = rng.standard_normal((2, 6))
    want, got, r, _ = forward_both(nodes, {"x": x}, 17)
    np.testing.assert_array_equal(got, want)
    assert not any("Sequence" in n.op_type for n in r.graph.node)
    check(nodes, {"x": x}, ["x"], opset=17)
