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
recurrence runs once; LSTM's fused rule and ``com.trainops::LSTMTrain`` likewise. Run on
the step's final node list (after the shape-dependent
simplifications: onnx's inference knows GRU, not GRUTrain).
"""

from __future__ import annotations

import onnx

from ..onnx_defs import TRAINOPS_DOMAIN
from .graph import captures

__all__ = ["merge_recomputations", "merge_gru_train", "MERGEABLE"]

# Ops whose optional outputs do not change what the node computes for the others. The
# recurrent ops' rules recompute Y where the forward node leaves it out: merged, the
# recurrence runs once (and onnxruntime 1.17-1.32 refuse the graph with the copy beside an
# LSTM whose first output is absent: "Argument type mismatch when adding edge").
MERGEABLE = frozenset({"MaxPool", "LayerNormalization", "RNN", "GRU", "LSTM"})


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
    by_key = {}
    for k, n in enumerate(forward):
        if n.op_type in MERGEABLE and (n.domain or "") == "":
            by_key.setdefault(_key(n), k)
    original, forward = forward, list(forward)
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
    if rename and any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                      for n in kept for a in n.attribute):
        # subgraph captures are not renamed: leave all. Without renames (the forward node
        # only fills output slots it left empty, as a recurrent node's Y) nothing is read
        # under another name, so the merge stands.
        return list(original), list(backward)
    return forward, [_reading(n, rename) for n in kept]


# The attributes each training forward mirrors, with ONNX's defaults, and its activations
# (per direction); a node with any other attribute (clip, activation_alpha, input_forget 1,
# ...) or other activations never merges.
_TRAIN_OF = {"GRU": "GRUTrain", "LSTM": "LSTMTrain"}
_DEFAULTS = {"GRU": {"hidden_size": None, "linear_before_reset": 0, "direction": "forward",
                     "layout": 0},
             "LSTM": {"hidden_size": None, "direction": "forward", "layout": 0,
                      "input_forget": 0}}
_ACTS = {"GRU": ("sigmoid", "tanh"), "LSTM": ("sigmoid", "tanh", "tanh")}
_N_OUT = {"GRU": 3, "LSTM": 4}  # the training forward's outputs (Y, Y_h, (Y_c,) gates)


def _gru_key(node: onnx.NodeProto, kind: str = "GRU"):
    """What makes a GRU (or GRUTrain; LSTM or LSTMTrain for ``kind`` "LSTM") node compute
    what another does: its kind, inputs (trailing absent ones dropped) and the attributes of
    :data:`_DEFAULTS`; None when the node has anything else (or peepholes)."""
    attrs = dict(_DEFAULTS[kind])
    acts_want = _ACTS[kind]
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if a.name == "activations":
            acts = [x.decode().lower() if isinstance(x, bytes) else x.lower() for x in v]
            n = len(acts_want)
            if len(acts) % n or any(tuple(acts[k:k + n]) != acts_want
                                    for k in range(0, len(acts), n)):
                return None
            continue
        if a.name not in attrs:
            return None
        attrs[a.name] = v.decode() if isinstance(v, bytes) else v
    if attrs["layout"] != 0 or attrs["hidden_size"] is None or attrs.get("input_forget"):
        return None
    ins = list(node.input)
    while ins and not ins[-1]:
        ins.pop()
    if kind == "LSTM" and len(ins) > 7:
        return None  # peepholes: the training forward has none
    return kind, tuple(ins), tuple(sorted(attrs.items()))


def merge_gru_train(nodes: list) -> list:
    """``nodes`` (topologically sorted) with each ``com.trainops::GRUTrain`` (or
    ``LSTMTrain``) node merged into the ``GRU`` (``LSTM``) node computing the same
    (:func:`_gru_key`): that node becomes the training forward (at the earlier of the two
    positions, where both read the same inputs) with its own ``Y``/``Y_h``(/``Y_c``) names
    and the gates output; readers of the training node's ``Y`` read the forward's. One whose
    ``Y`` a subgraph captures, or without a matching forward, is left as it is (correct,
    only computed twice). The list passed in is not changed."""
    kind_of = {v: k for k, v in _TRAIN_OF.items()}
    trains = [k for k, n in enumerate(nodes)
              if n.op_type in kind_of and n.domain == TRAINOPS_DOMAIN]
    if not trains:
        return list(nodes)
    fwd_at = {}
    for k, n in enumerate(nodes):
        if n.op_type in _TRAIN_OF and (n.domain or "") == "":
            key = _gru_key(n, n.op_type)
            if key is not None:
                fwd_at.setdefault(key, k)
    captured = {c for n in nodes for c in captures(n)}
    out: list = list(nodes)
    rename: dict[str, str] = {}
    for t in trains:
        train = nodes[t]
        kind = kind_of[train.op_type]
        key = _gru_key(train, kind)
        g = fwd_at.get(key)
        if g is None or (train.output and train.output[0] in captured):
            continue
        fwd = out[g]  # a previous merge may have made it a training forward already
        outs = _merged_outputs(list(fwd.output) + [""] * (_N_OUT[kind] - len(fwd.output)),
                               list(train.output), rename)
        merged = onnx.helper.make_node(train.op_type, list(train.input), outs, name=fwd.name,
                                       domain=TRAINOPS_DOMAIN)
        merged.attribute.extend(train.attribute)
        out[g] = out[t] = None
        out[min(g, t)] = merged
        fwd_at[key] = min(g, t)  # a duplicate training forward merges into this one
    return [_reading(n, rename) for n in out if n is not None]
