"""Mixed precision after Keras' dtype policies, with the optimizer step in ONNX Runtime.

:class:`Policy` mirrors Keras' ``Policy``/``DTypePolicy``: ``"float32"`` / ``"float64"``
(and ``"float16"`` / ``"bfloat16"``) compute and keep variables in that dtype;
``"mixed_float16"`` / ``"mixed_bfloat16"`` compute in 16 bits and keep float32 variables.
``mixed_float16`` uses dynamic loss scaling (Keras' ``LossScaleOptimizer``: initial scale
2**15, growth every 2000 finite steps); the others use none.

:func:`optimizer_model` emits one optimizer step under a policy as an ONNX model:

- ``float32`` / ``float64`` / ``float16`` / ``bfloat16``: one
  ``ai.onnx.preview.training::Adam`` node in that dtype;
- ``mixed_float16``: ``com.trainops::MixedPrecisionAdam`` (float16 gradients, float32
  weights and moments, float16 copies of the new weights for the next forward pass) and
  ``com.trainops::DynamicLossScale`` fed by its ``finite`` verdict;
- ``mixed_bfloat16``: ``MixedPrecisionAdam`` with bfloat16 gradients and copies and a fixed
  loss scale of 1 (no ``DynamicLossScale``).

:class:`InPlaceOptimizer` runs such a model with every state tensor bound in place through
an IOBinding::

    opt = InPlaceOptimizer({"w": w0, "b": b0}, "mixed_float16", lr=1e-3)
    for batch in data:
        w16, b16 = opt.compute_weights["w"], opt.compute_weights["b"]   # float16 copies
        gw, gb = backward(w16, b16, batch, scale=opt.loss_scale)        # scaled float16 grads
        if not opt.step({"w": gw, "b": gb}):
            print("skipped: non-finite gradients")

The package's modules: :mod:`.policy` (:class:`Policy`, Keras' loss-scale defaults),
:mod:`.model` (:func:`optimizer_names`, :func:`optimizer_model`, :func:`optimizer_state`),
:mod:`.inplace` (:class:`InPlaceOptimizer`); every name is importable from here.
"""

from __future__ import annotations

from .inplace import InPlaceOptimizer
from .model import ADAM_ATTRIBUTES, optimizer_model, optimizer_names, optimizer_state
from .policy import KERAS_GROWTH_INTERVAL, KERAS_INITIAL_LOSS_SCALE, Policy

__all__ = [
    "Policy",
    "ADAM_ATTRIBUTES",
    "optimizer_names",
    "optimizer_model",
    "optimizer_state",
    "InPlaceOptimizer",
    "KERAS_INITIAL_LOSS_SCALE",
    "KERAS_GROWTH_INTERVAL",
]
