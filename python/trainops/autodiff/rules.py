"""One gradient (vector-Jacobian product) rule per ONNX op, registered in :data:`RULES`.

A rule gets a :class:`Ctx` (the forward node, the gradients of its outputs, which inputs
need a gradient, and the :class:`~trainops.autodiff.graph.Builder` to emit nodes with) and
returns one gradient name per input (``None`` where the input needs none). Every emitted
node is an ordinary default-domain ONNX op of the model's own opset.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

import onnx
from onnx import numpy_helper

from ..onnx_defs import TRAINOPS_DOMAIN
from .graph import FLOAT_TYPES, Builder, GradientError, attr, describe


class Ctx:
    def __init__(self, b: Builder, node: onnx.NodeProto, gys: list[str | None],
                 needs: list[bool], producer: dict[str, onnx.NodeProto] | None = None,
                 wrt: frozenset[str] | set[str] = frozenset()):
        self.b = b
        self.node = node
        self.gys = gys
        self.needs = needs
        self.producer = producer or {}  # the forward nodes' producers of each value
        self.wrt = wrt  # the values whose gradients are asked for

    @property
    def gy(self) -> str:
        return self.gys[0]

    def x(self, i: int) -> str | None:
        ins = self.node.input
        return ins[i] if i < len(ins) and ins[i] else None

    @property
    def y(self) -> str:
        return self.node.output[0]

    def need(self, i: int) -> bool:
        return i < len(self.needs) and self.needs[i]

    def attr(self, name, default=None):
        v = attr(self.node, name, default)
        return v.decode() if isinstance(v, bytes) else v

    def fail(self, why: str) -> GradientError:
        return GradientError(f"{describe(self.node)}: {why}")

    def rank(self, name: str) -> int:
        return self.b.rank(name, self.node)

    def unb(self, g: str, i: int) -> str:
        """``g`` (shaped like output 0) summed down to input ``i``'s shape."""
        return self.b.unbroadcast(g, self.b.shape(self.y), self.x(i))

    def const_ints(self, i: int, what: str) -> list[int] | None:
        """Input ``i`` as constant ints (an initializer or Constant), None if absent."""
        name = self.x(i)
        if name is None:
            return None
        v = self.b.constant_value(name)
        if v is None:
            raise self.fail(f"input {i} ({what}) must be a constant (initializer or Constant)")
        return [int(a) for a in np.asarray(v).reshape(-1)]

    def axes(self, input_index: int = 1) -> list[int] | None:
        """A reduction's axes: the attribute (older opsets) or the input."""
        a = self.attr("axes")
        if a is not None:
            return list(a)
        if self.x(input_index) is not None:
            return self.const_ints(input_index, "axes")
        return None


Rule = Callable[[Ctx], list]
RULES: dict[str, Rule] = {}


def rule(*op_types: str):
    def register(fn):
        for t in op_types:
            RULES[t] = fn
        return fn
    return register


# -- elementwise arithmetic ---------------------------------------------------------

@rule("Add")
def add(c: Ctx):
    return [c.unb(c.gy, 0) if c.need(0) else None,
            c.unb(c.gy, 1) if c.need(1) else None]


@rule("Sub")
def sub(c: Ctx):
    return [c.unb(c.gy, 0) if c.need(0) else None,
            c.unb(c.b.op("Neg", [c.gy]), 1) if c.need(1) else None]


def _silu_input(c: Ctx) -> int | None:
    """Which input of a ``Mul`` is ``x`` when the node is SiLU, ``Mul(x, Sigmoid(x))`` in
    either order (PyTorch's ``nn.SiLU`` as both exporters write it), else None. Not when the
    Sigmoid's output is itself asked for: its gradient needs this Mul's share."""
    for k in (0, 1):
        s = c.producer.get(c.x(1 - k) or "")
        if (s is not None and s.op_type == "Sigmoid" and s.domain in ("", "ai.onnx")
                and s.input[0] == c.x(k) and c.x(1 - k) not in c.wrt):
            return k
    return None


@rule("Mul")
def mul(c: Ctx):
    b = c.b
    k = _silu_input(c)
    if k is not None and c.need(k) and b.fuses(c.x(k), c.y):
        # One com.trainops kernel for SiLU's whole derivative, s + x s (1 - s): x's
        # gradient by this path, and none for Sigmoid's output by it (another reader of
        # Sigmoid's output still sends its own gradient through the Sigmoid rule).
        out = [None, None]
        out[k] = b.op("SiluGrad", [c.gy, c.x(k)], domain=TRAINOPS_DOMAIN)
        return out
    return [c.unb(b.op("Mul", [c.gy, c.x(1)]), 0) if c.need(0) else None,
            c.unb(b.op("Mul", [c.gy, c.x(0)]), 1) if c.need(1) else None]


@rule("Div")
def div(c: Ctx):
    b = c.b
    ga = c.unb(b.op("Div", [c.gy, c.x(1)]), 0) if c.need(0) else None
    gb = None
    if c.need(1):  # d(a/b)/db = -a/b^2 = -y/b
        gb = c.unb(b.op("Neg", [b.op("Mul", [c.gy, b.op("Div", [c.y, c.x(1)])])]), 1)
    return [ga, gb]


@rule("Neg")
def neg(c: Ctx):
    return [c.b.op("Neg", [c.gy])]


@rule("Pow")
def pow_(c: Ctx):
    b = c.b
    a, e = c.x(0), c.x(1)
    if c.need(1):
        raise c.fail("the gradient with respect to the exponent is not supported (the "
                     "exponent must be a constant or need no gradient)")
    known = b.constant_value(e)
    if b.dtype(e) != b.dtype(a):
        e = b.op("Cast", [e], to=b.dtype(a))
    if known is not None and known.size == 1 and float(known.reshape(-1)[0]) == 2.0:
        # x ** 2 (RMSNorm's, LayerNorm's variance): pow(a, 1) is a itself, so the same
        # bits without a Pow, which onnxruntime computes by std::pow per element
        return [c.unb(b.op("Mul", [b.op("Mul", [c.gy, e]), a]), 0), None]
    em1 = b.op("Sub", [e, b.scalar(1.0, a)])
    g = b.op("Mul", [b.op("Mul", [c.gy, e]), b.op("Pow", [a, em1])])
    return [c.unb(g, 0), None]


@rule("Sqrt")
def sqrt(c: Ctx):
    b = c.b
    return [b.op("Div", [b.op("Mul", [c.gy, b.scalar(0.5, c.y)]), c.y])]


@rule("Exp")
def exp(c: Ctx):
    return [c.b.op("Mul", [c.gy, c.y])]


@rule("Log")
def log(c: Ctx):
    return [c.b.op("Div", [c.gy, c.x(0)])]


@rule("Abs")
def abs_(c: Ctx):
    return [c.b.op("Mul", [c.gy, c.b.op("Sign", [c.x(0)])])]


@rule("Reciprocal")
def reciprocal(c: Ctx):
    b = c.b
    return [b.op("Neg", [b.op("Mul", [c.gy, b.op("Mul", [c.y, c.y])])])]


# -- activations ----------------------------------------------------------------------

@rule("Relu")
def relu(c: Ctx):
    b = c.b
    x = c.x(0)
    # (gy has y's type; emitted gradients carry no type of their own, so fuses() asks y.)
    if b.fuses(x, c.y):
        # ReluGrad reads Relu's output y (y > 0 exactly when x > 0), so x may be freed.
        return [b.op("ReluGrad", [c.gy, c.y], domain=TRAINOPS_DOMAIN)]
    return [b.op("Where", [b.op("Greater", [x, b.scalar(0.0, x)]), c.gy, b.scalar(0.0, x)])]


@rule("LeakyRelu")
def leaky_relu(c: Ctx):
    b = c.b
    x = c.x(0)
    alpha = c.attr("alpha", 0.01)
    if b.fuses(x, c.y):
        # With alpha > 0, y > 0 exactly when x > 0: read y then (x may be freed).
        y = c.y if alpha > 0 else x
        return [b.op("LeakyReluGrad", [c.gy, y], domain=TRAINOPS_DOMAIN, alpha=float(alpha))]
    return [b.op("Where", [b.op("Greater", [x, b.scalar(0.0, x)]), c.gy,
                           b.op("Mul", [c.gy, b.scalar(alpha, x)])])]


@rule("Sigmoid")
def sigmoid(c: Ctx):
    b = c.b
    y = c.y
    return [b.op("Mul", [c.gy, b.op("Mul", [y, b.op("Sub", [b.scalar(1.0, y), y])])])]


