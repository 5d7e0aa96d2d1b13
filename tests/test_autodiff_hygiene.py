"""trainops.autodiff with no silently wrong gradient: gradients through ``If``
(outer-scope captures included) against central finite differences and a numpy Adam
reference, ``Loop``/``Scan`` refused, and graph hygiene before differentiation: nodes out
of order, cycles, undefined tensors, integer ``x``/``y`` and casts to integers."""

from __future__ import annotations

import signal
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.gradcheck import check, make_model, session
from helpers.references import adam_step
from trainops import Trainer, optim
from trainops.autodiff import GradientError, expand_gradients, toposort
from trainops.onnx_defs import IR_VERSION, TRAINING_DOMAIN

D = TensorProto.DOUBLE
rng = np.random.default_rng(19)


def r(*shape):
    return rng.standard_normal(shape)


def node(op, ins, outs=("y",), **kw):
    return helper.make_node(op, list(ins), list(outs), **kw)


def branch(nodes, outs, shapes, elem=D, name="branch"):
    return helper.make_graph(list(nodes), name, [],
                             [helper.make_tensor_value_info(o, elem, s)
                              for o, s in zip(outs, shapes)])


def if_node(then, els, outs=("y",), cond="c", name="if"):
    return helper.make_node("If", [cond], list(outs), name=name, then_branch=then,
                            else_branch=els)


def gradient_model(nodes, inputs: dict, xs, y="y", elem=D, inits=()):
    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
           for k, v in inputs.items()]
    g = helper.make_node("Gradient", list(xs), [f"d_{x}" for x in xs], name="my_gradient",
                         domain=TRAINING_DOMAIN, xs=list(xs), y=y)
    outs = [helper.make_tensor_value_info(f"d_{x}", elem, list(inputs[x].shape)) for x in xs]
    return make_model(list(nodes) + [g], vis, outs, initializers=inits)


def grads(model, feeds, xs):
    return session(expand_gradients(model)).run([f"d_{x}" for x in xs], feeds)


# --- If: the taken branch's gradient, captures included -------------------------------------

COND = [True, False]


@pytest.mark.parametrize("c", COND)
def test_if_captures_in_both_and_one_branch_match_finite_differences(c):
    # a is read by both branches, b only by else, w only by then.
    then = branch([node("Mul", ["a", "a"], ["t1"]), node("Mul", ["t1", "w"], ["t2"]),
                   node("Exp", ["t2"], ["t3"])], ["t3"], [[2, 3]])
    els = branch([node("Mul", ["a", "b"], ["e1"])], ["e1"], [[2, 3]])
    check([if_node(then, els)], {"a": r(2, 3) * 0.5, "b": r(2, 3), "w": r(3) * 0.5,
                                 "c": np.array(c)}, ["a", "b", "w"], dtypes=(np.float64,))


@pytest.mark.parametrize("c", COND)
def test_if_capture_unused_by_the_taken_branch_gets_exact_zeros(c):
    then = branch([node("Mul", ["a", "a"], ["t1"])], ["t1"], [[3]])
    els = branch([node("Mul", ["b", "b"], ["e1"])], ["e1"], [[3]])
    a, b = r(3), r(3)
    m = gradient_model([if_node(then, els)], {"a": a, "b": b, "c": np.array(c)}, ["a", "b"])
    da, db = grads(m, {"a": a, "b": b, "c": np.array(c)}, ["a", "b"])
    np.testing.assert_array_equal(da, 2 * a if c else np.zeros(3))
    np.testing.assert_array_equal(db, np.zeros(3) if c else 2 * b)


