"""Gradients through control flow: ``If``, and a clear refusal for ``Loop`` and ``Scan``.

The gradient of ``If(c, then, else)`` is the taken branch's, as PyTorch's autograd gives
for data-dependent control flow: a backward ``If`` on the same condition whose branches
are the backward graphs of ``then`` and ``else`` with respect to every outer-scope value
either branch reads that needs a gradient. Each backward branch

- takes the gradients of the ``If``'s outputs from the outer scope (by name, as any
  subgraph reads outer values);
- recomputes the values of its forward branch that its backward nodes read (a subgraph's
  values are invisible outside it); a random op among them is refused, as a second draw
  would differ from the forward's;
- outputs one gradient per such outer value, zeros (of the value's shape) where the branch
  does not use it.

Branches may hold ``If`` nodes themselves (the same construction, recursively).
``Loop`` and ``Scan`` have no gradient: one that takes or reads a value needing a gradient
is a :class:`GradientError` naming it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

import onnx
from onnx import helper

from .graph import (Builder, GradientError, attr, defined_in, describe, free_names, infer,
                    node_inputs)
from .hygiene import toposort

# The backward pass over a list of nodes (backward.backprop): ``backprop(b, nodes, seeds,
# xs, defined) -> gradient names``. backward.py calls into this module for If nodes and
# passes its own backprop in, which differentiates each branch; this module does not
# import backward.py (it sits below it).
Backprop = Callable[[Builder, list, dict, list, set], list]

SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan"})
"""Default-domain ops with subgraphs that :func:`backward` handles (or refuses)."""

RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                        "RandomUniformLike", "Multinomial", "Bernoulli"})


def backward(b: Builder, node: onnx.NodeProto, gys: list[str | None], need: list[bool],
             captured: list[str], backprop: Backprop) -> dict[str, str]:
    """The gradients (names emitted into ``b``) of the outer values ``captured`` (those
    ``node``'s subgraphs read that need one), given the gradients ``gys`` of its outputs;
    ``need``: which of its own inputs need one; ``backprop``: the backward pass that
    differentiates each branch's nodes (:func:`.backward.backprop`)."""
    if node.op_type != "If":
        inputs = [i for i, n in zip(node.input, need) if n]
        parts = ([f"it takes {inputs} as inputs"] if inputs else []) + \
                ([f"its body reads {captured} from the outer scope"] if captured else [])
        raise GradientError(f"{describe(node)}: gradients through {node.op_type} are not "
                            f"supported (of the control-flow ops only If has them); "
                            f"{' and '.join(parts)}, which need a gradient")
    wanted = list(captured)
    branches = {}
    for which in ("then_branch", "else_branch"):
        g = attr(node, which)
        if g is None:
            raise GradientError(f"{describe(node)}: attribute '{which}' is missing")
        branches[which] = _branch_backward(b, node, g, which, gys, wanted, backprop)
    names = [b.fresh("If_grad") for _ in wanted]
    b.op("If", [node.input[0]], names, **branches)
    for x, name in zip(wanted, names):
        b.set_info(name, b.dtype(x), b.shape(x))
    return dict(zip(wanted, names))


def _branch_backward(b: Builder, node: onnx.NodeProto, graph: onnx.GraphProto, which: str,
                     gys: list[str | None], wanted: list[str],
                     backprop: Backprop) -> onnx.GraphProto:
    free = free_names(graph)
    nodes = toposort(list(graph.node), set())
    sb = _branch_builder(b, graph, nodes, free, b.fresh(which.split("_")[0]))
    seeds: dict[str, list[str]] = {}
    for k, out in enumerate(graph.output):
        if k < len(gys) and gys[k] is not None:
            seeds.setdefault(out.name, []).append(gys[k])
    grads = backprop(sb, nodes, seeds, wanted, defined_in(graph) | set(free))
    outputs = []
    for x, g in zip(wanted, grads):
        if b.dtype(x) is None:
            raise GradientError(f"{describe(node)}: the element type of '{x}', which its "
                                f"{which} reads, is unknown (onnx shape inference could not "
                                "find it)")
        name = sb.op("Identity", [g])
        outputs.append(helper.make_tensor_value_info(name, b.dtype(x), b.shape(x)))
    b._used |= sb._used  # noqa: SLF001 - one naming space across the scopes
    recompute = _recomputed(sb, node, nodes, which)
    return helper.make_graph(recompute + sb.nodes, f"{node.name or 'If'}_{which}_grad", [],
                             outputs, initializer=list(graph.initializer),
                             sparse_initializer=list(graph.sparse_initializer))


def _branch_builder(b: Builder, graph: onnx.GraphProto, nodes: list[onnx.NodeProto],
                    free: list[str], prefix: str) -> Builder:
    """A builder knowing the branch's own values (onnx infers them with the outer values
    it reads as inputs: inference leaves no ``value_info`` inside subgraphs) and the outer
    scope's."""
    inputs = [helper.make_tensor_value_info(n, b.dtype(n), b.shape(n))
              for n in free if b.dtype(n) is not None]
    g = helper.make_graph(nodes, graph.name or "branch", inputs, list(graph.output),
                          initializer=list(graph.initializer),
                          value_info=list(graph.value_info))
    domains = sorted({n.domain for n in nodes if n.domain not in ("", "ai.onnx")})
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", b.opset)]
                              + [helper.make_opsetid(d, 1) for d in domains])
    sb = Builder(infer(model).graph, b.opset, prefix)
    for name, t in b.types.items():
        if name not in sb.types:
            sb.types[name] = t
            sb.shapes[name] = b.shapes.get(name)
    for name, v in b.consts.items():
        sb.consts.setdefault(name, v)
    sb._used |= b._used  # noqa: SLF001
    return sb


def _recomputed(sb: Builder, node: onnx.NodeProto, nodes: list[onnx.NodeProto],
                which: str) -> list[onnx.NodeProto]:
    """The branch's forward nodes whose values the backward nodes read, in order."""
    producer = {o: n for n in nodes for o in n.output if o}
    keep: set[int] = set()
    stack = [t for n in sb.nodes for t in node_inputs(n) if t in producer]
    while stack:
        n = producer[stack.pop()]
        if id(n) in keep:
            continue
        keep.add(id(n))
        stack.extend(t for t in node_inputs(n) if t in producer)
    out = [n for n in nodes if id(n) in keep]
    for n in out:
        if _random(sb, n):
            raise GradientError(f"{describe(node)}: the gradient of its {which} needs "
                                f"{describe(n)} computed again, and it draws random numbers "
                                "(a second draw would differ from the forward's)")
    return out


def _random(sb: Builder, n: onnx.NodeProto) -> bool:
    if n.domain not in ("", "ai.onnx"):
        return n.op_type.startswith("Philox")
    if n.op_type in RANDOM_OPS:
        return True
    if n.op_type == "Dropout" and len(n.input) > 2 and n.input[2]:
        on = sb.constant_value(n.input[2])
        return on is None or bool(np.asarray(on).reshape(-1)[0])
    return False
