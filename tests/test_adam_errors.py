"""Bad Adam nodes and inputs: a clear error (naming the op, the input and what was
expected), the process lives, and the same session then still runs a correct input.

Some errors can only surface when the session is created (ORT's own type checks, or the
kernel rejecting its attributes at creation); those are accepted at either stage. Each
case says where we expect it (``expect=``); the test accepts both as long as the message
is clear. For a node that is wrong for every input (a type, an arity, an attribute), "the
same session" is a model with an ``If`` whose then-branch holds the bad node and whose
else-branch a correct Adam: running the then-branch fails, the else-branch then works.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from helpers.checks import assert_clear, assert_matches_reference
from helpers.data import group
from trainops.models import TRAINING_DOMAIN, adam_feeds, adam_model, node_model

F32, F64 = np.float32, np.float64
DEFAULT_SHAPE = (2, 5)


def feeds_for(model, rng, **overrides) -> dict[str, np.ndarray]:
    """Feeds for every graph input: R = 0.1, T = 1, tensors random of their declared
    shape (or (2, 5)), in the declared dtype; ``overrides`` replace by name."""
    feeds = {}
    for vi in model.graph.input:
        if vi.name in overrides:
            feeds[vi.name] = overrides[vi.name]
            continue
        tt = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if tt.HasField("shape"):
            shape = tuple(d.dim_value for d in tt.shape.dim)
        else:
            shape = () if vi.name in ("R", "T") else DEFAULT_SHAPE
        if vi.name == "R":
            feeds[vi.name] = np.full(shape, 0.1, dtype=dtype)
        elif vi.name == "T":
            feeds[vi.name] = np.full(shape, 1, dtype=dtype)
        elif vi.name.startswith("H"):
            feeds[vi.name] = (0.01 * rng.random(shape)).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def raw_adam(inputs, outputs, **attrs):
    """An Adam node with arbitrary (name, dtype) inputs/outputs, shapes unknown."""
    return node_model("Adam", [(n, d, None) if n not in ("R", "T") else (n, d, ())
                               for n, d in inputs],
                      [(n, d, None) for n, d in outputs], **attrs)


def _f(names):
    return [(n, F32) for n in names]


RT = [("R", F32), ("T", np.int64)]


@dataclass
class Bad:
    id: str
    model: Callable[[], Any]
    needles: list  # each a str, or a tuple of alternatives; case-insensitive
    expect: str  # where we expect it: "load" or "run" (either is accepted)
    overrides: Callable[[Any], dict] = field(default=lambda rng: {})
    dynamic: bool = False  # the bad model itself accepts a correct input too


CASES = [
    # --- arity: ORT only checks the variadic lower bound; the kernel checks 2 + 4n / 3n.
    Bad("5-inputs", lambda: raw_adam(RT + _f(["X_1", "G_1", "V_1"]),
                                     _f(["X_1_new", "V_1_new", "H_1_new"])),
        ["Adam", "input", ("got 5", "size 5", "5 input")], expect="run"),
    Bad("7-inputs", lambda: raw_adam(RT + _f(["X_1", "G_1", "V_1", "H_1", "Z"]),
                                     _f(["X_1_new", "V_1_new", "H_1_new"])),
        ["Adam", "input", ("got 7", "size 7", "7 input")], expect="run"),
    Bad("6-inputs-4-outputs", lambda: raw_adam(RT + _f(["X_1", "G_1", "V_1", "H_1"]),
                                               _f(["X_1_new", "V_1_new", "H_1_new", "Z"])),
        ["Adam", "output", ("got 4", "size 4", "4 output")], expect="run"),
    Bad("6-inputs-2-outputs", lambda: raw_adam(RT + _f(["X_1", "G_1", "V_1", "H_1"]),
                                               _f(["X_1_new", "V_1_new"])),
        ["Adam", "output", ("got 2", "size 2", "2 output")], expect="run"),
    # --- shapes: only known at run time (the model's shapes are left unknown).
    Bad("V-shape", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 4", "V_1", "shape"], expect="run",
        overrides=lambda rng: {"V_1": np.zeros((1, 5), F32)}, dynamic=True),
    Bad("H-shape", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 5", "H_1", "shape"], expect="run",
        overrides=lambda rng: {"H_1": np.zeros((5, 2), F32)}, dynamic=True),
    Bad("V_2-shape", lambda: adam_model(2, dynamic=True),
        ["Adam", "input 7", "V_2", "shape"], expect="run",
        overrides=lambda rng: {"V_2": np.zeros((2, 4), F32)}, dynamic=True),
    Bad("G-not-broadcastable-(3,)", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 3", "G_1", "broadcast"], expect="run",
        overrides=lambda rng: {"G_1": np.zeros((3,), F32)}, dynamic=True),
    Bad("G-not-broadcastable-(5,2)", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 3", "G_1", "broadcast"], expect="run",
        overrides=lambda rng: {"G_1": np.zeros((5, 2), F32)}, dynamic=True),
    # Bidirectional numpy broadcasting would give (1, 2, 5), not X's shape.
    Bad("G-higher-rank-(1,2,5)", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 3", "G_1", "broadcast"], expect="run",
        overrides=lambda rng: {"G_1": np.zeros((1, 2, 5), F32)}, dynamic=True),
    Bad("G_2-not-broadcastable", lambda: adam_model(2, dynamic=True),
        ["Adam", "input 5", "G_2", "broadcast"], expect="run",
        overrides=lambda rng: {"G_2": np.zeros((4,), F32)}, dynamic=True),
    # --- element counts of R and T.
    Bad("R-two-elements", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 0", "(R)", "element"], expect="run",
        overrides=lambda rng: {"R": np.array([0.1, 0.2], F32)}, dynamic=True),
    Bad("R-no-element", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 0", "(R)", "element"], expect="run",
        overrides=lambda rng: {"R": np.zeros((0,), F32)}, dynamic=True),
    Bad("T-two-elements", lambda: adam_model(1, dynamic=True),
        ["Adam", "input 1", "(T)", "element"], expect="run",
        overrides=lambda rng: {"T": np.array([[1], [2]], np.int64)}, dynamic=True),
    # --- types. ORT checks declared op types at load; the kernel checks the rest at run.
    Bad("G-double-X-float", lambda: adam_model([DEFAULT_SHAPE], g_dtype=F64),
        ["Adam", ("input 3", "(G_1)"), "double"], expect="run"),
    Bad("V-double-X-float",
        lambda: _retype(adam_model([DEFAULT_SHAPE]), "V_1", TensorProto.DOUBLE),
        ["Adam", ("input 4", "(V_1)"), "double"], expect="run"),
    Bad("T-float", lambda: adam_model([DEFAULT_SHAPE], t_dtype=F32),
        ["Adam", "(T)", "tensor(float)"], expect="load"),
    Bad("R-int64", lambda: adam_model([DEFAULT_SHAPE], r_dtype=np.int64),
        ["Adam", "(R)", "int64"], expect="run"),
    Bad("X-int32", lambda: adam_model([DEFAULT_SHAPE], np.int32, r_dtype=F32),
        ["Adam", ("input 2", "(X_1)"), "int32"], expect="run"),
    # --- attributes: read when the kernel is created.
    Bad("alpha-int-attribute", lambda: adam_model([DEFAULT_SHAPE], alpha=1),
        ["Adam", "alpha", "float"], expect="load"),
    Bad("epsilon-floats-attribute", lambda: adam_model([DEFAULT_SHAPE], epsilon=[1e-6, 1e-7]),
        ["Adam", "epsilon", "float"], expect="load"),
    Bad("beta-string-attribute", lambda: adam_model([DEFAULT_SHAPE], beta="0.99"),
        ["Adam", "beta", "float"], expect="load"),
]


def _retype(model, name, elem_type):
    """``model`` with graph input ``name`` declared as ``elem_type``."""
    for vi in model.graph.input:
        if vi.name == name:
            vi.type.tensor_type.elem_type = elem_type
    return model


def guarded(bad, good, good_dtype=TensorProto.FLOAT):
    """``If(use_bad)``: then-branch = ``bad``'s node on inputs ``bad_*``, else-branch =
    ``good``'s node on inputs ``ok_*``; outputs o0..o2 (the first three node outputs,
    cycled, cast to ``good_dtype``)."""

    def branch(model, prefix, name):
        g = onnx.GraphProto()
        g.CopyFrom(model.graph)
        g.name = name
        node = g.node[0]
        for k, i in enumerate(node.input):
            node.input[k] = prefix + i
        declared = list(g.output)
        for k, o in enumerate(node.output):
            node.output[k] = f"{prefix}{o}"
        del g.input[:]
        del g.output[:]
        for vi, new_name in zip(declared, node.output):
            info = onnx.ValueInfoProto()
            info.CopyFrom(vi)
            info.name = new_name
            g.value_info.append(info)
        for k in range(3):
            src = node.output[k % len(node.output)]
            g.node.append(helper.make_node("Cast", [src], [f"{name}_o{k}"], to=good_dtype))
            g.output.append(helper.make_tensor_value_info(f"{name}_o{k}", good_dtype, None))
        inputs = []
        for vi in model.graph.input:
            info = onnx.ValueInfoProto()
            info.CopyFrom(vi)
            info.name = prefix + vi.name
            inputs.append(info)
        return g, inputs

    then_g, then_in = branch(bad, "bad_", "then")
    else_g, else_in = branch(good, "ok_", "else")
    node = helper.make_node("If", ["use_bad"], ["o0", "o1", "o2"],
                            then_branch=then_g, else_branch=else_g)
    graph = helper.make_graph(
        [node], "guarded",
        [helper.make_tensor_value_info("use_bad", TensorProto.BOOL, [])] + then_in + else_in,
        [helper.make_tensor_value_info(f"o{k}", good_dtype, None) for k in range(3)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(TRAINING_DOMAIN, 1)])
    model.ir_version = 8
    return model


def good_run(sess, rng):
    """Run a correct input (every tensor (2, 5) float32) through the plain Adam session
    ``sess`` and check it against the reference."""
    n = (len(sess.get_inputs()) - 2) // 4
    xs, gs, vs, hs = (list(c) for c in zip(*[group(rng, DEFAULT_SHAPE, F32) for _ in range(n)]))
    outs = sess.run(None, adam_feeds(0.1, 2, xs, gs, vs, hs))
    assert_matches_reference(outs, 0.1, 2, xs, gs, vs, hs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error(make_session, rng, case):
    model = case.model()
    bad_feeds = feeds_for(model, rng, **case.overrides(rng))
    try:
        sess = make_session(model)
    except Exception as exc:  # noqa: BLE001 - any error type, as long as it is clear
        assert_clear(str(exc), case.needles)
        # The process lives on: a correct model loads and runs.
        good_run(make_session(adam_model(1, dynamic=True)), rng)
        return

    with pytest.raises(Exception) as info:
        sess.run(None, bad_feeds)
    assert_clear(str(info.value), case.needles)

    if case.dynamic:
        same = sess
        good_run(same, rng)
        with pytest.raises(Exception) as again:  # and it still fails the same way
            same.run(None, bad_feeds)
        assert_clear(str(again.value), case.needles)
        good_run(same, rng)
        return

    same = make_session(guarded(model, adam_model(1, dynamic=True)))
    flagged = {"bad_" + k: a for k, a in bad_feeds.items()}
    ok_x, ok_g, ok_v, ok_h = group(rng, DEFAULT_SHAPE, F32)
    ok_feeds = {"ok_" + k: a for k, a in adam_feeds(0.1, 2, [ok_x], [ok_g], [ok_v], [ok_h]).items()}
    for _ in range(2):
        with pytest.raises(Exception) as info:
            same.run(None, {"use_bad": np.array(True), **flagged, **ok_feeds})
        assert_clear(str(info.value), case.needles)
        outs = same.run(None, {"use_bad": np.array(False), **flagged, **ok_feeds})
        assert_matches_reference(outs, 0.1, 2, [ok_x], [ok_g], [ok_v], [ok_h])


def test_session_survives_many_errors(make_session, rng):
    """Errors do not leak into later runs: alternate bad and good inputs many times."""
    sess = make_session(adam_model(1, dynamic=True))
    bad = feeds_for(adam_model(1, dynamic=True), rng, G_1=np.zeros((3,), F32))
    for _ in range(50):
        with pytest.raises(Exception):
            sess.run(None, bad)
        good_run(sess, rng)
