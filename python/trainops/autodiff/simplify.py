"""Post-passes over a forward graph and the backward nodes emitted for it, removing work the
one-rule-at-a-time emission leaves behind and ONNX Runtime's optimiser does not remove.

:func:`merge_recomputations`: a rule that needs an auxiliary output of a forward op
(MaxPool's Indices, LayerNormalization's Mean and InvStdDev) emits the op again with that
output; when the forward graph runs the very same node (same op, inputs and attributes)
without it, the forward node gains the output and the backward copy goes. The arithmetic
is unchanged: ONNX Runtime computes the first output the same way with or without the
others, and the backward nodes read the same values as before.
"""

from __future__ import annotations

import onnx

__all__ = ["merge_recomputations", "MERGEABLE"]

# Ops whose optional outputs do not change what the node computes for the others.
MERGEABLE = frozenset({"MaxPool", "LayerNormalization"})


def _key(node: onnx.NodeProto):
    attrs = tuple(sorted(a.SerializeToString() for a in node.attribute))
    return (node.domain or "", node.op_type, tuple(node.input), attrs)


def merge_recomputations(forward: list, backward: list) -> tuple[list, list]:
    """``(forward, backward)`` with each backward node of a :data:`MERGEABLE` op that
    recomputes a forward node merged into it: the forward node (a copy; the lists passed in
    are not changed) takes the backward node's outputs where it had none, and readers of
    the backward node's other outputs read the forward node's."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in backward for a in n.attribute):
        return list(forward), list(backward)  # subgraph captures are not renamed: leave all
    by_key = {}
    for k, n in enumerate(forward):
        if n.op_type in MERGEABLE and (n.domain or "") == "":
            by_key.setdefault(_key(n), k)
    forward = list(forward)
    rename: dict[str, str] = {}
    kept = []
    for n in backward:
        k = by_key.get(_key(n)) if n.op_type in MERGEABLE else None
        if k is None:
            kept.append(n)
            continue
        f = onnx.NodeProto()
        f.CopyFrom(forward[k])
        outs = list(f.output) + [""] * (len(n.output) - len(f.output))
        for i, o in enumerate(n.output):
            if not o:
                continue
            if outs[i]:
                rename[o] = outs[i]
            else:
                outs[i] = o
        del f.output[:]
        f.output.extend(outs)
        forward[k] = f
    if not rename:
        return forward, kept
    out = []
    for n in kept:
        if any(i in rename for i in n.input):
            m = onnx.NodeProto()
            m.CopyFrom(n)
            del m.input[:]
            m.input.extend(rename.get(i, i) for i in n.input)
            n = m
        out.append(n)
    return forward, out
