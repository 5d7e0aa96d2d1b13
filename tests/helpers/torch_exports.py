"""The torch exports committed under ``tests/data/torch_models`` (made by
``scripts/make_torch_fixtures.py``; gzipped byte for byte) and what the installed
onnxruntime can load of them."""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import onnx
import onnxruntime as ort

TORCH_MODELS = Path(__file__).resolve().parent.parent / "data" / "torch_models"


def read_export(path: Path) -> onnx.ModelProto:
    """A gzipped ONNX model."""
    return onnx.load_from_string(gzip.decompress(Path(path).read_bytes()))


def load_export(arch: str, exporter: str = "classic") -> onnx.ModelProto:
    """``<arch>.<exporter>.onnx.gz`` of the committed exports."""
    return read_export(TORCH_MODELS / f"{arch}.{exporter}.onnx.gz")


@functools.lru_cache(maxsize=None)
def runtime_ir() -> int:
    """The newest ONNX IR version onnxruntime loads (1.17.3: 9; the dynamo exporter
    writes 10), found by loading an Identity model at each."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ir", [x], [y])
    for ir in range(onnx.IR_VERSION, 3, -1):
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=ir)
        try:
            ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # noqa: BLE001 - "Unsupported model IR version": try the one below
            continue
    return 3
