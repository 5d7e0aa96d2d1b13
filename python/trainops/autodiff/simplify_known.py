"""What :mod:`.simplify_graph` knows of a step graph's values: onnx's inferred shapes and
element types over the whole forward+backward node list (:func:`step_shapes`), and small
helpers on nodes and shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import onnx
from onnx import TensorProto, helper

from .graph import _dims, node_inputs, skeleton

__all__ = ["Known", "attr", "known", "reads", "static", "step_shapes"]

RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# Default-domain ops whose output changes from run to run: never removed.
STATEFUL = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                      "Multinomial", "Bernoulli", "Dropout"})
INTS = (TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
        TensorProto.UINT64, TensorProto.UINT32, TensorProto.UINT16, TensorProto.UINT8)
FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


@dataclass
class Known:
    """What onnx's inference knows of a graph's values: ``shapes`` (name -> list of int,
    str or None) and ``types`` (name -> TensorProto element type)."""

    shapes: dict = field(default_factory=dict)
    types: dict = field(default_factory=dict)


def step_shapes(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto],
                extra_inputs: Sequence[onnx.ValueInfoProto] = ()) -> Known:
    """The shapes and element types of every value onnx's shape inference (with data
    propagation) finds when ``model``'s graph runs ``nodes`` (in topological order)
    instead of its own; ``extra_inputs``: typed values the graph lacks (the parameters).
    Empty where inference fails: the passes that need them then skip."""
    m = onnx.ModelProto()
    m.CopyFrom(skeleton(model)[0])  # the large initializers' data stays out of inference
    g = m.graph
    have = {i.name for i in g.input} | {i.name for i in g.initializer}
    g.input.extend(v for v in extra_inputs if v.name not in have)
    del g.node[:], g.output[:], g.value_info[:]
    g.node.extend(nodes)
    domains = {o.domain for o in m.opset_import}
    m.opset_import.extend(helper.make_opsetid(d, 1) for d in
                          sorted({n.domain for n in nodes} - domains - {"", "ai.onnx"}))
    try:
        inf = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return Known()
    out = Known()
    for v in list(inf.graph.input) + list(inf.graph.value_info):
        d = _dims(v.type)
        if d is not None:
            out.shapes[v.name] = d
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            out.types[v.name] = v.type.tensor_type.elem_type
    for i in inf.graph.initializer:
        out.shapes[i.name] = [int(x) for x in i.dims]
        out.types[i.name] = i.data_type
    return out


SUBGRAPH = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def reads(node) -> list[str]:
    """What ``node`` reads (:func:`~.graph.node_inputs`, without its cost for the nodes
    that have no subgraph: nearly all)."""
    if any(a.type in SUBGRAPH for a in node.attribute):
        return node_inputs(node)
    return [i for i in node.input if i]


def known(shape) -> bool:
    """Every dimension known: an int or a named symbol."""
    return shape is not None and all(d is not None and d != "" for d in shape)


def static(shape) -> bool:
    """Every dimension an int."""
    return shape is not None and all(isinstance(d, int) for d in shape)


def attr(node, name, default=None):
    """``node``'s attribute ``name`` (its Python value), else ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
