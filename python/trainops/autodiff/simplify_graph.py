"""Exact clean-up of a step graph's forward and backward nodes (:func:`simplify_backward`).

The rules emit one op's gradient at a time, so the graph they make carries work a look at
two neighbouring nodes removes. Every rewrite here keeps every remaining value bit for bit
(no arithmetic is reordered; only copies, layout changes and identity arithmetic go):

- ``Identity`` and a ``Cast``/``CastLike`` to its input's type (onnxruntime's removal of
  one before a ``Mul(it, Div(1, b))`` leaves the Mul naming it: an invalid model);
  ``Transpose`` with the identity permutation; ``Transpose(Transpose(x, p),
  q)``: ``x`` when the permutations cancel, else one ``Transpose`` when the inner one has
  no other reader;
- reshape chains: a ``Reshape`` to a constant target (no 0 entries) reads past a
  ``Reshape``/``Flatten``/``Squeeze``/``Unsqueeze``/``Identity`` before it;
  ``Squeeze(Unsqueeze(x, a), a)`` and ``Unsqueeze(Squeeze(x, a), a)`` are ``x``; any of
  these and ``Expand`` whose output has its input's shape is its input; so is a
  ``ReduceSum`` with no axes and ``noop_with_empty_axes``, and an integer ``ReduceSum``/
  ``ReduceMean`` over size-1 axes (with ``keepdims=0``: a ``Squeeze``). Not a float one:
  onnxruntime's kernel adds the element to +0.0 on some layouts (-0.0 comes out +0.0)
  and copies it on others, so no rewrite is bit for bit its result;
- ``Mul``/``Div`` by a constant 1 and ``Add`` of a constant -0.0 (``x + 0.0`` is +0.0
  for ``x = -0.0``: only integer zeros and -0.0 are identities) or ``Sub`` of 0 that do
  not broadcast ``x`` to a larger shape;
- ``Shape``/``Size`` of a statically shaped tensor and integer arithmetic on constants
  (shape chains) become ``Constant`` nodes (:mod:`.fold`'s evaluator; float values are
  never folded: ONNX Runtime's kernels, not numpy, must compute those);
- the ``LogSoftmax`` the gradient of ``SoftmaxCrossEntropyLoss`` emits for 2-d scores is
  the loss node's ``log_prob`` output (onnxruntime computes both by one LogSoftmax and
  does not merge them: its function body reads a reshaped view of the scores);
- nodes whose outputs nothing reads (and that are not in ``keep``) go.

Shapes and types come from onnx's inference over the whole node list
(:func:`.simplify_known.step_shapes`); two symbolic dimensions are the same when onnx gave
them the same name.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import onnx
from onnx import helper, numpy_helper

from .constants import constant_value
from .fold import FOLDABLE, _evaluate
from .graph import node_inputs
from .simplify_known import (FLOATS, INTS, RESHAPES, STATEFUL, SUBGRAPH, Known, attr as _attr,
                             known as _known, reads as _reads, static as _static, step_shapes)

__all__ = ["Known", "simplify_backward", "step_shapes"]


class _Pass:
    """One round over the nodes: rewrites, then dead-node removal."""

    def __init__(self, nodes, known, keep, consts, opset, compose):
        self.nodes, self.shapes, self.opset = list(nodes), known.shapes, opset
        self.compose = compose
        self.types = known.types
        self.keep = set(keep)
        for n in self.nodes:  # values a subgraph captures are never renamed
            if any(a.type in SUBGRAPH for a in n.attribute):
                self.keep.update(node_inputs(n))
        self.consts = consts
        self.alias: dict[str, str] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.uses: dict[str, int] = {}
        self.changed = 0

    # -- helpers -----------------------------------------------------------------------
    def name(self, x: str) -> str:
        while x in self.alias:
            x = self.alias[x]
        return x

    def const(self, x: str):
        return self.consts.get(x)

    def ints(self, x: str) -> list[int] | None:
        v = self.consts.get(x) if x else None
        if v is None or v.dtype.kind not in "iu" or v.ndim > 1:
            return None
        return [int(a) for a in v.reshape(-1)]

    def axes(self, node) -> list[int] | None:
        """A Squeeze/Unsqueeze/Reduce node's axes (attribute or input 1); [] if absent."""
        if len(node.input) > 1 and node.input[1]:
            return self.ints(node.input[1])
        return list(_attr(node, "axes", []))

    def same_shape(self, a: str, b: str) -> bool:
        sa, sb = self.shapes.get(a), self.shapes.get(b)
        return _known(sa) and sa == sb

    def default(self, node) -> bool:
        return node.domain in ("", "ai.onnx")

    # -- outcomes ----------------------------------------------------------------------
    def to_alias(self, node, x: str) -> bool:
        y = node.output[0]
        if y in self.keep or len([o for o in node.output if o]) != 1:
            return False
        self.alias[y] = x
        return True

    def replace(self, node, op_type: str, inputs: list[str], **attrs) -> onnx.NodeProto:
        return helper.make_node(op_type, inputs, [node.output[0]], name=node.name, **attrs)

    def const_node(self, node, value: np.ndarray) -> onnx.NodeProto:
        out = node.output[0]
        self.consts[out] = value
        return helper.make_node("Constant", [], [out], name=node.name or f"folded/{out}",
                                value=numpy_helper.from_array(value, out))

    def axes_input(self, axes: list[int], hint: str) -> list[str]:
        if self.opset < 13:
            return []
        name = f"{hint}/squeeze_axes"
        self.consts[name] = np.asarray(axes, np.int64)
        self.new_consts.append(helper.make_node(
            "Constant", [], [name], name=name,
            value=numpy_helper.from_array(np.asarray(axes, np.int64), name)))
        return [name]

    # -- the rewrites: None (keep), True (aliased away) or a replacement node ----------
    def rewrite(self, node):
        op = node.op_type
        if not self.default(node) or not node.output or any(
                a.type in SUBGRAPH for a in node.attribute):
            return None
        y = node.output[0]
        x = node.input[0] if node.input else ""
        if op in ("Cast", "CastLike"):  # to the type x has: a copy
            to = _attr(node, "to") if op == "Cast" else self.types.get(node.input[-1])
            if to is not None and to == self.types.get(x):
                return self.to_alias(node, x) or None
        if op == "Identity":
            return self.to_alias(node, x) or None
        if op == "Transpose":
            return self.transpose(node, x)
        if op in RESHAPES:
            r = self.reshape(node, x)
            if r is not None:
                return r
        if op in ("ReduceSum", "ReduceMean"):
            return self.reduce(node, x)
        if op == "Expand":
            return (self.same_shape(x, y) and self.to_alias(node, x)) or None
        if op in ("Mul", "Div", "Add", "Sub") and len(node.input) == 2:
            r = self.arith(node)
            if r is not None:
                return r
        if op == "LogSoftmax":
            return self.log_prob(node, x)
        if op in ("Shape", "Size") or op in FOLDABLE:
            return self.fold(node)
        return None

    def log_prob(self, node, x):
        """LogSoftmax(scores, axis=1) of the 2-d scores of a SoftmaxCrossEntropyLoss (the
        loss' gradient rule emits it): the loss node's own ``log_prob`` output, which
        onnxruntime computes by the same LogSoftmax (the op's function body)."""
        sce = self.sce.get(x)
        shape = self.shapes.get(x)
        if sce is None or shape is None or len(shape) != 2 or _attr(node, "axis", -1) not in (1, -1):
            return None
        if len(sce.output) > 1 and sce.output[1]:
            return self.to_alias(node, sce.output[1]) or None
        patched = onnx.NodeProto()
        patched.CopyFrom(sce)
        del patched.output[1:]
        patched.output.append(node.output[0])
        self.patch[id(sce)] = patched
        self.sce[x] = patched
        return True

    def transpose(self, node, x):
        rank = len(self.shapes[x]) if self.shapes.get(x) is not None else None
        p = _attr(node, "perm")
        if p is None:
            if rank is None:
                return None
            p = list(range(rank))[::-1]
        p = list(p)
        if p == sorted(p):
            return self.to_alias(node, x) or None
        inner = self.producer.get(x)
        if inner is None or inner.op_type != "Transpose" or not self.default(inner):
            return None
        q = _attr(inner, "perm")
        if q is None:
            return None
        r = [list(q)[i] for i in p]
        if r == sorted(r):
            return self.to_alias(node, inner.input[0]) or None
        if self.compose and self.uses.get(x, 0) == 1 and x not in self.keep:
            return self.replace(node, "Transpose", [inner.input[0]], perm=r)
        return None

    def reshape(self, node, x):
        op, y = node.op_type, node.output[0]
        if op != "Identity" and self.same_shape(x, y):
            return self.to_alias(node, x) or None
        inner = self.producer.get(x)
        if op in ("Squeeze", "Unsqueeze") and inner is not None and self.default(inner) \
                and inner.op_type == ("Unsqueeze" if op == "Squeeze" else "Squeeze"):
            a, b = self.axes(node), self.axes(inner)
            full = self.shapes.get(x) if op == "Squeeze" else self.shapes.get(y)
            if a and b and (full is not None or min(a + b) >= 0):
                n = len(full) if full is not None else 0
                if sorted(v % n if n else v for v in a) == sorted(v % n if n else v for v in b):
                    return self.to_alias(node, inner.input[0]) or None
        if op == "Reshape" and inner is not None and self.default(inner) \
                and inner.op_type in RESHAPES and len(node.input) > 1:
            target = self.ints(node.input[1])
            if target is not None and 0 not in target:
                root = inner.input[0]
                if self.same_shape(root, y):
                    return self.to_alias(node, root) or None
                return self.replace(node, "Reshape", [root, node.input[1]])
        return None

    def reduce(self, node, x):
        y = node.output[0]
        shape = self.shapes.get(x)
        axes = self.axes(node)
        if axes is None:
            return None
        if not axes:
            if _attr(node, "noop_with_empty_axes", 0):
                return self.to_alias(node, x) or None
            axes = list(range(len(shape))) if shape is not None else None
        if shape is None or axes is None or self.types.get(x) not in INTS:
            return None
        norm = sorted({a % len(shape) for a in axes}) if shape else []
        if not all(shape[a] == 1 for a in norm):
            return None
        if _attr(node, "keepdims", 1) or not norm:
            return self.to_alias(node, x) or None
        if self.same_shape(x, y):
            return self.to_alias(node, x) or None
        if self.opset < 13:
            return helper.make_node("Squeeze", [x], [y], name=node.name, axes=norm)
        return helper.make_node("Squeeze", [x] + self.axes_input(norm, y), [y], name=node.name)

    def uniform(self, name):
        """(value, shape) of a constant whose elements all equal one value; else None."""
        v = self.consts.get(name)
        if v is not None:
            if v.size == 0 or not np.all(v.reshape(-1) == v.reshape(-1)[0]):
                return None
            return v.reshape(-1)[:1].copy(), list(v.shape)
        n = self.producer.get(name)
        if n is not None and n.op_type == "ConstantOfShape" and self.default(n):
            shape = self.ints(n.input[0])
            val = _attr(n, "value")
            fill = numpy_helper.to_array(val).reshape(-1) if val is not None \
                else np.zeros(1, np.float32)
            return (fill, shape) if shape is not None else None
        return None

    def arith(self, node):
        op, y = node.op_type, node.output[0]
        a, b = node.input[0], node.input[1]
        order = [(a, b), (b, a)] if op in ("Mul", "Add") else [(a, b)]
        for x, c in order:
            u = self.uniform(c)
            if u is None:
                continue
            v, cshape = u
            sx = self.shapes.get(x)
            grows = sx is None or len(cshape) > len(sx) or not all(
                d == 1 or d == s for d, s in zip(cshape[::-1], sx[::-1]))
            if grows and not self.same_shape(x, y):
                continue
            if v.dtype.kind == "f":
                bits = v.view(np.uint16 if v.itemsize == 2 else
                              np.uint32 if v.itemsize == 4 else np.uint64)[0]
                neg_zero = v[0] == 0 and bits != 0
                ok = {"Mul": v[0] == 1, "Div": v[0] == 1, "Add": neg_zero,
                      "Sub": v[0] == 0 and not neg_zero}[op]
            else:
                ok = v[0] == (1 if op in ("Mul", "Div") else 0)
            if ok and self.to_alias(node, x):
                return True
        return None

    def fold(self, node):
        op = node.op_type
        if len(node.output) != 1:
            return None
        if op in ("Shape", "Size"):
            dims = self.shapes.get(node.input[0])
            if not _static(dims):
                return None
            if op == "Size":
                return self.const_node(node, np.array(int(np.prod(dims)), np.int64))
            start, end = _attr(node, "start", 0), _attr(node, "end", None)
            return self.const_node(node, np.array(dims[start:end], np.int64))
        vals = [self.consts.get(i) if i else None for i in node.input]
        if not node.input or any(i and v is None for i, v in zip(node.input, vals)):
            return None
        if any(v is not None and (v.dtype.kind not in "iub" or v.size > 4096) for v in vals):
            return None
        if op in ("ConstantOfShape", "Expand", "Range") or (
                _attr(node, "to") in FLOATS) or _attr(node, "value") is not None:
            return None
        try:
            value = np.asarray(_evaluate(node, vals, self.opset)[0])
        except Exception:  # noqa: BLE001 - not foldable here: left to run time
            return None
        if value.dtype.kind not in "iub" or value.size > 4096:
            return None
        return self.const_node(node, value)

    # -- one round -----------------------------------------------------------------------
    def run(self) -> list[onnx.NodeProto]:
        for n in self.nodes:
            for o in n.output:
                if o:
                    self.producer[o] = n
            for i in _reads(n):
                self.uses[i] = self.uses.get(i, 0) + 1
        self.sce = {n.input[0]: n for n in self.nodes if n.op_type == "SoftmaxCrossEntropyLoss"
                    and self.default(n)}
        self.patch: dict[int, onnx.NodeProto] = {}
        out = []
        self.new_consts: list[onnx.NodeProto] = []
        for n in self.nodes:
            n = self.renamed(n)
            r = self.rewrite(n)
            if r is True:
                self.changed += 1
                continue
            if r is not None:
                self.changed += 1
                for o in r.output:
                    self.producer[o] = r
                out.extend(self.new_consts)
                self.new_consts = []
                n = r
            out.append(n)
        out = [self.patch.get(id(n), n) for n in out]
        if self.alias:  # readers placed before their (aliased) producer
            out = [self.renamed(n) for n in out]
        return self._live(out)

    def renamed(self, n):
        """``n``, or a copy reading the aliases' targets."""
        if not any(i in self.alias for i in n.input):
            return n
        m = onnx.NodeProto()
        m.CopyFrom(n)
        del m.input[:]
        m.input.extend(self.name(i) if i else i for i in n.input)
        return m

    def _live(self, nodes: list) -> list:
        uses: dict[str, int] = {}
        reads = [_reads(n) for n in nodes]
        for r in reads:
            for i in r:
                uses[i] = uses.get(i, 0) + 1
        dead = [False] * len(nodes)
        for k in range(len(nodes) - 1, -1, -1):
            n = nodes[k]
            if not self.default(n) or n.op_type in STATEFUL:
                continue
            if any(o and (o in self.keep or uses.get(o, 0)) for o in n.output):
                continue
            dead[k] = True
            self.changed += 1
            for i in reads[k]:
                uses[i] -= 1
        return [n for k, n in enumerate(nodes) if not dead[k]]


def simplify_backward(nodes: Sequence[onnx.NodeProto], known: Known,
                      keep, constants: dict[str, np.ndarray] | None = None,
                      opset: int = 17, rounds: int = 8) -> list[onnx.NodeProto]:
    """``nodes`` (forward then backward, in topological order) with the exact rewrites of
    the module applied until none applies (at most ``rounds`` times; idempotent). ``keep``:
    the values that must stay (the loss, the gradients, the written states): never
    renamed, their producers never removed. ``known``: :func:`step_shapes`;
    ``constants``: name -> value of the graph's initializers that are not parameters.
    Nodes are not modified in place: a changed node is a new one."""
    consts: dict[str, Any] = dict(constants or {})
    consts.update((n.output[0], v) for n in nodes if (v := constant_value(n)) is not None)
    out = list(nodes)
    compose = False  # Transpose pairs compose once no pair cancels (composing the first
    for _ in range(rounds):  # pair of x -> a -> b -> a' would hide that a' is a)
        p = _Pass(out, known, keep, consts, opset, compose)
        out = p.run()
        if not p.changed:
            if compose:
                break
            compose = True
    return out
