"""examples/lora_finetune.py runs end to end: a few LoRA steps on the committed tiny GPT-2
export, the adapters saved, served by plain onnxruntime with the adapter file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_lora_finetune_example(library_path, tmp_path):
    if not hasattr(ort, "LoraAdapter"):
        pytest.skip(f"onnxruntime {ort.__version__} has no LoraAdapter")
    out = tmp_path / "out"
    env = dict(os.environ, TRAINOPS_LIBRARY=library_path)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "lora_finetune.py"),
                        "--steps", "20", "--generate", "5", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("adapter.safetensors", "adapter.onnx_adapter", "base_lora.onnx", "losses.json"):
        assert (out / name).is_file(), name
    record = json.loads((out / "losses.json").read_text())
    assert len(record["train"]) == 20
    # The base model's loss is near ln(96), uniform over the vocabulary (random weights);
    # the served adapter's is measured by the same float64 code over the same windows.
    assert record["eval_adapter"] < record["eval_base"]
    assert "greedy continuation" in r.stdout
