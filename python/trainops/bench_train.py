"""Kept for ``python -m trainops.bench_train``: the benchmark is the ``train`` target of
:mod:`trainops.bench` (``python -m trainops bench train``), in :mod:`trainops.bench.train`."""

import sys

from .bench.train import build_parser, main, run

__all__ = ["run", "main", "build_parser"]

if __name__ == "__main__":
    sys.exit(run())
