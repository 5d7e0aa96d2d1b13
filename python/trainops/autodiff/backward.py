"""Reverse-mode differentiation of an ONNX graph, and ``expand_gradients``: every
``ai.onnx.preview.training::Gradient`` node replaced by its backward graph."""

from __future__ import annotations

from typing import Sequence

import onnx
from onnx import helper

from ..onnx_defs import TRAINING_DOMAIN
from .graph import FLOAT_TYPES, Builder, GradientError, attr, describe, skeleton
from .rules import RULES, Ctx


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise GradientError("the model imports no default-domain opset")


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with onnx's inferred shapes and types in ``value_info``; its
    initializers over 1024 elements are graph inputs of their type and shape, without
    their data (:func:`~.graph.skeleton`)."""
    light, _ = skeleton(model)
    try:
        return onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return light


def build_backward(graph: onnx.GraphProto, opset: int, y: str, xs: Sequence[str],
                   prefix: str = "grad", seed: str | None = None,
                   builder: Builder | None = None) -> tuple[Builder, list[str]]:
    """Nodes computing d(sum(y))/dx for each x in ``xs`` from the values of ``graph``
    (whose nodes must be topologically sorted and whose ``value_info`` should hold the
    inferred shapes). ``seed``, when given, is the gradient of ``y`` (default: ones, i.e.
    the gradient of ``sum(y)``). Returns the builder (its ``nodes``) and one gradient
    name per x."""
    b = builder or Builder(graph, opset, prefix)
    producer: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for o in node.output:
            if o:
                producer[o] = node
    known = set(producer) | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for name in list(xs) + [y]:
        if name not in known:
            raise GradientError(f"tensor '{name}' is neither a graph input, an initializer "
                                "nor a node output")

    # Nodes that y depends on ...
    ancestors: set[int] = set()
    stack = [y]
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen or t in xs:
            continue
        seen.add(t)
        node = producer.get(t)
        if node is None or id(node) in ancestors:
            continue
        ancestors.add(id(node))
        stack.extend(i for i in node.input if i)
    order = [n for n in graph.node if id(n) in ancestors]
    # ... and, among them, the tensors that depend on an x (and are floats).
    needs = set(xs)
    for node in order:
        if any(i in needs for i in node.input):
            for o in node.output:
                if o and (b.dtype(o) is None or b.dtype(o) in FLOAT_TYPES):
                    needs.add(o)

    if seed is None:
        if b.dtype(y) is None and b.dtype(xs[0]) is not None:
            b.set_info(y, b.dtype(xs[0]), b.shape(y))  # inference gave up; y has x's type
        seed = b.ones_like(y)
    grads: dict[str, list[str]] = {y: [seed]}

    def total(name: str) -> str | None:
        parts = grads.get(name)
        if not parts:
            return None
        if len(parts) > 1:
            grads[name] = [b.op("Sum", parts)]
        return grads[name][0]

    for node in reversed(order):
        gys = [total(o) if o else None for o in node.output]
        if all(g is None for g in gys):
            continue
        need = [bool(i) and i in needs for i in node.input]
        if not any(need):
            continue
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        fn = RULES.get(node.op_type) if domain == "" else None
        if fn is None:
            raise GradientError(f"no gradient rule for {describe(node)} (op type "
                                f"'{node.op_type}'); it lies between {list(xs)} and '{y}'. "
                                f"Ops with rules: {', '.join(sorted(RULES))}")
        results = fn(Ctx(b, node, gys, need))
        for i, g in enumerate(results):
            if g is not None and i < len(need) and need[i]:
                grads.setdefault(node.input[i], []).append(g)
    out = []
    for x in xs:
        g = total(x)
        out.append(g if g is not None else b.zeros_like(x))
    return b, out


def toposort(nodes: Sequence[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced before use (stable otherwise)."""
    producer = {}
    for idx, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = idx
    done: list[bool] = [False] * len(nodes)
    out: list[onnx.NodeProto] = []

    def visit(start: int) -> None:
        stack = [(start, False)]
        while stack:
            idx, expanded = stack.pop()
            if done[idx]:
                continue
            if expanded:
                done[idx] = True
                out.append(nodes[idx])
                continue
            stack.append((idx, True))
            deps = set()
            for name in _all_inputs(nodes[idx]):
                j = producer.get(name)
                if j is not None and not done[j] and name not in available:
                    deps.add(j)
            for j in sorted(deps, reverse=True):
                stack.append((j, False))

    for i in range(len(nodes)):
        visit(i)
    return out


def _all_inputs(node: onnx.NodeProto) -> list[str]:
    names = [i for i in node.input if i]
    for a in node.attribute:  # outer-scope values that subgraphs read
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            inner = {o for n in g.node for o in n.output} | {i.name for i in g.input}
            for n in g.node:
                names += [i for i in _all_inputs(n) if i not in inner]
    return names


def expand_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in which every ``ai.onnx.preview.training::Gradient`` node is
    replaced by ordinary default-domain ONNX ops (of the model's own opset) computing it.

    A ``Gradient`` node's attributes ``xs`` (differentiated tensors, its first inputs),
    ``zs`` (its other inputs, not differentiated) and ``y`` (the target) follow the ONNX
    spec; its outputs are ``dy/dx`` for each x. A non-scalar ``y`` is differentiated as
    ``sum(y)`` (the gradient of each element's sum, as with a seed of ones). An x that ``y``
    does not depend on gets zeros. An op on the path from an x to y without a gradient rule
    raises :class:`GradientError` naming the op type and the node.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    grad_nodes = [n for n in g.node if n.domain == TRAINING_DOMAIN and n.op_type == "Gradient"]
    if not grad_nodes:
        return out
    opset = default_opset(out)
    forward = onnx.ModelProto()
    forward.CopyFrom(out)
    del forward.graph.node[:]
    forward.graph.node.extend(n for n in g.node if n not in grad_nodes)
    grad_outputs = {o for n in grad_nodes for o in n.output}
    keep = [o for o in forward.graph.output if o.name not in grad_outputs]
    del forward.graph.output[:]
    forward.graph.output.extend(keep)
    inferred = infer(forward).graph

    new_nodes = [n for n in g.node if n not in grad_nodes]
    builder = None
    for k, node in enumerate(grad_nodes):
        xs = [x.decode() if isinstance(x, bytes) else x for x in attr(node, "xs", [])]
        zs = [z.decode() if isinstance(z, bytes) else z for z in attr(node, "zs", [])]
        y = attr(node, "y")
        y = y.decode() if isinstance(y, bytes) else y
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

    available = {i.name for i in g.input} | {i.name for i in g.initializer}
    del g.node[:]
    g.node.extend(toposort(new_nodes, available))
    if not any(n.domain == TRAINING_DOMAIN for n in g.node):
        keep_ops = [o for o in out.opset_import if o.domain != TRAINING_DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(keep_ops)
    return out
