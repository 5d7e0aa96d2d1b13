"""Gradient rules for the reductions ReduceMax, ReduceMin, ReduceL2, ReduceLogSumExp, and
for CumSum and TopK. Registered into :data:`.rules.RULES`.

Ties: ReduceMax/ReduceMin split the gradient evenly between the elements that tie for the
extremum (PyTorch's ``amax``/``amin``; ``max(dim)`` would give it to one index instead).
TopK passes the gradient to the elements its Indices output picked. ReduceL2 gives 0 where
the norm is 0 (PyTorch's ``norm`` backward)."""

from __future__ import annotations

from typing import Callable

from .rules import Ctx, rule


def _reduced(c: Ctx) -> tuple[list[int] | None, Callable[[str], str]]:
    """The reduced axes (None: all; []: none, with ``noop_with_empty_axes``, where the
    composite reductions still apply their elementwise steps: ReduceL2 gives ``|x|``) and a
    function putting them back as 1s into a tensor shaped like the output."""
    b = c.b
    axes = c.axes()
    if not axes:
        if c.attr("noop_with_empty_axes", 0):
            return [], lambda t: t
        axes = None
    if axes is not None:
        r = c.rank(c.x(0))
        axes = sorted(a + r if a < 0 else a for a in axes)
    keep = c.attr("keepdims", 1)

    def back(t: str) -> str:
        if keep or axes is None:  # kept as 1s, or a scalar: both broadcast
            return t
        return b.unsqueeze(t, axes)
    return axes, back


def _rest(c: Ctx) -> list:
    return [None] * (len(c.node.input) - 1)


@rule("ReduceMax", "ReduceMin")
def reduce_extremum(c: Ctx):
    b = c.b
    x = c.x(0)
    axes, back = _reduced(c)
    if axes == []:
        return [c.gy] + _rest(c)
    gy, y = back(c.gy), back(c.y)
    beaten = "Less" if c.node.op_type == "ReduceMax" else "Greater"
    mask = b.op("Cast", [b.op("Not", [b.op(beaten, [x, y])])], to=b.dtype(x))
    count = b.reduce("ReduceSum", mask, axes, keepdims=1)
    return [b.op("Mul", [mask, b.op("Div", [gy, count])])] + _rest(c)


@rule("ReduceL2")
def reduce_l2(c: Ctx):
    b = c.b
    x = c.x(0)
    _, back = _reduced(c)
    gy, y = back(c.gy), back(c.y)
    pos = b.op("Greater", [y, b.scalar(0.0, x)])
    safe = b.op("Where", [pos, y, b.scalar(1.0, x)])
    g = b.op("Mul", [gy, b.op("Div", [x, safe])])
    return [b.op("Where", [pos, g, b.scalar(0.0, x)])] + _rest(c)


@rule("ReduceLogSumExp")
def reduce_log_sum_exp(c: Ctx):
    b = c.b
    x = c.x(0)
    _, back = _reduced(c)
    gy, y = back(c.gy), back(c.y)
    return [b.op("Mul", [gy, b.op("Exp", [b.op("Sub", [x, y])])])] + _rest(c)


@rule("CumSum")
def cumsum(c: Ctx):
    """The running sum backwards: the same ``exclusive``, the other direction."""
    rev = int(c.attr("reverse", 0))
    return [c.b.op("CumSum", [c.gy, c.x(1)], exclusive=int(c.attr("exclusive", 0)),
                   reverse=1 - rev), None]


@rule("TopK")
def topk(c: Ctx):
    """dy scattered back to the positions of the Indices output (which has no gradient)."""
    b = c.b
    x = c.x(0)
    if c.gys[0] is None:
        return [None] * len(c.node.input)
    r = c.rank(x)
    axis = c.attr("axis", -1)
    axis = axis + r if axis < 0 else axis
    idx = c.node.output[1] if len(c.node.output) > 1 else ""
    if not idx:
        attrs = {a.name: c.attr(a.name) for a in c.node.attribute}
        _, idx = b.op("TopK", list(c.node.input), 2, **attrs)
    if b.opset < 9:
        raise c.fail("the gradient needs opset >= 9 (Scatter)")
    scatter = "ScatterElements" if b.opset >= 11 else "Scatter"
    return [b.op(scatter, [b.zeros_like(x), idx, c.gy], axis=axis)] + _rest(c)
