"""Shape facts onnx's inference misses, recovered by folding constants
(:func:`fold_shape_constants`).

Exporters compute shapes inside the graph: torch's classic exporter writes
``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` chains, and index arithmetic such as
``Mod(Add(3, -1), 3)`` that feeds a ``Slice`` of a shape. onnx's shape inference (even with
``data_prop``) loses the rank of what follows, and a gradient rule that needs a rank
fails. Folding every node whose inputs are all constants (Constant nodes, integer and bool
initializers, results folded before, and ``Shape``/``Size`` of a tensor whose inferred
shape is static) into a Constant brings the facts back. Float initializers are never
folded in (they may be parameters), nor random ops, nor results over
:data:`MAX_ELEMENTS` elements. Nodes keep their positions (a folded node becomes a
Constant in place), so the Philox keys of random nodes do not move.
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..offload import is_offloaded
from .constants import constant_value
from .graph import default_opset, infer

__all__ = ["MAX_ELEMENTS", "fold_shape_constants"]

MAX_ELEMENTS = 4096

FOLDABLE = frozenset({
    "Shape", "Size", "Gather", "Squeeze", "Unsqueeze", "Concat", "Slice", "Cast", "Add",
    "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Equal", "Less", "Greater", "LessOrEqual",
    "GreaterOrEqual", "Not", "And", "Or", "Where", "Reshape", "Identity", "ConstantOfShape",
    "Expand", "Range", "Max", "Min", "Floor", "Ceil", "Sqrt", "ReduceProd", "ReduceSum",
    "Transpose", "Flatten", "Sign"})


def _static(vi) -> list[int] | None:
    if vi is None or not vi.type.HasField("tensor_type"):
        return None
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return dims


def _predicted_size(node: onnx.NodeProto, vals: list[np.ndarray]) -> int | None:
    """The output size of the ops that make big tensors from small inputs (None: unknown
    before running)."""
    if node.op_type == "ConstantOfShape":
        return int(np.prod(vals[0])) if vals[0].size else 1
    if node.op_type == "Expand":
        shape = np.broadcast_shapes(vals[0].shape, tuple(int(v) for v in vals[1]))
        return int(np.prod(shape))
    if node.op_type == "Range":
        start, limit, delta = (float(v) for v in vals)
        return max(int(np.ceil((limit - start) / delta)), 0) if delta else None
    return max([v.size for v in vals] + [1])


def _evaluate(node: onnx.NodeProto, vals: list, opset: int) -> list[np.ndarray]:
    """``node`` run by onnx's reference evaluator on ``vals`` (None: an absent input)."""
    from onnx.reference import ReferenceEvaluator

    names = [f"in{k}" if v is not None else "" for k, v in enumerate(vals)]
    n = onnx.NodeProto()
    n.CopyFrom(node)
    del n.input[:]
    n.input.extend(names)
    inputs = [helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(v.dtype),
                                            list(v.shape))
              for nm, v in zip(names, vals) if nm]
    outs = [helper.make_empty_tensor_value_info(o) for o in n.output if o]
    g = helper.make_graph([n], "fold", inputs, outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = helper.find_min_ir_version_for(list(m.opset_import))
    return ReferenceEvaluator(m).run(None, {nm: v for nm, v in zip(names, vals) if nm})


def fold_shape_constants(model: onnx.ModelProto, rounds: int = 4) -> int:
    """Fold ``model``'s constant shape computations (in place; see the module). Returns the
    number of nodes folded."""
    g = model.graph
    opset = default_opset(model)
    total = 0
    for _ in range(rounds):
        consts: dict[str, np.ndarray] = {}
        for init in g.initializer:
            if init.data_type not in (TensorProto.FLOAT, TensorProto.DOUBLE,
                                      TensorProto.FLOAT16, TensorProto.BFLOAT16) \
                    and not is_offloaded(init):
                consts[init.name] = numpy_helper.to_array(init)
        vi = {v.name: v for v in infer(model).graph.value_info}
        vi.update({v.name: v for v in g.input})
        folded = 0
        for idx, node in enumerate(list(g.node)):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Constant":
                value = constant_value(node)
                if value is not None:
                    consts[node.output[0]] = value
                continue
            if node.op_type not in FOLDABLE or len(node.output) != 1 or any(
                    a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                    for a in node.attribute):
                continue
            if node.op_type in ("Shape", "Size"):
                dims = _static(vi.get(node.input[0]))
                if dims is None:
                    continue
                if node.op_type == "Size":
                    value = np.array(int(np.prod(dims)), np.int64)
                else:
                    start = next((a.i for a in node.attribute if a.name == "start"), 0)
                    end = next((a.i for a in node.attribute if a.name == "end"), None)
                    value = np.array(dims[start:end], np.int64)
            else:
                ins = list(node.input)
                if not ins or any(i and i not in consts for i in ins):
                    continue
                vals = [consts[i] if i else None for i in ins]
                try:
                    size = _predicted_size(node, [v for v in vals if v is not None])
                    if size is None or size > MAX_ELEMENTS:
                        continue
                    value = np.asarray(_evaluate(node, vals, opset)[0])
                except Exception:  # noqa: BLE001 - not foldable here: leave it to run time
                    continue
                if value.size > MAX_ELEMENTS:
                    continue
            out = node.output[0]
            const = helper.make_node("Constant", [], [out], name=node.name or f"folded/{out}",
                                     value=numpy_helper.from_array(value, out))
            g.node[idx].CopyFrom(const)
            consts[out] = value
            folded += 1
        total += folded
        if not folded:
            break
    return total
