"""Gradient rules for elementwise ops: the variadic Sum/Mean/Max/Min, Clip, the
activations (HardSigmoid, HardSwish, Softplus, Elu, Selu, Celu, PRelu, Mish), Sin, Cos, and
the piecewise-constant Floor/Ceil/Round/Sign. Registered into :data:`.rules.RULES`.

Conventions at the points where the derivative is not defined (those of PyTorch):
Max/Min split the gradient evenly between the inputs that tie for the extremum (as
``torch.maximum``/``torch.minimum`` do for two); Clip passes the gradient to ``x`` on the
closed interval ``[min, max]``; the activations take the branch PyTorch's backward takes at
their kinks (HardSigmoid: 0 at the ends; HardSwish: ``x/3 + 1/2`` on ``[-3, 3]``; Elu, Selu,
Celu, PRelu: the negative branch at 0).
"""

from __future__ import annotations

from ..onnx_defs import TRAINOPS_DOMAIN
from .rules import Ctx, rule


# -- variadic ---------------------------------------------------------------------------

@rule("Sum")
def sum_(c: Ctx):
    return [c.unb(c.gy, i) if c.need(i) else None for i in range(len(c.node.input))]


@rule("Mean")
def mean(c: Ctx):
    n = len(c.node.input)
    g = c.gy if n == 1 else c.b.op("Div", [c.gy, c.b.scalar(float(n), c.x(0))])
    return [c.unb(g, i) if c.need(i) else None for i in range(n)]


@rule("Max", "Min")
def extremum(c: Ctx):
    """Each input where it equals the result gets ``dy / (number of inputs equal there)``."""
    b = c.b
    n = len(c.node.input)
    if n == 1:
        return [c.gy]
    y = c.y
    # x_i == y without Equal (floats need opset 11): y is the max, so x_i >= y says it.
    beaten = "Less" if c.node.op_type == "Max" else "Greater"
    masks = [b.op("Cast", [b.op("Not", [b.op(beaten, [x, y])])], to=b.dtype(c.x(0)))
             for x in c.node.input]
    share = b.op("Div", [c.gy, b.op("Sum", masks)])
    return [c.unb(b.op("Mul", [share, m]), i) if c.need(i) else None
            for i, m in enumerate(masks)]


# -- Clip -------------------------------------------------------------------------------

@rule("Clip")
def clip(c: Ctx):
    """``y = min(max(x, lo), hi)``. As PyTorch's clamp: x gets ``dy`` where
    ``lo <= x <= hi``; lo gets it where ``x < lo`` and ``lo < hi``; hi where ``x > hi`` or
    ``hi < lo``; min and max are attributes before opset 11 (no gradient), inputs after."""
    b = c.b
    x, gy = c.x(0), c.gy
    out: list = [None] * len(c.node.input)
    if b.opset < 11:
        lo_v, hi_v = c.attr("min"), c.attr("max")
        lo = b.scalar(lo_v, x) if lo_v is not None else None
        hi = b.scalar(hi_v, x) if hi_v is not None else None
    else:
        lo, hi = c.x(1), c.x(2)
    zero = b.scalar(0.0, x)
    conds = []
    if lo is not None:
        conds.append(b.op("Not", [b.op("Less", [x, lo])]))
    if hi is not None:
        conds.append(b.op("Not", [b.op("Greater", [x, hi])]))
    if c.need(0):
        if not conds:
            out[0] = gy
        else:
            inside = conds[0] if len(conds) == 1 else b.op("And", conds)
            out[0] = b.op("Where", [inside, gy, zero])

    def total(mask: str, like: str) -> str:
        s = b.reduce("ReduceSum", b.op("Where", [mask, gy, zero]), None, keepdims=0)
        return b.reshape_like(s, like)

    if c.need(1) and lo is not None:
        m = b.op("Less", [x, lo])
        if hi is not None:
            m = b.op("And", [m, b.op("Less", [lo, hi])])
        out[1] = total(m, lo)
    if c.need(2) and hi is not None:
        m = b.op("Greater", [x, hi])
        if lo is not None:
            m = b.op("Or", [m, b.op("Less", [hi, lo])])
        out[2] = total(m, hi)
    return out


# -- activations ------------------------------------------------------------------------

def _where_pos(c: Ctx, pos: str, neg: str) -> str:
    """``pos`` where x > 0, else ``neg``."""
    x = c.x(0)
    return c.b.op("Where", [c.b.op("Greater", [x, c.b.scalar(0.0, x)]), pos, neg])


