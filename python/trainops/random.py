"""Reproducible randomness for ONNX models: Philox states and ``make_reproducible``.

The ops ``com.trainops::PhiloxUniform``, ``PhiloxNormal`` and ``PhiloxDropout`` draw their
random numbers from a Philox4x32-10 *state*, a ``uint32`` tensor of six words
``[c0, c1, c2, c3, k0, k1]`` (a 128-bit counter, least significant word first, and a 64-bit
key), and return the state advanced past the words they used. The same state gives the same
numbers in any session, on any machine, for any thread count. ::

    import trainops.random as tr

    s = tr.state(seed=1234)                  # key from the seed's 64 bits, counter 0
    model = tr.make_reproducible(model, seed=1234)

:func:`state` makes a state: the key is the seed's 64 bits, ``k0`` the low word and ``k1``
the high word (a negative seed is taken as its 64-bit two's complement); the counter is
``counter`` (0 to 2^128 - 1).

:func:`make_reproducible` rewrites every ``RandomUniform``, ``RandomNormal``,
``RandomUniformLike``, ``RandomNormalLike`` and ``Dropout`` node of a model's main graph
into the Philox ops. The node at position ``i`` of ``graph.node`` gets

- a graph input ``trainops_rng_state_<i>`` (uint32, ``[6]``) whose default (an initializer)
  is its seeded state: key :func:`node_key`\\ ``(seed, i)``, counter 0;
- a graph output ``trainops_rng_state_<i>_out``: the state after the node, to feed back as
  ``trainops_rng_state_<i>`` for the next draw (a training step); without feeding it, every
  run draws the same numbers.

``node_key(seed, i)`` is output ``i`` of SplitMix64 seeded with ``seed``: a bijection of
``seed + (i + 1) * 0x9E3779B97F4A7C15`` (mod 2^64), so one model's nodes never share a key and
their streams never overlap. Dropout keeps ONNX's semantics: ``ratio`` (default 0.5),
``training_mode`` (default false: output = data, mask all true) and the optional ``mask``;
a ratio that is not float32 is cast to float32 (``PhiloxDropout`` declares it float). A
random node's own ``seed`` attribute is dropped. Nodes inside subgraphs (``If``, ``Loop``,
``Scan`` bodies) are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from .onnx_defs import IR_VERSION, TRAINOPS_DOMAIN, opset_imports, tensor_type

__all__ = [
    "DOMAIN",
    "RANDOM_OPS",
    "STATE_INPUT",
    "STATE_OUTPUT",
    "state",
    "counter_of",
    "node_key",
    "make_reproducible",
    "uniform_model",
    "normal_model",
    "dropout_model",
]

DOMAIN = TRAINOPS_DOMAIN
RANDOM_OPS = ("RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Dropout")
STATE_INPUT = "trainops_rng_state_{index}"
STATE_OUTPUT = "trainops_rng_state_{index}_out"

_M64 = (1 << 64) - 1
_M128 = (1 << 128) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_FLOAT, _FLOAT16, _DOUBLE, _BFLOAT16 = 1, 10, 11, 16
_DTYPES = (_FLOAT, _DOUBLE, _FLOAT16, _BFLOAT16)


def _seed_bits(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    seed = int(seed)
    if not -(1 << 63) <= seed <= _M64:
        raise ValueError(f"seed must fit in 64 bits (-2**63 <= seed < 2**64), got {seed}")
    return seed & _M64


def state(seed: int, counter: int = 0) -> np.ndarray:
    """A Philox state ``[c0, c1, c2, c3, k0, k1]`` (uint32, shape ``[6]``): key ``k0 = seed
    & 0xFFFFFFFF``, ``k1 = (seed >> 32) & 0xFFFFFFFF`` (a negative seed as its 64-bit two's
    complement); counter ``c0 | c1 << 32 | c2 << 64 | c3 << 96 = counter``."""
    key = _seed_bits(seed)
    if isinstance(counter, bool) or not isinstance(counter, (int, np.integer)):
        raise TypeError(f"counter must be an int, got {type(counter).__name__}")
    counter = int(counter)
    if not 0 <= counter <= _M128:
        raise ValueError(f"counter must be in [0, 2**128), got {counter}")
    words = [(counter >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
    return np.array(words + [key & 0xFFFFFFFF, key >> 32], dtype=np.uint32)


def counter_of(s: Any) -> int:
    """The 128-bit counter of a state (any shape with six elements)."""
    w = [int(x) for x in np.asarray(s, dtype=np.uint32).ravel()]
    if len(w) != 6:
        raise ValueError(f"a Philox state has 6 elements, got {len(w)}")
    return w[0] | w[1] << 32 | w[2] << 64 | w[3] << 96


def node_key(seed: int, index: int) -> int:
    """The 64-bit key of the node at ``index``: SplitMix64's output ``index`` for ``seed``."""
    z = (_seed_bits(seed) + (int(index) + 1) * _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


# --------------------------------------------------------------------------------------
# make_reproducible


def _attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model, domain: str = "") -> int:
    for o in model.opset_import:
        if o.domain in (domain, "ai.onnx" if domain == "" else domain):
            return int(o.version)
    return 0