@rule("Tanh")
def tanh(c: Ctx):
    b = c.b
    y = c.y
    return [b.op("Mul", [c.gy, b.op("Sub", [b.scalar(1.0, y), b.op("Mul", [y, y])])])]


@rule("Erf")
def erf(c: Ctx):
    b = c.b
    x = c.x(0)
    e = b.op("Exp", [b.op("Neg", [b.op("Mul", [x, x])])])
    return [b.op("Mul", [c.gy, b.op("Mul", [e, b.scalar(2.0 / math.sqrt(math.pi), x)])])]


@rule("Gelu")
def gelu(c: Ctx):
    b = c.b
    x = c.x(0)
    s = lambda v: b.scalar(v, x)  # noqa: E731
    approx = c.attr("approximate", "none")
    if approx in ("none", "tanh") and b.fuses(x, c.y):
        return [b.op("GeluGrad", [c.gy, x], domain=TRAINOPS_DOMAIN, approximate=approx)]
    if approx == "none":
        # d/dx [x/2 (1 + erf(x/sqrt2))] = (1 + erf(x/sqrt2))/2 + x exp(-x^2/2)/sqrt(2 pi)
        cdf = b.op("Mul", [s(0.5), b.op("Add", [s(1.0), b.op("Erf", [
            b.op("Mul", [x, s(1 / math.sqrt(2))])])])])
        pdf = b.op("Mul", [b.op("Exp", [b.op("Mul", [b.op("Mul", [x, x]), s(-0.5)])]),
                           s(1 / math.sqrt(2 * math.pi))])
        d = b.op("Add", [cdf, b.op("Mul", [x, pdf])])
    elif approx == "tanh":
        k = math.sqrt(2 / math.pi)
        x2 = b.op("Mul", [x, x])
        u = b.op("Mul", [b.op("Mul", [x, s(k)]), b.op("Add", [s(1.0), b.op("Mul", [x2, s(0.044715)])])])
        t = b.op("Tanh", [u])
        du = b.op("Mul", [s(k), b.op("Add", [s(1.0), b.op("Mul", [x2, s(3 * 0.044715)])])])
        d = b.op("Add", [b.op("Mul", [s(0.5), b.op("Add", [s(1.0), t])]),
                         b.op("Mul", [b.op("Mul", [b.op("Mul", [s(0.5), x]),
                                                   b.op("Sub", [s(1.0), b.op("Mul", [t, t])])]), du])])
    else:
        raise c.fail(f"approximate={approx!r} is not a Gelu mode")
    return [b.op("Mul", [c.gy, d])]


def _axis(c: Ctx, default: int, name: str = "axis") -> int:
    axis = c.attr(name, default)
    return axis + c.rank(c.x(0)) if axis < 0 else axis


def _softmax_axis(c: Ctx) -> int:
    if c.b.opset < 13:
        raise c.fail(f"{c.node.op_type} before opset 13 (coerced to 2-D) is not supported")
    return _axis(c, -1)


def _fused_softmax_grad(c: Ctx, op_type: str, axis: int) -> str | None:
    """``com.trainops::SoftmaxGrad`` / ``LogSoftmaxGrad`` of (gy, y) when the Trainer asks
    for fused kernels and y is float32 (gy has y's type; the Builder does not know the
    types of the gradients it emits); None otherwise."""
    b = c.b
    if not b.fuses(c.y):
        return None
    return b.op(op_type, [c.gy, c.y], domain=TRAINOPS_DOMAIN, axis=axis)


@rule("Softmax")
def softmax(c: Ctx):
    b = c.b
    axis = _softmax_axis(c)
    fused = _fused_softmax_grad(c, "SoftmaxGrad", axis)
    if fused is not None:
        return [fused]
    y = c.y
    gyy = b.op("Mul", [c.gy, y])
    s = b.reduce("ReduceSum", gyy, [axis], keepdims=1)
    return [b.op("Sub", [gyy, b.op("Mul", [y, s])])]


@rule("LogSoftmax")
def log_softmax(c: Ctx):
    b = c.b
    axis = _softmax_axis(c)
    fused = _fused_softmax_grad(c, "LogSoftmaxGrad", axis)
    if fused is not None:
        return [fused]
    s = b.reduce("ReduceSum", c.gy, [axis], keepdims=1)
    return [b.op("Sub", [c.gy, b.op("Mul", [b.op("Exp", [c.y]), s])])]


# -- linear algebra -------------------------------------------------------------------

def _swap_last2(b: Builder, x: str, rank: int) -> str:
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return b.op("Transpose", [x], perm=perm)


def _static_last(b: Builder, a: str, w: str) -> bool:
    """True when ``w`` is a 2-D tensor of static shape whose rows match ``a``'s last axis."""
    a_dims, w_dims = b.shape(a), b.shape(w)
    return (a_dims is not None and w_dims is not None and len(w_dims) == 2
            and all(isinstance(d, int) for d in w_dims) and a_dims[-1] == w_dims[0])


def _transposed(c: Ctx, t: str) -> bool:
    """True when ``t`` is the forward's 2-D ``Transpose`` of another tensor."""
    p = c.producer.get(t)
    if p is None or p.op_type != "Transpose" or p.domain not in ("", "ai.onnx"):
        return False
    perm = [list(a.ints) for a in p.attribute if a.name == "perm"]
    return c.rank(t) == 2 and perm in ([], [[1, 0]])


def _gemm_t(b: Builder, a: str, m: str, w: str, trans_b: int = 0, fused: bool | None = None) -> str:
    """``a^T op(m)`` of 2-D ``a`` and ``m``, the gradient of weight ``w`` (``X^T dY`` or ``dY^T
    X``): on the fused CPU step trainops' ``BlockedMatMul`` when ``w`` has at least
    ``_BLOCKED_FROM`` elements, else (and on other placements) a ``Gemm``. ``fused``: the
    caller's ``Builder.fuses`` of the tensors ``a`` and ``m`` were made from (a Reshape's
    output has no type yet), by default ``a``'s and ``m``'s own."""
    dims = b.shape(w)
    big = dims is not None and all(isinstance(d, int) for d in dims) and math.prod(dims) >= _BLOCKED_FROM
    if big and (b.fuses(a, m) if fused is None else fused):
        return b.op("BlockedMatMul", [a, m], domain=TRAINOPS_DOMAIN, transA=1, transB=trans_b)
    return b.op("Gemm", [a, m], transA=1, **({"transB": trans_b} if trans_b else {}))


# Weight gradients of this many elements and more run on BlockedMatMul in the fused CPU
# step. MLAS (onnxruntime's GEMM, with both operands graph inputs) ran the large ones at
# 0.7-0.8x its rate and the small ones faster, on this machine's kind (Intel Xeon, one
# thread, 2026-11-28, the same minutes): 2048 x 960 x 1024 at 120 against 149 GFLOP/s, a
# language model's [49152, 960] weight at 80-85 (its own blocks of 2048 rows 143-160), but
# ConvNeXt's 384 x 96 x 8192 at 141 against 122.
_BLOCKED_FROM = 1 << 19


# An input gradient dX = dY W whose depth (W's rows, dY's last axis) is at least this many
# terms runs on BlockedMatMul on the fused CPU step: a language model's output layer,
# 49152 terms deep, where MLAS swept C through memory once per 256 of them (1024 x 960 x
# 49152 at 107-108 GFLOP/s against 127-141 in the same runs, one thread, 2026-11-28).
_DEEP = 8192


