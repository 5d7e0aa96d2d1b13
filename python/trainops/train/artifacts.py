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

from .. import offload as _offload
from . import atomic
from . import checkpoint as _checkpoint
from . import schema as _schema
from .batchnorm import inference_batchnorm
from .spec import StepGraph

__all__ = ["CHECKPOINT", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MODELS", "ManifestError",
           "custom_ops", "eval_model", "eval_state", "inference_mode", "load", "manifest",
           "manifest_problems", "model_problems", "options_problems", "read_manifest", "save"]

FORMAT = "trainops-artifacts"
FORMAT_VERSION = 1
MIN_ONNXRUNTIME = "1.17.0"  # C API 17: what libtrainops.so registers against
CUSTOM_OP_LIBRARY = "libtrainops.so"  # trainops.dll / libtrainops.dylib on those systems
MODELS = {"training": "training.onnx", "eval": "eval.onnx", "inference": "inference.onnx"}
CHECKPOINT = "checkpoint.safetensors"
MANIFEST = "manifest.json"
NORM_OUTPUT = "trainops/grad_norm"  # clip_grad_norm's gradient norm (train/clip.py)
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
    extra = [o["name"] for o in m["extra_outputs"]]
    return {"options": m["options"], "data_inputs": [d["name"] for d in m["data_inputs"]],
            "loss_output": m["loss"]["training_output"], "lr_input": m["learning_rate"]["input"],
            "lr_dtype": m["learning_rate"]["dtype"], "step_input": m["step"]["input"],
            "states": m["states"], "extra_outputs": extra,
            "finite_output": m["step"]["skip_output"],
            # clip_grad_norm's output (Trainer.last_grad_norm), under its fixed name
            "norm_output": NORM_OUTPUT if NORM_OUTPUT in extra else None}


def save(trainer, directory, graph: StepGraph | None = None, finish=None) -> dict:
    """Write ``trainer``'s artifacts into ``directory`` (created if needed; the files are
    replaced): the three models, the checkpoint and the manifest, all or nothing
    (:func:`.atomic.write_files`: every target checked first, a symlink written through,
    a special file refused; every file written to a temporary file and fsync'ed before
    any is renamed over its target). Returns the manifest. One process only (not
    ``comm=``). ``graph``: the step to write (default the trainer's; its states are the
    trainer's); ``finish(models, manifest)``: checks the models and returns the manifest
    to write (:mod:`.artifacts_portable`), before any file is written."""
    if trainer.step_graph is None:
        raise NotImplementedError("save_artifacts of a data-parallel (comm=) trainer: its "
                                  "step is two sessions around the collectives; save from a "
                                  "one-process Trainer (Trainer.load of its checkpoint)")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    graph = trainer.step_graph if graph is None else graph
    train = trainer._train_model  # read once: a copy with the weights put back
    models = {"training": graph.model,
              "eval": eval_model(train, eval_state(graph), graph.options.loss),
              "inference": trainer.export()}
    # the model with its loss attached: a trainops.losses loss adds its target input
    man = manifest(graph, train, models, trainer.runtime.arrays)
    if finish is not None:
        man = finish(models, man)
    frozen = getattr(trainer, "_frozen", None)  # a LoRA base held outside: put back
    files = [(os.path.join(directory, MODELS[key]),
              [m.SerializeToString() if frozen is None
               else _offload.serialize(m, frozen, "save_artifacts")])
             for key, m in models.items()]
    files.append((os.path.join(directory, CHECKPOINT),
                  _checkpoint.serialize(*_checkpoint.state_of(trainer))))
    files.append((os.path.join(directory, MANIFEST), [(json.dumps(man, indent=2) + "\n").encode()]))
    # Older versions wrote through "<name>.tmp": an interrupted save of theirs left it.
    legacy = [(os.path.basename(p) + ".tmp",) for p, _ in files]
    atomic.write_files(files, "Trainer.save_artifacts", legacy)
    return man


class ManifestError(ValueError):
    """A ``manifest.json`` (or a model it names) that this reader refuses: the message
    names the file and lists every problem, each with its key (``states[0].output``) and
    what was expected."""


