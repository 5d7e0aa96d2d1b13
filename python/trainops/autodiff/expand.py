"""``expand_gradients``: every ``ai.onnx.preview.training::Gradient`` node of a model
replaced by its backward graph, the model taken as exporters write it
(:mod:`.importing`)."""

from __future__ import annotations

import onnx
from onnx import helper

from ..onnx_defs import TRAINING_DOMAIN
from .backward import build_backward
from .coverage import opset_needs
from .graph import Builder, GradientError, attr, default_opset, describe, infer
from .hygiene import check_definitions, toposort
from .importing import fold_shape_constants, load, sort_nodes, unlist_initializers, upgrade

__all__ = ["expand_gradients"]


def _names(node: onnx.NodeProto, key: str):
    v = attr(node, key, [] if key != "y" else None)
    if isinstance(v, bytes):
        return v.decode()
    return [x.decode() if isinstance(x, bytes) else x for x in v] if v is not None else v


def expand_gradients(model, name: str = "the model") -> onnx.ModelProto:
    """A copy of ``model`` in which every ``ai.onnx.preview.training::Gradient`` node is
    replaced by ordinary default-domain ONNX ops computing it.

    ``model``: a ModelProto, serialized bytes or a path (its external data loaded), as
    exporters and the ONNX zoo write it: any opset from 7 on, initializers also listed as
    graph inputs, nodes in any order. The gradients are built at the model's own opset; where
    a rule refuses it (Softmax, Concat before 13, overlapping MaxPool before 16, ...), the
    model is upgraded with ``onnx.version_converter`` to the opset the rules need
    (:func:`~.coverage.opset_needs`; said in one ``logging.getLogger("trainops")`` line; the
    Gradient nodes stay out of the conversion). Constant shape computations are folded into
    Constants (:func:`~.fold.fold_shape_constants`), so ranks onnx's inference misses are
    known. The inputs and outputs stay as they were
    (initializers listed as inputs too, then under IR version 4 or later, where they are
    overridable inputs). A model without Gradient nodes is returned as loaded.

    A ``Gradient`` node's attributes ``xs`` (differentiated tensors, its first inputs),
    ``zs`` (its other inputs, not differentiated) and ``y`` (the target) follow the ONNX
    spec; its outputs are ``dy/dx`` for each x. A non-scalar ``y`` is differentiated as
    ``sum(y)`` (the gradient of each element's sum, as with a seed of ones). An x that ``y``
    does not depend on gets zeros. An op on the path from an x to y without a gradient rule
    raises :class:`GradientError` naming the op type and the node; so do the other refusals
    of :func:`~.backward.build_backward` (a cycle, an undefined tensor, an integer x or y),
    a tensor defined twice (:func:`~.hygiene.check_definitions`) and a failed opset
    conversion.
    """
    out = load(model)
    g = out.graph
    check_definitions(g)  # the Gradient nodes' outputs included
    grad_nodes = [n for n in g.node if n.domain == TRAINING_DOMAIN and n.op_type == "Gradient"]
    if not grad_nodes:
        return out
    interface = unlist_initializers(out)
    outputs = [onnx.ValueInfoProto() for _ in g.output]
    for o, src in zip(outputs, g.output):
        o.CopyFrom(src)
    grad_outputs = {o for n in grad_nodes for o in n.output}
    forward = [n for n in g.node if not (n.domain == TRAINING_DOMAIN and n.op_type == "Gradient")]
    del g.node[:]
    g.node.extend(forward)
    keep = [o for o in outputs if o.name not in grad_outputs]
    del g.output[:]
    g.output.extend(keep)
    sort_nodes(out)  # onnx infers shapes in the listed order
    fold_shape_constants(out)
    try:
        nodes = _expanded(out, grad_nodes)
    except GradientError:
        # A rule refuses the model's (old) opset: upgrade to what the rules need and retry
        # (the Gradient nodes stay out of onnx's converter).
        opset = default_opset(out)
        if opset >= max(opset_needs(out.graph.node, False).values()):
            raise
        out = upgrade(out, False, name)
        fold_shape_constants(out)
        nodes = _expanded(out, grad_nodes)
    g = out.graph
    available = {i.name for i in g.input} | {i.name for i in g.initializer}
    del g.node[:]
    g.node.extend(toposort(nodes, available))
    del g.output[:]
    g.output.extend(outputs)
    del g.input[:]
    g.input.extend(interface)
    keep_ops = [o for o in out.opset_import if o.domain != TRAINING_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(keep_ops)
    return out


def _expanded(m: onnx.ModelProto, grad_nodes) -> list[onnx.NodeProto]:
    """``m``'s nodes followed by the backward nodes of each of ``grad_nodes`` (the
    Gradient nodes, not among ``m``'s), at ``m``'s opset."""
    opset = default_opset(m)
    inferred = infer(m).graph
    new_nodes = list(m.graph.node)
    builder = None
    for k, node in enumerate(grad_nodes):
        xs, zs, y = _names(node, "xs"), _names(node, "zs"), _names(node, "y")
        if not xs or not y:
            raise GradientError(f"{describe(node)}: attributes 'xs' and 'y' are required")
        if list(node.input) != xs + zs:
            raise GradientError(f"{describe(node)}: its inputs {list(node.input)} must be the "
                                f"tensors named by xs + zs ({xs + zs}): differentiating at "
                                "other values than the graph's own is not supported")
        if len(node.output) != len(xs):
            raise GradientError(f"{describe(node)}: {len(node.output)} outputs for "
                                f"{len(xs)} xs")
        prefix = f"{node.name or 'Gradient'}_{k}" if len(grad_nodes) > 1 else (node.name or "Gradient")
        builder = Builder(inferred, opset, prefix) if builder is None else builder
        builder.prefix = prefix
        builder.nodes = []
        builder, gnames = build_backward(inferred, opset, y, xs, builder=builder)
        nodes = list(builder.nodes)
        for gname, oname in zip(gnames, node.output):
            if oname:
                nodes.append(helper.make_node("Identity", [gname], [oname],
                                              name=builder.fresh("output_node")))
        new_nodes += nodes
    return new_nodes
