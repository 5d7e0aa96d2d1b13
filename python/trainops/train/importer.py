"""Models as exporters write them, made trainable (:func:`import_model`; the Trainer
applies it first). The steps but the last are :mod:`trainops.autodiff.importing`'s, which
``expand_gradients`` shares.

- a path is loaded with its external data (``onnx.load`` beside the file); a ModelProto
  whose tensors still point to external files is an error naming them;
- initializers also listed as graph inputs (IR < 4 models, the ONNX zoo) are dropped
  from the inputs: they are weights, not data (onnxruntime rejects the training graph's
  second definition of them);
- nodes in any order are sorted topologically; a tensor with two definitions (two
  nodes writing it, or a node writing a graph input or an initializer) is a
  GradientError naming the tensor and both definitions;
- a model older than the gradient rules support (:mod:`trainops.autodiff.coverage`:
  opset 13 forms, 14 for BatchNormalization in training mode, 16 for overlapping MaxPool
  windows) is upgraded with ``onnx.version_converter`` to the lowest opset that satisfies
  them, said in one ``logging.getLogger("trainops")`` line;
- constant shape computations are folded (:mod:`.fold`), so ranks onnx's inference
  misses are known;
- BatchNormalization running statistics shared by deduplication get one copy per node
  (:func:`.batchnorm.unshare_running_stats`).

The result is what :meth:`Trainer.export` writes the trained weights into.
"""

from __future__ import annotations

import onnx

from ..autodiff.importing import (fold_shape_constants, load, sort_nodes, unlist_initializers,
                                  upgrade)
from .batchnorm import unshare_running_stats

__all__ = ["import_model", "load", "upgrade"]


def import_model(model, batchnorm: str = "train", name: str = "the model") -> onnx.ModelProto:
    """``model`` (see :func:`~trainops.autodiff.importing.load`) ready for the step-graph
    builders (see the module); ``batchnorm``: the Trainer's mode (``"train"`` needs
    BatchNormalization's opset 14)."""
    m = load(model)
    unlist_initializers(m)
    sort_nodes(m)
    m = upgrade(m, batchnorm == "train", name)
    fold_shape_constants(m)
    unshare_running_stats(m)
    return m