@rule("MatMul")
def matmul(c: Ctx):
    b = c.b
    A, B = c.x(0), c.x(1)
    ra, rb = c.rank(A), c.rank(B)
    gy = c.gy
    if ra == 1 and rb == 1:
        return [b.op("Mul", [gy, B]) if c.need(0) else None,
                b.op("Mul", [gy, A]) if c.need(1) else None]
    if ra == 2 and rb == 2:  # Gemm transposes as it reads: no Transpose node
        return [b.op("Gemm", [gy, B], transB=1) if c.need(0) else None,
                _gemm_t(b, A, gy, B, fused=b.fuses(A, B)) if c.need(1) else None]
    y_dims = b.shape(c.y)
    a2, b2 = A, B
    if ra == 1:
        a2 = b.unsqueeze(A, [0])
        gy = b.unsqueeze(gy, [-2])
    if rb == 1:
        b2 = b.unsqueeze(B, [-1])
        gy = b.unsqueeze(gy, [-1])
    ra2, rb2 = max(ra, 2), max(rb, 2)
    if y_dims is None:
        batch = None
    elif ra == 1 or rb == 1:
        batch = y_dims[:-1]
    else:
        batch = y_dims[:-2]
    a_dims, b_dims = b.shape(A), b.shape(B)

    def full(dims_last2):
        if batch is None or dims_last2 is None:
            return None
        return list(batch) + list(dims_last2)

    out = [None, None]
    if c.need(0):
        depth = b_dims[-1] if b_dims is not None and rb == 2 else None
        if ra >= 2 and isinstance(depth, int) and depth >= _DEEP and b.fuses(A, B):
            # dY W^T over a deep axis: W itself when B is the forward's W^T (torch's Linear)
            ga = b.op("BlockedMatMul", [gy, c.producer[B].input[0]], domain=TRAINOPS_DOMAIN) \
                if _transposed(c, B) else \
                b.op("BlockedMatMul", [gy, B], domain=TRAINOPS_DOMAIN, transB=1)
        else:
            ga = b.op("MatMul", [gy, _swap_last2(b, b2, rb2)])
        last = (a_dims[-2:] if ra >= 2 else [1, a_dims[0]]) if a_dims is not None else None
        if ra == 1:
            b.set_info(a2, b.dtype(A), [1] + list(a_dims) if a_dims is not None else None)
            g = b.unbroadcast(ga, full(last), a2)
            out[0] = b.op("Reshape", [g, b.shape_of(A)])
        else:
            out[0] = b.unbroadcast(ga, full(last), A)
    if c.need(1) and rb == 2 and ra >= 3 and b.fuses(A, B) and _static_last(b, A, B):
        # x[..., K] @ W[K, N] (a linear layer over a batch of sequences): dW as ONE Gemm over
        # the flattened rows, not a batched MatMul of per-sample products and a ReduceSum.
        k, n = b.shape(B)
        a2, g2 = b.op("Reshape", [A, b.ints([-1, k])]), b.op("Reshape", [gy, b.ints([-1, n])])
        if _transposed(c, B):
            # B = W^T with W [N, K] (torch's Linear): dW = dY^T X, transposed back for the
            # Transpose's own rule to cancel
            out[1] = b.op("Transpose", [_gemm_t(b, g2, a2, B, fused=True)], perm=[1, 0])
        else:
            out[1] = _gemm_t(b, a2, g2, B, fused=True)
    elif c.need(1):
        gb = b.op("MatMul", [_swap_last2(b, a2, ra2), gy])
        last = (b_dims[-2:] if rb >= 2 else [b_dims[0], 1]) if b_dims is not None else None
        if rb == 1:
            b.set_info(b2, b.dtype(B), list(b_dims) + [1] if b_dims is not None else None)
            g = b.unbroadcast(gb, full(last), b2)
            out[1] = b.op("Reshape", [g, b.shape_of(B)])
        else:
            out[1] = b.unbroadcast(gb, full(last), B)
    return out


@rule("Gemm")
def gemm(c: Ctx):
    b = c.b
    A, B, C = c.x(0), c.x(1), c.x(2)
    alpha = float(c.attr("alpha", 1.0))
    beta = float(c.attr("beta", 1.0))
    ta, tb = int(c.attr("transA", 0)), int(c.attr("transB", 0))
    gy = c.gy
    out = [None, None, None]
    if c.need(0):
        if not ta:
            out[0] = b.op("Gemm", [gy, B], alpha=alpha, transB=1 - tb)
        else:
            out[0] = b.op("Gemm", [B, gy], alpha=alpha, transA=tb, transB=1)
    if c.need(1):
        if not tb and not ta and alpha == 1.0:
            out[1] = _gemm_t(b, A, gy, B, fused=b.fuses(A, B))
        elif not tb:
            out[1] = b.op("Gemm", [A, gy], alpha=alpha, transA=1 - ta)
        elif alpha == 1.0:
            out[1] = _gemm_t(b, gy, A, B, trans_b=ta, fused=b.fuses(A, B))
        else:
            out[1] = b.op("Gemm", [gy, A], alpha=alpha, transA=1, transB=ta)
    if C is not None and c.need(2):
        g = gy if beta == 1.0 else b.op("Mul", [gy, b.scalar(beta, C)])
        out[2] = c.unb(g, 2)
    return out


# -- shape and data movement ------------------------------------------------------------

@rule("Identity")
def identity(c: Ctx):
    return [c.gy]


@rule("Dropout")
def dropout(c: Ctx):
    """Inference (before opset 12, no ``training_mode``, or a constant false one) and a
    constant ratio of 0 (torch's ``nn.Dropout(p=0.0)``, torchvision's ViT default, exported
    in training mode: every element kept, scale 1): the identity. Training: ``dy * mask *
    scale`` with the forward's ``scale = 1 / (1 - ratio)`` (float32; float64 for double
    data), as ``Where(mask, dy * scale, 0)``; a ``training_mode`` known only at run time
    picks ``scale`` or 1 (mask all true)."""
    b = c.b
    out: list = [None] * len(c.node.input)
    if not c.need(0):
        return out
    mode = c.x(2) if b.opset >= 12 else None
    on = None if mode is None else b.constant_value(mode)
    ratio = b.constant_value(c.x(1)) if mode is not None and c.x(1) else None
    zero = ratio is not None and np.asarray(ratio).size == 1 and float(np.asarray(ratio).reshape(-1)[0]) == 0.0
    if mode is None or zero or (on is not None and not bool(np.asarray(on).reshape(-1)[0])):
        out[0] = c.gy
        return out
    if len(c.node.output) < 2 or not c.node.output[1]:
        raise c.fail("in training mode its gradient needs the mask (output 1); give the "
                     "node a mask output")
    dt = b.dtype(c.x(0))
    calc = np.float64 if dt == onnx.TensorProto.DOUBLE else np.float32
    one = b.const(np.asarray(1.0, calc), hint="one")
    ratio = c.x(1)
    r = b.op("Cast", [ratio], to=_tensor_type(calc)) if ratio else \
        b.const(np.asarray(0.5, calc), hint="ratio")
    scale = b.op("Div", [one, b.op("Sub", [one, r])])
    if on is None:  # training_mode is known only when the graph runs
        scale = b.op("Where", [mode, scale, one])
    if _tensor_type(calc) != dt:
        scale = b.op("Cast", [scale], to=dt)
    kept = b.op("Mul", [c.gy, scale])
    out[0] = b.op("Where", [c.node.output[1], kept, b.scalar(0.0, c.x(0))])
    return out


def _tensor_type(np_dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(np_dtype))


def _cast_back(c: Ctx, dst: int | None) -> str | None:
    """The gradient of a cast of input 0 to ``dst``: between float types the output's
    gradient cast back to input 0's type (itself when the types are the same: no Cast from
    a type to itself is emitted); a cast to or from an integer or boolean type stops the
    gradient (None)."""
    src = c.b.dtype(c.x(0))
    if src is None:
        raise c.fail(f"the element type of its input '{c.x(0)}' is unknown (onnx shape "
                     "inference could not find it)")
    if dst is None:
        raise c.fail(f"the element type of its output '{c.y}' is unknown (onnx shape "
                     "inference could not find it)")
    if src not in FLOAT_TYPES or dst not in FLOAT_TYPES:
        return None
    return c.gy if src == dst else c.b.op("Cast", [c.gy], to=src)


@rule("Cast")
def cast(c: Ctx):
    """Between float types the gradient cast back; a cast to or from an integer or
    boolean type stops the gradient (its input gets none)."""
    return [_cast_back(c, c.attr("to"))]


@rule("CastLike")
def cast_like(c: Ctx):
    """Input 0 as for Cast (to ``target_type``'s element type); ``target_type`` gives
    only its type, so it gets no gradient (and the walks leave it out:
    :data:`~.graph.TYPE_ONLY_INPUTS`)."""
    dst = c.b.dtype(c.x(1)) if c.x(1) else None
    return [_cast_back(c, dst if dst is not None else c.b.dtype(c.y)), None]


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(c: Ctx):
    return [c.b.reshape_like(c.gy, c.x(0))] + [None] * (len(c.node.input) - 1)


@rule("Transpose")
def transpose(c: Ctx):
    perm = c.attr("perm")
    if perm is None:
        perm = list(reversed(range(c.rank(c.x(0)))))
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return [c.b.op("Transpose", [c.gy], perm=inv)]


@rule("Expand")
def expand(c: Ctx):
    return [c.unb(c.gy, 0), None]


