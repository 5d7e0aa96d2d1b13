"""Reverse-mode differentiation of an ONNX graph (:func:`build_backward`, :func:`backprop`);
``expand_gradients`` (:mod:`.expand`) applies it to ``Gradient`` nodes."""

from __future__ import annotations

from typing import Sequence

import onnx

from ..onnx_defs import TRAINOPS_DOMAIN
from . import control
from .gelu_chain import gelu_chains
# infer, default_opset and toposort live in the modules below this one (graph, hygiene);
# they stay importable from here, where callers have always found them.
from .graph import (FLOAT_TYPES, Builder, GradientError, attr, captures, default_opset,
                    defined_in, describe, infer, node_inputs, value_inputs)
from .hygiene import cast_types, check_float, reinfer, toposort, undefined
from .rules import RULES, Ctx

__all__ = ["build_backward", "backprop", "infer", "toposort", "default_opset"]


def build_backward(graph: onnx.GraphProto, opset: int, y: str, xs: Sequence[str],
                   prefix: str = "grad", seed: str | None = None,
                   builder: Builder | None = None) -> tuple[Builder, list[str]]:
    """Nodes computing d(sum(y))/dx for each x in ``xs`` from the values of ``graph``
    (whose ``value_info`` should hold the inferred shapes; nodes in any order: they are
    sorted first). ``seed``, when given, is the gradient of ``y`` (default: ones, i.e. the
    gradient of ``sum(y)``). Returns the builder (its ``nodes``) and one gradient name per
    x. Gradients flow through ``If`` (the taken branch's) and the values its branches
    capture from the outer scope.

    Refused with :class:`GradientError`: a cycle, a tensor on the path that nothing
    defines, an integer or boolean ``y`` or x, an op without a rule (``Loop`` and ``Scan``
    among them)."""
    b = builder or Builder(graph, opset, prefix)
    defined = defined_in(graph)
    for name in list(xs) + [y]:
        if name not in defined:
            raise GradientError(f"tensor '{name}' is neither a graph input, an initializer "
                                "nor a node output")
    nodes = toposort(list(graph.node), {i.name for i in graph.input}
                     | {i.name for i in graph.initializer})
    if any(a is not c for a, c in zip(nodes, graph.node)):
        reinfer(b, graph, nodes, opset)  # onnx inferred shapes in the given (wrong) order
    cast_types(b, nodes)
    for x in xs:
        check_float(b, x, "x")
    check_float(b, y, "y")
    if seed is None:
        if b.dtype(y) is None and b.dtype(xs[0]) is not None:
            b.set_info(y, b.dtype(xs[0]), b.shape(y))  # inference gave up; y has x's type
        seed = b.ones_like(y)
    return b, backprop(b, nodes, {y: [seed]}, list(xs), defined)