@pytest.mark.parametrize("c", COND)
def test_if_branches_of_different_shapes_and_broadcast_captures(c):
    # then: [2, 3] (w broadcast over rows); else: [1, 3] (a summed over rows).
    then = branch([node("Mul", ["a", "w"], ["t1"])], ["t1"], [[2, 3]])
    els = branch([node("ReduceSum", ["a", "axes"], ["e1"], keepdims=1)], ["e1"], [[1, 3]])
    check([node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0], np.int64))),
           if_node(then, els)], {"a": r(2, 3), "w": r(3), "c": np.array(c)}, ["a", "w"],
          dtypes=(np.float64,))


@pytest.mark.parametrize("c", COND)
def test_if_output_gradient_flows_through_and_sums_with_direct_uses(c):
    # Two outputs (the second unused), computed from an outer intermediate; the output is
    # then used with a again outside; the condition depends on a as well.
    then = branch([node("Shrink", ["t"], ["t1"], lambd=0.5), node("Neg", ["t"], ["t2"])], ["t1", "t2"],
                  [[4], [4]])
    els = branch([node("Tanh", ["t"], ["e1"]), node("Abs", ["t"], ["e2"])], ["e1", "e2"],
                 [[4], [4]])
    nodes = [node("Mul", ["a", "a"], ["t"]),
             node("ReduceSum", ["a"], ["s"], keepdims=0),
             node("Greater", ["s", "zero"], ["cond"]),
             if_node(then, els, outs=("o1", "o2"), cond="cond"),
             node("Mul", ["o1", "a"], ["y"])]
    a = np.abs(r(4)) + 0.1
    a = a if c else -a  # the condition: sum(a) > 0
    with pytest.raises(GradientError, match="op type 'Shrink'"):  # Shrink has no rule
        check(nodes, {"a": a}, ["a"], consts={"zero": np.array(0.0)}, dtypes=(np.float64,))
    then = branch([node("Exp", ["t"], ["t1"]), node("Neg", ["t"], ["t2"])], ["t1", "t2"],
                  [[4], [4]])
    nodes[3] = if_node(then, els, outs=("o1", "o2"), cond="cond")
    check(nodes, {"a": a}, ["a"], consts={"zero": np.array(0.0)}, dtypes=(np.float64,))


@pytest.mark.parametrize("c", COND)
@pytest.mark.parametrize("c2", COND)
def test_nested_if_in_a_branch(c, c2):
    inner_then = branch([node("Mul", ["t1", "b"], ["u1"])], ["u1"], [[3]], name="inner_then")
    inner_else = branch([node("Exp", ["a"], ["u2"])], ["u2"], [[3]], name="inner_else")
    then = branch([node("Mul", ["a", "a"], ["t1"]),
                   if_node(inner_then, inner_else, outs=("t2",), cond="c2", name="inner"),
                   node("Add", ["t2", "t1"], ["t3"])], ["t3"], [[3]], name="then")
    els = branch([node("Mul", ["a", "b"], ["e1"])], ["e1"], [[3]], name="else")
    check([if_node(then, els)], {"a": r(3), "b": r(3), "c": np.array(c), "c2": np.array(c2)},
          ["a", "b"], dtypes=(np.float64,))


def test_if_in_float32_with_symbolic_batch():
    then = branch([node("MatMul", ["x", "w"], ["t1"]), node("Tanh", ["t1"], ["t2"])], ["t2"],
                  [["N", 2]], elem=TensorProto.FLOAT)
    els = branch([node("MatMul", ["x", "v"], ["e1"])], ["e1"], [["N", 2]], elem=TensorProto.FLOAT)
    for c in COND:
        check([if_node(then, els)], {"x": r(5, 3), "w": r(3, 2), "v": r(3, 2), "c": np.array(c)},
              ["x", "w", "v"], symbolic={"x": ["N", 3]}, dtypes=(np.float32,))