def _manifest_error(path, problems: list[str]) -> ManifestError:
    return ManifestError(f"manifest {os.fspath(path)!r} is not a valid trainops artifacts "
                         "manifest:\n" + "\n".join(f"  - {p}" for p in problems))


def read_manifest(directory) -> dict:
    """``manifest.json`` of ``directory``, checked: strict JSON (UTF-8), valid against
    ``docs/manifest.schema.json`` (:mod:`.schema`), and the rules the schema cannot
    express (:func:`manifest_problems`). :class:`ManifestError` listing every problem,
    each naming its key and what was expected."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    _checkpoint.refuse_special(path, "manifest")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        man = _checkpoint.parse_json(raw.decode("utf-8"))
    except (UnicodeError, ValueError) as exc:
        raise _manifest_error(path, [f"expected a JSON object in UTF-8: {exc}"]) from None
    problems = _schema.manifest_validator().problems(man)
    if not problems:
        problems = manifest_problems(man)
    if problems:
        raise _manifest_error(path, problems)
    return man


def manifest_problems(man: dict) -> list[str]:
    """What a manifest valid against the schema may still get wrong (empty: nothing):
    a name bound twice (two states, or a state and a data input, on one input; two states,
    a state and the loss or an extra output on one output), ``step.skip_output`` that is
    no bool extra output, a parameter that is no state of kind ``param``. The Rust
    trainer checks the same (``manifest.rs``)."""
    problems: list[str] = []

    def claim(seen: dict, name: str, key: str, what: str) -> None:
        if name in seen:
            problems.append(f"{key}: {_schema.show(name)} is also {seen[name]} ({what})")
        else:
            seen[name] = key

    for named, what in ((bound_inputs(man), "an input is bound once"),
                        (bound_outputs(man), "an output has one buffer")):
        seen: dict = {}
        for key, name in named:
            claim(seen, name, key, what)
    skip = man["step"]["skip_output"]
    if skip is not None:
        found = [(i, o) for i, o in enumerate(man["extra_outputs"]) if o["name"] == skip]
        if not found:
            problems.append(f"step.skip_output: {_schema.show(skip)} is not the name of an "
                            "extra_outputs entry (expected a bool extra output)")
        elif found[0][1]["dtype"] != "bool":
            problems.append(f"step.skip_output: {_schema.show(skip)} is extra_outputs"
                            f"[{found[0][0]}], of dtype {found[0][1]['dtype']} (expected bool)")
    params = {s["input"] for s in man["states"] if s["kind"] == "param"}
    for i, p in enumerate(man["parameters"]):
        if p not in params:
            problems.append(f"parameters[{i}]: {_schema.show(p)} is not the input of a state of "
                            "kind \"param\"")
    return problems


def bound_inputs(man: dict) -> list[tuple[str, str]]:
    """``(key, name)`` of every training-model input the manifest binds."""
    return ([(f"data_inputs[{i}].name", d["name"]) for i, d in enumerate(man["data_inputs"])] +
            [("learning_rate.input", man["learning_rate"]["input"]),
             ("step.input", man["step"]["input"])] +
            [(f"states[{i}].input", s["input"]) for i, s in enumerate(man["states"])])


def bound_outputs(man: dict) -> list[tuple[str, str]]:
    """``(key, name)`` of every training-model output the manifest binds."""
    return ([(f"states[{i}].output", s["output"]) for i, s in enumerate(man["states"])] +
            [("loss.training_output", man["loss"]["training_output"])] +
            [(f"extra_outputs[{i}].name", o["name"]) for i, o in enumerate(man["extra_outputs"])])


def model_problems(man: dict, inputs: list[str], outputs: list[str]) -> list[str]:
    """The manifest against its training model's ``inputs`` (initializers excluded) and
    ``outputs``: every name it binds exists there, every model input is bound."""
    file = man["models"]["training"]
    problems = [f"{key}: {_schema.show(name)} is not an input of {file}"
                for key, name in bound_inputs(man) if name not in set(inputs)]
    bound = {name for _, name in bound_inputs(man)}
    problems += [f"data_inputs: the input {_schema.show(name)} of {file} is not bound (neither "
                 "a data input, a state, the learning rate nor the step)"
                 for name in inputs if name not in bound]
    problems += [f"{key}: {_schema.show(name)} is not an output of {file}"
                 for key, name in bound_outputs(man) if name not in set(outputs)]
    return problems


def _training_model(directory: str, man: dict, mpath: str) -> onnx.ModelProto:
    """``models.training``, loaded and checked against the manifest (ManifestError)."""
    from google.protobuf.message import DecodeError

    path = os.path.join(directory, man["models"]["training"])
    _checkpoint.refuse_special(path, "models.training")
    try:
        model = onnx.load(path)
    except DecodeError as exc:
        raise _manifest_error(mpath, [f"models.training: {path!r} is not an ONNX model "
                                      f"({exc})"]) from None
    g = model.graph
    inits = {i.name for i in g.initializer}
    problems = model_problems(man, [i.name for i in g.input if i.name not in inits],
                              [o.name for o in g.output])
    if problems:
        raise _manifest_error(mpath, problems)
    return model


def options_problems(man: dict, metadata: dict) -> list[str]:
    """The manifest's ``options`` against the checkpoint's ``config`` and ``seed`` (both
    record how the step was built; they must agree). The Rust trainer checks the same."""
    config, o = json.loads(metadata["config"]), man["options"]
    # A trainops.losses loss is an object in the config and its output's name in options.
    keys = ("optimizer", "params", "policy") if isinstance(config.get("loss"), dict) else \
        ("loss", "optimizer", "params", "policy")
    problems = [f"config {k!r}: the checkpoint has {_schema.show(config.get(k))}, the "
                f"manifest's options.{k} {_schema.show(o.get(k))}"
                for k in keys if not _schema.json_equal(o.get(k), config.get(k))]
    if metadata["seed"] and not _schema.json_equal(o["key_seed"], int(metadata["seed"])):
        problems.append(f"seed {metadata['seed']}: the manifest's options.key_seed is "
                        f"{o['key_seed']}")
    return problems


def load(cls, directory, threads: int | None = None) -> Any:
    """A ``cls`` (:class:`~.trainer.Trainer`) resuming from the artifacts in ``directory``:
    the manifest (:func:`read_manifest`) and the training model checked against it, the
    checkpoint read (:func:`.checkpoint.read`) and checked against the manifest's options,
    the StepGraph from the manifest over ``training.onnx``, every state from the
    checkpoint (validated against it: :func:`.checkpoint.restore`), ``T``, the learning
    rate and the skipped count from its metadata. Steps continue bit for bit. Errors:
    :class:`ManifestError` (the manifest or the training model),
    :class:`~.checkpoint.CheckpointError` (the checkpoint), each naming the file."""
    directory = os.fspath(directory)
    mpath = os.path.join(directory, MANIFEST)
    man = read_manifest(directory)
    training = _training_model(directory, man, mpath)
    path = os.path.join(directory, man["checkpoint"])
    tensors, metadata = _checkpoint.read(path)
    problems = options_problems(man, metadata)
    if problems:
        raise _checkpoint.problems_error(path, f"does not match the manifest {mpath!r}",
                                         problems)
    try:
        graph = StepGraph.from_manifest(training, _step_graph_manifest(man), tensors)
    except (ValueError, TypeError, KeyError) as exc:  # a state missing or of another
        # dtype or shape; options its classes refuse (the same as the config's)
        raise _checkpoint.CheckpointError(
            f"checkpoint {path!r} and the manifest {mpath!r} cannot build the step: "
            f"{exc}") from exc
    # Portable artifacts resume as a portable trainer: its session is made as theirs was.
    trainer = _checkpoint.build_trainer(cls, tensors, metadata, path, threads,
                                        _step_graph=graph, portable=man.get("portable") or None)
    _checkpoint.restore(trainer, tensors, metadata, path)
    return trainer
