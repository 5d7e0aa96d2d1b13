"""trainops: ONNX training operators for ONNX Runtime.

The package's only job at load time is to say where the custom-op library is::

    import onnxruntime as ort, trainops
    so = ort.SessionOptions()
    so.register_custom_ops_library(trainops.get_library_path())

Everything else is imported on first use, so ``import trainops`` costs no onnx, no
onnxruntime and no numpy: ``trainops.Policy``, ``trainops.optimizer_model``, ... (mixed
precision, :mod:`trainops.mixed_precision`) and ``trainops.run``, ``trainops.to_ortvalue``,
``trainops.from_ortvalue`` (tensor I/O with bfloat16, :mod:`trainops.bfloat16`) load their
module when first read; so do ``trainops.Trainer``, ``trainops.expand_gradients``,
``trainops.GradientError`` (training, :mod:`trainops.train`, :mod:`trainops.autodiff`) and
the submodules ``trainops.optim`` and ``trainops.distributed`` (data-parallel training on
MPI, ``trainops.CollectiveTimeout``); ``trainops.make_reproducible`` and the submodule
``trainops.random`` (seeded Philox states, :mod:`trainops.random`); ``trainops.configure``
and the submodule ``trainops.device`` (the CPU door or the plugin execution provider, device
tensors); ``trainops.LoRA`` (low-rank adapters for the Trainer, :mod:`trainops.lora`). Other submodules (``trainops.models``, ``trainops.onnx_defs``, ...) are imported as
usual.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Names read from a submodule on first use: name -> module (relative to this package).
_LAZY = {
    "Policy": "mixed_precision",
    "optimizer_model": "mixed_precision",
    "optimizer_names": "mixed_precision",
    "optimizer_state": "mixed_precision",
    "InPlaceOptimizer": "mixed_precision",
    "to_ortvalue": "bfloat16",
    "from_ortvalue": "bfloat16",
    "run": "bfloat16",
    "expand_gradients": "autodiff",
    "GradientError": "autodiff",
    "Trainer": "train",
    "CollectiveTimeout": "distributed",
    "make_reproducible": "random",
    "configure": "device",
    "LoRA": "lora",
}
# Submodules that read as attributes without an explicit import (``trainops.optim.Adam``).
_LAZY_MODULES = ("optim", "autodiff", "distributed", "random", "device", "losses")

__all__ = ["get_library_path", "LIBRARY_NAME", *_LAZY, *_LAZY_MODULES]

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
    yield here / LIBRARY_NAME  # an installed wheel (setup.py keeps the library's own name)
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


def __getattr__(name: str):
    from importlib import import_module

    if name in _LAZY_MODULES:
        return import_module(f".{name}", __name__)  # importing sets the attribute
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))
