"""``Trainer.export(merge=...)`` of a LoRA trainer (:func:`finish`)."""

from __future__ import annotations

import numpy as np

import onnx
from onnx import helper, numpy_helper

from . import inject as _inject

__all__ = ["finish", "merged_weight"]


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                  transposed: bool) -> np.ndarray:
    """``W + scale * B A`` in ``W``'s orientation (``[out, in]`` when ``transposed``, else
    ``[in, out]``), computed in float64 and rounded once to ``W``'s dtype."""
    delta = scale * (b.astype(np.float64) @ a.astype(np.float64))  # [out, in]
    if not transposed:
        delta = delta.T
    return (w.astype(np.float64) + delta).astype(w.dtype)


def finish(model: onnx.ModelProto, merge: bool) -> onnx.ModelProto:
    """``model`` (the inference model with the trained values, adapters in place) with its
    adapters merged into the weights (``merge``: no adapter left, plain ONNX), or with the
    adapter tensors as graph inputs whose initializers (the trained values) are their
    defaults: ``onnxruntime.LoraAdapter`` files (``Trainer.save_adapter(".onnx_adapter")``)
    or feeds replace them per run."""
    record = _inject.read(model)
    if not merge:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        inits = {i.name: i for i in m.graph.initializer}
        m.graph.input.extend(
            helper.make_tensor_value_info(n, inits[n].data_type, list(inits[n].dims))
            for n in _inject.adapter_names(record))
        return m
    inits = {i.name: i for i in model.graph.initializer}
    m = _inject.strip(model)
    scale = record["alpha"] / record["rank"]
    for init in m.graph.initializer:
        entry = record["adapters"].get(init.name)
        if entry is None:
            continue
        a = numpy_helper.to_array(inits[f"{init.name}.lora_A"])
        b = numpy_helper.to_array(inits[f"{init.name}.lora_B"])
        w = merged_weight(numpy_helper.to_array(init), a, b, scale, entry["transposed"])
        init.CopyFrom(numpy_helper.from_array(w, init.name))
    return m
