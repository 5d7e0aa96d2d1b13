"""Test data: the dtypes the tests name, tensor groups for the optimizers, and onnx's
conformance cases as files."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

# ONNX TensorProto data types used by copy_dtype.
COPY_TYPES = {10: F16, 16: BF16}


def group(rng, shape, dtype=np.float32, g_shape=None):
    """(x, g, v, h) for one tensor group; h >= 0 as a second moment is."""
    g_shape = shape if g_shape is None else g_shape
    x = rng.standard_normal(shape).astype(dtype)
    g = rng.standard_normal(g_shape).astype(dtype)
    v = (0.1 * rng.standard_normal(shape)).astype(dtype)
    h = (0.01 * rng.random(shape)).astype(dtype)
    return x, g, v, h


def groups(rng, shapes, dtype=np.float32, g_shapes=None):
    g_shapes = g_shapes or shapes
    data = [group(rng, s, dtype, gs) for s, gs in zip(shapes, g_shapes)]
    return [list(col) for col in zip(*data)] if data else [[], [], [], []]


def tensors(rng, shapes, dtype=np.float32, g_shapes=None, state="V"):
    """``(xs, gs, ss)`` for tensor groups of ``shapes``; the state ``ss`` is ``H`` (an
    accumulated square, >= 0) or ``V`` (a momentum, any sign)."""
    g_shapes = g_shapes or shapes
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    gs = [rng.standard_normal(s).astype(dtype) for s in g_shapes]
    if state == "H":
        ss = [rng.random(s).astype(dtype) for s in shapes]
    else:
        ss = [(0.5 * rng.standard_normal(s)).astype(dtype) for s in shapes]
    return xs, gs, ss


def read_case(case_dir: Path):
    """(model, inputs, expected outputs) of an onnx backend-test case directory."""
    model = onnx.load(str(case_dir / "model.onnx"))
    ds = case_dir / "test_data_set_0"
    n_in, n_out = len(model.graph.input), len(model.graph.output)
    ins = [numpy_helper.to_array(onnx.load_tensor(str(ds / f"input_{k}.pb"))) for k in range(n_in)]
    outs = [numpy_helper.to_array(onnx.load_tensor(str(ds / f"output_{k}.pb")))
            for k in range(n_out)]
    return model, ins, outs
