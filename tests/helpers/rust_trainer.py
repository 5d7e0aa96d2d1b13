"""The Rust trainer's example (crates/trainops-trainer/examples/train.rs), built and run from
pytest: :func:`build` (the executable and its environment, or a skip saying why) and
:func:`run` (one run, with a timeout); :func:`build_example` builds any example of the
crate, :func:`onnxruntime_library` finds the wheel's library (the C example links it too).
ONNX Runtime is this Python's onnxruntime wheel (``ORT_DYLIB_PATH``), so the 1.17.3 venv
runs it against 1.17.3."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def onnxruntime_library() -> Path:
    """This Python's onnxruntime wheel's ``libonnxruntime.so.<version>`` (what the Rust
    example and the C example run against); skips without one."""
    import onnxruntime

    libs = sorted(glob.glob(str(Path(onnxruntime.__file__).parent / "capi" /
                                "libonnxruntime.so*")))
    if not libs:
        pytest.skip("this onnxruntime package has no libonnxruntime.so")
    return Path(libs[0])


def _cargo(what: str) -> str:
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip(f"no cargo on PATH: {what} cannot be built")
    return cargo


def build_example(name: str, what: str = "the Rust example") -> Path:
    """The path of crates/trainops-trainer's example ``name``, built in debug; skips
    without cargo (``what``: the example in the skip's words)."""
    r = subprocess.run([_cargo(what), "build", "-q", "-p", "trainops-trainer", "--example",
                        name], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return target / "debug" / "examples" / name


def build():
    """``(executable, environment)`` of the example, built in debug; skips without cargo or
    a libonnxruntime.so in this onnxruntime package."""
    _cargo("the Rust example")
    lib = onnxruntime_library()
    exe = build_example("train")
    assert exe.is_file(), exe
    return exe, dict(os.environ, ORT_DYLIB_PATH=str(lib))


def run(train_rs, library_path, *args, ok=True, timeout=600, preexec_fn=None):
    """One run of the example with ``args`` (one intra-op thread, the library given);
    ``ok``: assert it succeeded."""
    exe, env = train_rs
    r = subprocess.run([str(exe), *map(str, args), "--threads", "1", "--library", library_path],
                       capture_output=True, text=True, timeout=timeout, env=env,
                       preexec_fn=preexec_fn)
    if ok:
        assert r.returncode == 0, r.stderr
    return r
