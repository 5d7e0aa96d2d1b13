"""What an exported graph says about its initializers beyond the op positions that read
them (:func:`.params.default_params` uses these facts to leave out what torch does not
train).

- :func:`torch_kinds`: torch's dynamo exporter records, for each initializer it lifted
  from the module, whether it was a PARAMETER, a BUFFER or a CONSTANT_TENSOR
  (``pkg.torch.export.graph_signature.InputSpec.kind`` on the value's metadata, and the
  FX placeholder name ``p_``/``b_``/``c_...`` in ``pkg.torch.onnx.original_node_name``);
- :func:`exporter_named`: names exporters give the constants they make themselves
  (classic ``onnx::Add_12`` and ``/enc/Constant_output_0``, dynamo ``val_12``,
  ``_val_12``, ``_tensor_constant0``, ``lifted_tensor_0``), never a module path such as
  ``model.decoder.layers.0.fc1.weight``;
- :func:`value_reach`: the tensors whose values (not only their shape, or a mask made by
  comparing them) reach a graph output;
- :func:`index_like`: the tensors computed from integers only (shapes, ``Range``,
  positions), possibly cast to float: a weight multiplied by them is positional arithmetic
  (rotary frequencies times positions), not a layer;
- :func:`is_mask` and :func:`sinusoid_tables`: value tests for an additive attention mask
  (zeros and huge negatives) and for frozen sine/cosine tables (row 0 is sin 0 = 0 and
  cos 0 = 1, and sin^2 + cos^2 = 1 everywhere).
"""

from __future__ import annotations

import re

import numpy as np

import onnx
from onnx import TensorProto, numpy_helper

from ..offload import is_offloaded

__all__ = ["exporter_named", "index_like", "is_mask", "sinusoid_tables", "torch_kinds",
           "value_reach"]

KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
ORIGINAL_KEY = "pkg.torch.onnx.original_node_name"
_PLACEHOLDER_KIND = {"p_": "PARAMETER", "b_": "BUFFER", "c_": "CONSTANT_TENSOR"}

_EXPORTER_NAME = re.compile(
    r"^(onnx::.*|/.*_output_\d+|_?val_\d+|_tensor_constant\d*|lifted_tensor_\d+)$")


def exporter_named(name: str) -> bool:
    """Whether ``name`` is one exporters give the constants they create (see the module)."""
    return bool(_EXPORTER_NAME.match(name))


def _props(proto) -> dict[str, str]:
    return {p.key: p.value for p in getattr(proto, "metadata_props", ())}


def torch_kinds(graph: onnx.GraphProto) -> dict[str, str]:
    """Initializer name -> torch's kind for it (PARAMETER, BUFFER, CONSTANT_TENSOR), where
    the dynamo exporter recorded one (on the initializer or its value_info)."""
    out: dict[str, str] = {}
    for proto in list(graph.value_info) + list(graph.input) + list(graph.initializer):
        props = _props(proto)
        kind = props.get(KIND_KEY)
        original = props.get(ORIGINAL_KEY, "")
        if kind is None:
            kind = next((k for p, k in _PLACEHOLDER_KIND.items() if original.startswith(p)),
                        None)
        if kind:
            out[proto.name] = kind
    return out


