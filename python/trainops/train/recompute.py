"""Gradient checkpointing (``Trainer(recompute=True)``, :func:`recompute_blocks`): the
activations inside each repeated block of the model (each transformer layer) are computed
again in the backward pass instead of being kept from the forward pass.

The blocks come from the names the exporters give nodes after the module that made them:
the classic exporter's node names (``/model/layers.3/self_attn/q_proj/MatMul``, gpt2's
``/transformer/h.3/...``; the LoRA nodes carry the name of the output they adapt) or the
dynamo exporter's ``pkg.torch.onnx.name_scopes`` metadata. The first path segment of the
form ``<word>.<N>`` names the block (with the segment before it: ``model/layers``); the
family of blocks with the most nodes and at least two indices is the model's repeated
block. A model without one is refused (``ValueError``): recompute would change nothing.

For every block but the last (its backward runs first, right after the forward, so
recomputing it would not lower the peak), the forward nodes whose outputs the backward
reads, with the in-block nodes they need, are emitted again under new output names, and
the backward reads those copies. What the copies read from outside the block (the block's
input, values shared by all blocks) and the block's own outputs are kept as before.

ONNX Runtime runs a node as soon as its inputs exist in its own topological order, so a
copy reading only forward values could run during the forward and keep its output alive,
which would lower nothing. Each value a copy reads from the forward is therefore *gated*:
``Reshape(Concat(Reshape(x, [-1]), CastLike(empty, x)), Shape(x))``, where ``empty`` is an
empty slice of a gradient the backward computes on reaching the block: x's exact bits, and
a data dependency on that gradient. The anchor gradient is the one among the values the
block's gradient rules read that descends from most of the next block's gradient nodes.

Same inputs, same kernels: the copies compute the forward's bits (on one machine and
thread count). Random nodes (the Philox ops) are copied with the same state input, which
the step writes back only after every other node (:mod:`.barrier`), so the masks are the
same; their state output is renamed and unused. BatchNormalization (running statistics)
and nodes with subgraphs are never copied: the backward reads their outputs as before.
"""

from __future__ import annotations

import ast
import re

import numpy as np

import onnx
from onnx import helper, numpy_helper

from ..autodiff.backward import toposort
from .spec import PREFIX as _P

__all__ = ["block_of", "find_blocks", "recompute_blocks"]

_SCOPES = "pkg.torch.onnx.name_scopes"
_INDEX = re.compile(r"^\d+$")
# running statistics must not update twice (BatchNormTrain: the fused step's form of it)
_NEVER = frozenset({"BatchNormalization", "BatchNormTrain"})
_NAME = f"{_P}/recompute"


def _tokens(node: onnx.NodeProto) -> list[str]:
    """The module path of ``node``: its dynamo name scope, else its name (else its first
    output's), split at ``/`` and ``.``."""
    for p in node.metadata_props:
        if p.key == _SCOPES:
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                continue
            if scopes:  # the innermost module's: the last entry may be the op's own name
                return str(max(scopes, key=lambda s: str(s).count("."))).split(".")
    name = node.name or (node.output[0] if node.output else "")
    if name.startswith(f"{_P}/") and not name.startswith(f"{_P}/lora/"):
        return []  # trainops' own nodes (the loss, ...): not the model's modules
    return [t for seg in name.split("/") for t in seg.split(".")]


def block_of(node: onnx.NodeProto) -> tuple[tuple[str, str], int] | None:
    """``((parent, word), N)`` for the first ``<word>.<N>`` segment of ``node``'s module
    path (``/model/layers.3/mlp`` -> ``(("model", "layers"), 3)``), or None."""
    t = _tokens(node)
    for i in range(1, len(t)):
        if _INDEX.match(t[i]) and re.match(r"^[A-Za-z_]\w*$", t[i - 1]):
            return (t[i - 2] if i >= 2 else "", t[i - 1]), int(t[i])
    return None


def find_blocks(nodes) -> dict[int, list[int]]:
    """Block index -> positions in ``nodes`` of that block's nodes, for the family of
    repeated blocks with the most nodes among those with at least two indices; empty when
    there is none."""
    families: dict[tuple, dict[int, list[int]]] = {}
    for k, n in enumerate(nodes):
        b = block_of(n)
        if b is not None:
            families.setdefault(b[0], {}).setdefault(b[1], []).append(k)
    best = [f for f in families.values() if len(f) >= 2]
    if not best:
        return {}
    return max(best, key=lambda f: sum(len(v) for v in f.values()))


def _copyable(n: onnx.NodeProto) -> bool:
    return n.op_type not in _NEVER and not any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name,
                            value=numpy_helper.from_array(np.array(value, np.int64), name))


