"""Post-passes over a forward graph and the backward nodes emitted for it, removing work the
one-rule-at-a-time emission leaves behind and ONNX Runtime's optimiser does not remove.

:func:`merge_recomputations`: a rule that needs an auxiliary output of a forward op
(MaxPool's Indices, LayerNormalization's Mean and InvStdDev) emits the op again with that
output; when the forward graph runs the very same node (same op, inputs and attributes)
without it, the forward node gains the output and the backward copy goes. The arithmetic
is unchanged: ONNX Runtime computes the first output the same way with or without the
others, and the backward nodes read the same values as before.

:func:`merge_gru_train`: GRU's fused rule emits the node's forward again as
``com.trainops::GRUTrain`` (which also outputs the gates its ``GRUGrad`` reads); the forward
``GRU`` node with the same inputs and attributes becomes that GRUTrain node, so the
recurrence runs once. Run on the step's final node list (after the shape-dependent
simplifications: onnx's inference knows GRU, not GRUTrain).
"""

from __future__ import annotations

import onnx

from ..onnx_defs import TRAINOPS_DOMAIN
from .graph import captures

__all__ = ["merge_recomputations", "merge_gru_train", "MERGEABLE"]

# Ops whose optional outputs do not change what the node computes for the others.
MERGEABLE = frozenset({"MaxPool", "LayerNormalization"})


def _key(node: onnx.NodeProto):
    attrs = tuple(sorted(a.SerializeToString() for a in node.attribute))
    return (node.domain or "", node.op_type, tuple(node.input), attrs)


def _reading(n: onnx.NodeProto, rename: dict[str, str]) -> onnx.NodeProto:
    """``n``, or a copy of it reading ``rename``'s targets where it read their keys."""
    if not any(i in rename for i in n.input):
        return n
    m = onnx.NodeProto()
    m.CopyFrom(n)
    del m.input[:]
    m.input.extend(rename.get(i, i) for i in n.input)
    return m


def _merged_outputs(kept: list[str], dropped: list[str], rename: dict[str, str]) -> list[str]:
    """The outputs of a node that takes over another's: ``kept`` (padded with "" to the
    other's length), each slot it leaves empty filled by ``dropped``'s name; where both name
    a slot, ``rename`` maps ``dropped``'s name to ``kept``'s (its readers read that)."""
    outs = list(kept) + [""] * (len(dropped) - len(kept))
    for i, o in enumerate(dropped):
        if not o:
            continue
        if outs[i]:
            rename[o] = outs[i]
        else:
            outs[i] = o
    return outs


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
        outs = _merged_outputs(list(f.output), list(n.output), rename)
        del f.output[:]
        f.output.extend(outs)
        forward[k] = f
    return forward, [_reading(n, rename) for n in kept]


# GRU's attributes GRUTrain mirrors, with ONNX's defaults; a GRU with any other attribute
# (clip, activation_alpha, ...) or other activations never merges.
_GRU_DEFAULTS = {"hidden_size": None, "linear_before_reset": 0, "direction": "forward",
                 "layout": 0}
_GRU_ACTS = ("sigmoid", "tanh")


def _gru_key(node: onnx.NodeProto):
    """What makes a GRU (or GRUTrain) node compute what another does: its inputs (trailing
    absent ones dropped) and the attributes of :data:`_GRU_DEFAULTS`; None when the node
    has anything else."""
    attrs = dict(_GRU_DEFAULTS)
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if a.name == "activations":
            acts = [x.decode().lower() if isinstance(x, bytes) else x.lower() for x in v]
            if len(acts) % 2 or any(tuple(acts[k:k + 2]) != _GRU_ACTS
                                    for k in range(0, len(acts), 2)):
                return None
            continue
        if a.name not in attrs:
            return None
        attrs[a.name] = v.decode() if isinstance(v, bytes) else v
    if attrs["layout"] != 0 or attrs["hidden_size"] is None:
        return None
    ins = list(node.input)
    while ins and not ins[-1]:
        ins.pop()
    return tuple(ins), tuple(sorted(attrs.items()))


def merge_gru_train(nodes: list) -> list:
    """``nodes`` (topologically sorted) with each ``com.trainops::GRUTrain`` node merged
    into the ``GRU`` node computing the same (:func:`_gru_key`): that node becomes a
    GRUTrain (at the earlier of the two positions, where both read the same inputs) with its
    own ``Y``/``Y_h`` names and the gates output; readers of the GRUTrain's ``Y`` read the
    GRU's. A GRUTrain whose ``Y`` a subgraph captures, or without a matching GRU, is left
    as it is (correct, only computed twice). The list passed in is not changed."""
    trains = [k for k, n in enumerate(nodes)
              if n.op_type == "GRUTrain" and n.domain == TRAINOPS_DOMAIN]
    if not trains:
        return list(nodes)
    gru_at = {}
    for k, n in enumerate(nodes):
        if n.op_type == "GRU" and (n.domain or "") == "":
            key = _gru_key(n)
            if key is not None:
                gru_at.setdefault(key, k)
    captured = {c for n in nodes for c in captures(n)}
    out: list = list(nodes)
    rename: dict[str, str] = {}
    for t in trains:
        train = nodes[t]
        g = gru_at.get(_gru_key(train))
        if g is None or (train.output and train.output[0] in captured):
            continue
        gru = out[g]  # a previous merge may have made it a GRUTrain already
        outs = _merged_outputs(list(gru.output) + [""] * (3 - len(gru.output)),
                               list(train.output), rename)
        merged = onnx.helper.make_node("GRUTrain", list(train.input), outs, name=gru.name,
                                       domain=TRAINOPS_DOMAIN)
        merged.attribute.extend(train.attribute)
        out[g] = out[t] = None
        out[min(g, t)] = merged
        gru_at[_gru_key(train)] = min(g, t)  # a duplicate GRUTrain merges into this one
    return [_reading(n, rename) for n in out if n is not None]