# Input positions that carry a shape, an index, axes or a mask, not values, by op type.
_NOT_VALUES: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Gather": (1,),
    "GatherND": (1,), "GatherElements": (1,), "ScatterND": (1,), "ScatterElements": (1,),
    "Pad": (1, 3), "Resize": (1, 2, 3), "TopK": (1,), "Unsqueeze": (1,), "Squeeze": (1,),
    "Split": (1,), "Where": (0,), "Trilu": (1,), "CumSum": (1,), "OneHot": (0, 1),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
    "ReduceProd": (1,), "Dropout": (1, 2), "ConstantOfShape": (0,),
}
# Ops whose outputs are shapes, indices or booleans: none of their inputs' values pass on.
_INDEX_OUT = frozenset({
    "Shape", "Size", "Range", "NonZero", "ArgMax", "ArgMin", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"})
_INTS = {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
         TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
         TensorProto.BOOL}


def _cast_to_index(n: onnx.NodeProto) -> bool:
    return n.op_type == "Cast" and any(a.name == "to" and a.i in _INTS for a in n.attribute)


def value_reach(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> set[str]:
    """The tensors of ``nodes`` whose values reach an output of ``graph``: a tensor read
    only as a shape, an index, a Where condition or through a comparison does not. The
    results no node reads count as outputs (a graph cut before its outputs were named)."""
    producer = {o: n for n in nodes for o in n.output if o}
    read = {i for n in nodes for i in n.input if i}
    reached: set[str] = set()
    todo = [o.name for o in graph.output] + [o for o in producer if o not in read]
    while todo:
        t = todo.pop()
        if t in reached:
            continue
        reached.add(t)
        n = producer.get(t)
        if n is None or n.op_type in _INDEX_OUT or _cast_to_index(n):
            continue
        skip = _NOT_VALUES.get(n.op_type, ())
        todo.extend(i for k, i in enumerate(n.input) if i and k not in skip)
        # An If/Loop/Scan passes on what its subgraphs read: all of it counts (kept
        # simple: a subgraph is rare in exports and seldom holds a mask computation).
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                todo.extend(o.name for o in sub.output)
                todo.extend(i for m in _subgraph_nodes(sub) for i in m.input if i)
    return reached


def _subgraph_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    out = []
    for n in graph.node:
        out.append(n)
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                out.extend(_subgraph_nodes(sub))
    return out


def _arange(value: np.ndarray) -> bool:
    flat = value.reshape(-1)
    return flat.size >= 2 and bool(np.array_equal(flat, np.arange(flat.size)))


def index_like(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> set[str]:
    """The tensors computed from positions: Shape, Size and Range results, integer graph
    inputs (ids, positions), integer constants of two or more elements (a stored
    ``position_ids``) and float ones holding ``0, 1, ..., n-1`` (positions folded to
    float), and every result of such tensors and integer scalars alone (a Cast of
    positions to float included). An integer scalar alone is no position: a weight times
    ``Cast(2)`` stays a weight."""
    ints = {i.name for i in graph.input if i.type.tensor_type.elem_type in _INTS}
    out = set(ints)

    def constant(name, t):
        if t.data_type in _INTS:
            ints.add(name)
            if int(np.prod(t.dims, dtype=np.int64)) >= 2:
                out.add(name)
        elif t.data_type in _FLOATS and not is_offloaded(t) \
                and _arange(numpy_helper.to_array(t)):
            out.add(name)

    for init in graph.initializer:
        constant(init.name, init)
    for n in nodes:
        if n.op_type == "Constant":
            v = next((a.t for a in n.attribute if a.name == "value"), None)
            if v is not None:
                constant(n.output[0], v)
            elif any(a.name in ("value_int", "value_ints") for a in n.attribute):
                ints.add(n.output[0])
            continue
        ins = [i for i in n.input if i]
        if n.op_type in ("Shape", "Size", "Range") or (
                ins and all(i in out or i in ints for i in ins) and any(i in out for i in ins)):
            out.update(o for o in n.output if o)
    return out


_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def is_mask(value: np.ndarray) -> bool:
    """An additive attention mask: every value 0 or hugely negative (-inf, float's
    lowest, -1e4 and below), at least one of them negative."""
    v = value.astype(np.float64)
    neg = v <= -1e4
    return bool(neg.any() and np.all(neg | (v == 0)))


def _sin_cos(s: np.ndarray, c: np.ndarray) -> bool:
    """``s`` and ``c`` (positions along axis -2) are sin and cos of position times
    frequencies: at position 0 sin is 0 and cos is 1, sin^2 + cos^2 = 1 everywhere (to
    float16's rounding: a float16 table of width 2 ** -10), and sin is not all zero."""
    if s.shape != c.shape or s.ndim < 2 or s.shape[-2] < 2 or s.size == 0:
        return False
    s, c = s.astype(np.float64), c.astype(np.float64)
    return bool(np.all(s[..., 0, :] == 0) and np.all(c[..., 0, :] == 1) and np.any(s != 0)
                and np.max(np.abs(s * s + c * c - 1)) <= 4 * 2.0 ** -10)


def sinusoid_tables(values: dict[str, np.ndarray]) -> set[str]:
    """The names among ``values`` that are frozen sine/cosine tables: one table holding
    sines and cosines side by side (halves of the last axis, as Whisper's encoder
    positions) or interleaved (even/odd columns), or a pair of tables of one shape (the
    rotary cos and sin an exporter folded)."""
    out = set()
    zero_row, one_row = [], []
    for name, v in values.items():
        if v.ndim < 2 or v.shape[-2] < 2:
            continue
        w = v.shape[-1]
        if w % 2 == 0 and (_sin_cos(v[..., : w // 2], v[..., w // 2:])
                           or _sin_cos(v[..., 0::2], v[..., 1::2])):
            out.add(name)
        row = v[..., 0, :]
        if np.all(row == 0):
            zero_row.append(name)
        elif np.all(row == 1):
            one_row.append(name)
    for s in zero_row:
        for c in one_row:
            if _sin_cos(values[s], values[c]):
                out |= {s, c}
    return out
