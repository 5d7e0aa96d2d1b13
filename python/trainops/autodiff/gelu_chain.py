"""The exact GELU as exporters write it below opset 20, ``x * (1 + erf(x / sqrt(2))) * 0.5``
as five nodes (``Div`` or ``Mul`` by ``1/sqrt(2)``, ``Erf``, ``Add`` of 1, two ``Mul``\\ s
in any of the three groupings torch's exporters and transformers' code give), found so
that the fused CPU step differentiates the whole chain by one ``com.trainops::GeluGrad``
of ``x``.

Node by node, the chain's gradient is about ten elementwise nodes over the activation
(the Erf's rule alone is Mul, Neg, Exp, Mul, Mul), and every intermediate of the forward
stays alive for them. Measured on torchvision's ConvNeXt (3 blocks of 384 and 3 of 768
channels at 32x32 and 16x16, batch 8; 2026-11-28, one thread): the chain's forward and
backward nodes were about 160 ms of a 413 ms step. With its intermediates read by nothing
else, onnxruntime's own graph optimizer also fuses the forward chain into one ``Gelu``
node of its contrib domain.

A chain qualifies when every intermediate has exactly one reader (the next node of the
chain), no intermediate is a value the caller asked about, and its constants are within
float32 rounding of ``sqrt(2)`` (or ``1/sqrt(2)``), 1 and 0.5.
"""

from __future__ import annotations

import math
from typing import Callable

import onnx

from .graph import Builder

__all__ = ["gelu_chains"]

_TOL = 2.0 ** -22  # relative: a float32 rounding of the constant, with room


def _near(v, want: float) -> bool:
    return v is not None and v.size == 1 and abs(float(v.reshape(-1)[0]) - want) <= _TOL * want


def gelu_chains(b: Builder, nodes: list[onnx.NodeProto], producer: dict[str, onnx.NodeProto],
                protected: set[str]) -> dict[int, tuple[str, str]]:
    """``id(last node) -> (x, y)`` for each exact-GELU chain in ``nodes`` (see the module
    text) whose ``x`` and ``y`` are float32 (GeluGrad's type); ``producer``: each value's
    node; ``protected``: values that must keep their own gradients (the differentiated
    inputs, the seeds)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            if i:
                readers.setdefault(i, []).append(n)

    def const(name: str, want: float) -> bool:
        return name not in protected and _near(b.constant_value(name), want)

    def only_reader(t: str) -> onnx.NodeProto | None:
        """The one reader of ``t``, when it has one and ``t`` is free to fold away."""
        r = readers.get(t, [])
        return r[0] if len(r) == 1 and t not in protected else None

    def other(n: onnx.NodeProto, t: str) -> str | None:
        """The Mul/Add's other input than ``t`` (None unless it has two and ``t`` is one)."""
        ins = list(n.input)
        if len(ins) != 2 or t not in ins:
            return None
        return ins[1] if ins[0] == t else ins[0]

    def std(n: onnx.NodeProto | None, op: str) -> bool:
        return n is not None and n.op_type == op and n.domain in ("", "ai.onnx")

    found: dict[int, tuple[str, str]] = {}
    for erf in nodes:
        if not std(erf, "Erf"):
            continue
        scaled = producer.get(erf.input[0])
        if only_reader(erf.input[0]) is not erf or scaled is None or len(scaled.input) != 2:
            continue
        if std(scaled, "Div") and const(scaled.input[1], math.sqrt(2)):
            x = scaled.input[0]
        elif std(scaled, "Mul") and const(scaled.input[1], 1 / math.sqrt(2)):
            x = scaled.input[0]
        elif std(scaled, "Mul") and const(scaled.input[0], 1 / math.sqrt(2)):
            x = scaled.input[1]
        else:
            continue
        add = only_reader(erf.output[0])
        if not std(add, "Add") or not const(other(add, erf.output[0]) or "", 1.0):
            continue
        last = _products(add.output[0], x, only_reader, other, const, producer, std)
        if last is None:
            continue
        y = last.output[0]
        if b.fuses(x, y):
            found[id(last)] = (x, y)
    return found


def _products(a: str, x: str, only_reader: Callable, other: Callable, const: Callable,
              producer: dict, std: Callable) -> onnx.NodeProto | None:
    """The last node of ``x * a * 0.5`` grouped as ``(x * a) * 0.5``, ``(x * 0.5) * a``
    or ``x * (a * 0.5)``, each product in either order; None if the Muls are not so."""
    m1 = only_reader(a)
    if not std(m1, "Mul"):
        return None
    p = other(m1, a)
    if p is None:
        return None
    if p == x:  # (x * a) * 0.5
        m2 = only_reader(m1.output[0])
        return m2 if std(m2, "Mul") and const(other(m2, m1.output[0]) or "", 0.5) else None
    if const(p, 0.5):  # x * (a * 0.5)
        m2 = only_reader(m1.output[0])
        return m2 if std(m2, "Mul") and other(m2, m1.output[0]) == x else None
    half = producer.get(p)  # (x * 0.5) * a
    if std(half, "Mul") and only_reader(p) is m1 and other(half, x) is not None \
            and const(other(half, x), 0.5):
        return m1
    return None
