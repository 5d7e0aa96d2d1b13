"""Training steps of standard ONNX ops only, for execution providers that take no custom-op
library (DirectML, WebGPU, CoreML, OpenVINO, QNN, ...).

:func:`rewrite` replaces every optimizer and mixed-precision node of a model
(``ai.onnx.preview.training::Adam``/``Adagrad``/``Momentum``, ``com.trainops::AdamW``,
``MixedPrecisionAdam``, ``DynamicLossScale``, ``AllFinite``) by ``Mul``/``Add``/``Sub``/
``Div``/``Sqrt``/``Pow``/``Where``/``Cast``/... nodes doing the kernels' operations in the
kernels' order, so that on onnxruntime's CPU EP the rewritten step has the fused kernels'
bits (``tests/test_portable.py``). The per-op functions live in :mod:`.optimizers` and
:mod:`.mixed`; :mod:`.dropout` turns ``com.trainops::PhiloxDropout`` into ONNX ``Dropout``.
For EPs without float64 (:data:`NO_FLOAT64`) ``rewrite(float64=False)`` uses float32 only
(:mod:`.ff`, :func:`.fma.fma_split`): bitwise still where the EP's float32 ``Sqrt`` is
correctly rounded but in rare ties of the per-call scalars (tests/test_portable_float32.py).
"""

from .emit import Expansion, ExpansionError
from .rewrite import (EXPANSIONS, MIN_OPSET, NO_FLOAT64, custom_nodes, has_float64, rewrite,
                      value_types)

__all__ = ["rewrite", "custom_nodes", "value_types", "EXPANSIONS", "MIN_OPSET", "NO_FLOAT64",
           "has_float64", "Expansion", "ExpansionError"]
