"""Fixtures for the trainops Python tests.

Every test that needs the custom-op library takes the ``library_path`` fixture (directly or
through ``make_session``); when ``trainops.get_library_path()`` cannot find the library at
all, those tests skip and say why (also in pytest's header). A library that is found but
does not load is a failure, not a skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import trainops  # noqa: F401
except ImportError:  # a source checkout without PYTHONPATH=python
    sys.path.insert(0, str(ROOT / "python"))
    import trainops  # noqa: F401

from trainops import get_library_path  # noqa: E402


def _find_library() -> tuple[str | None, str]:
    try:
        return get_library_path(), ""
    except FileNotFoundError as exc:
        return None, str(exc)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes-long (VGG-19's 144M parameters); runs "
                                       "only with TRAINOPS_SLOW_TESTS=1 (CI sets it for one "
                                       "of its runs)")
    config.addinivalue_line("markers", "torch: needs torch, torchvision and transformers "
                                       "(tests/test_torch_bridge.py); skipped without them, "
                                       "run by scripts/test-torch")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRAINOPS_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set TRAINOPS_SLOW_TESTS=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    path, why = _find_library()
    if path:
        return f"trainops library: {path}"
    return f"trainops library: NOT FOUND, tests that need it will skip ({why})"


@pytest.fixture(scope="session")
def library_path() -> str:
    path, why = _find_library()
    if path is None:
        msg = f"trainops custom-op library not found: {why}"
        print(msg, file=sys.stderr)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def make_session(library_path):
    """``make_session(model, threads=None, **so_attrs)``: a CPU session with the library
    registered and ORT's own logging silenced."""
    from trainops.models import session

    def make(model, threads=None, **options):
        options.setdefault("log_severity_level", 4)
        return session(model, threads=threads, library=library_path, **options)

    return make


@pytest.fixture
def standard_grads(monkeypatch):
    """The CPU Trainer's backward from standard ops only (``TRAINOPS_FUSED_GRADS=0``), as the
    portable, CUDA and plugin-EP placements build it: for tests that compare the CPU Trainer
    with those bit for bit (the fused gradient kernels round differently)."""
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "0")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return ROOT / "models" / "onnx-node"


def _missing_features() -> list[tuple[str, str]]:
    """(text of the failure, why it is a skip) for what the oldest supported onnxruntime (1.17)
    and the onnx that goes with it (1.16) lack; empty with newer ones, so nothing is skipped
    there. scripts/test runs the suite against both."""
    missing = []
    try:
        import onnxruntime as ort

        if not hasattr(ort.OrtValue, "ortvalue_from_numpy_with_onnx_type"):
            missing.append(("ortvalue_from_numpy_with_onnx_type",
                            f"onnxruntime {ort.__version__} cannot make bfloat16 OrtValues from "
                            "Python (OrtValue.ortvalue_from_numpy_with_onnx_type, onnxruntime 1.18+)"))
    except ImportError:
        pass
    import onnx

    if tuple(int(p) for p in onnx.__version__.split(".")[:2]) < (1, 17):
        missing.append(("KeyError: dtype(bfloat16)",
                        f"onnx {onnx.__version__} has no numpy mapping for ml_dtypes' bfloat16 (onnx 1.17+)"))
    return missing


_MISSING = _missing_features()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails only for a feature the installed onnxruntime/onnx lacks is a skip
    that says so (the old-runtime run of scripts/test); never with the newest ones."""
    outcome = yield
    report = outcome.get_result()
    if not _MISSING or not report.failed or call.when != "call":
        return
    text = str(report.longrepr)
    for needle, why in _MISSING:
        if needle in text:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {why}")
            return
