"""Data dependencies that order ONNX Runtime's nodes without changing any value.

ONNX Runtime runs a node once its inputs exist; nothing else orders two nodes. A node that
writes a buffer in place (bound as both input and output through IOBinding) must not run
before a node that still reads the old value, so the writer is made to consume a value
computed from the tensors it has to wait for: :func:`zero_of`, an int64 0 read from one
element of each (a data dependency, which constant folding cannot remove, unlike a
``Shape`` of a static shape). Adding it to an integer, or testing it against 0, changes
no bits. Used by the step graph's barrier (:mod:`trainops.train.barrier`) and by the
standard-op optimizer expansions (:mod:`trainops.portable.emit`).
"""

from __future__ import annotations

from typing import Sequence

import onnx
from onnx import TensorProto, helper

__all__ = ["zero_of"]


def zero_of(values: Sequence[str], name: str, opset: int) -> list[onnx.NodeProto]:
    """Nodes computing ``name``, an int64 scalar 0 that depends on the data of every tensor
    in ``values`` (any type and shape, empty included), reading one element of each
    (``Reshape`` to 1-D, ``Slice`` of the first element, ``Cast`` to bool then int64,
    ``ReduceSum``, ``Mul`` by 0). Every name made starts with ``name + "/"``; ``opset``
    (the default domain's) picks the ``Slice`` form (attributes below 10)."""
    if not values:
        raise ValueError(f"zero_of({name!r}): expected at least one tensor to depend on")
    p = f"{name}/"
    nodes = [helper.make_node("Constant", [], [p + "flat"], value=helper.make_tensor(
                 p + "flat", TensorProto.INT64, [1], [-1])),
             helper.make_node("Constant", [], [p + "zero"], value=helper.make_tensor(
                 p + "zero", TensorProto.INT64, [], [0]))]
    if opset >= 10:
        nodes += [helper.make_node("Constant", [], [p + k], value=helper.make_tensor(
            p + k, TensorProto.INT64, [1], [v])) for k, v in (("start", 0), ("end", 1))]
    ones = []
    for k, v in enumerate(values):
        q = f"{p}{k}/"
        slice_ = (helper.make_node("Slice", [q + "flat", p + "start", p + "end"], [q + "first"])
                  if opset >= 10 else
                  helper.make_node("Slice", [q + "flat"], [q + "first"], starts=[0], ends=[1],
                                   axes=[0]))
        nodes += [helper.make_node("Reshape", [v, p + "flat"], [q + "flat"]), slice_,
                  helper.make_node("Cast", [q + "first"], [q + "bool"], to=TensorProto.BOOL),
                  helper.make_node("Cast", [q + "bool"], [q + "int"], to=TensorProto.INT64)]
        ones.append(q + "int")
    nodes += [helper.make_node("Concat", ones, [p + "all"], axis=0),
              helper.make_node("ReduceSum", [p + "all"], [p + "count"], keepdims=0),
              helper.make_node("Mul", [p + "count", p + "zero"], [name])]
    return nodes
