"""The ONNX names and numbers every model builder of the package uses, in one place.

- the operator domains: onnx's training domain and the library's own two;
- the IR version and opsets the builders write (IR 8 and opset 17: onnx >= 1.16 writes a
  newer IR than onnxruntime 1.17, the oldest supported, accepts);
- the mapping between numpy dtypes and ONNX ``TensorProto`` element types, float16 and
  bfloat16 (``ml_dtypes.bfloat16``, which onnx < 1.17 does not map) included.

Importing this module imports neither onnx nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "TRAINING_DOMAIN",
    "TRAINOPS_DOMAIN",
    "BENCH_DOMAIN",
    "IR_VERSION",
    "ONNX_OPSET",
    "DOMAIN_OPSETS",
    "opset_imports",
    "FLOAT16",
    "BFLOAT16",
    "bfloat16_dtype",
    "is_bfloat16",
    "numpy_dtype",
    "tensor_type",
]

TRAINING_DOMAIN = "ai.onnx.preview.training"  # Adam, Adagrad, Momentum (onnx's own)
TRAINOPS_DOMAIN = "com.trainops"  # Philox, MixedPrecisionAdam, DynamicLossScale, AllFinite
BENCH_DOMAIN = "com.trainops.bench"  # MemoryCeiling: benchmarks only

IR_VERSION = 8
ONNX_OPSET = 17

# The opset version a model imports for each domain ("" is the default ONNX domain).
DOMAIN_OPSETS = {"": ONNX_OPSET, TRAINING_DOMAIN: 1, TRAINOPS_DOMAIN: 1, BENCH_DOMAIN: 1}

# ONNX TensorProto element types the package names itself.
FLOAT16 = 10
BFLOAT16 = 16


def opset_imports(domains: Iterable[str]) -> list:
    """``OperatorSetIdProto``s for ``domains``, in the order given: each domain at its
    :data:`DOMAIN_OPSETS` version (1 for a domain not listed there)."""
    from onnx import helper

    return [helper.make_opsetid(d, DOMAIN_OPSETS.get(d, 1)) for d in domains]


def _is_enum(dtype: Any) -> bool:
    return isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool)


def bfloat16_dtype() -> np.dtype:
    """``np.dtype(ml_dtypes.bfloat16)``."""
    try:
        import ml_dtypes
    except ImportError as exc:  # pragma: no cover - onnx >= 1.16 depends on ml_dtypes
        raise ImportError("bfloat16 tensors need the ml_dtypes package "
                          "(pip install ml_dtypes)") from exc
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype: Any) -> bool:
    """True for ``ml_dtypes.bfloat16`` (as a dtype, type or the string ``"bfloat16"``)
    and for ONNX's ``TensorProto.BFLOAT16`` (16)."""
    if _is_enum(dtype):
        return int(dtype) == BFLOAT16
    if isinstance(dtype, str):
        return dtype == "bfloat16"
    try:
        return np.dtype(dtype).name == "bfloat16"
    except TypeError:
        return False


def numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype for a numpy dtype, a dtype name (``"bfloat16"`` included), an ONNX
    ``TensorProto`` enum or an ORT type string such as ``"tensor(bfloat16)"``."""
    if isinstance(dtype, str) and dtype.startswith("tensor(") and dtype.endswith(")"):
        dtype = dtype[len("tensor("):-1]
        if dtype == "float":
            dtype = "float32"
        elif dtype == "double":
            dtype = "float64"
    if is_bfloat16(dtype):
        return bfloat16_dtype()
    if _is_enum(dtype):
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(int(dtype)))
    return np.dtype(dtype)


def tensor_type(dtype: Any) -> int:
    """ONNX ``TensorProto`` element type of a numpy dtype (bfloat16 included); an ONNX
    enum passes through."""
    if is_bfloat16(dtype):
        return BFLOAT16
    if _is_enum(dtype):
        return int(dtype)
    from onnx import helper

    return int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
