"""Which ops a training run needs gradient rules for, and whether they have them.

:func:`coverage` lists every op type on the path from the parameters to the loss (the
nodes the backward pass differentiates) with its verdict: a rule in :data:`RULES`, or
why not (no rule, another domain, an opset the rule does not support). :func:`check`
raises ONE :class:`GradientError` listing every missing op, so a model's gaps show at
once (the Trainer runs it first; ``python -m trainops coverage MODEL.onnx`` prints it).

:data:`OPSET_NEEDS` is the oldest opset each rule supports where that is above the
rules' baseline (:data:`BASELINE_OPSET`); the Trainer's importer upgrades older models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import onnx

from .graph import (FLOAT_TYPES, GradientError, attr, default_opset, describe, infer,
                    value_inputs)
from .rules import RULES

__all__ = ["BASELINE_OPSET", "OPSET_NEEDS", "OpCoverage", "check", "coverage", "format_table",
           "opset_needs", "path_nodes"]

# The rules emit and read opset-13 forms (axes as inputs, Softmax on one axis, ...).
BASELINE_OPSET = 13


def _max_pool_need(node: onnx.NodeProto) -> int:
    k = list(attr(node, "kernel_shape", []))
    strides = list(attr(node, "strides", [1] * len(k)))
    dil = list(attr(node, "dilations", [1] * len(k)))
    overlap = any(s < (kk - 1) * d + 1 for s, kk, d in zip(strides, k, dil))
    return 16 if overlap else 0


def _batch_norm_need(node: onnx.NodeProto) -> int:
    return 14  # training_mode (batch statistics)


# op type -> (the oldest opset its rule supports for this node, why).
OPSET_NEEDS = {
    "MaxPool": (_max_pool_need, "overlapping MaxPool windows (ScatterElements 'add')"),
    "BatchNormalization": (_batch_norm_need, "BatchNormalization in training mode"),
    "GatherND": (lambda node: 16, "GatherND's gradient (ScatterND with reduction 'add')"),
}


def opset_needs(nodes: Sequence[onnx.NodeProto], train_batchnorm: bool = True) -> dict[str, int]:
    """Why -> the opset it needs, for ``nodes`` (the baseline included)."""
    needs = {"the gradient rules' operator forms": BASELINE_OPSET}
    for n in nodes:
        if n.domain not in ("", "ai.onnx") or n.op_type not in OPSET_NEEDS:
            continue
        if n.op_type == "BatchNormalization" and not train_batchnorm:
            continue
        fn, why = OPSET_NEEDS[n.op_type]
        v = fn(n)
        if v > needs.get(why, 0):
            needs[why] = v
    return needs


@dataclass
class OpCoverage:
    """One op type on the path: ``nodes`` (each described: ``Sin node 'name'``), ``rule``
    (True: it has one),
    ``why`` (the reason it has none, else "")."""

    op_type: str
    domain: str
    nodes: list[str] = field(default_factory=list)
    rule: bool = True
    why: str = ""


def path_nodes(graph: onnx.GraphProto, loss: str, params: Sequence[str],
               types: dict[str, int] | None = None) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` that the backward pass of ``loss`` with respect to
    ``params`` differentiates: ancestors of ``loss`` reading a value that depends on a
    parameter (through float values, and inputs read for more than their type or shape:
    :data:`~.graph.TYPE_ONLY_INPUTS`; ``types``: known element types, name -> type)."""
    types = types or {}
    producer = {o: n for n in graph.node for o in n.output if o}
    ancestors: set[int] = set()
    stack, seen = [loss], set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        n = producer.get(t)
        if n is None or id(n) in ancestors:
            continue
        ancestors.add(id(n))
        stack.extend(i for i in n.input if i)
    needs = set(params)
    out = []
    for n in graph.node:
        if id(n) not in ancestors or not any(
                v and i in needs for i, v in zip(n.input, value_inputs(n))):
            continue
        floats = [o for o in n.output if o and (types.get(o) is None or types[o] in FLOAT_TYPES)]
        if floats:  # a node with integer outputs only (Shape, ArgMax) passes no gradient
            out.append(n)
            needs.update(floats)
    return out


def coverage(model: onnx.ModelProto, loss: str, params: Sequence[str],
             train_batchnorm: bool = True) -> list[OpCoverage]:
    """Every op type on the path from ``params`` to ``loss`` in ``model`` (nodes in
    topological order), in first-seen order, with its verdict. ``train_batchnorm``:
    BatchNormalization will run in training mode (the Trainer's ``batchnorm="train"``)."""
    opset = default_opset(model)
    inferred = infer(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.value_info) + list(inferred.input) + list(inferred.output)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    rows: dict[tuple[str, str], OpCoverage] = {}
    for n in path_nodes(model.graph, loss, params, types):
        domain = n.domain if n.domain not in ("", "ai.onnx") else ""
        row = rows.get((domain, n.op_type))
        if row is None:
            row = rows[(domain, n.op_type)] = OpCoverage(n.op_type, domain)
            if domain:
                row.rule, row.why = False, (f"domain '{domain}': the rules cover ONNX's "
                                            "default domain")
            elif n.op_type not in RULES:
                row.rule, row.why = False, "no gradient rule (trainops.autodiff.RULES)"
        row.nodes.append(describe(n))
        if row.rule and n.op_type in OPSET_NEEDS and not domain and (
                train_batchnorm or n.op_type != "BatchNormalization"):
            need = OPSET_NEEDS[n.op_type][0](n)
            if opset < need:
                row.rule, row.why = False, (f"its rule needs opset >= {need} "
                                            f"({OPSET_NEEDS[n.op_type][1]}); the model "
                                            f"imports {opset}")
    return list(rows.values())


def format_table(rows: Sequence[OpCoverage]) -> str:
    """The rows as text: op type, node count, ``rule`` or ``NO RULE: why``."""
    lines = []
    for r in rows:
        name = f"{r.domain}::{r.op_type}" if r.domain else r.op_type
        verdict = "rule" if r.rule else f"NO RULE: {r.why}"
        lines.append(f"{name:<32} {len(r.nodes):>5} node{'s' if len(r.nodes) != 1 else ' '}  "
                     f"{verdict}")
    return "\n".join(lines)


def check(model: onnx.ModelProto, loss: str, params: Sequence[str],
          train_batchnorm: bool = True) -> list[OpCoverage]:
    """:func:`coverage`, or a GradientError listing EVERY op type on the path without a
    usable rule (with its nodes and why)."""
    rows = coverage(model, loss, params, train_batchnorm)
    missing = [r for r in rows if not r.rule]
    if missing:
        def nodes(r: OpCoverage) -> str:
            more = f" and {len(r.nodes) - 3} more" if len(r.nodes) > 3 else ""
            return ", ".join(r.nodes[:3]) + more

        parts = [f"{r.domain + '::' if r.domain else ''}{r.op_type}: {r.why} ({nodes(r)})"
                 for r in missing]
        raise GradientError(f"{len(missing)} op type(s) between the parameters and the loss "
                            f"{loss!r} have no gradient rule: " + "; ".join(parts))
    return rows