@rule("Concat")
def concat(c: Ctx):
    b = c.b
    axis = c.attr("axis")
    rank = c.rank(c.x(0))
    axis = axis + rank if axis < 0 else axis
    sizes = []
    for name in c.node.input:
        s = b.shape(name)
        if s is not None and isinstance(s[axis], int):
            sizes.append(b.ints([s[axis]]))
        else:
            sizes.append(b.op("Slice", [b.op("Shape", [name]), b.ints([axis]), b.ints([axis + 1])]))
    n = len(c.node.input)
    if n == 1:
        return [c.gy]
    split = b.op("Concat", sizes, axis=0)
    if b.opset >= 13:
        parts = b.op("Split", [c.gy, split], n, axis=axis)
    else:
        raise c.fail("Concat's gradient needs opset >= 13")
    return [p if c.need(i) else None for i, p in enumerate(parts)]


@rule("Split")
def split(c: Ctx):
    b = c.b
    axis = c.attr("axis", 0)
    parts = [g if g is not None else b.zeros_like(y) for g, y in zip(c.gys, c.node.output)]
    return [b.op("Concat", parts, axis=axis)] + [None] * (len(c.node.input) - 1)


def _index_grid(b: Builder, x: str) -> tuple[str, str]:
    """An int64 tensor shaped like ``x`` holding each element's flat index, and the
    element count as a 1-D tensor."""
    shape = b.shape_of(x)
    n = b.reduce("ReduceProd", shape, None, keepdims=0)
    idx = b.op("Range", [b.const(np.int64(0)), n, b.const(np.int64(1))])
    return b.op("Reshape", [idx, shape]), b.op("Reshape", [n, b.ints([1])])


def _scatter_flat(b: Builder, x: str, flat_idx: str, g: str, add: bool) -> str:
    """zeros like ``x`` with ``g``'s elements written (or added) at ``flat_idx``."""
    grid_n = b.op("Reshape", [b.reduce("ReduceProd", b.shape_of(x), None, keepdims=0), b.ints([1])])
    zeros = b.op("ConstantOfShape", [grid_n],
                 value=numpy_helper.from_array(np.zeros([1], b.np_dtype(x)), "zero"))
    kw = {"reduction": "add"} if add else {}
    flat = b.op("ScatterElements", [zeros, b.op("Reshape", [flat_idx, b.ints([-1])]),
                                    b.op("Reshape", [g, b.ints([-1])])], axis=0, **kw)
    return b.op("Reshape", [flat, b.shape_of(x)])


def _one_hot(b: Builder, indices: str, depth: str, axis: int, like: str) -> str:
    """OneHot in ``like``'s float type (onnxruntime's OneHot makes float32, not double)."""
    dt = b.np_dtype(like)
    values = b.const(np.array([0, 1], np.float32))
    out = b.op("OneHot", [indices, depth, values], axis=axis)
    return out if dt == np.float32 else b.op("Cast", [out], to=b.dtype(like))


def _slice_pads(c: Ctx) -> list[int] | None:
    """Pad's ``pads`` that put a Slice's output back in place: for constant starts, ends,
    axes and unit steps over axes of known length (rotary embeddings' halves), else None."""
    b = c.b
    ins = list(c.node.input) + [""] * (5 - len(c.node.input))
    vals = [b.constant_value(n) if n else None for n in ins[1:]]
    if any(v is None for n, v in zip(ins[1:], vals) if n):
        return None
    starts, ends, axes, steps = vals
    if starts is None or ends is None or (steps is not None and np.any(steps != 1)):
        return None  # (before opset 10 the bounds are attributes: the general form)
    shape = b.shape(c.x(0))
    if shape is None:
        return None
    r = len(shape)
    axes = range(len(starts)) if axes is None else [int(a) + r if a < 0 else int(a)
                                                     for a in axes]
    pads = [0] * (2 * r)
    for a, s0, e0 in zip(axes, starts.reshape(-1), ends.reshape(-1)):
        d = shape[a]
        if not isinstance(d, int) or d < 0:
            return None
        s = min(max(int(s0) + d if s0 < 0 else int(s0), 0), d)
        e = max(min(max(int(e0) + d if e0 < 0 else int(e0), 0), d), s)
        pads[a], pads[r + a] = s, d - e
    return pads


@rule("Slice")
def slice_(c: Ctx):
    b = c.b
    pads = _slice_pads(c)
    if pads is not None:  # the output placed back among zeros: no index grid, no scatter
        return [b.op("Pad", [c.gy, b.ints(pads)], mode="constant")] + \
            [None] * (len(c.node.input) - 1)
    grid, _ = _index_grid(b, c.x(0))
    picked = b.op("Slice", [grid] + list(c.node.input[1:]))
    return [_scatter_flat(b, c.x(0), picked, c.gy, add=False)] + [None] * (len(c.node.input) - 1)


def _gather_scatter(c: Ctx, gy: str, idx: str, depth: str, d_shape: str, axis: int,
                    r: int) -> list:
    """Gather's gradient as dY added into zeros at the gathered rows (ScatterND with
    reduction 'add', opset >= 16): a token embedding's gradient costs the tokens' rows, where
    the OneHot form multiplies a [vocabulary, tokens] matrix (BERT's 30522-word table: 24 G
    multiply-adds and a 125 MB OneHot per step). ``gy`` has the index dimensions in front.
    onnxruntime's ScatterND adds in float32 and float64 only, so other types keep the OneHot
    form. Negative indices are made positive (the spec allows them; not every EP does)."""
    b = c.b
    if axis == 0 and b.fuses(c.x(0)):
        # trainops' GatherGrad: the rows written once and added into by row blocks across
        # the threads (onnxruntime's ScatterND copies a zero table and adds on one thread:
        # 17 ms of BERT's step); negative indices are its own to count from the end.
        if b.dtype(idx) != onnx.TensorProto.INT64:
            idx = b.op("Cast", [idx], to=onnx.TensorProto.INT64)
        g = b.op("GatherGrad", [d_shape, idx, gy], domain=TRAINOPS_DOMAIN)
        b.scatters[g] = lambda base: b.op("GatherGrad", [d_shape, idx, gy, base], domain=TRAINOPS_DOMAIN)
        return [g, None]
    zero = b.const(np.int64(0))
    q = c.rank(idx)
    n = b.op("Squeeze", [depth])  # a scalar: a scalar index stays one
    idx = b.op("Where", [b.op("Less", [idx, zero]), b.op("Add", [idx, n]), idx])
    idx = b.unsqueeze(idx, [q])  # one coordinate per index: whole slices
    value = numpy_helper.from_array(np.zeros([1], b.np_dtype(c.x(0))), "zero")
    if axis == 0:
        zeros = b.op("ConstantOfShape", [d_shape], value=value)
        g = b.op("ScatterND", [zeros, idx, gy], reduction="add")
        b.scatters[g] = lambda base: b.op("ScatterND", [base, idx, gy], reduction="add")
        return [g, None]
    moved = b.op("Concat", [depth, b.op("Slice", [d_shape, b.ints([0]), b.ints([axis])]),
                            b.op("Slice", [d_shape, b.ints([axis + 1]), b.ints([r])])], axis=0)
    zeros = b.op("ConstantOfShape", [moved], value=value)
    g = b.op("ScatterND", [zeros, idx, gy], reduction="add")  # [V] + pre + post
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, r))
    return [b.op("Transpose", [g], perm=perm), None]


@rule("Gather")
def gather(c: Ctx):
    b = c.b
    data, idx = c.x(0), c.x(1)
    r = c.rank(data)
    axis = c.attr("axis", 0)
    axis = axis + r if axis < 0 else axis
    q = c.rank(idx)
    gy = c.gy
    if axis != 0:  # move the index dimensions to the front: gy is pre + I + post
        perm = list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, r + q - 1))
        gy = b.op("Transpose", [gy], perm=perm)
    d_shape = b.shape_of(data)
    depth = b.op("Slice", [d_shape, b.ints([axis]), b.ints([axis + 1])])
    if b.opset >= 16 and b.np_dtype(data) in (np.float32, np.float64):
        return _gather_scatter(c, gy, idx, depth, d_shape, axis, r)
    flat_idx = b.op("Reshape", [idx, b.ints([-1])])
    onehot = _one_hot(b, flat_idx, depth, 0, data)  # [V, numel(I)]
    g2 = b.op("Reshape", [gy, b.op("Concat", [b.op("Reshape", [
        b.reduce("ReduceProd", b.op("Shape", [idx]), None, keepdims=0), b.ints([1])]),
        b.ints([-1])], axis=0)])
    g = b.op("MatMul", [onehot, g2])  # [V, rest]
    if axis == 0:
        return [b.op("Reshape", [g, d_shape]), None]
    # g is [V] + pre + post laid flat; reshape to that order, then move V back.
    rest = [b.op("Slice", [d_shape, b.ints([axis]), b.ints([axis + 1])]),
            b.op("Slice", [d_shape, b.ints([0]), b.ints([axis])]),
            b.op("Slice", [d_shape, b.ints([axis + 1]), b.ints([r])])]
    g = b.op("Reshape", [g, b.op("Concat", rest, axis=0)])
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, r))
    return [b.op("Transpose", [g], perm=perm), None]


