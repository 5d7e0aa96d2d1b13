"""Emitting backward-graph nodes: unique names, constants, opset-aware helpers, and the
static shapes and element types that onnx's shape inference found for the forward graph.

Shapes are lists of ``int`` (known), ``str`` (symbolic, e.g. a batch dimension) or
``None`` (unknown); a whole shape is ``None`` when even the rank is unknown.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..offload import is_offloaded
from ..onnx_defs import TRAINOPS_DOMAIN
from .constants import constant_type, constant_value

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                         TensorProto.BFLOAT16})


class GradientError(ValueError):
    """The backward graph cannot be built (an op without a gradient rule, an unsupported
    attribute, a shape that must be known statically, ...). The message names the op type
    and the node."""


def _dims(type_proto) -> list[Any] | None:
    if not type_proto.HasField("tensor_type"):
        return None
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return None
    out: list[Any] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


class Builder:
    """Collects the nodes of a backward graph for a model of default-domain ``opset``."""

    def __init__(self, graph: onnx.GraphProto, opset: int, prefix: str = "grad"):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix
        self._used: set[str] = set()
        self._count = 0
        # Rules may emit trainops' gradient kernels (com.trainops) instead of their
        # standard-op forms: set by the Trainer for the CPU placement (StepOptions.fused).
        self.fused = False
        self.types: dict[str, int] = {}
        self.shapes: dict[str, list[Any] | None] = {}
        self.consts: dict[str, np.ndarray] = {}
        # Gradients made by adding updates into zeros (ScatterND 'add', GatherGrad): output
        # -> the same scatter into a given base. Where one meets another gradient of the same
        # tensor (a tied embedding), the backward scatters into that one instead of an Add.
        self.scatters: dict[str, Callable[[str], str]] = {}
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            self._used.add(vi.name)
            if vi.type.HasField("tensor_type"):
                self.types[vi.name] = vi.type.tensor_type.elem_type
                self.shapes[vi.name] = _dims(vi.type)
        for init in graph.initializer:
            self._used.add(init.name)
            self.types[init.name] = init.data_type
            self.shapes[init.name] = [int(d) for d in init.dims]
            if not is_offloaded(init):  # a frozen weight held outside: no constant to fold
                self.consts[init.name] = numpy_helper.to_array(init)
        for node in graph.node:
            self._used.update(node.output)
            for sub in subgraphs(node):  # no emitted name may shadow a subgraph's value
                self._used.update(defined_in(sub, nested=True))
            arr = constant_value(node)
            if arr is not None:
                self.consts[node.output[0]] = arr
                self.types[node.output[0]] = constant_type(node)
                self.shapes[node.output[0]] = list(arr.shape)

    # -- names and nodes ---------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        while True:
            self._count += 1
            name = f"{self.prefix}/{hint}_{self._count}"
            if name not in self._used:
                self._used.add(name)
                return name

    def op(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1,
           **attrs) -> Any:
        """Emit one node; returns its output name (or list of names when ``outputs`` > 1
        or a list). A Cast of a tensor known to have the target type already is no node:
        its input is returned (onnxruntime removes such a Cast, and where it precedes a
        ``Mul(it, Div(1, b))`` the removal leaves the Mul naming it: an invalid model)."""
        to = attrs.get("to") if op_type == "Cast" else None
        if to is not None and outputs == 1 and self.types.get(inputs[0]) == to:
            return inputs[0]
        if isinstance(outputs, int):
            names = [self.fresh(op_type) for _ in range(outputs)]
        else:
            names = list(outputs)
            self._used.update(names)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), names,
                                           name=self.fresh(op_type + "_node"), **attrs))
        if to is not None:
            self.types.setdefault(names[0], to)
        if isinstance(outputs, int) and outputs == 1:
            return names[0]
        return names

    def fuses(self, *names: str) -> bool:
        """True when a rule should emit trainops' gradient kernel (``com.trainops``):
        :attr:`fused` is set and every tensor in ``names`` is float32 (the kernels' type)."""
        return self.fused and all(self.types.get(n) == TensorProto.FLOAT for n in names)

    def const(self, value, dtype=None, hint: str = "const") -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh(hint)
        self.nodes.append(helper.make_node("Constant", [], [name], name=self.fresh("Constant_node"),
                                           value=numpy_helper.from_array(arr, name)))
        self.consts[name] = arr
        self.types[name] = helper.np_dtype_to_tensor_dtype(arr.dtype)
        self.shapes[name] = list(arr.shape)
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), np.int64), hint="ints")

    def scalar(self, value: float, like: str) -> str:
        """A 0-d constant of ``like``'s float element type."""
        return self.const(np.asarray(value, dtype=self.np_dtype(like)), hint="scalar")

    # -- what the forward graph knows ------------------------------------------------
    def dtype(self, name: str) -> int | None:
        return self.types.get(name)

    def np_dtype(self, name: str):
        t = self.types.get(name)
        if t is None:
            raise GradientError(f"the element type of tensor '{name}' is unknown "
                                "(onnx shape inference could not find it)")
        if t == TensorProto.BFLOAT16:
            raise GradientError(f"tensor '{name}' is bfloat16: gradient constants need "
                                "float16, float or double")
        return helper.tensor_dtype_to_np_dtype(t)

    def shape(self, name: str) -> list[Any] | None:
        return self.shapes.get(name)

    def rank(self, name: str, node=None) -> int:
        s = self.shapes.get(name)
        if s is None:
            where = f" ({describe(node)})" if node is not None else ""
            raise GradientError(f"the rank of tensor '{name}' is unknown{where}; the "
                                "gradient needs it (give the graph's inputs shapes)")
        return len(s)

    def constant_value(self, name: str) -> np.ndarray | None:
        return self.consts.get(name)

    def set_info(self, name: str, dtype: int | None, shape: list[Any] | None) -> None:
        if dtype is not None:
            self.types[name] = dtype
        self.shapes[name] = shape

    # -- opset-aware helpers -----------------------------------------------------------
    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: int = 1) -> str:
        """ReduceSum/ReduceMean/... over constant ``axes`` (None: all axes)."""
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes is None:
            return self.op(op_type, [x], keepdims=keepdims)
        axes = [int(a) for a in axes]
        if axes_as_input:
            return self.op(op_type, [x, self.ints(axes)], keepdims=keepdims)
        return self.op(op_type, [x], axes=axes, keepdims=keepdims)

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.ints(axes)])
        return self.op("Unsqueeze", [x], axes=list(axes))

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.op("Squeeze", [x, self.ints(axes)])
        return self.op("Squeeze", [x], axes=list(axes))

    def zeros_like(self, x: str) -> str:
        dt = self.dtype(x)
        shape = self.shape(x)
        value = numpy_helper.from_array(np.zeros([1], dtype=self.np_dtype(x)), "zero")
        if shape is not None and all(isinstance(d, int) for d in shape):
            return self.op("ConstantOfShape", [self.ints(shape)], value=value)
        del dt
        return self.op("ConstantOfShape", [self.op("Shape", [x])], value=value)

    def ones_like(self, x: str) -> str:
        shape = self.shape(x)
        value = numpy_helper.from_array(np.ones([1], dtype=self.np_dtype(x)), "one")
        if shape is not None and all(isinstance(d, int) for d in shape):
            return self.op("ConstantOfShape", [self.ints(shape)], value=value)
        return self.op("ConstantOfShape", [self.op("Shape", [x])], value=value)

    def shape_of(self, x: str) -> str:
        """``x``'s shape as an int64 tensor: a constant when static, else a Shape node."""
        shape = self.shape(x)
        if shape is not None and all(isinstance(d, int) for d in shape):
            return self.ints(shape)
        return self.op("Shape", [x])

    def reshape_like(self, g: str, x: str) -> str:
        return self.op("Reshape", [g, self.shape_of(x)])

    def unbroadcast(self, g: str, g_dims: list[Any] | None, x: str) -> str:
        """Sum ``g`` (of shape ``g_dims``, the broadcast result) down to ``x``'s shape:
        the gradient of numpy-style broadcasting."""
        x_dims = self.shape(x)
        if g_dims is not None and x_dims is not None and len(g_dims) >= len(x_dims):
            lead = len(g_dims) - len(x_dims)
            axes = list(range(lead))
            static = True
            for i, d in enumerate(x_dims):
                gd = g_dims[lead + i]
                if d == 1:
                    if gd != 1:
                        axes.append(lead + i)
                elif isinstance(d, int) or (d is not None and d == gd):
                    continue
                else:
                    static = False
                    break
            if static:
                if not axes:
                    return g
                if axes == list(range(lead)):  # only leading axes: drop them as we go
                    if self.fuses(x):  # a bias's gradient on trainops' threaded kernel
                        return self.op("BiasGrad", [g], domain=TRAINOPS_DOMAIN, leading=lead)
                    return self.reduce("ReduceSum", g, axes, keepdims=0)
                r = self.reduce("ReduceSum", g, axes, keepdims=1)
                if lead:
                    r = self.op("Reshape", [r, self.shape_of(x)])
                return r
        # Dynamic: pad x's shape with leading ones to g's rank, reduce where it is 1.
        g_shape = self.op("Shape", [g])
        x_shape = self.op("Shape", [x])
        n_lead = self.op("Sub", [self.op("Size", [g_shape]), self.op("Size", [x_shape])])
        ones = self.op("ConstantOfShape", [self.op("Reshape", [n_lead, self.ints([1])])],
                       value=numpy_helper.from_array(np.ones([1], np.int64), "one"))
        padded = self.op("Concat", [ones, x_shape], axis=0)
        is_one = self.op("Equal", [padded, self.ints([1])])
        axes_t = self.op("Reshape", [self.op("NonZero", [is_one]), self.ints([-1])])
        if self.opset >= 13:
            r = self.op("ReduceSum", [g, axes_t], keepdims=1, noop_with_empty_axes=1)
        else:
            raise GradientError("broadcasting with shapes unknown before run time needs "
                                "opset >= 13")
        return self.op("Reshape", [r, x_shape])


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs in ``node``'s attributes (an If's branches, a Loop's or Scan's body)."""
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.HasField("g"):
            out.append(a.g)
        out.extend(a.graphs)
    return out


def defined_in(graph: onnx.GraphProto, nested: bool = False) -> set[str]:
    """The values ``graph`` defines itself: its inputs, initializers and node outputs
    (and, with ``nested``, those of the subgraphs within it)."""
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    names |= {i.values.name for i in graph.sparse_initializer}
    for n in graph.node:
        names.update(o for o in n.output if o)
        if nested:
            for sub in subgraphs(n):
                names |= defined_in(sub, nested=True)
    return names


def free_names(graph: onnx.GraphProto) -> list[str]:
    """The outer-scope values ``graph`` reads (its nodes' and its nested subgraphs'), in
    order of first use."""
    inner = defined_in(graph)
    out = [i for n in graph.node for i in node_inputs(n) if i not in inner]
    out += [o.name for o in graph.output if o.name not in inner]  # an output passed through
    return list(dict.fromkeys(out))


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Every value ``node`` reads: its inputs, then the outer-scope values its subgraphs
    capture (at any depth), in order of first use."""
    names = [i for i in node.input if i]
    for sub in subgraphs(node):
        names += free_names(sub)
    return list(dict.fromkeys(names))


