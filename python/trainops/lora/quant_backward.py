"""The backward's own dequantisation of a quantised LoRA base (:func:`dequantise_in_backward`,
run on a step graph built from a :func:`.quantize.quantize` model).

Autodiff's ``dX`` products (``dY @ W^T``) read the forward's dequantised ``W``, so
onnxruntime would keep every dequantised weight alive from its forward use to its backward
use: at the turn of the step, all of them at once, as many bytes as a float32 base. This
pass gives the backward readers of each dequantised value (``W``, or a node of the model
that reads only it, such as ``Transpose(W)``) a copy of its dequantisation chain, so the
forward's copy dies after the forward's MatMul and the backward's is made just before its
products and dies after them.

ONNX Runtime runs a node as soon as its inputs exist in its own order, and its common
subexpression elimination merges nodes with the same inputs and attributes: a copy reading
only initializers would run (or be merged) with the forward's. The copy's
DequantizeLinear therefore reads its scale *gated*: ``Reshape(Concat(Reshape(scale, [-1]),
Cast(Slice(Reshape(g, [-1]), [0], [0]))), Shape(scale))`` with ``g`` a value the backward
computes for the first reader (its other input: the gradient it multiplies): the scale's
exact bits, and a data dependency on that gradient. Same inputs, same kernels: the backward
reads the bits the forward computed.
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import helper, numpy_helper

from .quantize import PREFIX

__all__ = ["dequantise_in_backward"]


def _pure(g: onnx.GraphProto) -> tuple[set, dict]:
    """``(pure, root)``: the values computed from initializers alone, and for those of
    them that descend from one :mod:`.quantize` DequantizeLinear, its name (None when
    they descend from several)."""
    pure = {i.name for i in g.initializer} | {""}
    root: dict = {}
    changed = True
    while changed:
        changed = False
        for n in g.node:
            if n.output[0] in pure or not all(x in pure for x in n.input) or \
                    n.op_type in ("RandomNormal", "RandomUniform", "Multinomial"):
                continue
            pure.update(n.output)
            if n.op_type == "DequantizeLinear" and n.name.startswith(PREFIX):
                r = {n.name}
            else:
                r = {root[x] for x in n.input if x in root}
            if r:
                root.update({o: r.pop() if len(r) == 1 else None for o in n.output})
            changed = True
    return pure, root


def _ancestors(g: onnx.GraphProto, names) -> set:
    producer = {o: n for n in g.node for o in n.output}
    seen, todo = set(), list(names)
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        n = producer.get(t)
        if n is not None:
            todo.extend(n.input)
    return seen


def dequantise_in_backward(model: onnx.ModelProto, loss: str) -> int:
    """Rewrite ``model`` (a step graph; ``loss``: its loss value) in place: every node
    that reads a dequantised value and is not in the forward (not an ancestor of
    ``loss``) reads a gated copy of that value's chain (module docstring), one copy per
    DequantizeLinear whatever the values of it the backward reads (``W``,
    ``Transpose(W)``). Returns the number of copies."""
    g = model.graph
    pure, root = _pure(g)
    quant = set(root)
    if not quant:
        return 0
    forward = _ancestors(g, [loss])
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[int]] = {}  # quantised value -> backward readers (positions)
    for k, n in enumerate(g.node):
        if n.output[0] in pure or any(o in forward for o in n.output):
            continue
        for x in n.input:
            if root.get(x) is not None:
                readers.setdefault(x, []).append(k)
    groups: dict[str, list[str]] = {}  # one copy per DequantizeLinear, whatever reads it
    for v in readers:
        groups.setdefault(root[v], []).append(v)
    if not groups:
        return 0
    inits = {i.name for i in g.initializer}
    flat = f"{PREFIX}-1"
    if flat not in inits:
        g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), flat))
    zero = f"{PREFIX}0"  # quantize writes it ([0], int64)
    nodes = list(g.node)
    at = {id(n): k for k, n in enumerate(nodes)}
    insert: dict[int, list] = {}
    rewire: dict[int, dict[str, str]] = {}
    for c, vs in enumerate(sorted(groups.values(), key=lambda vs: min(readers[v][0]
                                                                        for v in vs))):
        first = min(readers[v][0] for v in vs)
        gate = next(x for x in nodes[first].input if x not in pure)
        sfx = f"/bwd{c}"
        chain, todo, seen = [], list(vs), set()
        while todo:  # the values' producers back to the initializers
            n = producer.get(todo.pop())
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            chain.append(n)
            todo.extend(x for x in n.input if x in quant)
        chain.sort(key=lambda n: at[id(n)])
        p = f"{PREFIX}gate{sfx}/"
        new = [helper.make_node("Reshape", [gate, flat], [f"{p}flat"], name=f"{p}flat"),
               helper.make_node("Slice", [f"{p}flat", zero, zero], [f"{p}empty"],
                                name=f"{p}empty"),
               helper.make_node("Cast", [f"{p}empty"], [f"{p}emptyf"], name=f"{p}emptyf",
                                to=onnx.TensorProto.FLOAT)]
        rename = {}
        for n in chain:
            m = onnx.NodeProto()
            m.CopyFrom(n)
            m.name = f"{n.name}{sfx}" if n.name else ""
            for i, x in enumerate(m.input):
                m.input[i] = rename.get(x, x)
            if n.op_type == "DequantizeLinear" and n.name.startswith(PREFIX):
                s = n.input[1]
                new += [helper.make_node("Reshape", [s, flat], [f"{p}s"], name=f"{p}s"),
                        helper.make_node("Concat", [f"{p}s", f"{p}emptyf"], [f"{p}cat"],
                                         name=f"{p}cat", axis=0),
                        helper.make_node("Shape", [s], [f"{p}shape"], name=f"{p}shape"),
                        helper.make_node("Reshape", [f"{p}cat", f"{p}shape"], [f"{p}scale"],
                                         name=f"{p}scale")]
                m.input[1] = f"{p}scale"
            for i, o in enumerate(m.output):
                rename[o] = m.output[i] = f"{o}{sfx}"
            new.append(m)
        insert.setdefault(first, []).extend(new)
        for v in vs:
            for k in readers[v]:
                rewire.setdefault(k, {})[v] = rename[v]
    order = []
    for k, n in enumerate(nodes):
        order.extend(insert.get(k, []))
        for i, x in enumerate(n.input):
            if x in rewire.get(k, {}):
                n.input[i] = rewire[k][x]
        order.append(n)
    # chains left without a reader (an earlier pass's copies, now rewired) are dropped
    outputs = {o.name for o in g.output}
    while True:
        used = {x for n in order for x in n.input} | outputs
        dead = {id(n) for n in order
                if n.output[0] in quant and not any(o in used for o in n.output)}
        if not dead:
            break
        order = [n for n in order if id(n) not in dead]
    copies = [onnx.NodeProto() for _ in order]
    for dst, src in zip(copies, order):
        dst.CopyFrom(src)
    del g.node[:]
    g.node.extend(copies)
    return len(groups)