@rule("Where")
def where(c: Ctx):
    b = c.b
    cond = c.x(0)
    out = [None, None, None]
    if c.need(1):
        out[1] = c.unb(b.op("Where", [cond, c.gy, b.scalar(0.0, c.y)]), 1)
    if c.need(2) and _nan_guarded_softmax(c):
        # torch's attention decomposition zeroes a softmax's NaN rows (Where(IsNaN(s), 0,
        # s)): a softmax row is NaN in every element or in none, and the Softmax gradient
        # of a NaN row is NaN whatever dY is, so dY passing unmasked changes no result and
        # saves a single-threaded Where over the attention probabilities (10 ms a layer in
        # the bench's Llama).
        out[2] = c.gy
    elif c.need(2):
        out[2] = c.unb(b.op("Where", [cond, b.scalar(0.0, c.y), c.gy]), 2)
    return out


def _nan_guarded_softmax(c: Ctx) -> bool:
    """True for ``Where(IsNaN(s), 0, s)`` with ``s`` a Softmax's output, all one shape."""
    b, s = c.b, c.x(2)
    guard, soft = c.producer.get(c.x(0)), c.producer.get(s)
    zero = b.constant_value(c.x(1)) if c.x(1) else None
    return (guard is not None and guard.op_type == "IsNaN" and guard.input[0] == s
            and soft is not None and soft.op_type == "Softmax" and soft.domain in ("", "ai.onnx")
            and zero is not None and np.asarray(zero).size == 1 and float(np.asarray(zero).reshape(-1)[0]) == 0.0
            and b.shape(s) is not None and b.shape(s) == b.shape(c.y))


# -- reductions ---------------------------------------------------------------------

def _reduce_back(c: Ctx) -> tuple[str, list[int] | None]:
    """gy broadcast back over the reduced axes (still to be expanded); the axes."""
    b = c.b
    x = c.x(0)
    axes = c.axes()
    if not axes:
        if c.attr("noop_with_empty_axes", 0):
            return c.gy, []
        return c.gy, None  # all axes: keepdims or scalar, both broadcast
    r = c.rank(x)
    axes = sorted(a + r if a < 0 else a for a in axes)
    gy = c.gy
    if not c.attr("keepdims", 1):
        gy = b.unsqueeze(gy, axes)
    return gy, axes


@rule("ReduceSum")
def reduce_sum(c: Ctx):
    b = c.b
    gy, axes = _reduce_back(c)
    if axes == []:
        return [gy] + [None] * (len(c.node.input) - 1)
    return [b.op("Expand", [gy, b.shape_of(c.x(0))])] + [None] * (len(c.node.input) - 1)


@rule("ReduceMean")
def reduce_mean(c: Ctx):
    b = c.b
    x = c.x(0)
    gy, axes = _reduce_back(c)
    if axes == []:
        return [gy] + [None] * (len(c.node.input) - 1)
    xs = b.shape(x)
    if axes is None:
        axes = list(range(c.rank(x)))
    if xs is not None and all(isinstance(xs[a], int) for a in axes):
        count = b.scalar(float(np.prod([xs[a] for a in axes])), x)
    else:
        count = b.op("Cast", [b.op("Div", [b.op("Size", [x]), b.op("Size", [c.y])])],
                     to=b.dtype(x))
    g = b.op("Expand", [b.op("Div", [gy, count]), b.shape_of(x)])
    return [g] + [None] * (len(c.node.input) - 1)


# -- convolution and pooling ------------------------------------------------------------

def _spatial(c: Ctx, x: str, what: str) -> list[int]:
    s = c.b.shape(x)
    if s is None or len(s) < 3 or not all(isinstance(d, int) for d in s[2:]):
        raise c.fail(f"the gradient needs the {what}'s spatial dimensions statically "
                     f"(tensor '{x}' has shape {s})")
    return list(s[2:])