def backprop(b: Builder, nodes: Sequence[onnx.NodeProto], seeds: dict[str, list[str]],
             xs: list[str], defined: set[str]) -> list[str]:
    """Emit into ``b`` the gradient of every x in ``xs`` given the gradients ``seeds`` of
    some values of the topologically sorted ``nodes`` (a graph's or a subgraph's);
    ``defined``: every value those nodes may read. An x out of reach gets zeros."""
    producer: dict[str, onnx.NodeProto] = {}
    for node in nodes:
        for o in node.output:
            if o:
                producer[o] = node
    # Nodes that the seeded values depend on (through their subgraphs' captures too) ...
    ancestors: set[int] = set()
    stack: list[tuple[str, onnx.NodeProto | None]] = [(s, None) for s in seeds]
    seen: set[str] = set()
    xset = set(xs)
    while stack:
        t, reader = stack.pop()
        if t in seen or t in xset:
            continue
        seen.add(t)
        node = producer.get(t)
        if node is None:
            if t not in defined and reader is not None:
                raise undefined(t, reader)
            continue
        if id(node) in ancestors:
            continue
        ancestors.add(id(node))
        stack.extend((i, node) for i in node_inputs(node))
    order = [n for n in nodes if id(n) in ancestors]
    # ... and, among them, the tensors that depend on an x (and are floats; an input read
    # for its type or shape only passes no dependency: TYPE_ONLY_INPUTS).
    needs = set(xs)
    for node in order:
        reads = [i for i, v in zip(node.input, value_inputs(node)) if v] + captures(node)
        if any(i in needs for i in reads):
            for o in node.output:
                if o and (b.dtype(o) is None or b.dtype(o) in FLOAT_TYPES):
                    needs.add(o)

    grads: dict[str, list[str]] = {k: list(v) for k, v in seeds.items()}

    def total(name: str) -> str | None:
        parts = grads.get(name)
        if not parts:
            return None
        if len(parts) > 1:
            # Add after Add, left to right: the bits of onnxruntime's CPU Sum, which adds its
            # inputs in order (2-5 inputs of 2^20 values bitwise on 1.17.3 and 1.32.0), and
            # an op every EP has (WebGPU 0.4.0 has no Sum kernel: the sums of a value's
            # gradients ran on the CPU, activation-sized tensors copied both ways)
            # (every part of a tensor's gradient has the tensor's shape)
            tiled = _tiles(b, name, parts)
            if tiled is not None:
                grads[name] = [tiled]
                return tiled
            parts = _unexpanded(b, parts)
            scattered = next((p for p in parts if p in b.scatters), None)
            rest = [p for p in parts if p != scattered]
            acc = rest[0]
            for part in rest[1:]:
                acc = b.op("Add", [acc, part])
            if scattered is not None:  # a tied embedding's rows added into the other
                # gradient of the table in place of a dense Add of a mostly-zero tensor
                # (the same terms; the rows' updates come after the dense part)
                acc = b.scatters[scattered](acc)
            grads[name] = [acc]
        return grads[name][0]

    # the fused CPU step differentiates an exported exact GELU's five nodes as one
    # (.gelu_chain): the chain's last node hands x its gradient, the rest get none
    gelus = gelu_chains(b, order, producer, xset | set(seeds)) if b.fused else {}
    for node in reversed(order):
        gys = [total(o) if o else None for o in node.output]
        if all(g is None for g in gys):
            continue
        if id(node) in gelus:
            x, _ = gelus[id(node)]
            grads.setdefault(x, []).append(
                b.op("GeluGrad", [gys[0], x], domain=TRAINOPS_DOMAIN, approximate="none"))
            continue
        need = [v and i in needs for i, v in zip(node.input, value_inputs(node))]
        captured = [t for t in captures(node) if t in needs]
        if not any(need) and not captured:
            continue
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        if domain == "" and node.op_type in control.SUBGRAPH_OPS:
            # control differentiates each branch by calling backprop back: it is handed
            # the function rather than importing this module (modules only look down).
            for name, g in control.backward(b, node, gys, need, captured, backprop).items():
                grads.setdefault(name, []).append(g)
            continue
        fn = RULES.get(node.op_type) if domain == "" else None
        if fn is None or captured:
            why = (f"its subgraph reads {captured}, which need a gradient" if fn else
                   f"op type '{node.op_type}'")
            target = ", ".join(f"'{s}'" for s in seeds)
            raise GradientError(f"no gradient rule for {describe(node)} ({why}); it lies "
                                f"between {list(xs)} and {target}. Ops with rules: "
                                f"{', '.join(sorted(RULES) + ['If'])}")
        results = fn(Ctx(b, node, gys, need, producer, xset))
        for i, g in enumerate(results):
            if g is not None and i < len(need) and need[i]:
                grads.setdefault(node.input[i], []).append(g)
    out = []
    for x in xs:
        g = total(x)
        out.append(g if g is not None else b.zeros_like(x))
    return out



