"""Gradient rules for the fused transformer ops of opset 23 that torch's exporter writes at
``opset_version=23``: Attention (``scaled_dot_product_attention``; ViT, Llama, BART, Whisper,
ModernBERT), RMSNormalization (``torch.nn.RMSNorm``) and RotaryEmbedding. Registered into
:data:`.rules.RULES`.

Attention: the rule recomputes the probabilities ``P = Softmax(softcap(Q K^T * scale) +
bias)`` from the inputs (the node does not output them) and emits the standard backward of
the chain: ``dV = P^T dY``, ``dZ = P * (dY V^T - rowsum(P * dY V^T))``, the softcap's
``1 - tanh^2``, ``dQ = dZ K * scale``, ``dK = dZ^T Q * scale``. Handled as the spec
computes them: 3-D inputs (``q_num_heads``/``kv_num_heads``), grouped-query heads (the
key/value heads' gradients summed over their group), ``scale`` (default
``1/sqrt(head_size)``), boolean and additive masks (shorter than the keys: padded as
masked), ``is_causal`` (top-left aligned, no cache), ``softcap``, rows the bias masks
entirely (zeros), ``present_key``/``present_value`` read downstream. A float mask gets
``dZ`` summed to its shape. Refused, naming the node: ``past_key``/``past_value`` (a
decoding cache), ``nonpad_kv_seqlen`` and a gradient into ``qk_matmul_output``.
"""

from __future__ import annotations

import math

import numpy as np

import onnx

from .rules import Ctx, rule


def _dim(c: Ctx, x: str, i: int) -> str:
    """Dimension ``i`` of ``x`` as a 1-element int64 tensor."""
    return c.b.op("Shape", [x], start=i, end=i + 1)