def _pads(c: Ctx, in_sp, k, strides, dil) -> list[int]:
    n = len(in_sp)
    auto = c.attr("auto_pad", "NOTSET")
    pads = list(c.attr("pads", [0] * (2 * n)))
    if auto in ("NOTSET", "VALID"):
        return pads if auto == "NOTSET" else [0] * (2 * n)
    begin, end = [], []
    for i in range(n):
        out = -(-in_sp[i] // strides[i])
        total = max(0, (out - 1) * strides[i] + (k[i] - 1) * dil[i] + 1 - in_sp[i])
        lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
        begin.append(lo)
        end.append(total - lo)
    return begin + end


def _out_sizes(in_sp, k, strides, dil, pads, ceil=False):
    n = len(in_sp)
    out = []
    for i in range(n):
        span = in_sp[i] + pads[i] + pads[i + n] - ((k[i] - 1) * dil[i] + 1)
        o = (-(-span // strides[i]) if ceil else span // strides[i]) + 1
        out.append(o)
    return out


def _conv_transpose(c: Ctx, g: str, w: str, in_sp, k, strides, dil, pads, group, out_sp):
    """The adjoint of a convolution: ``g`` scattered back onto the input's grid."""
    n = len(in_sp)
    opad = []
    for i in range(n):
        produced = strides[i] * (out_sp[i] - 1) + (k[i] - 1) * dil[i] + 1 - pads[i] - pads[i + n]
        opad.append(in_sp[i] - produced)
    if any(p < 0 for p in opad):
        raise c.fail("cannot map the gradient back onto the input (ceil_mode windows past the end)")
    kw = {}
    if any(opad):
        if any(p >= max(s, d) for p, s, d in zip(opad, strides, dil)):
            # Input rows that no window reads: pad the result with zeros instead.
            kw["pads"] = pads
            res = c.b.op("ConvTranspose", [g, w], strides=strides, dilations=dil, group=group, **kw)
            n_pad = [0, 0] + [0] * n + [0, 0] + [p for p in opad]
            return c.b.op("Pad", [res, c.b.ints(n_pad)])
        kw["output_padding"] = opad
    return c.b.op("ConvTranspose", [g, w], strides=strides, dilations=dil, pads=pads,
                  group=group, **kw)


def _input_grad_kernel(w_shape, out_sp) -> bool:
    """True where com.trainops::ConvInputGrad beats onnxruntime's ConvTranspose for dX:
    few output positions per sample (<= 32) and a long column of the product (C/group x
    kernel >= 1024). Measured per node at one thread (2026-11-28): resnet18's layer4 3x3
    gradients (4x4 grid, 2304-4608 rows) 1.4-1.6x faster; on larger grids (8x8 and up)
    within -12%..+5% of ConvTranspose, and slower on every short column (pointwise
    convolutions of mobilenet_v3_small, 16-32 channels of the small residual CNN: up to
    1.7x slower), so those keep ConvTranspose."""
    column = (w_shape[1] if len(w_shape) > 1 else 0) * math.prod(w_shape[2:])
    return math.prod(out_sp) <= 32 and column >= 1024


@rule("Conv")
def conv(c: Ctx):
    b = c.b
    X, W, B = c.x(0), c.x(1), c.x(2)
    in_sp = _spatial(c, X, "input")
    w_shape = b.shape(W)
    if w_shape is None or not all(isinstance(d, int) for d in w_shape):
        raise c.fail(f"the gradient needs the weight's shape statically ('{W}': {w_shape})")
    n = len(in_sp)
    k = list(c.attr("kernel_shape", w_shape[2:]))
    strides = list(c.attr("strides", [1] * n))
    dil = list(c.attr("dilations", [1] * n))
    group = int(c.attr("group", 1))
    pads = _pads(c, in_sp, k, strides, dil)
    out_sp = _out_sizes(in_sp, k, strides, dil, pads)
    gy = c.gy
    out = [None, None, None]
    pointwise = b.fused and group == 1 and all(v == 1 for v in k + strides) and not any(pads)
    # One input channel per group, 2-d: trainops' direct depthwise kernel for dX and dW
    # (docs/ops/gradients-depthwise.md: 1.8-3.3x ConvTranspose + ConvWeightGrad there).
    fused_dw = n == 2 and group > 1 and w_shape[1] == 1 and b.fuses(X, W, c.y)
    if fused_dw and (c.need(0) or c.need(1)):
        names = [b.fresh("dX") if c.need(0) else "", b.fresh("dW") if c.need(1) else ""]
        dx, dw = b.op("DepthwiseConvGrad", [gy, X, W], names, domain=TRAINOPS_DOMAIN,
                      kernel_shape=k, strides=strides, pads=pads, dilations=dil, group=group)
        out[0], out[1] = dx or None, dw or None
    elif c.need(0) and b.fuses(X, W, c.y) and _input_grad_kernel(w_shape, out_sp):
        xs = b.shape(X)
        shape = (b.ints(xs) if xs is not None and all(isinstance(d, int) for d in xs)
                 else b.op("Shape", [X]))
        out[0] = b.op("ConvInputGrad", [gy, W, shape], domain=TRAINOPS_DOMAIN, kernel_shape=k,
                      strides=strides, pads=pads, dilations=dil, group=group)
    elif c.need(0) and pointwise:
        # A pointwise convolution's dX = W^T dY per sample: onnxruntime's MatMul (the same
        # MLAS product, the same bits) threads where its ConvTranspose mostly does not:
        # mobilenet_v3_small's 40 pointwise gradients 1.0-1.4x at one thread, 1.1-2.1x at two.
        co, ci = w_shape[0], w_shape[1]
        wt = b.op("Transpose", [b.op("Reshape", [W, b.ints([co, ci])])], perm=[1, 0])
        dx = b.op("MatMul", [wt, b.op("Reshape", [gy, b.ints([0, co, -1])])])
        out[0] = b.op("Reshape", [dx, b.shape_of(X)])
    elif c.need(0):
        # onnxruntime's ConvTranspose (MLAS, AVX-512) everywhere else, and in the portable
        # and device steps (docs/ops/gradients-conv.md).
        out[0] = _conv_transpose(c, gy, W, in_sp, k, strides, dil, pads, group, out_sp)
    if c.need(1) and pointwise and b.fuses(X, W, c.y) and math.prod(out_sp) >= 64:
        # A pointwise convolution over 64 positions or more: dW = sum_n dY[n] X[n]^T as a
        # batched MatMul (MLAS, threaded over the batch) and a sum over the batch:
        # efficientnet_b0's and mobilenet_v3_small's 8x8 to 64x64 grids 1.2-3.6x
        # ConvWeightGrad at one thread, 1.2-5.4x at two (per node, the same process); on
        # 4x4 grids ConvWeightGrad is 2x faster and stays.
        co, ci = w_shape[0], w_shape[1]
        xt = b.op("Transpose", [b.op("Reshape", [X, b.ints([0, ci, -1])])], perm=[0, 2, 1])
        per_sample = b.op("MatMul", [b.op("Reshape", [gy, b.ints([0, co, -1])]), xt])
        out[1] = b.op("Reshape", [b.reduce("ReduceSum", per_sample, [0], keepdims=0), b.ints(w_shape)])
    elif c.need(1) and not fused_dw and b.fuses(X, W, c.y):
        # trainops' kernel (im2col + GEMM over the batch): 1.5-1.8x the batch-as-channels Conv.
        out[1] = b.op("ConvWeightGrad", [X, gy], domain=TRAINOPS_DOMAIN, kernel_shape=k,
                      strides=strides, pads=pads, dilations=dil, group=group)
    elif c.need(1) and not fused_dw:
        # dW[co, ci, k] = sum_{n, o} gy[n, co, o] X[n, ci, o*s + k*d - p]: a convolution of
        # X (batch as channels) with gy (batch as channels), strides and dilations swapped.
        perm = [1, 0] + list(range(2, n + 2))
        xt = b.op("Transpose", [X], perm=perm)       # [C_in, N, sp]
        gt = b.op("Transpose", [gy], perm=perm)      # [C_out, N, osp]
        gw = b.op("Conv", [xt, gt], strides=dil, dilations=strides, pads=pads)  # [C_in, C_out, >=k]
        gw = b.op("Slice", [gw, b.ints([0] * n), b.ints(k), b.ints(list(range(2, n + 2)))])
        c_out, cig = w_shape[0], w_shape[1]
        if group == 1:
            out[1] = b.op("Transpose", [gw], perm=perm)
        else:
            cog = c_out // group
            # [g, cig, g, cog, k]: keep the diagonal blocks (input group == output group).
            g5 = b.op("Reshape", [gw, b.ints([group, cig, group, cog] + k)])
            eye = np.eye(group, dtype=b.np_dtype(W)).reshape([group, 1, group, 1] + [1] * n)
            diag = b.reduce("ReduceSum", b.op("Mul", [g5, b.const(eye)]), [0], keepdims=0)
            # [cig, g, cog, k] -> [g, cog, cig, k]
            t = b.op("Transpose", [diag], perm=[1, 2, 0] + list(range(3, n + 3)))
            out[1] = b.op("Reshape", [t, b.ints(w_shape)])
    if B is not None and c.need(2):
        out[2] = b.reduce("ReduceSum", gy, [0] + list(range(2, n + 2)), keepdims=0)
    return out


def _pool_out_sizes(in_sp, k, strides, dil, pads, ceil):
    """MaxPool's output sizes as onnxruntime computes them: with ``ceil`` the last window
    must still start inside the input or its leading padding (one fewer otherwise)."""
    n = len(in_sp)
    out = _out_sizes(in_sp, k, strides, dil, pads, ceil)
    if ceil:
        out = [o - 1 if (o - 1) * s >= i + p else o
               for o, s, i, p in zip(out, strides, in_sp, pads[:n])]
    return out


def _pool_windows(in_sp, out_sp, k, strides, dil, pads):
    """The constant maps of MaxPool's windows over the flattened spatial grid.

    - ``idx`` [O, K] int64: the input position each window (row-major output order) reads
      at each kernel offset (row-major), 0 where that offset falls in the padding;
    - ``valid`` [O, K] bool, or None when no offset falls in the padding;
    - ``inv`` [P, M] int64: for each input position the slots ``o * K + k`` that read it,
      in increasing ``o`` (output order), padded with ``O * K`` (a slot that holds 0)."""
    n = len(in_sp)
    o = np.indices(out_sp).reshape(n, -1)[:, :, None]  # [n, O, 1]
    kk = np.indices(k).reshape(n, -1)[:, None, :]       # [n, 1, K]
    col = lambda v: np.asarray(v, np.int64).reshape(n, 1, 1)  # noqa: E731
    pos = o * col(strides) - col(pads[:n]) + kk * col(dil)   # [n, O, K]
    inside = np.all((pos >= 0) & (pos < col(in_sp)), axis=0)  # [O, K]
    flat = np.where(inside, np.ravel_multi_index(
        tuple(np.clip(pos[i], 0, in_sp[i] - 1) for i in range(n)), in_sp), 0)
    slots = np.flatnonzero(inside)  # increasing: output order, then kernel order
    readers = flat.reshape(-1)[slots]
    order = np.argsort(readers, kind="stable")  # per input, slots stay in output order
    counts = np.bincount(readers, minlength=int(np.prod(in_sp)))
    m = max(int(counts.max()) if counts.size else 0, 1)
    inv = np.full((counts.size, m), flat.size, np.int64)
    rank = np.arange(readers.size) - np.repeat(np.cumsum(counts) - counts, counts)
    inv[readers[order], rank] = slots[order]
    return flat.astype(np.int64), (None if inside.all() else inside), inv


@rule("MaxPool")
def max_pool(c: Ctx):
    b = c.b
    X = c.x(0)
    if int(c.attr("storage_order", 0)) != 0:
        raise c.fail("storage_order=1 is not supported")
    if len(c.gys) > 1 and c.gys[1] is not None:
        raise c.fail("the Indices output has no gradient")
    in_sp = _spatial(c, X, "input")
    n = len(in_sp)
    k = list(c.attr("kernel_shape"))
    strides = list(c.attr("strides", [1] * n))
    dil = list(c.attr("dilations", [1] * n))
    pads = _pads(c, in_sp, k, strides, dil)
    # ceil_mode matters with explicit pads only (auto_pad's sizes are the floor of the
    # pads _pads works out).
    ceil = int(c.attr("ceil_mode", 0)) if c.attr("auto_pad", "NOTSET") == "NOTSET" else 0
    if b.fuses(X, c.y):
        outs = c.node.output
        if len(outs) > 1 and outs[1]:  # the forward's own Indices
            return [b.op("MaxPoolGrad", [c.gy, outs[1], b.shape_of(X)], domain=TRAINOPS_DOMAIN)]
        # Else the argmax found again in X: asking MaxPool for Indices would take the forward
        # off onnxruntime's fast pooling (2-3x slower with them). Given ceil_mode, the op
        # refuses a dY of the other rounding too.
        return [b.op("MaxPoolGradFromInput", [c.gy, X], domain=TRAINOPS_DOMAIN, kernel_shape=k,
                     strides=strides, dilations=dil, pads=pads, ceil_mode=ceil)]
    # Standard ops, without MaxPool's Indices (execution providers such as WebGPU claim
    # MaxPool and fail at run time on that output): every window's elements gathered from
    # X, compared with the forward's Y, the first equal one in window order (row-major,
    # which is increasing input position: the element onnxruntime's Indices name, ties
    # included, as its kernel keeps a maximum until a strictly greater one comes) gets the
    # window's dY; each input sums what its windows send in output order, one Add at a time
    # from +0 (ScatterElements' order at the Indices): the same bits. Padding is skipped.
    out_sp = _pool_out_sizes(in_sp, k, strides, dil, pads, ceil)
    idx, valid, inv = _pool_windows(in_sp, out_sp, k, strides, dil, pads)
    n_out, n_k = idx.shape
    flat = lambda t, sizes: b.op("Reshape", [t, b.ints([0, 0] + sizes)])  # noqa: E731
    windows = b.op("Gather", [flat(X, [inv.shape[0]]), b.const(idx)], axis=2)  # [N, C, O, K]
    # A maximum not above the type's lowest finite value (a window of -inf and NaN only)
    # is no element's: no gradient (onnxruntime's kernel starts from that value and takes
    # strictly greater ones; its Indices name no element there either).
    y = c.y
    y = b.op("Where", [b.op("Greater", [y, b.scalar(np.finfo(b.np_dtype(X)).min, X)]), y,
                       b.scalar(np.nan, X)])
    hit = b.op("Equal", [windows, flat(y, [n_out, 1])])
    if valid is not None:
        hit = b.op("And", [hit, b.const(valid)])
    if n_k > 1:  # drop every hit that follows an earlier one of its window
        earlier = b.op("MatMul", [b.op("Cast", [hit], to=onnx.TensorProto.FLOAT),
                                  b.const(np.triu(np.ones((n_k, n_k), np.float32), 1))])
        hit = b.op("And", [hit, b.op("Less", [earlier, b.const(np.float32(0.5))])])
    sent = b.op("Where", [hit, flat(c.gy, [n_out, 1]), b.scalar(0.0, X)])
    sent = b.op("Pad", [flat(sent, [n_out * n_k]), b.ints([0, 0, 0, 0, 0, 1])])  # slot O*K: 0
    gx = b.scalar(0.0, X)
    for j in range(inv.shape[1]):
        gx = b.op("Add", [gx, b.op("Gather", [sent, b.const(inv[:, j])], axis=2)])
    return [b.op("Reshape", [gx, b.ints([0, 0] + in_sp)])]


@rule("AveragePool")
def average_pool(c: Ctx):
    b = c.b
    X = c.x(0)
    if int(c.attr("ceil_mode", 0)):
        raise c.fail("ceil_mode=1 is not supported")
    s = b.shape(X)
    in_sp = _spatial(c, X, "input")
    if not isinstance(s[1], int):
        raise c.fail(f"the gradient needs the channel count statically ('{X}': {s})")
    n = len(in_sp)
    k = list(c.attr("kernel_shape"))
    strides = list(c.attr("strides", [1] * n))
    dil = list(c.attr("dilations", [1] * n))
    pads = _pads(c, in_sp, k, strides, dil)
    out_sp = _out_sizes(in_sp, k, strides, dil, pads)
    dt = b.np_dtype(X)
    if int(c.attr("count_include_pad", 0)) or not any(pads):
        g = b.op("Div", [c.gy, b.scalar(float(np.prod(k)), X)])
    else:  # each window's count of real (unpadded) elements
        ones_in = b.const(np.ones([1, 1] + in_sp, dt))
        cnt = b.op("Conv", [ones_in, b.const(np.ones([1, 1] + k, dt))], strides=strides,
                   dilations=dil, pads=pads)
        g = b.op("Div", [c.gy, cnt])
    w = b.const(np.ones([s[1], 1] + k, dt))
    return [_conv_transpose(c, g, w, in_sp, k, strides, dil, pads, s[1], out_sp)]


@rule("GlobalAveragePool")
def global_average_pool(c: Ctx):
    b = c.b
    X = c.x(0)
    s = b.shape(X)
    if s is not None and all(isinstance(d, int) for d in s[2:]):
        count = b.scalar(float(np.prod(s[2:])), X)
    else:
        count = b.op("Cast", [b.op("Div", [b.op("Size", [X]), b.op("Size", [c.y])])], to=b.dtype(X))
    return [b.op("Expand", [b.op("Div", [c.gy, count]), b.shape_of(X)])]


# -- normalization --------------------------------------------------------------------

@rule("BatchNormalization")
def batch_norm(c: Ctx):
    b = c.b
    if any(g is not None for g in c.gys[1:]):
        raise c.fail("only the first output has a gradient")
    if int(c.attr("training_mode", 0)):
        return _batch_norm_training(c)
    X, scale, bias, mean, var = (c.x(i) for i in range(5))
    eps = float(c.attr("epsilon", 1e-5))
    r = c.rank(X)
    chan = lambda t: b.op("Reshape", [t, b.ints([-1] + [1] * (r - 2))])  # noqa: E731
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.scalar(eps, var)])])])
    axes = [0] + list(range(2, r))
    gy = c.gy
    out = [None] * 5
    if c.need(0):
        out[0] = b.op("Mul", [gy, chan(b.op("Mul", [scale, inv]))])
    xc = b.op("Sub", [X, chan(mean)]) if (c.need(1) or c.need(4)) else None
    if c.need(1):
        out[1] = b.reduce("ReduceSum", b.op("Mul", [gy, b.op("Mul", [xc, chan(inv)])]), axes, 0)
    if c.need(2):
        out[2] = b.reduce("ReduceSum", gy, axes, 0)
    if c.need(3):
        s = b.reduce("ReduceSum", gy, axes, 0)
        out[3] = b.op("Neg", [b.op("Mul", [s, b.op("Mul", [scale, inv])])])
    if c.need(4):
        s = b.reduce("ReduceSum", b.op("Mul", [gy, xc]), axes, 0)
        inv3 = b.op("Mul", [inv, b.op("Mul", [inv, inv])])
        out[4] = b.op("Mul", [b.op("Mul", [s, scale]), b.op("Mul", [inv3, b.scalar(-0.5, var)])])
    return out


