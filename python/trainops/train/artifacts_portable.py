"""Portable training artifacts: ``training.onnx`` and ``eval.onnx`` of default-domain ONNX
ops only, for runtimes that cannot load a custom-op library (onnxruntime-web,
onnxruntime-node, mobile builds). ``docs/artifacts.md`` ("Portable artifacts").

:func:`save` writes them for any :class:`~.trainer.Trainer`: a trainer built with
``portable=True`` (or resumed from portable artifacts) has its step graph already; any other
(the default CPU trainer, whose backward uses trainops' fused gradient kernels) has its step
built again from the same model and options with the standard-op backward, then rewritten
by :func:`.placement.portable_graph`, the rewrite ``Trainer(portable=True)`` uses. The
state names are the trainer's, so its current states (checkpoint) carry over as they are.

The manifest differs from the library's in four keys: ``"portable": true``,
``"custom_ops": []``, ``"custom_op_library": null`` and ``"dropout"`` (every ONNX Dropout
of the step and its ``seed``). A runtime feeds exactly what the loop of docs/artifacts.md
feeds: the data inputs, ``lr``, ``T`` and every state; nothing for the Dropout masks, which
the runtime's own Dropout kernel draws from the node's ``seed`` attribute (run k of a
session draws the same masks in every session of one onnxruntime build).
"""

from __future__ import annotations

import dataclasses

import onnx

from . import artifacts as _artifacts
from .graph import build_step_graph
from .placement import portable_graph
from .spec import StepGraph

__all__ = ["DEFAULT_DOMAINS", "NotPortableError", "dropout_nodes", "explicit_conv_attributes",
           "foreign_nodes", "portable_step_graph", "save"]

# The domains of the ONNX standard: what every runtime implements.
DEFAULT_DOMAINS = ("", "ai.onnx")


class NotPortableError(ValueError):
    """A trainer whose step cannot be written with default-domain ONNX ops only: the
    message names the ops (``domain::op_type``), the nodes, the model file and why."""


