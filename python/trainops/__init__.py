"""trainops: ONNX training operators for ONNX Runtime.

The package's only job at load time is to say where the custom-op library is::

    import onnxruntime as ort, trainops
    so = ort.SessionOptions()
    so.register_custom_ops_library(trainops.get_library_path())
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["get_library_path", "LIBRARY_NAME"]

if sys.platform == "win32":
    LIBRARY_NAME = "trainops.dll"
elif sys.platform == "darwin":
    LIBRARY_NAME = "libtrainops.dylib"
else:
    LIBRARY_NAME = "libtrainops.so"


def _candidates():
    env = os.environ.get("TRAINOPS_LIBRARY")
    if env:  # an explicit choice: that file or an error, never a silent fallback
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    # An installed wheel: setuptools-rust names the library like an extension module,
    # e.g. libtrainops.cpython-311-x86_64-linux-gnu.so.
    stem, _, suffix = LIBRARY_NAME.rpartition(".")
    yield from sorted(here.glob(f"{stem}*.{suffix}"))
    yield from sorted(here.glob(f"{stem}*.pyd")) if sys.platform == "win32" else ()
    root = here.parent.parent  # a source checkout: python/trainops -> repository root
    # The most recently built of the release and debug libraries, so that a stale build
    # of one profile never shadows a fresh build of the other.
    built = [root / "target" / profile / LIBRARY_NAME for profile in ("release", "debug")]
    yield from sorted((p for p in built if p.is_file()), key=lambda p: p.stat().st_mtime, reverse=True)


def get_library_path() -> str:
    """Absolute path of the trainops custom-op library, for
    ``SessionOptions.register_custom_ops_library``.

    ``$TRAINOPS_LIBRARY`` when set (and then only that file); else beside this package (an installed wheel), then in a
    source checkout's ``target/release`` and ``target/debug`` (the newer of the two).
    """
    tried = []
    for path in _candidates():
        if path.is_file():
            return str(path)
        tried.append(str(path))
    raise FileNotFoundError(f"{LIBRARY_NAME} not found; looked at: {', '.join(tried)}")


# Mixed precision (issue 5): Keras-style dtype policies, optimizer-step models, and tensor
# I/O that handles bfloat16 (which onnxruntime's numpy bridge does not).
from .bfloat16 import from_ortvalue, run, to_ortvalue  # noqa: E402
from .mixed_precision import (  # noqa: E402
    InPlaceOptimizer,
    Policy,
    optimizer_model,
    optimizer_names,
    optimizer_state,
)

__all__ += ["Policy", "optimizer_model", "optimizer_names", "optimizer_state",
            "InPlaceOptimizer", "to_ortvalue", "from_ortvalue", "run"]
