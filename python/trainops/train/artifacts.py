"""Training artifacts: a folder that trains on stock ONNX Runtime with ``libtrainops.so``
loaded, from any language (``docs/artifacts.md``, schema ``docs/manifest.schema.json``).

- ``training.onnx``: the :class:`~.spec.StepGraph`'s model (one step; every state an input
  with its output partner, to be bound to one buffer);
- ``eval.onnx``: the source model in inference mode (Dropout off) whose parameters are graph
  inputs: forward and loss, no update, no Philox state;
- ``inference.onnx``: :meth:`Trainer.export`'s model;
- ``checkpoint.safetensors``: every state tensor by its input name, with the metadata of
  :mod:`.checkpoint`;
- ``manifest.json``: names, dtypes and shapes of everything a loop binds.

:func:`save` writes them for a Trainer; :func:`load` resumes one (:class:`~.spec.StepGraph`
from the manifest and the training model, states from the checkpoint).
"""

from __future__ import annotations

import json
import os
from typing import Any

import onnx
from onnx import TensorProto, helper

from . import checkpoint as _checkpoint
from .batchnorm import inference_batchnorm
from .spec import StepGraph

__all__ = ["CHECKPOINT", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MODELS", "custom_ops",
           "eval_model", "eval_state", "inference_mode", "load", "manifest", "read_manifest", "save"]

FORMAT = "trainops-artifacts"
FORMAT_VERSION = 1
MIN_ONNXRUNTIME = "1.17.0"  # C API 17: what libtrainops.so registers against
CUSTOM_OP_LIBRARY = "libtrainops.so"  # trainops.dll / libtrainops.dylib on those systems
MODELS = {"training": "training.onnx", "eval": "eval.onnx", "inference": "inference.onnx"}
CHECKPOINT = "checkpoint.safetensors"
MANIFEST = "manifest.json"
# Domains ONNX Runtime implements itself: nodes there need no custom-op library.
BUILTIN_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")
_DTYPE_NAMES = {TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64",
                TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
                TensorProto.INT64: "int64", TensorProto.INT32: "int32",
                TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64",
                TensorProto.BOOL: "bool", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8"}


def _value_info(vi: onnx.ValueInfoProto) -> dict:
    """``{"name", "dtype", "shape"}`` of a graph input/output (a dim: int, its symbolic
    name, or None when unknown; shape None when the rank is unknown)."""
    t = vi.type.tensor_type
    dtype = _DTYPE_NAMES.get(t.elem_type, helper.tensor_dtype_to_string(t.elem_type))
    shape = None
    if t.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else
                 (d.dim_param if d.HasField("dim_param") else None) for d in t.shape.dim]
    return {"name": vi.name, "dtype": dtype, "shape": shape}


