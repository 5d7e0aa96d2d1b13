"""Emitting one custom node's standard-op expansion: fresh names, scalar constants,
loads into and stores from the compute type, and the node's declared attributes.

An :class:`Emitter` collects ``NodeProto``s and ``TensorProto`` initializers for one
expansion. Every name it makes starts with the custom node's prefix and avoids the names
already taken in the graph; the last value of each output stream is renamed to the
custom node's output name at the end (:meth:`Emitter.finish`), so in-place IOBinding of
the original graph outputs keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Mapping

import numpy as np

__all__ = ["Emitter", "Expansion", "ExpansionError", "float_attrs", "FLOAT", "DOUBLE",
           "FLOAT16", "BFLOAT16", "INT64", "BOOL", "FLOAT_TYPES", "SQRT_MODES", "MIN_OPSET"]

# ONNX TensorProto element types used here.
FLOAT, INT64, BOOL, FLOAT16, DOUBLE, BFLOAT16 = 1, 7, 9, 10, 11, 16
FLOAT_TYPES = (FLOAT, DOUBLE, FLOAT16, BFLOAT16)
# How float32 square roots are emitted (see Emitter.sqrt).
SQRT_MODES = ("exact", "native")
# The oldest default-domain opset the expansions' nodes are written for (Cast to bfloat16,
# Reshape to rank 0, ReduceSum without axes, IsInf, Slice with inputs).
MIN_OPSET = 13
_NP = {FLOAT: np.float32, DOUBLE: np.float64, INT64: np.int64, BOOL: np.bool_}
_NAMES = {FLOAT: "float", DOUBLE: "double", FLOAT16: "float16", BFLOAT16: "bfloat16",
          INT64: "int64", BOOL: "bool"}


class ExpansionError(ValueError):
    """A node cannot be expanded: names the node, the input or attribute, and what was
    expected."""


class Expansion:
    """The standard-op replacement of one node: ``nodes`` (topologically ordered) and the
    ``initializers`` they read."""

    def __init__(self, nodes: list, initializers: list):
        self.nodes = nodes
        self.initializers = initializers

    def __iter__(self):
        return iter((self.nodes, self.initializers))


def type_name(elem: int) -> str:
    """``tensor(float)``-style name of an ONNX element type, for messages."""
    return f"tensor({_NAMES.get(elem, str(elem))})"


def float_attrs(node, defaults: Mapping[str, float | None]) -> dict[str, float]:
    """``node``'s FLOAT attributes named in ``defaults`` (a ``None`` default: required),
    as Python floats holding the float32 values; an unknown attribute, one of another type
    or a missing required one is an :class:`ExpansionError`, as the kernels refuse them."""
    from onnx import AttributeProto

    got = {}
    for a in node.attribute:
        if a.name not in defaults:
            continue
        if a.type != AttributeProto.FLOAT:
            raise ExpansionError(f"{node.op_type} node {node.name!r}: attribute {a.name!r}: "
                                 f"expected a float, got {AttributeProto.AttributeType.Name(a.type)}")
        got[a.name] = float(np.float32(a.f))
    out = {}
    for name, default in defaults.items():
        if name in got:
            out[name] = got[name]
        elif default is None:
            raise ExpansionError(f"{node.op_type} node {node.name!r}: attribute {name!r} is "
                                 "required (a float)")
        else:
            out[name] = float(np.float32(default))
    return out


class Emitter:
    """Builds one expansion. ``types`` maps value names to ONNX element types (at least
    the node's inputs); ``taken`` is the set of names already used in the graph (names
    made here are added to it); ``sqrt``, ``dropout_seed`` and ``float64`` are the rewrite's
    options (``sizes``: element counts of values of static shape). ``float64=False``: no
    float64 value anywhere (EPs without float64): square
    roots native, per-call scalars in float-float (:mod:`.ff`), fmas in float32
    (:func:`~.fma.fma_split`); :attr:`wide` is the type the per-call scalars come in."""

    def __init__(self, node, types: Mapping[str, int], taken: set[str], sqrt: str = "exact",
                 dropout_seed: int = 0, float64: bool = True,
                 sizes: Mapping[str, int] | None = None):
        self.dropout_seed = int(dropout_seed)
        if sqrt not in SQRT_MODES:
            raise ValueError(f"sqrt: expected one of {', '.join(SQRT_MODES)}, got {sqrt!r}")
        self.float64 = bool(float64)
        self.sizes = dict(sizes or {})  # element counts of values with static shapes
        self.wide = DOUBLE if self.float64 else FLOAT
        self.sqrt_mode = sqrt if self.float64 else "native"
        self.node = node
        self.types = types
        self.taken = taken
        self.prefix = f"{node.name or node.op_type}/portable"
        self.nodes: list = []
        self.initializers: list = []
        self._consts: dict[tuple, str] = {}
        self._renames: dict[str, str] = {}
        self._scalars: dict[str, str] = {}
        self._ones: dict[int, str] = {}
        self.ordered_after: list[str] = []  # see ready
        self._ready: str | None = None
        self._zero: str | None = None  # see _runtime_zero
        self._count = 0

    # -- names -------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        """A name not used in the graph, starting with the node's prefix."""
        while True:
            self._count += 1
            name = f"{self.prefix}/{hint}_{self._count}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def where(self, what: str) -> str:
        """``Op node 'name': what`` for error messages."""
        return f"{self.node.op_type} node {self.node.name!r}: {what}"

    def elem(self, name: str, what: str, allowed: Iterable[int]) -> int:
        """The element type of input ``name`` (described as ``what``), one of ``allowed``."""
        allowed = tuple(allowed)
        elem = self.types.get(name)
        if elem is None:
            raise ExpansionError(self.where(
                f"input {what} ({name!r}) has no known element type; declare it (graph "
                "input, initializer or value_info) or pass types= to the rewrite"))
        if elem not in allowed:
            want = " or ".join(type_name(t) for t in allowed)
            why = (" (float64=False, the rewrite for EPs without float64, takes no double "
                   "value)" if elem == DOUBLE and not self.float64 else "")
            raise ExpansionError(self.where(f"input {what} ({name!r}): expected {want}, "
                                            f"got {type_name(elem)}{why}"))
        return elem

    # -- nodes -------------------------------------------------------------------------

    def op(self, op_type: str, *inputs: str, hint: str | None = None, **attrs: Any) -> str:
        """Appends one single-output node; returns its output's name."""
        from onnx import helper

        out = self.fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=self.fresh(op_type), **attrs))
        return out

    def const(self, value: Any, elem: int) -> str:
        """A scalar initializer of ``elem`` holding ``value`` (converted with numpy: a
        Python float becomes the nearest float32 for FLOAT); shared within the expansion."""
        from onnx import numpy_helper

        array = np.asarray(value, dtype=_NP[elem])
        key = (elem, array.tobytes())
        if key not in self._consts:
            name = self.fresh("c")
            self.initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values: list[int]) -> str:
        """A 1-D int64 initializer (shapes, axes)."""
        from onnx import numpy_helper

        name = self.fresh("i")
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    def scalar(self, name: str) -> str:
        """``name`` (a one-element tensor of any rank) reshaped to rank 0, so it broadcasts
        without changing any other operand's rank."""
        if name not in self._scalars:
            self._scalars[name] = self.op("Reshape", name, self.ints([]), hint="scalar")
        return self._scalars[name]

    def ready(self) -> str:
        """A bool scalar, always true, that depends on every input of the node: ``not
        (s < s)`` for each name in :attr:`ordered_after` (the node's one-element inputs:
        ``R``, ``T``, ``loss_scale``), and ``z == 0`` for ``z``, an int64 0 read from one
        element of each of its other inputs (:func:`trainops.graph_deps.zero_of`).

        The fused node reads all its inputs before it writes any output. Its expansion
        must keep that order for in-place IOBinding (each state output bound to its
        input's buffer), so every output depends on this value (through
        :meth:`coefficient`). Without it the runtime may write a tensor's new value as
        soon as that tensor's OWN inputs exist: ``X_2`` as soon as ``G_2`` does, while
        the backward pass still reads ``X_2`` to compute ``G_1``; or overwrite ``step``
        (``step.new``, computed from an output, bound to ``step``'s buffer) before ``T =
        step + 1`` is read. Computed once per expansion."""
        if self._ready is None:
            from ..graph_deps import zero_of

            parts = [self.op("Not", self.op("Less", self.scalar(n), self.scalar(n)))
                     for n in self.ordered_after]
            rest = list(dict.fromkeys(x for x in self.node.input
                                      if x and x not in self.ordered_after))
            if rest and not self.float64:
                parts.append(self._all_read_float(rest))
            elif rest:
                zero = self.fresh("all_read")
                nodes = zero_of(rest, zero, MIN_OPSET)
                self.taken.update(o for n in nodes for o in n.output)
                self.nodes.extend(nodes)
                parts.append(self.op("Equal", zero, self.const(0, INT64)))
            token = parts[0]
            for p in parts[1:]:
                token = self.op("And", token, p)
            self._ready = token
        return self._ready

    def _all_read_float(self, values: list[str]) -> str:
        """A bool scalar, always true, reading one element of each of ``values``:
        :func:`~trainops.graph_deps.zero_of` in float32 instead of int64 (WebGPU has no
        int64 Concat / ReduceSum: the element read from each state would cross to the
        host every step)."""
        ones, flat = [], self.ints([-1])
        start, end = self.ints([0]), self.ints([1])
        for v in values:
            first = self.op("Slice", self.op("Reshape", v, flat), start, end, hint="first")
            ones.append(self.op("Cast", self.op("Cast", first, to=BOOL), to=FLOAT))
        count = self.op("ReduceSum", self.op("Concat", *ones, axis=0), keepdims=0)
        zero = self.const(0.0, FLOAT)
        return self.op("Equal", self.op("Mul", count, zero), zero, hint="all_read")

    def coefficient(self, value: float, elem: int) -> str:
        """The constant ``value`` of ``elem`` times a 1.0 computed from :meth:`ready`
        (the bits of ``value`` unchanged): a coefficient that orders its users after the
        node's one-element inputs."""
        if elem not in self._ones:
            self._ones[elem] = self.op("Cast", self.ready(), to=elem, hint="one")
        return self.op("Mul", self.const(value, elem), self._ones[elem], hint="k")

    def cast(self, name: str, src: int, dst: int) -> str:
        """``name`` converted from ``src`` to ``dst`` (no node when they are equal).

        A 16-bit ``name`` goes through a ``Reshape`` to its own shape first (the shape
        computed at run time): ONNX Runtime's CPU EP computes a float16 node that has no
        float16 kernel in float32 between two ``Cast`` nodes it inserts, and then drops
        such an inserted ``Cast`` to float16 when a ``Cast`` back to float32 follows, so
        the value read would be the unrounded float32 (a gradient that overflows float16
        would even read as finite). The fused kernels read the float16 tensor."""
        if src == dst:
            return name
        if src in (FLOAT16, BFLOAT16):
            shape = self.op("Add", self.op("Shape", name), self._runtime_zero(), hint="shape")
            name = self.op("Reshape", name, shape, hint="as_stored")
        return self.op("Cast", name, to=dst, hint="cast")

    def _runtime_zero(self) -> str:
        """An int64 scalar 0 read from the node's first input (a data dependency, which
        ONNX Runtime cannot fold into a constant; when that input is itself a 16-bit value
        :meth:`cast` loads, reading it here makes no cycle)."""
        if self._zero is None:
            from ..graph_deps import zero_of

            self._zero = self.fresh("runtime_zero")
            nodes = zero_of([self.node.input[0]], self._zero, MIN_OPSET)
            self.taken.update(o for n in nodes for o in n.output)
            self.nodes.extend(nodes)
        return self._zero

    def sqrt(self, name: str, elem: int) -> str:
        """``sqrt(name)``, correctly rounded: for float32 with ``sqrt="exact"`` (the
        default) through float64 (``Cast``, ``Sqrt``, ``Cast``: a double square root
        rounded to float is the correctly rounded float square root), because some
        runtimes' float ``Sqrt`` is not (onnxruntime 1.17's CPU EP: Eigen's fast
        reciprocal-square-root path, about 1 ulp off on a third of inputs, NaN for +Inf,
        0 for subnormals). ``sqrt="native"`` uses ``Sqrt`` on float32 as is, for EPs
        without float64 (bitwise only where that ``Sqrt`` is correctly rounded)."""
        if elem != FLOAT or self.sqrt_mode == "native":
            return self.op("Sqrt", name)
        wide = self.op("Sqrt", self.op("Cast", name, to=DOUBLE))
        return self.op("Cast", wide, to=FLOAT, hint="sqrt")

    # -- tests and logic that EPs without float64 run too ---------------------------------
    # WebGPU has no Or, Xor, IsInf, IsNaN or bool Where kernel (its And, Not, Equal, Abs
    # and Cast of bool do exist): with float64=False those are built from bools counted as
    # float 0/1, so that no node reading a state falls back to the CPU (the state would
    # cross to the host every step). No Not feeds a Where either (onnxruntime's CPU EP
    # fuses the two, swapping the operands). With float64 the nodes are the standard ones.

    def _true_count(self, *flags: str) -> str:
        """The number of true ``flags`` (bools) as a float."""
        total = self.op("Cast", flags[0], to=FLOAT)
        for f in flags[1:]:
            total = self.op("Add", total, self.op("Cast", f, to=FLOAT))
        return total

    def or_(self, a: str, b: str) -> str:
        """``a or b`` of bools."""
        if self.float64:
            return self.op("Or", a, b)
        return self.op("Greater", self._true_count(a, b), self.const(0.5, FLOAT), hint="or")

    def xor(self, a: str, b: str) -> str:
        """``a xor b`` of bools."""
        if self.float64:
            return self.op("Xor", a, b)
        return self.op("Equal", self._true_count(a, b), self.const(1.0, FLOAT), hint="xor")

    def is_inf(self, x: str, elem: int) -> str:
        """``x`` is +-Inf (``x`` of ``elem``)."""
        if self.float64:
            return self.op("IsInf", x)
        return self.op("Equal", self.op("Abs", x), self.const(np.inf, elem), hint="isinf")

    def is_nan(self, x: str) -> str:
        """``x`` is NaN (without float64: ``x == x`` is false)."""
        if self.float64:
            return self.op("IsNaN", x)
        return self.op("Less", self._true_count(self.op("Equal", x, x)), self.const(0.5, FLOAT),
                       hint="isnan")

    def select(self, cond: str, a: str, b: str, elem: int) -> str:
        """``cond ? a : b`` for floating-point ``a``, ``b`` of ``elem``, bit for bit.

        onnxruntime's CPU ``Where`` builds its result as ``x != 0 ? x : y`` from the two
        masked inputs, so a selected ``-0.0`` from ``a`` comes out ``+0.0`` (``b``'s zeros
        and every NaN keep their bits). Here that one case is put right by multiplying with
        -1 (``+0 * -1 = -0``; every other value is multiplied by 1, which keeps its bits).
        Meant for scalars; :func:`~trainops.portable.mixed.mixed_precision_adam` selects
        whole tensors with ``If`` instead."""
        one = self.const(1.0, elem)
        picked = self.op("Where", cond, a, b)
        negative_zero = self.op("And", self.op("Equal", a, self.const(0.0, elem)),
                                self.op("Less", self.op("Div", one, a), self.const(0.0, elem)))
        sign = self.op("Where", self.op("And", cond, negative_zero), self.const(-1.0, elem), one)
        return self.op("Mul", picked, sign, hint="select")

    def output(self, value: str, out: str, src: int, dst: int) -> None:
        """Makes ``value`` (of type ``src``) the node output ``out`` of type ``dst``: a
        final Cast when the types differ, else ``value``'s producer is renamed to ``out``
        in :meth:`finish`."""
        if src != dst:
            from onnx import helper

            self.nodes.append(helper.make_node("Cast", [value], [out], to=dst,
                                               name=self.fresh("Cast")))
        elif value in self._renames or any(value == o for o in self._renames.values()):
            raise AssertionError(f"{value} already renamed")
        else:
            self._renames[value] = out

    def finish(self) -> Expansion:
        """The expansion, with the pending renames applied to every node."""
        for n in self.nodes:
            for seq in (n.input, n.output):
                for k, name in enumerate(seq):
                    if name in self._renames:
                        seq[k] = self._renames[name]
        return Expansion(self.nodes, self.initializers)