def _batch_norm_training(c: Ctx):
    """training_mode=1: Y = scale * xhat + bias with the batch statistics (biased
    variance) over every axis but 1; the running statistics get no gradient."""
    b = c.b
    X, scale = c.x(0), c.x(1)
    eps = float(c.attr("epsilon", 1e-5))
    # One com.trainops kernel for all three gradients. (gy has Y's type; gradient names
    # carry no recorded type, so the forward tensors are asked.)
    if b.fuses(X, scale, c.y):
        from ..onnx_defs import TRAINOPS_DOMAIN

        outs = [b.fresh("BatchNormTrainGrad") if c.need(i) else "" for i in range(3)]
        while outs and not outs[-1]:
            outs.pop()
        if outs:
            b.op("BatchNormTrainGrad", [c.gy, X, scale], outs, domain=TRAINOPS_DOMAIN, epsilon=eps)
        for name, like in zip(outs, (X, scale, scale)):
            if name:
                b.set_info(name, onnx.TensorProto.FLOAT, b.shape(like))
        grads = [name or None for name in outs]
        return grads + [None] * (len(c.node.input) - len(grads))
    r = c.rank(X)
    axes = [0] + list(range(2, r))
    chan = lambda t: b.op("Reshape", [t, b.ints([-1] + [1] * (r - 2))])  # noqa: E731
    xc = b.op("Sub", [X, b.reduce("ReduceMean", X, axes, 1)])
    var = b.reduce("ReduceMean", b.op("Mul", [xc, xc]), axes, 1)
    rstd = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.scalar(eps, X)])])])
    xhat = b.op("Mul", [xc, rstd])
    gy = c.gy
    out = [None] * len(c.node.input)
    if c.need(0):  # scale * rstd * (gy - mean(gy) - xhat * mean(gy * xhat))
        m1 = b.reduce("ReduceMean", gy, axes, 1)
        m2 = b.reduce("ReduceMean", b.op("Mul", [gy, xhat]), axes, 1)
        d = b.op("Sub", [b.op("Sub", [gy, m1]), b.op("Mul", [xhat, m2])])
        out[0] = b.op("Mul", [d, b.op("Mul", [chan(scale), rstd])])
    if c.need(1):
        out[1] = b.reduce("ReduceSum", b.op("Mul", [gy, xhat]), axes, 0)
    if c.need(2):
        out[2] = b.reduce("ReduceSum", gy, axes, 0)
    return out