def _known_types(model) -> dict[str, Any]:
    """Name -> TypeProto for every value onnx's shape inference can type."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model onnx cannot infer (custom ops): use what it declares
        inferred = model
    g = inferred.graph
    types = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type
    for init in g.initializer:
        if init.name not in types:
            types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
    return types


def _shape_of(type_proto) -> Optional[list]:
    if not type_proto.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in type_proto.tensor_type.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return dims


def make_reproducible(model: Any, seed: int) -> Any:
    """A copy of ``model`` whose random nodes draw from Philox states (see the module's
    documentation for the names and keys). Raises ``ValueError`` naming the node when a
    node cannot be rewritten (a ``*Like`` node or a Dropout whose input type is unknown, a
    dtype the Philox ops do not produce, Dropout before opset 10)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    _seed_bits(seed)
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load_model_from_string(bytes(model)) if isinstance(model, (bytes, bytearray)) \
            else onnx.load(str(model))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    types = _known_types(model)
    opset = _opset(model)
    taken = {n for node in g.node for n in list(node.input) + list(node.output)}
    taken |= {v.name for v in list(g.input) + list(g.output) + list(g.initializer)}

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    def where(i, node) -> str:
        return f"node {i} ({node.op_type} {node.name!r})"

    def dtype_of(name: str, i, node) -> int:
        t = types.get(name)
        if t is None:
            raise ValueError(f"make_reproducible: {where(i, node)}: the type of input {name!r} is "
                             "unknown; declare it (value_info) so the output type can be set")
        return int(t.tensor_type.elem_type)

    def check_dtype(dtype: int, i, node) -> int:
        if dtype not in _DTYPES:
            raise ValueError(f"make_reproducible: {where(i, node)}: dtype {dtype} is not one of "
                             "float (1), double (11), float16 (10), bfloat16 (16)")
        return dtype

    new_nodes, new_values, count = [], [], 0
    for i, node in enumerate(g.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in RANDOM_OPS:
            new_nodes.append(node)
            continue
        count += 1
        a = _attrs(node)
        st_in = fresh(STATE_INPUT.format(index=i))
        st_out = fresh(STATE_OUTPUT.format(index=i))
        key = node_key(seed, i)
        init = numpy_helper.from_array(state(key), st_in)
        g.initializer.append(init)
        g.input.append(helper.make_tensor_value_info(st_in, TensorProto.UINT32, [6]))
        g.output.append(helper.make_tensor_value_info(st_out, TensorProto.UINT32, [6]))
        name = node.name or f"{node.op_type}_{i}"
        op = node.op_type
        if op in ("RandomUniform", "RandomNormal"):
            dtype = check_dtype(int(a.get("dtype", _FLOAT)), i, node)
            attrs = {"shape": list(a["shape"]), "dtype": dtype}
            shape = list(a["shape"])
            inputs = [st_in]
        elif op in ("RandomUniformLike", "RandomNormalLike"):
            src = node.input[0]
            dtype = check_dtype(int(a["dtype"]) if "dtype" in a else dtype_of(src, i, node), i, node)
            shape_name = fresh(f"{name}_shape")
            new_nodes.append(helper.make_node("Shape", [src], [shape_name], name=f"{name}_shape"))
            attrs = {"dtype": dtype}
            t = types.get(src)
            shape = _shape_of(t) if t is not None else None
            inputs = [st_in, shape_name]
        if op.startswith("RandomUniform"):
            attrs.update(low=float(a.get("low", 0.0)), high=float(a.get("high", 1.0)))
            new_nodes.append(helper.make_node("PhiloxUniform", inputs, [node.output[0], st_out],
                                              domain=DOMAIN, name=name, **attrs))
            new_values.append(helper.make_tensor_value_info(node.output[0], dtype, shape))
        elif op.startswith("RandomNormal"):
            attrs.update(mean=float(a.get("mean", 0.0)), scale=float(a.get("scale", 1.0)))
            new_nodes.append(helper.make_node("PhiloxNormal", inputs, [node.output[0], st_out],
                                              domain=DOMAIN, name=name, **attrs))
            new_values.append(helper.make_tensor_value_info(node.output[0], dtype, shape))
        else:  # Dropout
            if opset < 10:
                raise ValueError(f"make_reproducible: {where(i, node)}: Dropout before opset 10 "
                                 f"(this model imports opset {opset}) is not rewritten")
            data = node.input[0]
            dtype = check_dtype(dtype_of(data, i, node), i, node)
            ins = list(node.input[1:3]) if opset >= 12 else []
            if opset < 12:  # ratio was an attribute; training was never on (inference)
                ratio_name = fresh(f"{name}_ratio")
                g.initializer.append(numpy_helper.from_array(
                    np.array(a.get("ratio", 0.5), np.float32), ratio_name))
                ins = [ratio_name]
            ins = ins + [""] * (2 - len(ins))
            if ins[0] and ins[0] in types and types[ins[0]].tensor_type.elem_type != _FLOAT:
                # PhiloxDropout's ratio is float: ONNX Runtime cannot type an op with two
                # inputs of undeclared type (docs/ops/random.md, PhiloxDropout).
                cast = fresh(f"{name}_ratio_float")
                new_nodes.append(helper.make_node("Cast", [ins[0]], [cast], to=_FLOAT,
                                                  name=f"{name}_ratio_cast"))
                ins[0] = cast
            outs = [node.output[0], node.output[1] if len(node.output) > 1 else "", st_out]
            new_nodes.append(helper.make_node("PhiloxDropout", [data] + ins + [st_in], outs,
                                              domain=DOMAIN, name=name))
            shape = _shape_of(types[data]) if data in types else None
            new_values.append(helper.make_tensor_value_info(node.output[0], dtype, shape))
            if outs[1]:
                new_values.append(helper.make_tensor_value_info(outs[1], TensorProto.BOOL, shape))
    if not count:
        return out
    del g.node[:]
    g.node.extend(new_nodes)
    declared = {v.name for v in list(g.value_info) + list(g.output)}
    g.value_info.extend(v for v in new_values if v.name not in declared)
    # A declared type that disagrees (e.g. an old value_info) would fail at load: replace it.
    fresh_types = {v.name: v for v in new_values}
    for vi in list(g.value_info) + list(g.output):
        if vi.name in fresh_types and vi.type.tensor_type.elem_type != \
                fresh_types[vi.name].type.tensor_type.elem_type:
            vi.type.tensor_type.elem_type = fresh_types[vi.name].type.tensor_type.elem_type
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.extend(opset_imports([DOMAIN]))
    if out.ir_version < 4:  # inputs with initializer defaults
        out.ir_version = 4
    return out


# --------------------------------------------------------------------------------------
# One-node models of the ops


def _dist_model(op: str, shape: Optional[Sequence[int]], dtype: Any, state_out: bool,
                dynamic: bool, attrs: dict[str, Any], output_shape: Any = None):
    from .models import node_model

    state_shape = None if dynamic else (6,)
    inputs = [("state", np.uint32, state_shape)]
    attrs = {k: v for k, v in attrs.items() if v is not None}
    if shape is None:
        inputs.append(("shape", np.int64, None if dynamic else [None]))
    else:
        attrs["shape"] = [int(d) for d in shape]
    if dtype is not None:
        attrs["dtype"] = tensor_type(dtype)
    out_type = tensor_type(np.float32 if dtype is None else dtype)
    outputs = [("output", out_type, output_shape)]
    if state_out:
        outputs.append(("state_out", np.uint32, state_shape))
    return node_model(op, inputs, outputs, domain=DOMAIN, **attrs)


def uniform_model(shape: Optional[Sequence[int]] = None, dtype: Any = None, *,
                  low: Optional[float] = None, high: Optional[float] = None,
                  state_out: bool = True, dynamic: bool = False):
    """A ``PhiloxUniform`` model: input ``state`` and, when ``shape`` is None, ``shape``
    (int64 1-D); outputs ``output`` and (``state_out``) ``state_out``. ``dtype`` (numpy or
    ONNX enum; None leaves the attribute out: float32)."""
    return _dist_model("PhiloxUniform", shape, dtype, state_out, dynamic,
                       {"low": low, "high": high})


def normal_model(shape: Optional[Sequence[int]] = None, dtype: Any = None, *,
                 mean: Optional[float] = None, scale: Optional[float] = None,
                 state_out: bool = True, dynamic: bool = False):
    """A ``PhiloxNormal`` model, like :func:`uniform_model`."""
    return _dist_model("PhiloxNormal", shape, dtype, state_out, dynamic,
                       {"mean": mean, "scale": scale})


def dropout_model(dtype: Any = np.float32, *, ratio: Any = np.float32,
                  training_mode: bool = True, mask: bool = True, state_out: bool = True,
                  shape: Any = None):
    """A ``PhiloxDropout`` model: inputs ``data`` (``dtype``), ``ratio`` (a scalar of dtype
    ``ratio``; None leaves it out), ``training_mode`` (bool scalar, when ``training_mode``),
    ``state``; outputs ``output``, ``mask`` (when ``mask``), ``state_out`` (when
    ``state_out``). ``shape``: data's declared shape (None: unknown rank)."""
    from onnx import helper

    elem = tensor_type(dtype)
    vi = helper.make_tensor_value_info
    inputs = [vi("data", elem, shape)]
    names = ["data"]
    if ratio is not None:
        inputs.append(vi("ratio", tensor_type(ratio), []))
        names.append("ratio")
    else:
        names.append("")
    if training_mode:
        inputs.append(vi("training_mode", helper.TensorProto.BOOL, []))
        names.append("training_mode")
    else:
        names.append("")
    inputs.append(vi("state", helper.TensorProto.UINT32, [6]))
    names.append("state")
    outputs = [vi("output", elem, shape)]
    out_names = ["output", "mask" if mask else "", "state_out" if state_out else ""]
    if mask:
        outputs.append(vi("mask", helper.TensorProto.BOOL, shape))
    if state_out:
        outputs.append(vi("state_out", helper.TensorProto.UINT32, [6]))
    while out_names and out_names[-1] == "":
        out_names.pop()
    node = helper.make_node("PhiloxDropout", names, out_names, domain=DOMAIN, name="dropout")
    graph = helper.make_graph([node], "philox_dropout", inputs, outputs)
    model = helper.make_model(graph, opset_imports=opset_imports(["", DOMAIN]),
                              producer_name="trainops")
    model.ir_version = IR_VERSION
    return model
