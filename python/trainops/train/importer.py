"""Models as exporters write them, made trainable (:func:`import_model`; the Trainer
applies it first).

- a path is loaded with its external data (``onnx.load`` beside the file); a ModelProto
  whose tensors still point to external files is an error naming them;
- initializers also listed as graph inputs (IR < 4 models, the ONNX zoo) are dropped
  from the inputs: they are weights, not data (onnxruntime rejects the training graph's
  second definition of them);
- nodes in any order are sorted topologically;
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

import logging
import os

import onnx
from onnx import helper

from ..autodiff import GradientError, toposort
from ..autodiff.backward import default_opset
from ..autodiff.coverage import opset_needs
from ..autodiff.graph import skeleton
from .batchnorm import unshare_running_stats
from .fold import fold_shape_constants

__all__ = ["import_model", "load"]

log = logging.getLogger("trainops")


def load(model) -> onnx.ModelProto:
    """A copy of ``model`` (a ModelProto, serialized bytes or a path; a path's external
    data loaded). ValueError for tensors whose external data is not loaded."""
    if isinstance(model, (str, os.PathLike)):
        m = onnx.load(os.fspath(model), load_external_data=True)
    elif isinstance(model, bytes):
        m = onnx.load_from_string(model)
    elif isinstance(model, onnx.ModelProto):
        m = onnx.ModelProto()
        m.CopyFrom(model)
    else:
        raise TypeError(f"model: expected an onnx.ModelProto, bytes or a path, got "
                        f"{type(model).__name__}")
    external = [t.name for t in m.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ValueError(f"initializers {external[:5]} hold their data in external files "
                         "that are not loaded: pass the model's path (or onnx.load it with "
                         "load_external_data=True)")
    return m


def import_model(model, batchnorm: str = "train", name: str = "the model") -> onnx.ModelProto:
    """``model`` (see :func:`load`) ready for the step-graph builders (see the module);
    ``batchnorm``: the Trainer's mode (``"train"`` needs BatchNormalization's opset 14)."""
    m = load(model)
    g = m.graph
    inits = {i.name for i in g.initializer}
    if any(i.name in inits for i in g.input):
        keep = [i for i in g.input if i.name not in inits]
        del g.input[:]
        g.input.extend(keep)
        m.ir_version = max(m.ir_version, 4)  # IR 3 requires initializers among the inputs
    if g.node:
        nodes = toposort(list(g.node), {i.name for i in g.input} | inits)
        del g.node[:]
        g.node.extend(nodes)
    m = upgrade(m, batchnorm == "train", name)
    fold_shape_constants(m)
    unshare_running_stats(m)
    return m


def upgrade(m: onnx.ModelProto, train_batchnorm: bool, name: str) -> onnx.ModelProto:
    """``m`` converted to the lowest opset its gradient rules need (itself if new enough);
    GradientError when onnx's converter fails."""
    opset = default_opset(m)
    needs = opset_needs(m.graph.node, train_batchnorm)
    target = max(needs.values())
    if opset >= target:
        return m
    from onnx import version_converter

    light, big = skeleton(m)
    try:
        out = version_converter.convert_version(light, target)
    except Exception as exc:  # noqa: BLE001 - the converter's errors are of many types
        raise GradientError(f"{name} imports opset {opset}; training needs opset {target} "
                            f"({', '.join(w for w, v in needs.items() if v > opset)}) and "
                            f"onnx's version converter failed: {exc}. Export the model with "
                            f"opset_version={target} or later") from exc
    names = {i.name for i in big}
    keep = [i for i in out.graph.input if i.name not in names]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    out.graph.initializer.extend(big)
    # The converter may write its own (newest) IR version: keep the oldest that fits, which
    # older onnxruntimes read.
    out.ir_version = max(m.ir_version, helper.find_min_ir_version_for(
        [o for o in out.opset_import if o.domain in ("", "ai.onnx")]))
    why = ", ".join(f"{w} ({v})" for w, v in needs.items() if v > opset)
    log.info("upgraded %s from opset %d to %d for %s", name, opset, target, why)
    return out
