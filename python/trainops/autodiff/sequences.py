"""Tensor sequences whose elements are known when the graph is built, rewritten into plain
tensors (:func:`unsequence`), so that the gradient rules of Split, Concat and Unsqueeze
apply to them.

PyTorch's dynamo exporter writes ``torch.split``/``chunk``/``unbind`` as ``SplitToSequence``
read by ``SequenceAt`` at constant positions (GPT-2's query/key/value, ModernBERT's gated
MLP). A gradient cannot flow through a sequence value as the rules emit it (the gradients of
a value read several times are summed by ``Sum``, a tensor op), but such a sequence is only
a list of tensors with a name, which this pass takes apart:

- makers: ``SplitToSequence`` whose parts are known statically (no split: the axis's length
  known; a scalar split: chunks of it, the last one shorter; a 1-D split: a constant, or at
  opset >= 13 any tensor of static length) becomes one ``Split`` (and a ``Squeeze`` per part
  with ``keepdims=0``), emitted only when a part is read; ``SequenceConstruct``,
  ``SequenceEmpty``, ``SequenceInsert`` and ``SequenceErase`` (constant or absent
  positions) and ``Identity`` of a sequence are bookkeeping;
- readers: ``SequenceAt`` at a constant position becomes ``Identity`` of the element,
  ``ConcatFromSequence`` a ``Concat`` (of ``Unsqueeze`` d elements for ``new_axis=1``),
  ``SequenceLength`` a ``Constant``.

Split sizes and positions computed from static shapes are folded into constants first
(:func:`~.fold.fold_shape_constants`). A sequence that anything else reads (a
``SequenceAt`` at a position known only at run time, a graph output, a subgraph,
``SequenceMap``, ...) keeps its makers, so the model computes what it did; a gradient
through it is then refused by the backward pass (no rule for the op, naming the node).
The tensors of the rewritten graph are bit for bit those of the sequence ops (copies and
Split's slices).
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import helper, numpy_helper

from .constants import constant_type, constant_value
from .fold import fold_shape_constants
from .graph import captures, default_opset, infer

__all__ = ["SEQUENCE_OPS", "unsequence"]

MAKERS = {"SplitToSequence", "SequenceConstruct", "SequenceEmpty", "SequenceInsert",
          "SequenceErase"}
READERS = {"SequenceAt", "ConcatFromSequence", "SequenceLength"}
SEQUENCE_OPS = MAKERS | READERS


class _Part:
    """Element ``k`` of the parts of the ``SplitToSequence`` node ``maker``."""

    def __init__(self, maker: onnx.NodeProto, k: int):
        self.maker, self.k = maker, k


class _Split:
    """How one SplitToSequence becomes a Split: its axis, the sizes (ints) or the name of a
    run-time split input, the part count, and whether each part loses the axis."""

    def __init__(self, axis: int, sizes, count: int, squeeze: bool):
        self.axis, self.sizes, self.count, self.squeeze = axis, sizes, count, squeeze
        self.used: set[int] = set()
        self.names: dict[int, str] = {}


def unsequence(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s main-graph sequences whose elements are known statically (in
    place; nodes in topological order, see the module). Returns the number of sequence
    nodes replaced or removed."""
    g = model.graph
    if not any(n.op_type in SEQUENCE_OPS and n.domain in ("", "ai.onnx") for n in g.node):
        return 0
    opset = default_opset(model)
    # Split sizes and positions computed from static shapes (torch.chunk of a dimension)
    # become Constants first; the importer folds after this pass, too late for them.
    fold_shape_constants(model)
    nodes = list(g.node)  # one wrapper per node: the passes below key them by id()
    inferred = infer(model).graph
    shapes = {}
    for vi in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is not None and tt.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None
                               for d in tt.shape.dim]
    for init in g.initializer:
        shapes[init.name] = list(init.dims)
    consts = {i.name: numpy_helper.to_array(i) for i in g.initializer
              if i.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)}
    for n in nodes:
        if constant_type(n) in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            v = constant_value(n)  # any of Constant's forms (value, value_int(s), ...)
            if v is not None:
                consts[n.output[0]] = v

    def const_int(name: str) -> int | None:
        v = consts.get(name) if name else None
        if v is None or v.size != 1 or v.ndim > 1:
            return None
        return int(v.reshape(-1)[0])

    # Pass 1: each sequence value's elements (tensor names or _Part), in node order.
    elems: dict[str, list] = {}
    splits: dict[int, _Split] = {}
    plan: dict[int, object] = {}  # id(reader) -> its replacement recipe
    for n in nodes:
        if n.domain not in ("", "ai.onnx"):
            continue
        t, ins = n.op_type, list(n.input)
        src = elems.get(ins[0]) if ins else None
        if t == "SplitToSequence":
            how = _split_plan(n, shapes, consts, opset)
            if how is not None:
                splits[id(n)] = how
                elems[n.output[0]] = [_Part(n, k) for k in range(how.count)]
        elif t == "SequenceConstruct":
            elems[n.output[0]] = ins
        elif t == "SequenceEmpty":
            elems[n.output[0]] = []
        elif t == "SequenceInsert" and src is not None:
            pos = len(src) if len(ins) < 3 or not ins[2] else const_int(ins[2])
            if pos is not None and -len(src) <= pos <= len(src):
                pos = pos + len(src) if pos < 0 else pos
                elems[n.output[0]] = src[:pos] + [ins[1]] + src[pos:]
        elif t == "SequenceErase" and src:
            pos = -1 if len(ins) < 2 or not ins[1] else const_int(ins[1])
            if pos is not None and -len(src) <= pos < len(src):
                pos = pos + len(src) if pos < 0 else pos
                elems[n.output[0]] = src[:pos] + src[pos + 1:]
        elif t == "Identity" and src is not None:
            elems[n.output[0]] = src
        elif t == "SequenceAt" and src is not None:
            pos = const_int(ins[1])
            if pos is not None and -len(src) <= pos < len(src):
                plan[id(n)] = src[pos]
        elif t == "ConcatFromSequence" and src:
            plan[id(n)] = src
        elif t == "SequenceLength" and src is not None:
            plan[id(n)] = len(src)
    if not plan:
        return 0

    # Sequences something still reads as a sequence keep their makers (and theirs).
    seq_producer = {n.output[0]: n for n in nodes if n.output and n.output[0] in elems}
    kept = {o.name for o in g.output}
    for n in nodes:
        if id(n) not in plan and seq_producer.get(n.output[0] if n.output else None) is not n:
            kept.update(i for i in n.input if i)
            kept.update(captures(n))
    stack = [s for s in kept if s in seq_producer]
    while stack:
        p = seq_producer[stack.pop()]
        for i in p.input:
            if i in seq_producer and i not in kept:
                kept.add(i)
                stack.append(i)

    # Readers of the parts of a SplitToSequence whose sequence is kept stay as they are (the
    # parts are not split out a second time); elements that are tensors of the graph, or
    # parts of a SplitToSequence that goes, are read directly.
    def kept_part(recipe) -> bool:
        return any(isinstance(e, _Part) and e.maker.output[0] in kept
                   for e in (recipe if isinstance(recipe, list) else [recipe]))
    plan = {k: v for k, v in plan.items() if not kept_part(v)}
    if not plan:
        return 0
    taken = {i for n in nodes for i in list(n.input) + list(n.output)} | kept
    taken |= {i.name for i in g.input} | {i.name for i in g.initializer}

    def fresh(base: str) -> str:
        k = 0
        while f"{base}_{k}" in taken:
            k += 1
        taken.add(f"{base}_{k}")
        return f"{base}_{k}"

    def elem_name(e) -> str:
        if isinstance(e, _Part):
            how = splits[id(e.maker)]
            how.used.add(e.k)
            if e.k not in how.names:
                how.names[e.k] = fresh(f"{e.maker.output[0]}/part{e.k}")
            return how.names[e.k]
        return e

    # Pass 2: the readers' replacements (naming the parts they read), then the node list.
    made: dict[int, list[onnx.NodeProto]] = {}
    for n in nodes:
        if id(n) in plan:
            made[id(n)] = _reader_nodes(n, plan[id(n)], elem_name, fresh, opset)
    out: list[onnx.NodeProto] = []
    changed = 0
    for n in nodes:
        if id(n) in plan:
            out.extend(made[id(n)])
            changed += 1
        elif n.op_type in MAKERS | {"Identity"} and n.domain in ("", "ai.onnx") and \
                n.output and n.output[0] in elems and n.output[0] not in kept:
            if id(n) in splits and splits[id(n)].used:
                out.extend(_split_nodes(n, splits[id(n)], fresh, opset))
            changed += 1
        else:
            out.append(n)
    del g.node[:]
    g.node.extend(out)
    return changed