def recompute_blocks(nodes: list, forward_outputs: set[str], available: set[str],
                     keep: set[str], opset: int) -> list:
    """The step's ``nodes`` (forward and backward) with each repeated block but the last
    recomputed in the backward (module docstring). ``forward_outputs``: the names the
    forward nodes output; ``available``: graph inputs and initializers; ``keep``: values
    read after these nodes (loss, gradients, states): never renamed. ValueError when the
    model has no repeated blocks; NotImplementedError below opset 15 (CastLike)."""
    if opset < 15:
        raise NotImplementedError(f"recompute=True needs opset 15 or later (CastLike); "
                                  f"this model imports opset {opset}")
    nodes = toposort(list(nodes), available)
    fwd = [k for k, n in enumerate(nodes)
           if any(o for o in n.output) and all(o in forward_outputs for o in n.output if o)]
    fset = set(fwd)
    blocks = find_blocks([nodes[k] for k in fwd])
    if len(blocks) < 2:
        raise ValueError("recompute=True: the model has no repeated blocks (node names or "
                         "name scopes of the form <module>.<N>, such as layers.0, layers.1: "
                         "trainops.train.recompute); nothing would be recomputed")
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            readers.setdefault(i, []).append(k)
    order = sorted(blocks)
    members = _absorb(nodes, fwd, producer, {b: {fwd[j] for j in blocks[b]} for b in order})
    wanted, grad_readers, outside = {}, {}, {}
    for b in order:
        inside = {o for k in members[b] for o in nodes[k].output if o}
        escapes = {o for o in inside if o in keep
                   or any(r in fset and r not in members[b] for r in readers.get(o, []))}
        want = {o for o in inside - escapes
                if any(r not in fset for r in readers.get(o, []))}
        wanted[b] = {o for o in want if _copyable(nodes[producer[o]])
                     and nodes[producer[o]].op_type != "Constant"}
        grad_readers[b] = sorted({r for o in wanted[b] for r in readers[o] if r not in fset})
        # the block's output: its last value a forward node after it reads
        outs = [o for o in escapes if o not in keep
                and any(r in fset and r not in members[b] for r in readers.get(o, []))]
        outside[b] = max(outs, key=lambda o: producer[o]) if outs else None
    extra, back, fwd_rename = [], {}, {}
    for j in range(len(order) - 2, -1, -1):  # in the backward's order: later blocks first
        b = order[j]
        anchor = _anchor(nodes, fset, producer, grad_readers[b], grad_readers[order[j + 1]])
        if anchor is None or not wanted[b] or outside[b] is None:
            continue
        new, names, y_g = _copies(nodes, fset, members[b], producer, readers, wanted[b],
                                  anchor, b, outside[b])
        extra += new
        back.update(names)
        for r in readers[outside[b]]:
            if r in fset and r not in members[b]:
                fwd_rename.setdefault(r, {})[outside[b]] = y_g
    out = []
    for k, n in enumerate(nodes):
        rename = fwd_rename.get(k, {}) if k in fset else back
        if any(i in rename for i in n.input):
            m = onnx.NodeProto()
            m.CopyFrom(n)
            del m.input[:]
            m.input.extend(rename.get(i, i) for i in n.input)
            n = m
        out.append(n)
    return toposort(out + extra, available)


def _absorb(nodes, fwd: list[int], producer, members: dict[int, set]) -> dict[int, set]:
    """``members`` with each forward node that names no block (a node without a name
    scope, one LoRA added to a dynamo export, the glue after a block) in the block of its
    inputs' producers, where they are all of one block."""
    label = {k: b for b, ks in members.items() for k in ks}
    for k in fwd:  # topological: producers first
        if k in label or block_of(nodes[k]) is not None:
            continue
        found = {label.get(producer.get(i)) for i in nodes[k].input if producer.get(i) in label}
        if len(found) == 1:
            label[k] = found.pop()
            members[label[k]].add(k)
    return members


def _anchor(nodes, fset, producer, mine: list[int], nxt: list[int]) -> str | None:
    """The gradient that gates block's copies: among the backward values ``mine`` (its
    gradient readers) read, the one descending from most of ``nxt`` (the next block's),
    earliest on ties; None when none descends from any."""
    bits = {r: 1 << i for i, r in enumerate(nxt)}
    mask = [0] * len(nodes)
    for k, n in enumerate(nodes):  # topological: producers first
        if k in fset:
            continue
        m = bits.get(k, 0)
        for i in n.input:
            p = producer.get(i)
            if p is not None:
                m |= mask[p]
        mask[k] = m
    best, score = None, (0, 0)
    for r in mine:
        for i in nodes[r].input:
            p = producer.get(i)
            if p is None or p in fset or not mask[p]:
                continue
            s = (bin(mask[p]).count("1"), -p)
            if s > score:
                best, score = i, s
    return best


