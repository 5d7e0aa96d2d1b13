"""The demos. ``main`` is ``python -m trainops demo``:

- by default (and with ``--distributed``, under ``mpirun``) :func:`trainops.demos.train.main`:
  a small CNN trained entirely inside ONNX Runtime by :class:`trainops.Trainer`;
- with ``--mixed`` first, :func:`trainops.demos.mixed.main`: numpy gradients in float16
  with ``MixedPrecisionAdam`` and dynamic loss scaling in ONNX Runtime.

:func:`trainops.demos.logistic.train` is the earliest demo: a logistic regression trained
with every Adam step run in ONNX Runtime (numpy gradients).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv=None) -> int:
    """``python -m trainops demo [--mixed] [options]``: run one demo, return its exit code."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--mixed"]:
        from .mixed import main as mixed_main

        return mixed_main(argv[1:])
    from .train import main as train_main

    return train_main(argv)