# Inputs a default-domain op reads for their element type or shape only, never their
# values: no gradient flows back through them, and a value reaching an op only there does
# not put the op on the path the backward pass differentiates.
TYPE_ONLY_INPUTS = {"CastLike": (1,), "EyeLike": (0,), "RandomNormalLike": (0,),
                    "RandomUniformLike": (0,)}


def value_inputs(node: onnx.NodeProto) -> list[bool]:
    """For each input of ``node``: whether its value (not only its type or shape,
    :data:`TYPE_ONLY_INPUTS`) goes into ``node``'s outputs; False for an absent one."""
    skip = TYPE_ONLY_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ()
    return [bool(i) and k not in skip for k, i in enumerate(node.input)]


def captures(node: onnx.NodeProto) -> list[str]:
    """The outer-scope values ``node``'s subgraphs read (some may also be its inputs)."""
    return list(dict.fromkeys(n for sub in subgraphs(node) for n in free_names(sub)))


def type_name(elem_type: int | None) -> str:
    """``TensorProto`` element type as onnx spells it in lower case (``int64``, ...)."""
    if elem_type is None:
        return "of unknown type"
    try:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return f"element type {elem_type}"


def skeleton(model: onnx.ModelProto, limit: int = 1024) -> tuple[onnx.ModelProto, list]:
    """A copy of ``model`` without the data of its initializers over ``limit`` elements
    (each becomes a graph input of its type and shape), and those initializers. Shape
    inference and the version converter serialize the whole model: on the skeleton they
    do not copy the weights (576 MB for VGG-19) back and forth."""
    def copy_fields(dst, src, skip):
        for fd, val in src.ListFields():
            if fd.name == skip:
                continue
            repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.28; label before
            if repeated is None:
                repeated = fd.label == fd.LABEL_REPEATED
            if repeated:
                getattr(dst, fd.name).extend(val)
            elif fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(val)
            else:
                setattr(dst, fd.name, val)

    m = onnx.ModelProto()
    copy_fields(m, model, "graph")
    copy_fields(m.graph, model.graph, "initializer")
    big = []
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) > limit:
            big.append(init)
            m.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type,
                                                               list(init.dims)))
        else:
            m.graph.initializer.append(init)
    return m, big


def describe(node: onnx.NodeProto) -> str:
    name = node.name or "(unnamed)"
    dom = f"{node.domain}::" if node.domain not in ("", "ai.onnx") else ""
    return f"{dom}{node.op_type} node '{name}'"


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default-domain opset ``model`` imports (GradientError if none)."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise GradientError("the model imports no default-domain opset")


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with onnx's inferred shapes and types in ``value_info``; its
    initializers over 1024 elements are graph inputs of their type and shape, without
    their data (:func:`skeleton`)."""
    light, _ = skeleton(model)
    try:
        return onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return light