@rule("Attention")
def attention(c: Ctx):
    b = c.b
    q, k, v, mask = c.x(0), c.x(1), c.x(2), c.x(3)
    if c.x(4) or c.x(5):
        raise c.fail("past_key/past_value (a decoding cache) have no gradient rule")
    if c.x(6):
        raise c.fail("nonpad_kv_seqlen has no gradient rule")
    if len(c.gys) > 3 and c.gys[3] is not None:
        raise c.fail("a gradient into qk_matmul_output (output 3) is not supported")
    rank = c.rank(q)
    if rank not in (3, 4):
        raise c.fail(f"Q '{q}' has rank {rank}; Attention takes 3-D or 4-D inputs")
    hq, hk = c.attr("q_num_heads"), c.attr("kv_num_heads")
    if rank == 4:
        hq, hk = (b.shape(q) or [None] * 4)[1], (b.shape(k) or [None] * 4)[1]
    if not isinstance(hq, int) or not isinstance(hk, int) or hq % hk:
        raise c.fail(f"the gradient needs the query and key/value head counts statically, "
                     f"the first a multiple of the second (got {hq} and {hk})")
    group = hq // hk

    def heads(x: str, h: int) -> str:  # [B, S, h*D] -> [B, h, S, D]
        if rank == 4:
            return x
        return b.op("Transpose", [b.op("Reshape", [x, b.ints([0, 0, h, -1])])], perm=[0, 2, 1, 3])

    def unheads(g: str, like: str) -> str:  # [B, h, S, D] -> like's layout
        if rank == 4:
            return g
        return b.op("Reshape", [b.op("Transpose", [g], perm=[0, 2, 1, 3]), b.shape_of(like)])

    def repeat(x: str) -> str:  # [B, hk, T, D] -> [B, hq, T, D], each head `group` times
        if group == 1:
            return x
        rest = b.op("Shape", [x], start=2)
        five = b.op("Concat", [_dim(c, x, 0), b.ints([hk, group]), rest], axis=0)
        rep = b.op("Expand", [b.unsqueeze(x, [2]), five])
        return b.op("Reshape", [rep, b.op("Concat", [_dim(c, x, 0), b.ints([hq]), rest],
                                          axis=0)])

    def unrepeat(g: str) -> str:  # [B, hq, T, D] -> [B, hk, T, D], summed over the group
        if group == 1:
            return g
        five = b.op("Concat", [_dim(c, g, 0), b.ints([hk, group]), b.op("Shape", [g], start=2)],
                    axis=0)
        return b.reduce("ReduceSum", b.op("Reshape", [g, five]), [2], keepdims=0)

    q4, k4, v4 = heads(q, hq), heads(k, hk), heads(v, hk)
    kr, vr = repeat(k4), repeat(v4)
    one = b.scalar(1.0, q)
    scale = c.attr("scale")
    if scale is None:
        d = (b.shape(q) or [None])[-1]
        if isinstance(d, int):
            scale = 1.0 / math.sqrt(d // hq if rank == 3 else d)
            s = b.scalar(scale, q)
        else:
            dq = b.op("Cast", [_dim(c, q4, 3)], to=b.dtype(q))
            s = b.op("Div", [one, b.op("Sqrt", [dq])])
    else:
        s = b.scalar(float(scale), q)
    logits = b.op("Mul", [b.op("MatMul", [q4, b.op("Transpose", [kr], perm=[0, 1, 3, 2])]), s])
    softcap = float(c.attr("softcap", 0.0) or 0.0)
    t = None
    if softcap > 0:
        t = b.op("Tanh", [b.op("Div", [logits, b.scalar(softcap, q)])])
        logits = b.op("Mul", [t, b.scalar(softcap, q)])
    bias, padded = _bias(c, mask, q4, kr)
    z = logits if bias is None else b.op("Add", [logits, bias])
    p = b.op("Softmax", [z], axis=-1)
    if bias is not None:  # rows the bias masks entirely: zeros (the spec's guard)
        ninf = b.scalar(-np.inf, q)
        dead = b.op("Equal", [b.reduce("ReduceMax", bias, [-1], keepdims=1), ninf])
        p = b.op("Where", [dead, b.scalar(0.0, q), p])

    gy = c.gys[0]
    out: list = [None] * len(c.node.input)
    gk_extra, gv_extra = (c.gys[1] if len(c.gys) > 1 else None,
                          c.gys[2] if len(c.gys) > 2 else None)
    if gy is None:
        gq4 = gkr = gvr = dz = None
    else:
        gy4 = heads(gy, hq)
        gvr = b.op("MatMul", [b.op("Transpose", [p], perm=[0, 1, 3, 2]), gy4])
        dp = b.op("MatMul", [gy4, b.op("Transpose", [vr], perm=[0, 1, 3, 2])])
        pdp = b.op("Mul", [p, dp])
        dz = b.op("Sub", [pdp, b.op("Mul", [p, b.reduce("ReduceSum", pdp, [-1], keepdims=1)])])
        dl = dz if t is None else b.op("Mul", [dz, b.op("Sub", [one, b.op("Mul", [t, t])])])
        dl = b.op("Mul", [dl, s])
        gq4 = b.op("MatMul", [dl, kr])
        gkr = b.op("MatMul", [b.op("Transpose", [dl], perm=[0, 1, 3, 2]), q4])
    if c.need(0) and gq4 is not None:
        out[0] = unheads(gq4, q)
    for i, (g, extra, x) in enumerate([(gkr, gk_extra, k), (gvr, gv_extra, v)], start=1):
        if not c.need(i):
            continue
        g = unrepeat(g) if g is not None else None
        if extra is not None:
            g = extra if g is None else b.op("Add", [g, extra])
        out[i] = unheads(g, x) if g is not None else None
    if c.need(3) and dz is not None and b.dtype(mask) != onnx.TensorProto.BOOL:
        gm = dz
        if padded:  # the keys past the mask's length were padding
            gm = b.op("Slice", [gm, b.ints([0]), _dim(c, mask, c.rank(mask) - 1), b.ints([-1])])
        out[3] = b.unbroadcast(gm, None, mask)
    return out


def _bias(c: Ctx, mask: str | None, q4: str, kr: str) -> tuple[str | None, bool]:
    """The additive bias (broadcasting to [B, H, S, T]): the mask (a boolean one as 0 and
    -inf; padded with -inf to the keys' length when shorter) plus the causal mask; and
    whether the mask was padded."""
    b = c.b
    ninf, zero = b.scalar(-np.inf, c.x(0)), b.scalar(0.0, c.x(0))
    bias, padded = None, False
    if mask is not None:
        bias = mask
        if b.dtype(mask) == onnx.TensorProto.BOOL:
            bias = b.op("Where", [mask, zero, ninf])
        m_dims, k_dims = b.shape(mask), b.shape(c.x(1))
        r = c.rank(mask)
        keys = None if k_dims is None else k_dims[2 if len(k_dims) == 4 else 1]
        if not (m_dims and isinstance(m_dims[-1], int) and m_dims[-1] == keys):
            short = b.op("Sub", [_dim(c, kr, 2), _dim(c, mask, r - 1)])
            pads = b.op("Concat", [b.ints([0] * (2 * r - 1)), short], axis=0)
            bias = b.op("Pad", [bias, pads, ninf])
            padded = True
    if c.attr("is_causal", 0):
        s_len = b.op("Squeeze", [_dim(c, q4, 2)])
        t_len = b.op("Squeeze", [_dim(c, kr, 2)])
        one = b.const(np.int64(1))
        i = b.unsqueeze(b.op("Range", [b.const(np.int64(0)), s_len, one]), [1])
        j = b.unsqueeze(b.op("Range", [b.const(np.int64(0)), t_len, one]), [0])
        causal = b.op("Where", [b.op("LessOrEqual", [j, i]), zero, ninf])
        bias = causal if bias is None else b.op("Add", [bias, causal])
    return bias, padded


@rule("RMSNormalization")
def rms_normalization(c: Ctx):
    """``x^ = x / sqrt(mean(x^2) + eps)`` over the axes from ``axis`` on, ``y = x^ * scale``:
    ``dx = (g - x^ mean(g x^)) / sqrt(mean(x^2) + eps)`` with ``g = dY * scale``, and
    ``dscale = dY x^`` summed to scale's shape. float16/bfloat16 inputs are computed in
    float32 (``stash_type`` 1, the default), as the forward does."""
    b = c.b
    x, scale = c.x(0), c.x(1)
    r = c.rank(x)
    axis = int(c.attr("axis", -1))
    axis = axis + r if axis < 0 else axis
    axes = list(range(axis, r))
    dt = b.dtype(x)
    low = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    ct = onnx.TensorProto.FLOAT if dt in low and int(c.attr("stash_type", 1)) == 1 else dt
    if ct == onnx.TensorProto.BFLOAT16:
        raise c.fail("bfloat16 with stash_type 0 (computed in bfloat16) is not supported")
    np_ct = onnx.helper.tensor_dtype_to_np_dtype(ct)

    def to(v: str, t: int) -> str:
        return v if b.dtype(v) == t else b.op("Cast", [v], to=t)

    # (dY has x's type; the Builder records no types for the gradients it emits.)
    xc, sc = to(x, ct), to(scale, ct)
    gy = c.gy if ct == dt else b.op("Cast", [c.gy], to=ct)
    eps = b.const(np.asarray(float(c.attr("epsilon", 1e-5)), np_ct), hint="epsilon")
    ms = b.reduce("ReduceMean", b.op("Mul", [xc, xc]), axes, keepdims=1)
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, eps])])])
    xh = b.op("Mul", [xc, inv])
    out: list = [None, None]
    if c.need(0):
        g = b.op("Mul", [gy, sc])
        m = b.reduce("ReduceMean", b.op("Mul", [g, xh]), axes, keepdims=1)
        gx = b.op("Mul", [inv, b.op("Sub", [g, b.op("Mul", [xh, m])])])
        out[0] = gx if ct == dt else b.op("Cast", [gx], to=dt)
    if c.need(1):
        gs = b.unbroadcast(b.op("Mul", [gy, xh]), b.shape(x), scale)
        out[1] = to(gs, b.dtype(scale)) if b.dtype(scale) != ct else gs
    return out


@rule("RotaryEmbedding")
def rotary_embedding(c: Ctx):
    """A rotation of each pair by the position's angle: its gradient is the rotation back,
    the same op with ``-sin``. The caches (computed from positions) get none: refused when
    they need one."""
    b = c.b
    if c.need(1) or c.need(2):
        raise c.fail("a gradient into cos_cache/sin_cache is not supported (they should "
                     "depend on positions only)")
    attrs = {a: c.attr(a) for a in ("interleaved", "num_heads", "rotary_embedding_dim")
             if c.attr(a) is not None}
    ins = [c.gy, c.x(1), b.op("Neg", [c.x(2)])] + ([c.x(3)] if c.x(3) else [])
    return [b.op("RotaryEmbedding", ins, **attrs)] + [None] * (len(c.node.input) - 1)