def inference_mode(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every ONNX Dropout in inference mode (its ``training_mode``
    input removed, as PyTorch's ``model.eval()``: it passes its input through) and every
    BatchNormalization in the inference form (:func:`.batchnorm.inference_batchnorm`)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inference_batchnorm(m)
    for n in m.graph.node:
        if n.op_type == "Dropout" and n.domain in ("", "ai.onnx") and len(n.input) > 2:
            ins = list(n.input[:2])
            del n.input[:]
            n.input.extend(ins)
    return m


def eval_state(graph) -> list[str]:
    """The states ``eval.onnx`` reads as inputs: the parameters, then the BatchNormalization
    running statistics (``bn_stat``; eval normalises with them, as ``model.eval()``)."""
    return graph.param_names + [e.input for e in graph.of_kind("bn_stat")]


def eval_model(model: onnx.ModelProto, params, loss: str) -> onnx.ModelProto:
    """Forward and loss of ``model`` with no update: inference mode (:func:`inference_mode`),
    each of ``params`` a graph input (its initializer removed: the caller binds the
    training state's buffer of the same name), outputs the model's own with ``loss``
    among them. No optimizer state, learning rate or ``T``; no Philox state advances."""
    m = inference_mode(model)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    missing = [p for p in params if p not in inits]
    if missing:
        raise ValueError(f"eval_model: params {missing} are not initializers of the model")
    keep = [i for i in g.initializer if i.name not in set(params)]
    declared = {i.name for i in g.input}
    for p in params:
        if p not in declared:
            g.input.append(helper.make_tensor_value_info(p, inits[p].data_type,
                                                         list(inits[p].dims)))
    del g.initializer[:]
    g.initializer.extend(keep)
    if loss not in {o.name for o in g.output}:
        inferred = onnx.shape_inference.infer_shapes(model).graph
        vi = {v.name: v for v in inferred.value_info}
        g.output.append(vi[loss] if loss in vi else helper.make_tensor_value_info(
            loss, TensorProto.FLOAT, None))
    g.name = (g.name or "model") + "_eval"
    return m


def custom_ops(*models: onnx.ModelProto) -> list[str]:
    """``"domain::op_type"`` of every node of ``models`` (main graphs and subgraphs) in a
    domain ONNX Runtime does not implement itself (sorted, without repeats)."""
    found = set()

    def scan(graph):
        for n in graph.node:
            if n.domain not in BUILTIN_DOMAINS:
                found.add(f"{n.domain}::{n.op_type}")
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    scan(sub)

    for m in models:
        scan(m.graph)
    return sorted(found)


def _producer() -> str:
    try:
        from importlib.metadata import version

        return f"trainops {version('trainops')}"
    except Exception:  # a source checkout: no installed distribution
        return "trainops"


def manifest(graph: StepGraph, source: onnx.ModelProto, models: dict, outputs: dict) -> dict:
    """The ``manifest.json`` of the step graph ``graph`` of the model ``source``;
    ``models``: ``{"training", "eval", "inference"}`` -> ModelProto (for the custom ops);
    ``outputs``: the loss and extra outputs' buffers (numpy arrays of the static shapes
    ONNX Runtime gives them, as :class:`~.runtime.StepRuntime` allocates them)."""
    inputs = {i.name: i for i in source.graph.input}

    def out(name):
        return {"name": name, "dtype": str(outputs[name].dtype),
                "shape": list(outputs[name].shape)}

    loss = out(graph.loss_output)
    eval_inputs = list(graph.data_inputs) + eval_state(graph)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "producer": _producer(),
        "min_onnxruntime": MIN_ONNXRUNTIME, "custom_op_library": CUSTOM_OP_LIBRARY,
        "custom_ops": custom_ops(*models.values()),
        "models": dict(MODELS), "checkpoint": CHECKPOINT,
        "data_inputs": [_value_info(inputs[n]) for n in graph.data_inputs],
        "loss": {"training_output": graph.loss_output, "eval_output": graph.options.loss,
                 "dtype": loss["dtype"], "shape": loss["shape"]},
        "learning_rate": {"input": graph.lr_input, "dtype": _dtype_name(graph.lr_dtype)},
        "step": {"input": graph.step_input, "dtype": "int64",
                 "skip_output": graph.finite_output},
        "states": [e.to_manifest() for e in graph.states],
        "extra_outputs": [out(n) for n in graph.extra_outputs],
        "parameters": graph.param_names,
        "eval_inputs": eval_inputs,
        "options": graph.options.to_manifest(),
    }


def _dtype_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def _step_graph_manifest(m: dict) -> dict:
    """The artifacts manifest in :meth:`StepGraph.to_manifest`'s form."""
    return {"options": m["options"], "data_inputs": [d["name"] for d in m["data_inputs"]],
            "loss_output": m["loss"]["training_output"], "lr_input": m["learning_rate"]["input"],
            "lr_dtype": m["learning_rate"]["dtype"], "step_input": m["step"]["input"],
            "states": m["states"], "extra_outputs": [o["name"] for o in m["extra_outputs"]],
            "finite_output": m["step"]["skip_output"]}


def save(trainer, directory) -> dict:
    """Write ``trainer``'s artifacts into ``directory`` (created if needed; the files are
    replaced): the three models, the checkpoint (atomically) and, last, the manifest.
    Returns the manifest. One process only (not ``comm=``)."""
    if trainer.step_graph is None:
        raise NotImplementedError("save_artifacts of a data-parallel (comm=) trainer: its "
                                  "step is two sessions around the collectives; save from a "
                                  "one-process Trainer (Trainer.load of its checkpoint)")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    graph = trainer.step_graph
    models = {"training": graph.model,
              "eval": eval_model(trainer._train_model, eval_state(graph), graph.options.loss),
              "inference": trainer.export()}
    for key, m in models.items():
        _write_bytes(os.path.join(directory, MODELS[key]), m.SerializeToString())
    _checkpoint.write(os.path.join(directory, CHECKPOINT), *_checkpoint.state_of(trainer))
    man = manifest(graph, trainer._model, models, trainer.runtime.arrays)
    _write_bytes(os.path.join(directory, MANIFEST),
                 (json.dumps(man, indent=2) + "\n").encode())
    return man


def _write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def read_manifest(directory) -> dict:
    """``manifest.json`` of ``directory``, its format and version checked (ValueError
    naming what was expected)."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    with open(path, encoding="utf-8") as f:
        man = json.load(f)
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise ValueError(f"{path}: not a trainops artifacts manifest (expected format "
                         f"{FORMAT!r})")
    if man.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {man.get('format_version')!r}; this "
                         f"trainops reads version {FORMAT_VERSION}")
    return man


def load(cls, directory, threads: int | None = None) -> Any:
    """A ``cls`` (:class:`~.trainer.Trainer`) resuming from the artifacts in ``directory``:
    the StepGraph from the manifest over ``training.onnx``, every state from the
    checkpoint (validated against it: :func:`.checkpoint.restore`), ``T``, the learning
    rate and the skipped count from its metadata. Steps continue bit for bit."""
    from .. import optim

    directory = os.fspath(directory)
    man = read_manifest(directory)
    path = os.path.join(directory, man["checkpoint"])
    tensors, metadata = _checkpoint.read(path)
    if _checkpoint.MODEL_KEY not in tensors:
        raise _checkpoint.CheckpointError(f"checkpoint {path!r} has no source model (tensor "
                                          f"{_checkpoint.MODEL_KEY!r})")
    training = onnx.load(os.path.join(directory, man["models"]["training"]))
    graph = StepGraph.from_manifest(training, _step_graph_manifest(man), tensors)
    config = json.loads(metadata["config"])
    o = man["options"]
    differ = [k for k in ("loss", "optimizer", "params", "policy") if o.get(k) != config.get(k)]
    if metadata["seed"] and o.get("key_seed") != int(metadata["seed"]):
        differ.append("key_seed (the checkpoint's seed)")
    if differ:
        raise ValueError(f"{directory}: the manifest's options and the checkpoint's config "
                         f"differ in {differ}")
    trainer = cls(tensors[_checkpoint.MODEL_KEY].tobytes(), config["loss"],
                  optim.from_dict(config["optimizer"]), params=config["params"],
                  policy=config["policy"], threads=threads,
                  seed=int(metadata["seed"]) if metadata["seed"] else None, _step_graph=graph)
    _checkpoint.restore(trainer, tensors, metadata, path)
    return trainer