@pytest.mark.parametrize("c", COND)
def test_if_branch_with_its_own_initializer(c):
    then = helper.make_graph([node("Mul", ["a", "k"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", D, [3])],
                             initializer=[numpy_helper.from_array(np.array([1.0, -2.0, 3.0]), "k")])
    els = helper.make_graph([node("Identity", ["k"], ["e"])], "else", [],
                            [helper.make_tensor_value_info("e", D, [3])],
                            initializer=[numpy_helper.from_array(np.ones(3), "k")])
    check([if_node(then, els)], {"a": r(3), "c": np.array(c)}, ["a"], dtypes=(np.float64,))


@pytest.mark.parametrize("random", ["RandomNormal", "Dropout"])
def test_if_branch_that_recomputes_a_random_op_is_refused(random):
    if random == "RandomNormal":
        draw = node("RandomNormal", [], ["n"], dtype=D, shape=[3], name="draw")
    else:  # in training mode: its mask is random, and its gradient reads the mask
        draw = node("Dropout", ["a", "", "on"], ["n", "mask"], name="draw")
    then = helper.make_graph([draw, node("Mul", ["n", "a"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", D, [3])],
                             initializer=[numpy_helper.from_array(np.array(True), "on")])
    els = branch([node("Neg", ["a"], ["e"])], ["e"], [[3]])
    m = gradient_model([if_node(then, els)], {"a": r(3), "c": np.array(True)}, ["a"])
    with pytest.raises(GradientError, match=rf"^If node 'if': the gradient of its then_branch "
                       rf"needs {random} node 'draw' computed again, and it draws random "
                       r"numbers \(a second draw would differ from the forward's\)$"):
        expand_gradients(m)


def test_if_branch_with_an_inference_dropout_is_recomputed():
    then = helper.make_graph([node("Dropout", ["a", "", "off"], ["n"]),
                              node("Mul", ["n", "a"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", D, [3])],
                             initializer=[numpy_helper.from_array(np.array(False), "off")])
    els = branch([node("Neg", ["a"], ["e"])], ["e"], [[3]])
    check([if_node(then, els)], {"a": r(3), "c": np.array(True)}, ["a"], dtypes=(np.float64,))


def test_if_gradient_is_a_backward_if_on_the_same_condition():
    then = branch([node("Mul", ["a", "a"], ["t"])], ["t"], [[3]])
    els = branch([node("Neg", ["b"], ["e"])], ["e"], [[3]])
    m = gradient_model([if_node(then, els)], {"a": r(3), "b": r(3), "c": np.array(True)},
                       ["a", "b"])
    out = expand_gradients(m)
    onnx.checker.check_model(out)
    ifs = [n for n in out.graph.node if n.op_type == "If"]
    assert len(ifs) == 2 and list(ifs[1].input) == ["c"] and len(ifs[1].output) == 2


# --- If in a Trainer: a weight read only inside a branch moves as Adam says ---------------

def _if_model(w, v):
    F = TensorProto.FLOAT
    then = branch([node("MatMul", ["x", "w"], ["t1"]), node("Tanh", ["t1"], ["t2"])], ["t2"],
                  [["N", 2]], elem=F)
    els = branch([node("MatMul", ["x", "v"], ["e1"])], ["e1"], [["N", 2]], elem=F)
    nodes = [if_node(then, els, outs=("h",)), node("Mul", ["h", "h"], ["h2"]),
             node("ReduceMean", ["h2"], ["loss"], keepdims=0)]
    ins = [helper.make_tensor_value_info("x", F, ["N", 3]),
           helper.make_tensor_value_info("c", TensorProto.BOOL, [])]
    g = helper.make_graph(nodes, "if_model", ins,
                          [helper.make_tensor_value_info("loss", F, [])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m


def _if_model_grads(p, x, c):
    """float64 backprop of _if_model: loss = mean(h * h), h = tanh(x w) or x v."""
    x = x.astype(np.float64)
    w, v = p["w"].astype(np.float64), p["v"].astype(np.float64)
    if c:
        h = np.tanh(x @ w)
        return {"w": x.T @ (2 * h / h.size * (1 - h * h)), "v": np.zeros_like(v)}
    h = x @ v
    return {"w": np.zeros_like(w), "v": x.T @ (2 * h / h.size)}


def test_trainer_moves_a_weight_read_inside_an_if_branch_as_numpy_adam(library_path):
    w = r(3, 2).astype(np.float32)
    v = r(3, 2).astype(np.float32)
    tr = Trainer(_if_model(w, v), "loss", optim.Adam(lr=0.05), threads=1)
    x = r(6, 3).astype(np.float32)
    p = {"w": w, "v": v}
    state = {k: (np.zeros((3, 2)), np.zeros((3, 2))) for k in p}
    for t, c in [(1, True), (2, False), (3, True)]:
        g = _if_model_grads(p, x, c)
        tr.step({"x": x, "c": np.array(c)})
        got, st = tr.parameters(), tr.optimizer_state()
        for k in p:
            x_new, v_new, h_new = adam_step(0.05, t, p[k], g[k], *state[k])
            np.testing.assert_allclose(got[k], x_new, rtol=1e-5, atol=1e-6, err_msg=f"{k} step {t}")
            np.testing.assert_allclose(st[f"trainops/V/{k}"], v_new, rtol=1e-4, atol=1e-7)
        assert not np.array_equal(got["w" if c else "v"], p["w" if c else "v"])
        p = got
        state = {k: (st[f"trainops/V/{k}"], st[f"trainops/H/{k}"]) for k in p}


# --- Loop and Scan: refused when their body needs a gradient -------------------------------

def _loop_nodes(body_nodes, body_out, name="loop"):
    """``y = Loop(n, "", init)`` with a body carrying ``acc`` ([3] doubles)."""
    body = helper.make_graph(
        list(body_nodes) + [node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc", D, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info(body_out, D, [3])])
    return [helper.make_node("Loop", ["n", "", "init"], ["y"], name=name, body=body)]


def test_loop_whose_body_captures_a_value_needing_a_gradient_is_refused():
    nodes = _loop_nodes([node("Mul", ["acc", "a"], ["acc2"])], "acc2")
    m = gradient_model(nodes, {"a": r(3), "init": r(3), "n": np.array(2, np.int64)}, ["a"])
    with pytest.raises(GradientError, match=r"^Loop node 'loop': gradients through Loop are "
                       r"not supported \(of the control-flow ops only If has them\); its body "
                       r"reads \['a'\] from the outer scope, which need a gradient$"):
        expand_gradients(m)


def test_loop_taking_a_value_needing_a_gradient_is_refused():
    nodes = _loop_nodes([node("Mul", ["acc", "k"], ["acc2"])], "acc2")
    m = gradient_model(nodes, {"init": r(3), "k": r(3), "n": np.array(2, np.int64)}, ["init"])
    with pytest.raises(GradientError, match=r"Loop node 'loop': .* it takes \['init'\] as "
                       r"inputs, which need a gradient$"):
        expand_gradients(m)


def test_loop_off_the_gradient_path_is_fine():
    nodes = _loop_nodes([node("Mul", ["acc", "k"], ["acc2"])], "acc2") + \
        [node("Mul", ["a", "a"], ["sq"]), node("Add", ["sq", "y"], ["z"])]
    feeds = {"a": r(3), "init": r(3), "k": r(3), "n": np.array(2, np.int64)}
    m = gradient_model(nodes, feeds, ["a"], y="z")
    np.testing.assert_allclose(grads(m, feeds, ["a"])[0], 2 * feeds["a"], rtol=1e-15)


def test_scan_taking_or_capturing_a_value_needing_a_gradient_is_refused():
    body = helper.make_graph(
        [node("Add", ["s", "row"], ["s2"]), node("Mul", ["s2", "w"], ["o"])], "scan_body",
        [helper.make_tensor_value_info("s", D, [3]), helper.make_tensor_value_info("row", D, [3])],
        [helper.make_tensor_value_info("s2", D, [3]), helper.make_tensor_value_info("o", D, [3])])
    scan = helper.make_node("Scan", ["s0", "xs"], ["y", "ys"], name="scan", body=body,
                            num_scan_inputs=1)
    feeds = {"s0": r(3), "xs": r(4, 3), "w": r(3)}
    m = gradient_model([scan], feeds, ["xs", "w"])
    with pytest.raises(GradientError, match=r"^Scan node 'scan': gradients through Scan are "
                       r"not supported .*; it takes \['xs'\] as inputs and its body reads "
                       r"\['w'\] from the outer scope, which need a gradient$"):
        expand_gradients(m)


def test_loop_inside_an_if_branch_is_refused():
    loop = _loop_nodes([node("Mul", ["acc", "a"], ["acc2"])], "acc2", name="inner_loop")[0]
    then = branch([loop], ["y"], [[3]])
    els = branch([node("Neg", ["a"], ["e"])], ["e"], [[3]])
    feeds = {"a": r(3), "init": r(3), "n": np.array(2, np.int64), "c": np.array(True)}
    m = gradient_model([if_node(then, els, outs=("z",))], feeds, ["a"], y="z")
    with pytest.raises(GradientError, match=r"^Loop node 'inner_loop': gradients through Loop"):
        expand_gradients(m)


# --- graph hygiene: order, cycles, undefined tensors -------------------------------------

def _chain():
    return [node("Mul", ["a", "b"], ["t1"], name="n1"), node("Exp", ["t1"], ["t2"], name="n2"),
            node("Mul", ["t2", "a"], ["t3"], name="n3"),
            node("ReduceSum", ["t3"], ["y"], name="n4")]


def test_nodes_out_of_order_give_the_sorted_graphs_gradients():
    feeds = {"a": r(2, 3) * 0.5, "b": r(2, 3) * 0.5}
    sorted_m = gradient_model(_chain(), feeds, ["a", "b"])
    shuffled = [_chain()[i] for i in (3, 1, 2, 0)]
    m = gradient_model(shuffled, feeds, ["a", "b"])
    want = grads(sorted_m, feeds, ["a", "b"])
    got = grads(m, feeds, ["a", "b"])
    for w, g in zip(want, got):
        assert np.abs(w).min() > 0
        np.testing.assert_array_equal(g, w)
    a, b = feeds["a"], feeds["b"]
    np.testing.assert_allclose(got[0], np.exp(a * b) * (1 + a * b), rtol=1e-12)
    np.testing.assert_allclose(got[1], np.exp(a * b) * a * a, rtol=1e-12)


def test_toposort_keeps_a_valid_order_and_moves_only_what_it_must():
    nodes = _chain()
    assert toposort(nodes, set()) == nodes
    swapped = [nodes[1], nodes[0], nodes[2], nodes[3]]  # n2 reads t1, made by n1
    assert [n.name for n in toposort(swapped, set())] == ["n1", "n2", "n3", "n4"]
    off_path = node("Neg", ["b"], ["nb"], name="off")
    mixed = [nodes[3], off_path, nodes[2], nodes[1], nodes[0]]
    assert [n.name for n in toposort(mixed, set())] == ["off", "n1", "n2", "n3", "n4"]


@contextmanager
def time_bound(seconds: float):
    """Fail (not hang, not eat memory) if the block runs longer than ``seconds``."""
    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


CYCLE = (r"^the graph has a cycle, so its nodes cannot be ordered with every tensor produced "
         r"before use: Add node 'n2' -> 't2' -> Mul node 'n3' -> 't3' -> Add node 'n2'$")


def _cyclic(n_before=0):
    pre = [node("Neg", [f"p{k}" if k else "a"], [f"p{k + 1}"], name=f"p{k}")
           for k in range(n_before)]
    start = f"p{n_before}" if n_before else "a"
    return pre + [node("Mul", [start, "a"], ["t1"], name="n1"),
                  node("Add", ["t1", "t3"], ["t2"], name="n2"),
                  node("Mul", ["t2", "a"], ["t3"], name="n3"),
                  node("ReduceSum", ["t3"], ["y"], name="n4")]


@pytest.mark.parametrize("n_before", [0, 20000])
def test_cycle_is_a_fast_error_naming_its_nodes(n_before):
    # The old code looped forever (memory growing): the alarm turns that into a failure. No
    # absolute time is asserted (timings are noisy on a shared machine); detection is linear.
    m = gradient_model(_cyclic(n_before), {"a": r(3)}, ["a"])
    with time_bound(30.0), pytest.raises(GradientError, match=CYCLE):
        expand_gradients(m)
    with time_bound(30.0), pytest.raises(GradientError, match=CYCLE):
        toposort(list(m.graph.node), {"a"})


def test_self_loop_is_a_cycle():
    nodes = [node("Add", ["a", "t"], ["t"], name="self"), node("ReduceSum", ["t"], ["y"])]
    m = gradient_model(nodes, {"a": r(3)}, ["a"])
    with time_bound(5.0), pytest.raises(GradientError, match=r"cycle.*: Add node 'self' -> "
                                        r"'t' -> Add node 'self'$"):
        expand_gradients(m)


def test_cycle_through_an_if_capture_is_seen():
    then = branch([node("Neg", ["t3"], ["u"])], ["u"], [[3]])
    els = branch([node("Neg", ["a"], ["e"])], ["e"], [[3]])
    nodes = [if_node(then, els, outs=("t2",), name="if"),
             node("Mul", ["t2", "a"], ["t3"], name="n3"),
             node("ReduceSum", ["t3"], ["y"])]
    m = gradient_model(nodes, {"a": r(3), "c": np.array(True)}, ["a"])
    with time_bound(5.0), pytest.raises(GradientError, match=r"cycle.*If node 'if' -> 't2' -> "
                                        r"Mul node 'n3' -> 't3' -> If node 'if'$"):
        expand_gradients(m)


def test_undefined_tensor_on_the_path_is_named():
    nodes = [node("Mul", ["a", "d2"], ["t"], name="uses_d2"), node("ReduceSum", ["t"], ["y"])]
    m = gradient_model(nodes, {"a": r(3)}, ["a"])
    with pytest.raises(GradientError, match=r"^tensor 'd2' used by Mul node 'uses_d2' is not "
                       r"defined by any node, input or initializer$"):
        expand_gradients(m)


def test_undefined_tensor_read_in_a_branch_is_named():
    then = branch([node("Mul", ["a", "ghost"], ["t"])], ["t"], [[3]])
    els = branch([node("Neg", ["a"], ["e"])], ["e"], [[3]])
    m = gradient_model([if_node(then, els)], {"a": r(3), "c": np.array(True)}, ["a"])
    with pytest.raises(GradientError, match=r"^tensor 'ghost' used by If node 'if' \(read in "
                       r"its subgraph\) is not defined by any node, input or initializer$"):
        expand_gradients(m)


# --- integer and boolean x and y; casts to integers --------------------------------------

@pytest.mark.parametrize("dtype,name", [(np.int64, "int64"), (np.bool_, "bool"),
                                         (np.int32, "int32")])
def test_integer_or_boolean_x_is_refused(dtype, name):
    nodes = [node("Cast", ["k"], ["kf"], to=D), node("Mul", ["kf", "a"])]
    m = gradient_model(nodes, {"a": r(3), "k": np.ones(3, dtype)}, ["a", "k"])
    with pytest.raises(GradientError, match=rf"^cannot differentiate with respect to 'k': it is "
                       rf"{name}; gradients are defined for float tensors only \(float, double, "
                       r"float16, bfloat16\)$"):
        expand_gradients(m)


def test_integer_y_is_refused():
    m = gradient_model([node("Cast", ["a"], ["y"], to=TensorProto.INT64)], {"a": r(3)}, ["a"])
    with pytest.raises(GradientError, match=r"^cannot differentiate 'y': it is int64; gradients "
                       r"are defined for float tensors only"):
        expand_gradients(m)


def test_cast_to_an_integer_stops_the_gradient():
    # y = a * float(int(a)): the integer factor is a constant as far as gradients go.
    nodes = [node("Cast", ["a"], ["k"], to=TensorProto.INT64),
             node("Cast", ["k"], ["kf"], to=D), node("Mul", ["a", "kf"])]
    a = r(5) * 3
    m = gradient_model(nodes, {"a": a}, ["a"])
    out = expand_gradients(m)
    assert not any(n.op_type == "Cast" and n.attribute[0].i == TensorProto.INT64
                   for n in out.graph.node[3:]), "no integer 'gradient' is made"
    np.testing.assert_array_equal(session(out).run(["d_a"], {"a": a})[0], np.trunc(a))


def test_cast_to_bool_gives_zero_gradient():
    nodes = [node("Cast", ["a"], ["k"], to=TensorProto.BOOL), node("Cast", ["k"], ["y"], to=D)]
    a = r(4)
    m = gradient_model(nodes, {"a": a}, ["a"])
    np.testing.assert_array_equal(grads(m, {"a": a}, ["a"])[0], np.zeros(4))


def test_cast_between_floats_still_differentiates():
    nodes = [node("Cast", ["a"], ["f"], to=TensorProto.FLOAT), node("Mul", ["f", "f"], ["g"]),
             node("Cast", ["g"], to=D)]
    a = r(4)
    m = gradient_model(nodes, {"a": a}, ["a"])
    got = grads(m, {"a": a}, ["a"])[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, 2 * a, rtol=1e-6)


# --- the Trainer gets the same hygiene -----------------------------------------------------

def _trainer_model(nodes):
    F = TensorProto.FLOAT
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", F, [4, 3])],
                          [helper.make_tensor_value_info("loss", F, [])],
                          [numpy_helper.from_array(np.full((3, 2), 0.5, np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = IR_VERSION
    return m


def _trainer_nodes():
    return [node("MatMul", ["x", "w"], ["h"], name="mm"), node("Tanh", ["h"], ["t"], name="tanh"),
            node("Mul", ["t", "t"], ["t2"], name="sq"),
            node("ReduceMean", ["t2"], ["loss"], keepdims=0, name="mean")]


def test_trainer_out_of_order_nodes_train_as_sorted(library_path):
    x = r(4, 3).astype(np.float32)
    a = Trainer(_trainer_model(_trainer_nodes()), "loss", optim.Adam(lr=0.1), threads=1)
    b = Trainer(_trainer_model(_trainer_nodes()[::-1]), "loss", optim.Adam(lr=0.1), threads=1)
    for _ in range(2):
        assert a.step({"x": x}) == b.step({"x": x})
    np.testing.assert_array_equal(a.parameters()["w"], b.parameters()["w"])
    assert not np.array_equal(a.parameters()["w"], np.full((3, 2), 0.5, np.float32))


def test_trainer_cycle_and_undefined_tensor_errors(library_path):
    cyc = _trainer_nodes()
    cyc[1] = node("Add", ["h", "t2"], ["t"], name="tanh")
    with time_bound(30.0), pytest.raises(GradientError, match=r"cycle.*Add node 'tanh' -> 't' "
                                         r"-> Mul node 'sq' -> 't2' -> Add node 'tanh'$"):
        Trainer(_trainer_model(cyc), "loss", optim.Adam(), threads=1)
    bad = _trainer_nodes()
    bad[2] = node("Mul", ["t", "d2"], ["t2"], name="sq")
    with pytest.raises(GradientError, match=r"^tensor 'd2' used by Mul node 'sq' is not defined"):
        Trainer(_trainer_model(bad), "loss", optim.Adam(), threads=1)
