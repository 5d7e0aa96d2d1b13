"""Fixtures for the trainops Python tests.

Every test that needs the custom-op library takes the ``library_path`` fixture (directly or
through ``make_session``); when ``trainops.get_library_path()`` cannot find the library at
all, those tests skip and say why (also in pytest's header). A library that is found but
does not load is a failure, not a skip.
"""

from __future__ import annotations

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
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return ROOT / "models" / "onnx-node"
