"""scripts/gpu_check carries its reference models serialized (the GPU machine has no onnx):
they must be the models its build_models() makes with the onnx installed here."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import onnx

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check"


def load():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_embedded_models_are_the_built_ones():
    gc = load()
    built = gc.build_models()
    assert set(built) == set(gc.MODELS)
    for name, data in built.items():
        embedded = onnx.load_from_string(gc.model(name))
        fresh = onnx.load_from_string(data)
        assert embedded.graph == fresh.graph, name
        assert list(embedded.opset_import) == list(fresh.opset_import), name
        assert embedded.ir_version == fresh.ir_version == 8
