"""trainops.random: seeded states and make_reproducible. A model with RandomNormal and
Dropout gives different outputs in two stock onnxruntime sessions, and identical ones - equal
to the numpy reference on the documented per-node keys - once rewritten, in any session and
for any thread count."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import random_reference as ref
from helpers.checks import same_bits
from trainops.random import STATE_INPUT, STATE_OUTPUT, make_reproducible, node_key, state

SEED = 20240601


def test_state_words():
    s = state(0x0123456789ABCDEF, counter=(5 << 96) | (4 << 64) | (3 << 32) | 2)
    assert s.dtype == np.uint32 and s.tolist() == [2, 3, 4, 5, 0x89ABCDEF, 0x01234567]
    assert state(-1).tolist() == [0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF]
    assert state(7, counter=ref.M128)[:4].tolist() == [0xFFFFFFFF] * 4
    for bad in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(ValueError, match="seed"):
            state(bad)
    with pytest.raises(ValueError, match="counter"):
        state(1, counter=1 << 128)
    with pytest.raises(TypeError, match="seed"):
        state(1.5)


def test_node_keys_are_distinct_and_fixed():
    keys = [node_key(SEED, i) for i in range(10_000)]
    assert len(set(keys)) == len(keys) and all(0 <= k < 1 << 64 for k in keys)
    # SplitMix64's first output for seed 0 (a published value of the generator).
    assert node_key(0, 0) == 0xE220A8397B1DCDAF


def _model(opset=17, dropout_mask=False):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])]
    drop_out = ["y"]
    if dropout_mask:
        drop_out.append("mask")
        outs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [4, 8]))
    nodes = [
        helper.make_node("RandomNormal", [], ["n"], shape=[4, 8], dtype=1, scale=0.5, name="noise"),
        helper.make_node("Add", ["x", "n"], ["xn"]),
        helper.make_node("Constant", [], ["ratio"],
                         value=helper.make_tensor("r", TensorProto.FLOAT, [], [0.25])),
        helper.make_node("Constant", [], ["train"],
                         value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node("Dropout", ["xn", "ratio", "train"], drop_out, name="drop"),
    ]
    g = helper.make_graph(nodes, "noisy_dropout", [x], outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _stock_session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_stock_onnxruntime_differs_between_sessions():
    x = np.ones((4, 8), np.float32)
    a = _stock_session(_model()).run(None, {"x": x})[0]
    b = _stock_session(_model()).run(None, {"x": x})[0]
    assert not np.array_equal(a, b)


def test_reproducible_across_sessions_and_threads_and_equal_to_numpy(make_session):
    model = make_reproducible(_model(), SEED)
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    runs = [make_session(model, threads=t).run(None, {"x": x}) for t in (1, 2, 1)]
    names = [o.name for o in model.graph.output]
    assert names == ["y", STATE_OUTPUT.format(index=0), STATE_OUTPUT.format(index=4)]
    for r in runs[1:]:
        assert same_bits(r, runs[0])
    # The numpy reference on the documented keys: node 0 (RandomNormal), node 4 (Dropout).
    s0, s4 = ref.make_state(0, 0, 0), ref.make_state(0, 0, 0)
    s0[4:] = state(node_key(SEED, 0))[4:]
    s4[4:] = state(node_key(SEED, 4))[4:]
    noise, z, r, n0 = ref.normal(s0, 32, ref.FLOAT, scale=0.5)
    xn = x + noise.reshape(4, 8)
    y, keep, n4 = ref.dropout(s4, xn, 0.25)
    got = runs[0][0]
    assert np.array_equal(got == 0, ~keep | (xn == 0))
    np.testing.assert_allclose(got, y, rtol=1e-6, atol=1e-6)  # noise is within normal's tolerance
    assert ref.counter(runs[0][1]) == n0 and ref.counter(runs[0][2]) == n4
    assert runs[0][1][4:].tolist() == s0[4:].tolist()


def test_feeding_state_out_back_draws_the_next_numbers(make_session):
    sess = make_session(make_reproducible(_model(), SEED))
    x = np.ones((4, 8), np.float32)
    y1, a, b = sess.run(None, {"x": x})
    y2, a2, b2 = sess.run(None, {"x": x, STATE_INPUT.format(index=0): a, STATE_INPUT.format(index=4): b})
    assert not np.array_equal(y1, y2)
    assert ref.counter(a2) == 2 * ref.counter(a)
    again = make_session(make_reproducible(_model(), SEED)).run(
        None, {"x": x, STATE_INPUT.format(index=0): a, STATE_INPUT.format(index=4): b})
    assert same_bits(again[0], y2)
    other = make_session(make_reproducible(_model(), SEED + 1)).run(None, {"x": x})[0]
    assert not np.array_equal(other, y1)


def test_dropout_keeps_onnx_semantics(make_session):
    """Mask output kept; without training_mode the node is the identity (no words used)."""
    from onnx import TensorProto, helper

    model = make_reproducible(_model(dropout_mask=True), SEED)
    y, mask, _, _ = make_session(model).run(None, {"x": np.full((4, 8), 2.0, np.float32)})
    assert mask.dtype == bool and np.array_equal(y != 0, mask)
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])
    g = helper.make_graph([helper.make_node("Dropout", ["x"], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    out = make_session(make_reproducible(m, SEED)).run(None, {"x": np.array([1.0, -2.0, 3.0])})
    assert same_bits(out[0], np.array([1.0, -2.0, 3.0]))
    assert same_bits(out[1], state(node_key(SEED, 0)))


@pytest.mark.parametrize("op", ["RandomUniformLike", "RandomNormalLike"])
def test_like_ops_take_shape_and_type_from_their_input(make_session, op):
    ref.skip_unless_typed(ref.DOUBLE)
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])
    u = helper.make_tensor_value_info("u", TensorProto.FLOAT16, [2, 3])
    nodes = [helper.make_node(op, ["x"], ["y"], name="like"),
             helper.make_node(op, ["x"], ["u"], dtype=TensorProto.FLOAT16, name="like16")]
    g = helper.make_graph(nodes, "g", [x], [y, u])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    rm = make_reproducible(m, SEED)
    outs = make_session(rm).run(None, {"x": np.zeros((2, 3))})
    s = ref.make_state(0, 0, 0)
    s[4:] = state(node_key(SEED, 0))[4:]
    if op == "RandomUniformLike":
        want, _ = ref.uniform(s, 6, ref.DOUBLE)
        assert outs[0].dtype == np.float64 and same_bits(outs[0].ravel(), want)
    else:
        _, z, r, _ = ref.normal(s, 6, ref.DOUBLE)
        np.testing.assert_allclose(outs[0].ravel(), z, rtol=0, atol=1e-12 * 6)
    assert outs[1].dtype == np.float16 and outs[1].shape == (2, 3)


def test_uniform_attributes_carry_over(make_session):
    from onnx import TensorProto, helper

    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])
    g = helper.make_graph([helper.make_node("RandomUniform", [], ["y"], shape=[5], low=-3.0,
                                            high=-1.0, seed=1.0)], "g", [], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    out = make_session(make_reproducible(m, 3)).run(None, {})[0]
    s = state(node_key(3, 0))
    want, _ = ref.uniform(s, 5, ref.FLOAT, -3.0, -1.0)
    assert same_bits(out, want)


def test_errors_name_the_node():
    from onnx import TensorProto, helper

    y = helper.make_tensor_value_info("y", TensorProto.INT32, [5])
    g = helper.make_graph([helper.make_node("RandomUniform", [], ["y"], shape=[5], dtype=6,
                                            name="ints")], "g", [], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="node 0 .*'ints'.*dtype 6"):
        make_reproducible(m, 1)
    with pytest.raises(TypeError, match="seed"):
        make_reproducible(_model(), "seed")


def test_a_model_without_random_nodes_is_unchanged():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert make_reproducible(m, 1).SerializeToString() == m.SerializeToString()


def test_a_double_ratio_is_cast_to_float(make_session):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])
    nodes = [
        helper.make_node("Constant", [], ["ratio"],
                         value=helper.make_tensor("r", TensorProto.DOUBLE, [], [0.25])),
        helper.make_node("Constant", [], ["train"],
                         value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node("Dropout", ["x", "ratio", "train"], ["y"], name="drop"),
    ]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    rm = make_reproducible(m, SEED)
    assert [n.op_type for n in rm.graph.node] == ["Constant", "Constant", "Cast", "PhiloxDropout"]
    data = np.arange(1, 65, dtype=np.float32)
    out = make_session(rm).run(None, {"x": data})[0]
    want, _, _ = ref.dropout(state(node_key(SEED, 2)), data, 0.25)
    assert same_bits(out, want)
