"""onnx's own Adam test cases (models/onnx-node) through the library, the conformance
runner and its command line, and the exporter's idempotence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from helpers.runners import check_onnx_case, check_reference_on_case
from helpers.references import adam as adam_ref

ROOT = Path(__file__).resolve().parent.parent
ADAM_CASES = ["test_adam", "test_adam_multiple"]


@pytest.mark.parametrize("name", ADAM_CASES)
def test_onnx_case(make_session, models_dir, name):
    check_onnx_case(make_session, models_dir / name)


@pytest.mark.parametrize("name", ADAM_CASES)
def test_onnx_case_against_our_reference(models_dir, name):
    """Our float64 reference reproduces onnx's expected outputs (no library needed)."""
    check_reference_on_case(models_dir / name, adam_ref, 4,
                            lambda node: {a.name: a.f for a in node.attribute})


def test_exported_cases_are_current(models_dir):
    """models/onnx-node is what scripts/export_conformance.py writes for this onnx."""
    version = (models_dir / "VERSION").read_text().split("\n")[0]
    if version != f"onnx {onnx.__version__}":
        pytest.skip(f"models/onnx-node was exported with {version}, installed onnx is "
                    f"{onnx.__version__}")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_conformance.py"),
                           "--check", "--output", str(models_dir)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_exporter_is_idempotent(tmp_path):
    script = ROOT / "scripts" / "export_conformance.py"
    out = tmp_path / "onnx-node"
    first = subprocess.run([sys.executable, str(script), "--output", str(out)],
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    snapshot = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert {p.parts[0] for p in snapshot if len(p.parts) > 1} >= set(ADAM_CASES)
    assert all(len(p.parts) == 1 or (out / p.parts[0] / "model.onnx").is_file()
               for p in snapshot)
    (out / "test_adam" / "stale.pb").write_bytes(b"x")  # a leftover is removed
    second = subprocess.run([sys.executable, str(script), "--output", str(out)],
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    again = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert again == snapshot


def test_conformance_rows(library_path, models_dir):
    from trainops.conformance import run_conformance

    rows = {r.name: r for r in run_conformance(models_dir, library=library_path)}
    for name in ADAM_CASES:
        assert rows[name].status == "pass", rows[name]
    for row in rows.values():
        assert row.status in {"pass", "fail", "not implemented"}
    assert any("Gradient" in r.name or "Gradient" in r.detail for r in rows.values())
    assert not [r for r in rows.values() if r.status == "fail"]


def test_conformance_cli(library_path):
    env = dict(os.environ, TRAINOPS_LIBRARY=library_path,
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "trainops", "conformance"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"onnxruntime {__import__('onnxruntime').__version__}" in proc.stdout
    assert f"onnx {onnx.__version__}" in proc.stdout
    for name in ADAM_CASES:
        assert any(line.split()[:2] == [name, "pass"] for line in proc.stdout.splitlines())


def test_conformance_reports_failure(library_path, models_dir, tmp_path):
    """A wrong expected output makes the case fail and the command exit non-zero."""
    import shutil

    from trainops.conformance import run_conformance

    bad = tmp_path / "onnx-node"
    shutil.copytree(models_dir / "test_adam", bad / "test_adam")
    out0 = bad / "test_adam" / "test_data_set_0" / "output_0.pb"
    tensor = onnx.load_tensor(str(out0))
    arr = numpy_helper.to_array(tensor) + np.float32(1.0)
    out0.write_bytes(numpy_helper.from_array(arr, tensor.name).SerializeToString())
    rows = {r.name: r for r in run_conformance(bad, library=library_path)}
    assert rows["test_adam"].status == "fail"
    env = dict(os.environ, TRAINOPS_LIBRARY=library_path,
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "trainops", "conformance", "--models", str(bad)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_models_dir_lookup_order(tmp_path, monkeypatch):
    """An installed copy (trainops/data/onnx-node) wins over the checkout's models/."""
    from trainops import conformance

    package = tmp_path / "site" / "trainops"
    checkout = tmp_path / "checkout"
    (checkout / "models" / "onnx-node" / "test_adam").mkdir(parents=True)
    (checkout / "models" / "onnx-node" / "test_adam" / "model.onnx").write_bytes(b"")
    monkeypatch.setattr(conformance, "_PACKAGE_DIR", package)
    monkeypatch.setattr(conformance, "_CHECKOUT_ROOT", checkout)
    assert conformance.find_models_dir() == checkout / "models" / "onnx-node"
    (package / "data" / "onnx-node" / "test_adam").mkdir(parents=True)
    (package / "data" / "onnx-node" / "test_adam" / "model.onnx").write_bytes(b"")
    assert conformance.find_models_dir() == package / "data" / "onnx-node"
    monkeypatch.setattr(conformance, "_CHECKOUT_ROOT", tmp_path / "nowhere")
    monkeypatch.setattr(conformance, "_PACKAGE_DIR", tmp_path / "nowhere")
    assert conformance.find_models_dir() is None
