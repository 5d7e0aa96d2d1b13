"""The value of a ``Constant`` node, whichever attribute holds it (:func:`constant_value`).

ONNX's Constant takes its value from exactly one of ``value`` (a tensor), ``value_float``,
``value_floats``, ``value_int``, ``value_ints``, ``value_string``, ``value_strings`` or
``sparse_value``. torch's classic exporter writes ``value``; its dynamo exporter writes the
scalar and list forms too (``Constant(value_ints=[-1])`` as a ReduceMean's axes). Every
reader of a Constant's value in trainops goes through this one function, so none knows
only some of the forms.
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import AttributeProto, TensorProto, numpy_helper


__all__ = ["VALUE_ATTRIBUTES", "constant_type", "constant_value", "is_constant"]

# attribute -> the numpy type of its value (onnx.reference's Constant: value_int an int64
# 0-d array, value_ints a 1-D one, value_float(s) float32, value_string(s) str).
VALUE_ATTRIBUTES = {"value": None, "sparse_value": None, "value_float": np.float32,
                    "value_floats": np.float32, "value_int": np.int64,
                    "value_ints": np.int64, "value_string": np.str_, "value_strings": np.str_}

# attribute -> (the AttributeProto field holding it, the type it must have)
_FIELDS = {"value_float": ("f", AttributeProto.FLOAT),
           "value_floats": ("floats", AttributeProto.FLOATS),
           "value_int": ("i", AttributeProto.INT), "value_ints": ("ints", AttributeProto.INTS),
           "value_string": ("s", AttributeProto.STRING),
           "value_strings": ("strings", AttributeProto.STRINGS)}

# attribute -> the element type of the tensor it makes (value, sparse_value: their own)
_ELEM_TYPES = {"value_float": TensorProto.FLOAT, "value_floats": TensorProto.FLOAT,
               "value_int": TensorProto.INT64, "value_ints": TensorProto.INT64,
               "value_string": TensorProto.STRING, "value_strings": TensorProto.STRING}


def is_constant(node: onnx.NodeProto) -> bool:
    """``node`` is a default-domain Constant."""
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def _where(node: onnx.NodeProto) -> str:
    out = node.output[0] if node.output else ""
    return f"Constant node '{node.name or '(unnamed)'}' (output '{out}')"


def _value_attribute(node: onnx.NodeProto) -> AttributeProto:
    found = [a for a in node.attribute if a.name in VALUE_ATTRIBUTES]
    if len(found) != 1:
        what = "none" if not found else ", ".join(a.name for a in found)
        raise ValueError(f"{_where(node)}: a Constant takes its value from exactly one "
                            f"of {', '.join(VALUE_ATTRIBUTES)}; it has {what}")
    return found[0]


def constant_type(node: onnx.NodeProto) -> int | None:
    """The element type (``TensorProto``) of the Constant ``node``'s value; None when
    ``node`` is no default-domain Constant (errors: :func:`constant_value`)."""
    if not is_constant(node):
        return None
    a = _value_attribute(node)
    if a.name == "value":
        return a.t.data_type
    if a.name == "sparse_value":
        return a.sparse_tensor.values.data_type
    return _ELEM_TYPES[a.name]


def _dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    """A SparseTensorProto as the dense array it stands for (zeros where no value is given);
    its indices are either linear ([NNZ]) or one row of coordinates per value ([NNZ, rank])."""
    values = numpy_helper.to_array(sparse.values).reshape(-1)
    dims = [int(d) for d in sparse.dims]
    out = np.zeros(dims, dtype=values.dtype)
    if values.size:
        idx = numpy_helper.to_array(sparse.indices).astype(np.int64)
        if idx.ndim == 1:
            out.reshape(-1)[idx] = values
        else:
            out[tuple(idx.T)] = values
    return out


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of the Constant ``node`` as a numpy array (onnx.reference's semantics:
    ``value_int`` an int64 0-d array, ``value_ints`` a 1-D int64 one, ``value_float`` a
    float32 0-d array, ``value_floats`` 1-D float32, strings as ``str``). None when
    ``node`` is not a default-domain Constant, or when its value is a reference to an
    attribute of the function it lies in (known only where the function is called).
    A Constant with no value attribute or several, or one of the wrong type, is a
    ValueError naming it (this module sits below :mod:`.graph` and its GradientError)."""
    if not is_constant(node):
        return None
    a = _value_attribute(node)
    if a.ref_attr_name:
        return None
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    if a.name == "sparse_value":
        return _dense(a.sparse_tensor)
    field, expected = _FIELDS[a.name]
    if a.type != expected:
        raise ValueError(f"{_where(node)}: attribute {a.name!r} should be of type "
                            f"{AttributeProto.AttributeType.Name(expected)}, it is "
                            f"{AttributeProto.AttributeType.Name(a.type)}")
    v = getattr(a, field)
    if field == "s":
        v = v.decode("utf-8")
    elif field == "strings":
        v = [s.decode("utf-8") for s in v]
    elif field != "i" and field != "f":
        v = list(v)
    return np.array(v, dtype=VALUE_ATTRIBUTES[a.name])