def _split_plan(n: onnx.NodeProto, shapes: dict, consts: dict, opset: int) -> _Split | None:
    x = n.input[0]
    split = n.input[1] if len(n.input) > 1 and n.input[1] else None
    dims = shapes.get(x)
    if dims is None:
        return None
    r = len(dims)
    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
    axis = axis + r if axis < 0 else axis
    if not 0 <= axis < r:
        return None
    keepdims = next((a.i for a in n.attribute if a.name == "keepdims"), 1)
    d = dims[axis]
    if split is None:
        if not d:
            return None
        return _Split(axis, [1] * d, d, squeeze=not keepdims)
    v = consts.get(split)
    if v is not None and v.ndim == 0:
        s = int(v)
        if not d or s <= 0:
            return None
        sizes = [s] * (d // s) + ([d % s] if d % s else [])
        return _Split(axis, sizes, len(sizes), squeeze=False)
    if v is not None and v.ndim == 1 and v.size:
        return _Split(axis, [int(a) for a in v], int(v.size), squeeze=False)
    sdims = shapes.get(split)
    if v is None and opset >= 13 and sdims is not None and len(sdims) == 1 and sdims[0]:
        return _Split(axis, split, int(sdims[0]), squeeze=False)  # sizes known at run time
    return None


def _ints(name: str, values) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"{name}/node",
                            value=numpy_helper.from_array(np.asarray(values, np.int64), name))


