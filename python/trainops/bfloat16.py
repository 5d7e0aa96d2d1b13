"""Tensor I/O with onnxruntime's Python binding, bfloat16 included.

onnxruntime's binding cannot take or return ``ml_dtypes.bfloat16`` arrays (``Numpy_type
256 can't be converted to MLDataType`` / ``No corresponding Numpy type for Tensor Type.
bfloat16``). It can, however, wrap a ``uint16`` buffer as a ``tensor(bfloat16)``
``OrtValue``, and an IOBinding accepts such values as inputs and as pre-bound outputs.
These helpers do that for you::

    from trainops.bfloat16 import run, to_ortvalue, from_ortvalue

    outs = run(sess, {"X_1": x_bf16, "G_1": g_bf16, ...})   # bfloat16 out as ml_dtypes

Every other dtype passes through unchanged. ``ml_dtypes`` (a dependency of onnx >= 1.16)
is imported only when a bfloat16 tensor is met.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from .onnx_defs import BFLOAT16, bfloat16_dtype, is_bfloat16, numpy_dtype
from .onnx_defs import tensor_type as onnx_elem_type

__all__ = [
    "BFLOAT16",
    "bfloat16_dtype",
    "is_bfloat16",
    "onnx_elem_type",
    "numpy_dtype",
    "to_ortvalue",
    "from_ortvalue",
    "empty_ortvalue",
    "run",
]


def to_ortvalue(array: Any, dtype: Any = None):
    """An ``OrtValue`` (CPU) holding ``array``; ``dtype`` converts first.

    bfloat16 arrays become ``tensor(bfloat16)`` values through a ``uint16`` view.
    The value shares ``array``'s memory when it is C-contiguous and already of the
    right dtype (as ``OrtValue.ortvalue_from_numpy`` does), so binding it as an input and
    as an output updates ``array`` in place; keep ``array`` alive while the value is used.
    """
    import onnxruntime as ort

    a = np.asarray(array) if dtype is None else np.asarray(array, dtype=numpy_dtype(dtype))
    if not a.flags.c_contiguous:
        a = np.asarray(a, order="C")
    if is_bfloat16(a.dtype):
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(a)


def from_ortvalue(value, dtype: Any = None) -> np.ndarray:
    """A numpy copy of a CPU ``OrtValue``; ``tensor(bfloat16)`` values come back as
    ``ml_dtypes.bfloat16`` arrays. ``dtype`` (optional) is the dtype expected, checked
    against the value's own type."""
    elem = value.element_type() if hasattr(value, "element_type") else None
    type_name = value.data_type()
    bf16 = elem == BFLOAT16 or type_name == "tensor(bfloat16)"
    if dtype is not None:
        want = numpy_dtype(dtype)
        have = bfloat16_dtype() if bf16 else None
        if have is None:
            have = numpy_dtype(type_name)
        if want != have:
            raise TypeError(f"OrtValue holds {type_name}, expected {want.name}")
    if not bf16:
        return np.array(value.numpy(), copy=True)
    shape = tuple(int(d) for d in value.shape())
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.zeros(shape, dtype=bfloat16_dtype())
    if value.device_name().lower() != "cpu":
        raise ValueError("from_ortvalue reads bfloat16 values from CPU memory only")
    raw = (ctypes.c_uint16 * n).from_address(value.data_ptr())
    return np.frombuffer(raw, dtype=np.uint16).copy().view(bfloat16_dtype()).reshape(shape)


def empty_ortvalue(shape: Sequence[int], dtype: Any):
    """(``OrtValue``, numpy array sharing its memory) of ``shape`` and ``dtype``,
    zero-filled: a buffer to pre-bind as an output and to read afterwards."""
    a = np.zeros(tuple(int(d) for d in shape), dtype=numpy_dtype(dtype))
    return to_ortvalue(a), a


def _static_shape(shape) -> Optional[tuple[int, ...]]:
    if shape is None:
        return None
    dims = []
    for d in shape:
        if not isinstance(d, (int, np.integer)) or d < 0:
            return None
        dims.append(int(d))
    return tuple(dims)


def run(session, feeds: Mapping[str, Any], outputs: Optional[Sequence[str]] = None,
        output_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> list[np.ndarray]:
    """``session.run`` through an IOBinding, bfloat16 included.

    ``feeds`` maps input names to arrays (any dtype, ``ml_dtypes.bfloat16`` included) or
    ``OrtValue``s. ``outputs``: the output names to fetch (default: all, in the model's
    order). bfloat16 outputs are pre-bound to buffers of the shape the session declares
    (or ``output_shapes[name]``, for any output); a bfloat16 output of unknown or scalar
    shape, and every other output, is allocated by onnxruntime (``bind_output``) and
    read back from its buffer. Returns numpy arrays in the
    order of ``outputs``, bfloat16 ones as ``ml_dtypes.bfloat16``.
    """
    binding = session.io_binding()
    keep = []  # arrays the bound OrtValues borrow from
    for name, a in feeds.items():
        if hasattr(a, "data_ptr") and hasattr(a, "data_type"):
            binding.bind_ortvalue_input(name, a)
            continue
        a = np.asarray(a, order="C")
        keep.append(a)
        binding.bind_ortvalue_input(name, to_ortvalue(a))
    declared = {o.name: o for o in session.get_outputs()}
    names = list(declared) if outputs is None else list(outputs)
    for name in names:
        if name not in declared:
            raise KeyError(f"the model has no output {name!r}; it has {list(declared)}")
    prebound: dict[str, np.ndarray] = {}
    for name in names:
        info = declared[name]
        shape = None
        if output_shapes is not None and name in output_shapes:
            shape = tuple(int(d) for d in output_shapes[name])
        elif info.type == "tensor(bfloat16)":
            # ORT reports an unknown rank as [], like a scalar: only a non-empty, fully
            # static shape is trusted; anything else is left to ORT to allocate.
            shape = _static_shape(info.shape) if info.shape else None
        if shape is not None:
            value, buf = empty_ortvalue(shape, info.type)
            binding.bind_ortvalue_output(name, value)
            prebound[name] = buf
            keep.append(value)
        else:
            binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    values = binding.get_outputs()
    result = []
    for name, value in zip(names, values):
        if name in prebound:
            result.append(prebound[name].copy())
        else:
            result.append(from_ortvalue(value))
    del keep
    return result
