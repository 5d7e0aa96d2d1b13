"""train.host_reads: which states get a host alias and which nodes read it (no library
needed: the graphs are only rewritten, never run)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from trainops.train.host_reads import HOST_SUFFIX, split_host_reads


def _model(nodes, inputs):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2])
                                       for n in inputs],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _adam(x, g="g"):
    return helper.make_node("Adam", ["r", "t", x, g, "v", "h"], ["x_new", "v_new", "h_new"],
                            domain="ai.onnx.preview.training")


def test_a_weight_read_by_the_optimizer_and_the_forward_pass_gets_a_host_alias():
    model = _model([helper.make_node("MatMul", ["a", "w"], ["y"]), _adam("w")],
                   ["a", "w", "g", "v", "h", "r", "t"])
    out, aliases = split_host_reads(model, ["w", "v", "h"])
    assert aliases == {"w" + HOST_SUFFIX: "w"}  # v and h: the optimizer's alone
    matmul, adam = out.graph.node
    assert list(matmul.input) == ["a", "w" + HOST_SUFFIX]
    assert list(adam.input)[2] == "w"  # the device reads the bound buffer itself
    alias = [vi for vi in out.graph.input if vi.name == "w" + HOST_SUFFIX]
    assert len(alias) == 1 and alias[0].type == [vi for vi in out.graph.input if vi.name == "w"][0].type
    # the caller's model is untouched
    assert list(model.graph.node[0].input) == ["a", "w"]


def test_states_read_on_one_side_only_are_left_alone():
    # w: the optimizer's alone; c: the forward pass's alone
    model = _model([helper.make_node("MatMul", ["a", "c"], ["y"]), _adam("w")],
                   ["a", "c", "w", "g", "v", "h", "r", "t"])
    out, aliases = split_host_reads(model, ["w", "c", "v", "h"])
    assert aliases == {} and out is model


def test_a_host_input_of_a_device_op_is_a_host_read():
    # Philox takes its state (input 0) in host memory: a state read by it and by the CPU
    # is read in host memory by both, no alias
    model = _model([helper.make_node("Philox", ["s", "shape"], ["words", "s_new"], domain="com.trainops"),
                    helper.make_node("Identity", ["s"], ["y"])], ["s", "shape"])
    out, aliases = split_host_reads(model, ["s"])
    assert aliases == {} and out is model


def test_a_taken_alias_name_is_not_reused():
    model = _model([helper.make_node("MatMul", ["a", "w"], ["y"]), _adam("w")],
                   ["a", "w", "g", "v", "h", "r", "t", "w" + HOST_SUFFIX])
    out, aliases = split_host_reads(model, ["w"])
    assert aliases == {} and list(out.graph.node[0].input) == ["a", "w"]


def test_the_device_ops_mirror_the_plugin_eps_claims():
    """DEVICE_OPS is a copy of the library's list of the ops the plugin EP runs on its
    device and their host inputs (crates/trainops-ort/src/ops/mod.rs, device_support): an op
    added there and not here would read host copies of the weights again."""
    import re
    from pathlib import Path

    from trainops.train.host_reads import DEVICE_OPS

    root = Path(__file__).resolve().parent.parent
    src = (root / "crates/trainops-ort/src/ops/mod.rs").read_text()
    body = src[src.index("pub fn device_support"):]
    body = body[:body.index("_ => None")]
    named = {"SCALARS": frozenset({0, 1})}
    found = {}
    arm = r'\(b"([^"]+)", ((?:b"\w+"(?: \| )?)+)\) => support\((SCALARS|&\[[^\]]*\]),'
    for domain, ops, host in re.findall(arm, body):
        hosts = named.get(host) or frozenset(int(i) for i in re.findall(r"\d+", host))
        for op in re.findall(r'b"(\w+)"', ops):
            found[(domain, op)] = hosts
    assert found and found == DEVICE_OPS
