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


def test_without_a_gpu_every_part_fails_clearly(library_path):
    """Here (no cupy, no GPU, no onnxruntime-gpu, no WebGPU EP) the script reports one FAIL
    line per missing piece, naming it, exits 1 and prints no traceback."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRAINOPS_FAKE_DEVICE", "TRAINOPS_CUDA")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--library", library_path, "--quick", "--steps", "2"],
                         capture_output=True, text=True, env=env, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text, text
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails and all(len(ln.split(None, 1)[1]) > 50 for ln in fails), fails
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert any("cupy" in ln for ln in fails)
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert any("onnxruntime-gpu" in ln for ln in fails)
    assert any("WebGPU" in ln for ln in fails)


def test_a_missing_library_is_one_clear_failure(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(SCRIPT), "--library", str(tmp_path / "nope.so")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "does not exist" in out.stdout and "Traceback" not in out.stderr


def test_trainer_harness_and_transformer_train_on_the_cpu(library_path):
    """Part 3's harness with the CPU as the "device": the same run twice, so losses and
    weights agree exactly; the transformer (attention, LayerNormalization, Dropout as
    PhiloxDropout) trains: its loss falls."""
    gc = load()
    model = gc.transformer_model()
    lc, ld, diff, dev = gc.trainer_pair(model, lambda i: gc.transformer_data(16, i % 2), 12, device="cpu")
    assert lc == ld and diff == 0.0
    assert any(n.op_type == "PhiloxDropout" for n in dev.training_model().graph.node)
    assert min(lc[-4:]) < lc[0]
    data = gc.cnn_data(4)
    assert data["x"].shape == (4, 1, 8, 8) and data["t"].dtype.name == "int64"


def test_dry_run_passes_here(library_path):
    """--dry-run: part 3's device-state checks over the CPU device path, the plugin EP Trainer
    on the fake device (onnxruntime 1.24+), the PhiloxNormal bound's own cases: all pass, and
    the same functions then run on a GPU."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRAINOPS_FAKE_DEVICE", "TRAINOPS_CUDA")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--library", library_path, "--dry-run", "--steps", "2"],
                         capture_output=True, text=True, env=env, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Traceback" not in text, text
    passes = [ln for ln in out.stdout.splitlines() if ln.startswith("pass")]
    assert sum("0 state bytes a step" in ln for ln in passes) >= 2, text
    assert any("normal_within_bound" in ln for ln in passes)


def test_normal_bound():
    import numpy as np

    gc = load()
    a = np.array([0.0, -1.5, 2.25, -0.0], np.float32)
    assert gc.normal_within_bound(a, a) == (True, "bitwise: 0 of 4 differ, max 0 ulps")
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(0))  # one ulp towards zero, on the negative side
    ok, detail = gc.normal_within_bound(b, a)
    assert ok and "1 of 4 differ, max 1 ulps" in detail
    assert gc.normal_within_bound(np.float32([0.0]), np.float32([-0.0]))[0]
    assert not gc.normal_within_bound(np.float32([1.0]), np.float32([-1.0]))[0]
    assert not gc.normal_within_bound(a, a.astype(np.float64))[0]
    d = np.array([1.0, -2.0]) + np.array([8, 0]) * np.finfo(np.float64).eps
    assert gc.normal_within_bound(d, np.array([1.0, -2.0]))[0]
    assert not gc.normal_within_bound(d * (1 + 1e-14), np.array([1.0, -2.0]))[0]