def _static_numel(b: Builder, name: str) -> int | None:
    dims = b.shape(name)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64))


def _fused_layer_norm_grad(c: Ctx, axis: int) -> list | None:
    """``com.trainops::LayerNormGrad`` from the node's own Mean and InvStdDev (a rerun the
    Trainer's simplify pass merges into the forward node), when the Trainer asks for fused
    kernels, everything is float32 with stash_type 1, and Scale (and Bias, if it needs a
    gradient) hold exactly the normalised elements in Scale's shape; None otherwise."""
    b = c.b
    X, scale, bias = c.x(0), c.x(1), c.x(2)
    if not b.fuses(c.y, X, scale) or int(c.attr("stash_type", 1)) != 1:  # gy: y's type
        return None
    x_dims = b.shape(X)
    if x_dims is None or not all(isinstance(d, int) for d in x_dims[axis:]):
        return None
    cols = int(np.prod(x_dims[axis:], dtype=np.int64))
    if _static_numel(b, scale) != cols:
        return None
    want_bias = bias is not None and c.need(2)
    if want_bias and (b.shape(bias) != b.shape(scale) or not b.fuses(bias)):
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in c.node.attribute}
    _, mu, rstd = b.op("LayerNormalization", list(c.node.input), 3, **attrs)
    names = [b.fresh("LayerNormGrad_dX"),
             b.fresh("LayerNormGrad_dScale") if c.need(1) else "",
             b.fresh("LayerNormGrad_dBias") if want_bias else ""]
    while not names[-1]:
        names.pop()
    outs = b.op("LayerNormGrad", [c.gy, X, scale, mu, rstd], names, domain=TRAINOPS_DOMAIN,
                axis=axis)
    outs = outs + [""] * (3 - len(outs))
    return [outs[0] if c.need(0) else None, outs[1] or None, outs[2] or None]


@rule("LayerNormalization")
def layer_norm(c: Ctx):
    b = c.b
    if any(g is not None for g in c.gys[1:]):
        raise c.fail("only the first output (Y) has a gradient")
    X, scale, bias = c.x(0), c.x(1), c.x(2)
    r = c.rank(X)
    axis = _axis(c, -1)
    axes = list(range(axis, r))
    eps = float(c.attr("epsilon", 1e-5))
    fused = _fused_layer_norm_grad(c, axis)
    if fused is not None:
        return fused
    if b.dtype(X) == onnx.TensorProto.FLOAT and int(c.attr("stash_type", 1)) == 1:
        # The node's own Mean and InvStdDev outputs (float32 here): the Trainer's
        # autodiff.simplify pass merges this node into the forward one, so the
        # statistics are not computed twice.
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in c.node.attribute}
        _, mu, rstd = b.op("LayerNormalization", list(c.node.input), 3, **attrs)
        xc = b.op("Sub", [X, mu])
    else:  # float16 / double: the statistics in X's own type
        mu = b.reduce("ReduceMean", X, axes, 1)
        xc = b.op("Sub", [X, mu])
        var = b.reduce("ReduceMean", b.op("Mul", [xc, xc]), axes, 1)
        rstd = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.scalar(eps, X)])])])
    xhat = b.op("Mul", [xc, rstd])
    gy = c.gy
    y_dims = b.shape(c.y)
    out = [None, None, None]
    if c.need(0):
        gh = b.op("Mul", [gy, scale])
        m1 = b.reduce("ReduceMean", gh, axes, 1)
        m2 = b.reduce("ReduceMean", b.op("Mul", [gh, xhat]), axes, 1)
        out[0] = b.op("Mul", [rstd, b.op("Sub", [b.op("Sub", [gh, m1]), b.op("Mul", [xhat, m2])])])
    if c.need(1):
        out[1] = b.unbroadcast(b.op("Mul", [gy, xhat]), y_dims, scale)
    if bias is not None and c.need(2):
        out[2] = b.unbroadcast(gy, y_dims, bias)
    return out


# -- losses -----------------------------------------------------------------------------

def _loss_weights(c: Ctx, labels: str, weight: str | None, like: str) -> str:
    """Per-sample weight: weight[label] (or 1), 0 where label == ignore_index; float."""
    b = c.b
    ii = c.attr("ignore_index")
    safe = labels
    if ii is not None:
        keep = b.op("Not", [b.op("Equal", [labels, b.const(np.asarray(ii, b.np_dtype(labels)))])])
        safe = b.op("Where", [keep, labels, b.const(np.asarray(0, b.np_dtype(labels)))])
    if weight is not None:
        w = b.op("Gather", [weight, safe], axis=0)
    else:
        w = b.op("Cast", [b.op("Equal", [safe, safe])], to=b.dtype(like))
    if ii is not None:
        w = b.op("Mul", [w, b.op("Cast", [keep], to=b.dtype(like))])
    return w


def _loss_scale(c: Ctx, w: str, like: str) -> str:
    """d loss / d (per-sample loss), shaped like the labels."""
    b = c.b
    reduction = c.attr("reduction", "mean")
    if reduction == "none":
        return b.op("Mul", [c.gy, w])
    if reduction == "sum":
        return b.op("Mul", [c.gy, w])
    if reduction == "mean":
        # Every target ignored (or weighted 0): the loss is 0/0, NaN, and PyTorch's gradient
        # is 0; dividing by the zero total would give inf * 0 = NaN and poison the weights.
        # The total is taken as 1 there, so the gradient is dY * 0.
        total = b.reduce("ReduceSum", w, None, keepdims=0)
        zero, one = b.scalar(0.0, like), b.scalar(1.0, like)
        total = b.op("Where", [b.op("Equal", [total, zero]), one, total])
        return b.op("Mul", [b.op("Div", [c.gy, total]), w])
    raise c.fail(f"reduction={reduction!r} is not one of none, mean, sum")


def _onehot(c: Ctx, labels: str, scores: str) -> str:
    b = c.b
    depth = b.op("Slice", [b.op("Shape", [scores]), b.ints([1]), b.ints([2])])
    return _one_hot(b, labels, depth, 1, scores)


def _sample_scale(c: Ctx) -> str:
    """d loss / d (per-sample loss) with a class axis: [N, 1, d1, ...]."""
    scores, labels, weight = c.x(0), c.x(1), c.x(2)
    return c.b.unsqueeze(_loss_scale(c, _loss_weights(c, labels, weight, scores), scores), [1])


def _fused_cross_entropy_grad(c: Ctx) -> str | None:
    """``com.trainops::SoftmaxCrossEntropyLossGrad`` for the common case (float32 [N, C]
    scores, int64 labels, no class weights, only the loss output differentiated) when the
    Trainer asks for fused kernels; None otherwise (the standard form)."""
    b = c.b
    scores, labels = c.x(0), c.x(1)
    dims = b.shape(scores)
    if (not b.fuses(scores) or c.x(2) is not None or c.gys[0] is None
            or any(g is not None for g in c.gys[1:]) or dims is None or len(dims) != 2
            or b.dtype(labels) != onnx.TensorProto.INT64
            or c.attr("reduction", "mean") not in ("none", "sum", "mean")):
        return None
    return b.op("SoftmaxCrossEntropyLossGrad", [c.gy, scores, labels], domain=TRAINOPS_DOMAIN,
                reduction=c.attr("reduction", "mean"), ignore_index=c.attr("ignore_index"))


@rule("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy(c: Ctx):
    b = c.b
    scores, labels = c.x(0), c.x(1)
    if not c.need(0):
        return [None] * len(c.node.input)
    fused = _fused_cross_entropy_grad(c)
    if fused is not None:
        return [fused] + [None] * (len(c.node.input) - 1)
    logp = b.op("LogSoftmax", [scores], axis=1)
    p = b.op("Exp", [logp])
    g = None
    if c.gys[0] is not None:
        g = b.op("Mul", [b.op("Sub", [p, _onehot(c, labels, scores)]), _sample_scale(c)])
    if len(c.gys) > 1 and c.gys[1] is not None:  # the log_prob output
        gl = c.gys[1]
        gl = b.op("Sub", [gl, b.op("Mul", [p, b.reduce("ReduceSum", gl, [1], keepdims=1)])])
        g = gl if g is None else b.op("Add", [g, gl])
    return [g] + [None] * (len(c.node.input) - 1)


@rule("NegativeLogLikelihoodLoss")
def nll_loss(c: Ctx):
    b = c.b
    if not c.need(0):
        return [None] * len(c.node.input)
    g = b.op("Neg", [b.op("Mul", [_onehot(c, c.x(1), c.x(0)), _sample_scale(c)])])
    return [g] + [None] * (len(c.node.input) - 1)