@rule("HardSigmoid")
def hard_sigmoid(c: Ctx):
    b = c.b
    x = c.x(0)
    alpha, beta = float(c.attr("alpha", 0.2)), float(c.attr("beta", 0.5))
    if b.fuses(x, c.y):  # the same float32 operations in one com.trainops kernel
        return [b.op("HardSigmoidGrad", [c.gy, x], domain=TRAINOPS_DOMAIN, alpha=alpha, beta=beta)]
    u = b.op("Add", [b.op("Mul", [x, b.scalar(alpha, x)]), b.scalar(beta, x)])
    inside = b.op("And", [b.op("Greater", [u, b.scalar(0.0, x)]),
                          b.op("Less", [u, b.scalar(1.0, x)])])
    return [b.op("Where", [inside, b.op("Mul", [c.gy, b.scalar(alpha, x)]), b.scalar(0.0, x)])]


@rule("HardSwish")
def hard_swish(c: Ctx):
    """0 below -3, ``x/3 + 1/2`` on [-3, 3], 1 above (PyTorch's hardswish_backward)."""
    b = c.b
    x = c.x(0)
    if b.fuses(x, c.y):  # the same float32 operations in one com.trainops kernel
        return [b.op("HardSwishGrad", [c.gy, x], domain=TRAINOPS_DOMAIN)]
    s = lambda v: b.scalar(v, x)  # noqa: E731
    mid = b.op("Mul", [c.gy, b.op("Add", [b.op("Div", [x, s(3.0)]), s(0.5)])])
    upper = b.op("Where", [b.op("Greater", [x, s(3.0)]), c.gy, mid])
    return [b.op("Where", [b.op("Less", [x, s(-3.0)]), s(0.0), upper])]


@rule("Softplus")
def softplus(c: Ctx):
    return [c.b.op("Mul", [c.gy, c.b.op("Sigmoid", [c.x(0)])])]


@rule("Elu")
def elu(c: Ctx):
    b = c.b
    alpha = float(c.attr("alpha", 1.0))
    neg = b.op("Mul", [c.gy, b.op("Add", [c.y, b.scalar(alpha, c.x(0))])])  # alpha e^x
    return [_where_pos(c, c.gy, neg)]


@rule("Selu")
def selu(c: Ctx):
    b = c.b
    alpha = float(c.attr("alpha", 1.67326319217681884765625))
    gamma = float(c.attr("gamma", 1.05070102214813232421875))
    pos = b.op("Mul", [c.gy, b.scalar(gamma, c.x(0))])
    neg = b.op("Mul", [c.gy, b.op("Add", [c.y, b.scalar(gamma * alpha, c.x(0))])])
    return [_where_pos(c, pos, neg)]


@rule("Celu")
def celu(c: Ctx):
    b = c.b
    x = c.x(0)
    alpha = float(c.attr("alpha", 1.0))
    neg = b.op("Mul", [c.gy, b.op("Exp", [b.op("Div", [x, b.scalar(alpha, x)])])])
    return [_where_pos(c, c.gy, neg)]


@rule("PRelu")
def prelu(c: Ctx):
    b = c.b
    x, slope = c.x(0), c.x(1)
    out = [None, None]
    if c.need(0):
        out[0] = _where_pos(c, c.gy, b.op("Mul", [c.gy, slope]))
    if c.need(1):
        out[1] = c.unb(_where_pos(c, b.scalar(0.0, x), b.op("Mul", [c.gy, x])), 1)
    return out


@rule("Mish")
def mish(c: Ctx):
    """``y = x tanh(softplus(x))``: ``dy (t + x sigmoid(x) (1 - t^2))``, ``t = tanh(sp)``."""
    b = c.b
    x = c.x(0)
    t = b.op("Tanh", [b.op("Softplus", [x])])
    sech2 = b.op("Sub", [b.scalar(1.0, x), b.op("Mul", [t, t])])
    d = b.op("Add", [t, b.op("Mul", [b.op("Mul", [x, b.op("Sigmoid", [x])]), sech2])])
    return [b.op("Mul", [c.gy, d])]


@rule("Sin")
def sin(c: Ctx):
    return [c.b.op("Mul", [c.gy, c.b.op("Cos", [c.x(0)])])]


@rule("Cos")
def cos(c: Ctx):
    return [c.b.op("Neg", [c.b.op("Mul", [c.gy, c.b.op("Sin", [c.x(0)])])])]


@rule("Floor", "Ceil", "Round", "Sign")
def piecewise_constant(c: Ctx):
    """Zero almost everywhere (and undefined at the steps, where PyTorch also gives 0):
    nothing flows back, so no nodes are emitted; an x reached only through these gets
    zeros."""
    return [None]