def _split_nodes(n: onnx.NodeProto, how: _Split, fresh, opset: int) -> list[onnx.NodeProto]:
    """The Split replacing SplitToSequence ``n``, and the Squeezes of the parts read when
    they lose the axis."""
    base = n.output[0]
    parts = [how.names[k] if k in how.used and not how.squeeze else fresh(f"{base}/split{k}")
             for k in range(how.count)]
    nodes: list[onnx.NodeProto] = []
    name = n.name or base
    if isinstance(how.sizes, str):
        nodes.append(helper.make_node("Split", [n.input[0], how.sizes], parts,
                                      name=f"{name}/split", axis=how.axis))
    elif opset >= 13:
        sizes = fresh(f"{base}/sizes")
        nodes.append(_ints(sizes, how.sizes))
        nodes.append(helper.make_node("Split", [n.input[0], sizes], parts,
                                      name=f"{name}/split", axis=how.axis))
    else:
        nodes.append(helper.make_node("Split", [n.input[0]], parts, name=f"{name}/split",
                                      axis=how.axis, split=list(how.sizes)))
    if how.squeeze:
        for k in sorted(how.used):
            nodes.extend(_squeeze(parts[k], how.names[k], how.axis, fresh, opset,
                                  f"{name}/squeeze{k}"))
    return nodes


def _squeeze(x: str, y: str, axis: int, fresh, opset: int, name: str) -> list:
    if opset >= 13:
        axes = fresh(f"{y}/axes")
        return [_ints(axes, [axis]), helper.make_node("Squeeze", [x, axes], [y], name=name)]
    return [helper.make_node("Squeeze", [x], [y], name=name, axes=[axis])]


def _reader_nodes(n: onnx.NodeProto, recipe, elem_name, fresh, opset: int) -> list:
    y, name = n.output[0], n.name or n.output[0]
    if n.op_type == "SequenceAt":
        return [helper.make_node("Identity", [elem_name(recipe)], [y], name=name)]
    if n.op_type == "SequenceLength":
        return [helper.make_node("Constant", [], [y], name=name, value=numpy_helper.from_array(
            np.asarray(recipe, np.int64), y))]
    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
    new_axis = next((a.i for a in n.attribute if a.name == "new_axis"), 0)
    ins = [elem_name(e) for e in recipe]
    nodes = []
    if new_axis:
        stacked = []
        for k, e in enumerate(ins):
            u = fresh(f"{y}/item{k}")
            if opset >= 13:
                axes = fresh(f"{y}/axes{k}")
                nodes += [_ints(axes, [axis]),
                          helper.make_node("Unsqueeze", [e, axes], [u], name=f"{name}/unsq{k}")]
            else:
                nodes.append(helper.make_node("Unsqueeze", [e], [u], name=f"{name}/unsq{k}",
                                              axes=[axis]))
            stacked.append(u)
        ins = stacked
    nodes.append(helper.make_node("Concat", ins, [y], name=name, axis=axis))
    return nodes
