"""Graph hygiene before differentiation: one definition per tensor, nodes in topological
order (onnxruntime runs models listed in any order), cycles and undefined tensors named,
gradients of and with respect to non-float tensors refused, and the shapes onnx infers for
a graph whose nodes were out of order."""

from __future__ import annotations

import heapq
from typing import Sequence

import onnx
from onnx import helper

from .graph import (FLOAT_TYPES, Builder, GradientError, _dims, describe, infer, node_inputs,
                    type_name)


def check_definitions(graph: onnx.GraphProto, where: str = "") -> None:
    """Every tensor of ``graph`` has one definition (ONNX's single assignment, which
    onnx.checker and onnxruntime enforce): a GradientError names the first tensor that two
    nodes write, or that a node writes although it is a graph input or an initializer,
    and both definitions. Subgraphs (an If's branches, a Loop's body) are checked the
    same way, where a node also may not write a graph input or initializer of an enclosing
    graph. Without it, a second writer silently replaced the first one: the backward pass
    followed one producer while onnxruntime refused the model."""
    _check_definitions(graph, {}, where)


def _check_definitions(graph: onnx.GraphProto, outer: dict[str, str], where: str) -> None:
    defined = dict(outer)  # tensor name -> what defines it, in words
    for i in graph.input:
        defined[i.name] = "a graph input"
    for i in graph.initializer:
        defined[i.name] = "an initializer"
    for i in graph.sparse_initializer:
        defined[i.values.name] = "an initializer"
    scope = dict(defined)  # what a subgraph of this graph may not write
    written: dict[str, str] = {}
    for n in graph.node:
        for o in n.output:
            if not o:
                continue  # an optional output left out
            if o in written:
                raise GradientError(f"tensor '{o}' is written by two nodes, {written[o]} and "
                                    f"{describe(n)}{where}: ONNX allows one definition per "
                                    "tensor (onnxruntime refuses the model)")
            if o in defined:
                raise GradientError(f"tensor '{o}' is {defined[o]}{_scope(o, graph, outer)} "
                                    f"and is also written by {describe(n)}{where}: ONNX "
                                    "allows one definition per tensor (onnxruntime refuses "
                                    "the model)")
            written[o] = describe(n)
        for a in n.attribute:
            for k, sub in enumerate(([a.g] if a.HasField("g") else []) + list(a.graphs)):
                label = a.name if a.HasField("g") else f"{a.name}[{k}]"
                _check_definitions(sub, scope, f" (in the {label} of {describe(n)}{where})")


def _scope(name: str, graph: onnx.GraphProto, outer: dict[str, str]) -> str:
    """`` of an enclosing graph`` when ``name`` is defined outside ``graph``."""
    own = {i.name for i in graph.input} | {i.name for i in graph.initializer} \
        | {i.values.name for i in graph.sparse_initializer}
    return " of an enclosing graph" if name in outer and name not in own else ""


def toposort(nodes: Sequence[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where every value a node reads (its inputs and what its
    subgraphs capture from the outer scope) is produced before use. Stable: the given
    order where it is already valid (Kahn's algorithm, lowest position first). Names in
    ``available`` are not waited for. A cycle raises :class:`GradientError` naming the
    nodes and tensors on it."""
    producer: dict[str, int] = {}
    for idx, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = idx
    deps: list[dict[int, str]] = [{} for _ in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for idx, n in enumerate(nodes):
        for name in node_inputs(n):
            j = producer.get(name)
            if j is not None and name not in available and j not in deps[idx]:
                deps[idx][j] = name
                users[j].append(idx)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    out: list[onnx.NodeProto] = []
    while ready:
        i = heapq.heappop(ready)
        out.append(nodes[i])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(out) < len(nodes):
        raise GradientError(_cycle_message(nodes, deps, waiting))
    return out


def _cycle_message(nodes, deps: list[dict[int, str]], waiting: list[int]) -> str:
    """Every node left waiting reads from another one left waiting: walking those edges
    back from any of them must come round to a node already seen, the cycle."""
    start = min(i for i, w in enumerate(waiting) if w > 0)
    path: list[int] = []
    pos: dict[int, int] = {}
    i = start
    while i not in pos:
        pos[i] = len(path)
        path.append(i)
        i = min(j for j in deps[i] if waiting[j] > 0)
    cycle = path[pos[i]:][::-1]  # in data-flow order: each node feeds the next ...
    first = cycle.index(min(cycle))
    cycle = cycle[first:] + cycle[:first]  # ... from the one listed first
    steps = []
    for k, idx in enumerate(cycle):
        nxt = cycle[(k + 1) % len(cycle)]
        steps.append(f"{describe(nodes[idx])} -> '{deps[nxt][idx]}' -> ")
    steps.append(describe(nodes[cycle[0]]))
    return ("the graph has a cycle, so its nodes cannot be ordered with every tensor "
            "produced before use: " + "".join(steps))


def check_float(b: Builder, name: str, role: str) -> None:
    """ONNX's Gradient is defined for float tensors only (its outputs are float): an
    integer or boolean ``x`` or ``y`` is an error naming the tensor and its type."""
    t = b.dtype(name)
    if t is not None and t not in FLOAT_TYPES:
        what = (f"cannot differentiate with respect to '{name}'" if role == "x"
                else f"cannot differentiate '{name}'")
        raise GradientError(f"{what}: it is {type_name(t)}; gradients are defined for "
                            "float tensors only (float, double, float16, bfloat16)")


def cast_types(b: Builder, nodes: Sequence[onnx.NodeProto]) -> None:
    """A Cast's output type is its ``to`` attribute, whatever inference found."""
    for n in nodes:
        if n.op_type == "Cast" and n.domain in ("", "ai.onnx") and n.output and n.output[0]:
            to = next((a.i for a in n.attribute if a.name == "to"), None)
            if to is not None and b.dtype(n.output[0]) is None:
                b.set_info(n.output[0], to, b.shape(n.output[0]))


def reinfer(b: Builder, graph: onnx.GraphProto, nodes: Sequence[onnx.NodeProto],
            opset: int) -> None:
    """onnx infers shapes in the listed node order: for a graph given out of order, infer
    again with ``nodes`` (sorted) and take every type and shape the builder lacked or
    knew less of."""
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    del g.node[:]
    g.node.extend(nodes)
    domains = sorted({n.domain for n in nodes if n.domain not in ("", "ai.onnx")})
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]
                              + [helper.make_opsetid(d, 1) for d in domains])
    for vi in infer(model).graph.value_info:
        if not vi.type.HasField("tensor_type"):
            continue
        shape = _dims(vi.type)
        known = b.shape(vi.name)
        if b.dtype(vi.name) is None or known is None or (
                shape is not None and sum(isinstance(d, int) for d in shape)
                > sum(isinstance(d, int) for d in known)):
            b.set_info(vi.name, vi.type.tensor_type.elem_type, shape)


def undefined(name: str, reader: onnx.NodeProto) -> GradientError:
    where = "" if name in reader.input else " (read in its subgraph)"
    return GradientError(f"tensor '{name}' used by {describe(reader)}{where} is not "
                         "defined by any node, input or initializer")
