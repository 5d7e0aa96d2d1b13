"""Training steps of standard ONNX ops only, for execution providers that take no custom-op
library (DirectML, WebGPU, CoreML, OpenVINO, QNN, ...).

:func:`rewrite` replaces every optimizer and mixed-precision node of a model
(``ai.onnx.preview.training::Adam``/``Adagrad``/``Momentum``, ``com.trainops::AdamW``,
``MixedPrecisionAdam``, ``DynamicLossScale``, ``AllFinite``) by ``Mul``/``Add``/``Sub``/
``Div``/``Sqrt``/``Pow``/``Where``/``Cast``/... nodes doing the kernels' operations in the
kernels' order, so that on onnxruntime's CPU EP the rewritten step has the fused kernels'
bits (``tests/test_portable.py``). The per-op functions live in :mod:`.optimizers` and
:mod:`.mixed`; :mod:`.dropout` turns ``com.trainops::PhiloxDropout`` into ONNX ``Dropout``.
"""

from .emit import Expansion, ExpansionError
from .rewrite import EXPANSIONS, MIN_OPSET, custom_nodes, rewrite, value_types

__all__ = ["rewrite", "custom_nodes", "value_types", "EXPANSIONS", "MIN_OPSET", "Expansion",
           "ExpansionError"]