def _empty(p: str, t: str, minus1: str, zero: str) -> tuple[list, str]:
    """Nodes reading ``t`` into an empty 1-D slice of it (``<p>/empty``)."""
    return [helper.make_node("Reshape", [t, minus1], [f"{p}/flat"]),
            helper.make_node("Slice", [f"{p}/flat", zero, zero], [f"{p}/empty"])], \
        f"{p}/empty"


def _gated(p: str, t: str, empties: list[str], minus1: str) -> list:
    """Nodes computing ``p``: ``t``'s exact value that depends on ``empties`` (empty 1-D
    tensors of any type) too."""
    cast = [helper.make_node("CastLike", [e, t], [f"{p}/empty/{k}"])
            for k, e in enumerate(empties)]
    return cast + [
        helper.make_node("Reshape", [t, minus1], [f"{p}/flat"]),
        helper.make_node("Concat", [f"{p}/flat"] + [c.output[0] for c in cast], [f"{p}/cat"],
                         axis=0),
        helper.make_node("Shape", [t], [f"{p}/shape"]),
        helper.make_node("Reshape", [f"{p}/cat", f"{p}/shape"], [p], allowzero=1)]


def _sink(p: str, values: list[str], minus1: str, zero: str) -> tuple[list, list[str]]:
    """A spare reader for each of ``values``: their empty slices."""
    nodes, empties = [], []
    for k, t in enumerate(values):
        new, e = _empty(f"{p}/{k}", t, minus1, zero)
        nodes += new
        empties.append(e)
    return nodes, empties


def _copies(nodes, fset, members, producer, readers, want, anchor, b, y):
    """The copy nodes of block ``b`` computing ``want`` again, gated on ``anchor``, the
    renaming original -> copy the backward reads, and the gated block output ``y`` the
    forward after the block reads.

    ONNX Runtime fuses a node with its reader when that reader is the value's only one
    (DivMulFusion: ``Mul(y, Div(1, x))`` -> ``Div(y, x)``, other bits). So that every
    value keeps as many readers as without recompute, each original the backward no
    longer reads gets a spare reader (an empty slice of it) that the block's output
    depends on (so it runs in the forward, right after the value: it keeps nothing
    alive), and each copy read by fewer nodes than its original gets one that a copy
    the backward reads depends on."""
    need, stack = set(), [producer[o] for o in want]
    while stack:
        k = stack.pop()
        if k in need:
            continue
        need.add(k)
        for i in nodes[k].input:
            p = producer.get(i)
            if p is not None and p in members and _copyable(nodes[p]):
                stack.append(p)
    p = f"{_NAME}/{b}"
    m1, z = f"{p}/minus1", f"{p}/zero"
    head = [_const(m1, [-1]), _const(z, [0])]
    gate, empty = _empty(f"{p}/anchor", anchor, m1, z)
    rename = {o: f"{o}/{_NAME}" for k in need for o in nodes[k].output if o}
    gated: dict[str, str] = {}
    out = []
    for k in sorted(need):
        n = onnx.NodeProto()
        n.CopyFrom(nodes[k])
        ins = []
        for i in n.input:
            q = producer.get(i)
            if i in rename or not i or q is None or nodes[q].op_type == "Constant":
                ins.append(rename.get(i, i))  # a copy, absent, an input or a constant
                continue
            if i not in gated:
                gated[i] = f"{p}/gated/{len(gated)}"
                gate += _gated(gated[i], i, [empty], m1)
            ins.append(gated[i])
        del n.input[:], n.output[:]
        n.input.extend(ins)
        n.output.extend(rename.get(o, o) for o in nodes[k].output)
        n.name = f"{n.name}/{_NAME}" if n.name else ""
        out.append(n)
    names = {o: rename[o] for o in want}
    copied = set(need)
    fewer = [rename[o] for o in rename
             if sum(r in copied or (o in want and r not in fset) for r in readers.get(o, []))
             < len(readers.get(o, []))]
    if fewer:
        w = max(want, key=lambda o: producer[o])
        sink, empties = _sink(f"{p}/spare_copy", fewer, m1, z)
        out += sink + _gated(f"{p}/sunk", rename[w], empties, m1)
        names[w] = f"{p}/sunk"
    sink, empties = _sink(f"{p}/spare", sorted(want), m1, z)
    y_g = f"{p}/output"
    out += sink + _gated(y_g, y, empties, m1)
    return head + gate + out, names, y_g