def _made_by(b: Builder, parts: list[str]) -> dict[str, onnx.NodeProto]:
    """The emitted nodes making ``parts`` (a tensor's gradients: made by the latest rules,
    so found from the end)."""
    made: dict[str, onnx.NodeProto] = {}
    for n in reversed(b.nodes):
        if len(made) == len(parts):
            break
        if n.output and n.output[0] in parts:
            made[n.output[0]] = n
    return made


def _zero_padded(b: Builder, node: onnx.NodeProto | None, shape) -> tuple | None:
    """``(axis, start, end, dY)`` when ``node`` is a Pad of zeros (constant pads, no value
    given) putting dY back along one axis of ``shape`` (a Slice's gradient), else None."""
    if node is None or node.op_type != "Pad" or len(node.input) != 2 or shape is None:
        return None
    pads = b.consts.get(node.input[1])
    mode = attr(node, "mode", b"constant")
    if pads is None or mode not in (b"constant", "constant") or len(pads) != 2 * len(shape) \
            or (pads < 0).any():
        return None
    r = len(shape)
    moved = [a for a in range(r) if pads[a] or pads[r + a]]
    if len(moved) != 1 or not isinstance(shape[moved[0]], int):
        return None
    a = moved[0]
    return a, int(pads[a]), shape[a] - int(pads[r + a]), node.input[0]


def _tiles(b: Builder, name: str, parts: list[str]) -> str | None:
    """The gradients ``parts`` of ``name`` as a single Concat when every one is a Slice's
    gradient put back among zeros by Pad and together they cover one axis exactly, without
    overlap: torch's LSTM export slices each weight into its four gates and concatenates
    them in ONNX's order, and the sum of the four padded gradients (Pad and Add on one
    thread: 2 ms of the bench LSTM's step) is the gradients side by side. Each element's sum
    is one term and zeros, so the values are the same (a -0.0 term, which the zeros' sum
    turns into +0.0, stays -0.0). None when the parts do not tile."""
    shape = b.shape(name)
    made = _made_by(b, parts)
    placed = [_zero_padded(b, made.get(p), shape) for p in parts]
    if any(t is None for t in placed) or len({t[0] for t in placed}) != 1:
        return None
    axis = placed[0][0]
    ranges = sorted(t[1:] for t in placed)
    ends = [0] + [e for _, e, _ in ranges]
    if any(s != e or s >= end for (s, end, _), e in zip(ranges, ends)) or ends[-1] != shape[axis]:
        return None
    # The Pads, emitted by the Slice rule before their sum was known, go, and their pads
    # with them where nothing else reads those.
    b.nodes[:] = [n for n in b.nodes if not (n.output and n.output[0] in parts)]
    read = {i for n in b.nodes for i in n.input}
    unread = {made[p].input[1] for p in parts} - read
    b.nodes[:] = [n for n in b.nodes if not (n.output and n.output[0] in unread)]
    return b.op("Concat", [g for _, _, g in ranges], axis=axis)


def _unexpanded(b: Builder, parts: list[str]) -> list[str]:
    """``parts`` with each Expand the rules made (a mean's or a broadcast's gradient) read
    through to the tensor it expands, where another part has the full shape: the Adds
    broadcast it to the same values (x + e, one rounding either way), where onnxruntime's
    Expand wrote the full tensor on one thread first (efficientnet_b0's squeeze-excitation
    means: 5 ms of its step at one thread and at two). The unread Expands go."""
    made = _made_by(b, parts)
    small = {p: made[p].input[0] for p in parts
             if p in made and made[p].op_type == "Expand" and p not in b.scatters}
    if small:  # (an Expand some node reads stays as it is)
        read = {i for n in b.nodes for i in n.input}
        small = {p: v for p, v in small.items() if p not in read}
    if not small or len(small) == len(parts):
        return parts
    gone = {id(made[p]) for p in small}
    b.nodes[:] = [n for n in b.nodes if id(n) not in gone]
    return [small.get(p, p) for p in parts]
