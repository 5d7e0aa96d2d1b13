"""``Trainer.export(merge=...)`` of a LoRA trainer (:func:`finish`)."""

from __future__ import annotations

import numpy as np

import onnx
from onnx import helper, numpy_helper

from .. import offload as _offload
from . import inject as _inject
from . import quantize as _quantize

__all__ = ["finish", "merged_weight"]


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                  transposed: bool) -> np.ndarray:
    """``W + scale * B A`` in ``W``'s orientation (``[out, in]`` when ``transposed``, else
    ``[in, out]``), computed in float64 and rounded once to ``W``'s dtype."""
    delta = scale * (b.astype(np.float64) @ a.astype(np.float64))  # [out, in]
    if not transposed:
        delta = delta.T
    return (w.astype(np.float64) + delta).astype(w.dtype)


def _drop_dropout(g: onnx.GraphProto) -> None:
    """The adapters' Dropout nodes removed (inference: they pass their input through),
    their consumers reading that input, the ratio initializer dropped."""
    skip = {n.output[0]: n.input[0] for n in g.node
            if n.name.startswith(_inject.PREFIX) and n.op_type == "Dropout"}
    if not skip:
        return
    keep = [n for n in g.node if not (n.op_type == "Dropout" and n.output[0] in skip)]
    for n in keep:
        for i, x in enumerate(n.input):
            if x in skip:
                n.input[i] = skip[x]
    del g.node[:]
    g.node.extend(keep)
    inits = [i for i in g.initializer if i.name != f"{_inject.PREFIX}dropout_ratio"]
    del g.initializer[:]
    g.initializer.extend(inits)


def finish(model: onnx.ModelProto, merge: bool, store=None) -> onnx.ModelProto:
    """``model`` (the inference model with the trained values, adapters in place) with its
    adapters merged into the weights (``merge``: no adapter left, plain ONNX), or with the
    adapter tensors as graph inputs whose initializers (the trained values) are their
    defaults: ``onnxruntime.LoraAdapter`` files (``Trainer.save_adapter(".onnx_adapter")``)
    or feeds replace them per run; the adapters' Dropout nodes (identities at inference)
    are left out. A quantised base (``base_dtype`` int8 / int4) is float32 again in both:
    its dequantised values, which the adapters trained against, and which
    ``merge=True`` adds ``scale * B A`` to. ``store``: where the values of ``model``'s
    held-outside tensors are (:mod:`trainops.offload`): the result holds every value,
    each weight copied once."""
    model = _quantize.dequantize(model, store)
    if store is not None:  # the merged weights join a copy of the store (the trainer's stays)
        store = _offload.FrozenStore(store)
    record = _inject.read(model)
    if not merge:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        _drop_dropout(m.graph)
        inits = {i.name: i for i in m.graph.initializer}
        m.graph.input.extend(
            helper.make_tensor_value_info(n, inits[n].data_type, list(inits[n].dims))
            for n in _inject.adapter_names(record))
        return m if store is None else _offload.materialise(m, store)
    inits = {i.name: i for i in model.graph.initializer}
    m = _inject.strip(model)
    scale = record["alpha"] / record["rank"]
    for init in m.graph.initializer:
        entry = record["adapters"].get(init.name)
        if entry is None:
            continue
        a = numpy_helper.to_array(inits[f"{init.name}.lora_A"])
        b = numpy_helper.to_array(inits[f"{init.name}.lora_B"])
        w = merged_weight(_offload.value(init, store), a, b, scale, entry["transposed"])
        if store is not None and _offload.is_offloaded(init):
            init.CopyFrom(store.put(init.name, w))
        else:
            init.CopyFrom(numpy_helper.from_array(w, init.name))
    return m if store is None else _offload.materialise(m, store)
