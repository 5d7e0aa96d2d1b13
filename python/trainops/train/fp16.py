"""The float16 rewrite of a forward graph for ``mixed_float16`` training
(:func:`to_fp16_graph`): compute in float16 on float16 copies of float32 master weights."""

from __future__ import annotations

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..autodiff.constants import constant_type, constant_value
from .spec import PREFIX as _P

__all__ = ["to_fp16_graph"]


def to_fp16_graph(graph: onnx.GraphProto, params: list[str], data_inputs: list[str]) -> dict:
    """Turn a float32 forward graph into float16 compute in place: float32 data inputs
    and parameters are cast (parameters arrive as float16 copies), other float32
    initializers and Constants become float16, Casts to float become Casts to float16.
    Returns {param: name of its float16 copy}."""
    copies = {p: f"{_P}/{p}/float16" for p in params}
    renames = dict(copies)
    pre = []
    for name in data_inputs:
        vi = next(i for i in graph.input if i.name == name)
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            new = f"{_P}/{name}/float16"
            pre.append(helper.make_node("Cast", [name], [new], to=TensorProto.FLOAT16,
                                        name=f"{_P}/cast_{name}"))
            renames[name] = new
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in params:
            init.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float16), init.name))
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        if constant_type(node) == TensorProto.FLOAT and node.attribute[0].name != "value":
            # value_float(s) or sparse_value: written as a value tensor, converted below
            value = constant_value(node)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute(
                "value", numpy_helper.from_array(value, node.output[0])))
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.FLOAT16
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(a.t).astype(np.float16), a.t.name))
    # Exporters record intermediate types (torch's dynamo exporter: every tensor's); the
    # float32 ones are float16 now, and a stale entry makes onnxruntime refuse the graph
    # ("type mismatch"): they go, and shape inference writes them again.
    kept = [vi for vi in graph.value_info if vi.type.tensor_type.elem_type != TensorProto.FLOAT]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    # The casts go last so the model's nodes keep their positions (Philox node keys depend
    # on them); the caller sorts the graph before inferring it.
    graph.node.extend(pre)
    return copies