def foreign_nodes(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """``(domain::op_type, node name)`` of every node of ``model`` (main graph, subgraphs,
    functions) outside the default ONNX domain, in graph order."""
    found: list[tuple[str, str]] = []

    def scan(nodes):
        for n in nodes:
            if n.domain not in DEFAULT_DOMAINS:
                found.append((f"{n.domain}::{n.op_type}", n.name or n.output[0]))
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    scan(sub.node)

    scan(model.graph.node)
    for f in model.functions:
        scan(f.node)
    return found


def _refuse(what: str, why: str) -> NotPortableError:
    return NotPortableError(f"save_artifacts(portable=True): {what}; {why}. Save the "
                            "artifacts without portable=True to train them with trainops' "
                            "custom-op library loaded")


def _check(models: dict) -> None:
    """NotPortableError naming every node outside the default domain, per model file."""
    problems = []
    for key, m in models.items():
        nodes = foreign_nodes(m)
        if nodes:
            ops = sorted({op for op, _ in nodes})
            shown = ", ".join(f"{name!r} ({op})" for op, name in nodes[:5])
            more = f" and {len(nodes) - 5} more" if len(nodes) > 5 else ""
            problems.append(f"{_artifacts.MODELS[key]} would keep {', '.join(ops)} (nodes "
                            f"{shown}{more})")
    if problems:
        raise _refuse("; ".join(problems),
                      "the portable rewrite (trainops.portable.EXPANSIONS) has no default-"
                      "domain form for them (a model's RandomUniform/RandomNormal become "
                      "Philox ops, a quantised or custom op stays what it is)")


def portable_step_graph(trainer) -> StepGraph:
    """The step graph of ``trainer`` in default-domain ops: its own when it has no node of
    another domain left (``Trainer(portable=True)``, or resumed from portable artifacts);
    else built again with the standard-op backward and rewritten
    (:func:`.placement.portable_graph`), its states checked to be the trainer's (names,
    dtypes, shapes) so the checkpoint carries over. NotPortableError otherwise."""
    graph = trainer.step_graph
    if graph is None:
        raise NotImplementedError("save_artifacts of a data-parallel (comm=) trainer: its "
                                  "step is two sessions around the collectives; save from a "
                                  "one-process Trainer (Trainer.load of its checkpoint)")
    if not foreign_nodes(graph.model):
        return graph
    if getattr(trainer, "_frozen", None) is not None or trainer.base_dtype != "float32":
        raise _refuse("a LoRA trainer whose frozen base is held outside the model or "
                      f"quantised (base_dtype={trainer.base_dtype!r})",
                      "its step reads the base through trainops' own machinery")
    options = dataclasses.replace(graph.options, fused=False)
    try:
        rebuilt = portable_graph(build_step_graph(trainer._train_model, options),
                                 options.key_seed)
    except ValueError as exc:  # an optimizer without a standard-op form (check_portable)
        raise _refuse("the step cannot be rewritten", str(exc)) from exc
    mine = [(e.input, e.output, e.kind, str(e.initial.dtype), e.initial.shape)
            for e in graph.states]
    theirs = [(e.input, e.output, e.kind, str(e.initial.dtype), e.initial.shape)
              for e in rebuilt.states]
    if mine != theirs:  # a state the standard-op step lacks or adds: no checkpoint carries
        raise _refuse("the standard-op step's states differ from the trainer's "
                      f"({sorted(set(theirs) ^ set(mine))[:3]})",
                      "the checkpoint would not fit it")
    return rebuilt


def dropout_nodes(model: onnx.ModelProto) -> list[dict]:
    """``{"node", "seed"}`` of every ONNX Dropout of ``model``'s main graph that trains
    (a ``training_mode`` input): the masks the runtime draws from ``seed``."""
    out = []
    for n in model.graph.node:
        if n.op_type == "Dropout" and n.domain in DEFAULT_DOMAINS and len(n.input) > 2 \
                and n.input[2]:
            seed = next((a.i for a in n.attribute if a.name == "seed"), None)
            out.append({"node": n.name or n.output[0], "seed": seed})
    return out


def explicit_conv_attributes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (changed in place, returned) with every default-domain ``Conv`` of its main
    graph given its ``strides``, ``dilations`` and (without ``auto_pad``) ``pads`` when they
    are left to their defaults (ones, ones, zeros): the same convolution, but
    onnxruntime-web's WebGPU kernel refuses a Conv without them ("dilations should be 2D").
    The spatial rank comes from ``kernel_shape`` or the weight's declared rank."""
    from onnx import helper

    g = model.graph
    ranks = {i.name: len(i.dims) for i in g.initializer}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            ranks.setdefault(vi.name, len(t.shape.dim))
    for n in g.node:
        if n.op_type != "Conv" or n.domain not in DEFAULT_DOMAINS:
            continue
        attrs = {a.name: a for a in n.attribute}
        k = len(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else \
            ranks.get(n.input[1], 0) - 2
        if k < 1:
            continue  # the weight's rank is unknown: left as it is
        auto = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
        for name, value in (("strides", [1] * k), ("dilations", [1] * k),
                            ("pads", [0] * (2 * k))):
            if name not in attrs and (name != "pads" or auto == "NOTSET"):
                n.attribute.append(helper.make_attribute(name, value))
    return model


def _finish(models: dict, man: dict) -> dict:
    _check(models)
    for m in models.values():  # fresh copies (save() passes a copy of the step's model)
        explicit_conv_attributes(m)
    return dict(man, portable=True, custom_ops=[], custom_op_library=None,
                dropout=dropout_nodes(models["training"]))


def save(trainer, directory) -> dict:
    """Write ``trainer``'s portable artifacts into ``directory`` (as
    :func:`.artifacts.save`: all or nothing) and return the manifest. NotPortableError,
    before anything is written, when a model would keep a node outside the default domain."""
    if getattr(trainer, "accumulate", 1) > 1:
        raise NotImplementedError("save_artifacts with accumulate > 1 (a micro-batch "
                                  "model and an update model) is not supported yet")
    graph = portable_step_graph(trainer)
    copy = onnx.ModelProto()
    copy.CopyFrom(graph.model)  # the trainer's own step model (its session's) stays as it is
    graph = dataclasses.replace(graph, model=copy)
    return _artifacts.save(trainer, directory, graph=graph, finish=_finish)
