"""Gradient rules for data movement: Pad, Tile, GatherElements, DepthToSpace,
SpaceToDepth and Einsum. Registered into :data:`.rules.RULES`."""

from __future__ import annotations

import numpy as np

from .graph import Builder
from .rules import Ctx, _index_grid, _one_hot, _scatter_flat, rule

INT64_MIN = int(np.iinfo(np.int64).min)


def _slice(b: Builder, g: str, axis: int, start: int, end: int, step: int = 1) -> str:
    return b.op("Slice", [g, b.ints([start]), b.ints([end]), b.ints([axis]), b.ints([step])])


def _zero_pad(b: Builder, g: str, axis: int, before: int, after: int, rank: int) -> str:
    """``g`` with ``before``/``after`` zeros along ``axis``."""
    pads = [0] * (2 * rank)
    pads[axis], pads[rank + axis] = before, after
    if b.opset >= 11:
        return b.op("Pad", [g, b.ints(pads)])
    return b.op("Pad", [g], pads=pads)


# -- Pad ------------------------------------------------------------------------------------

def _pad_amounts(c: Ctx, r: int) -> list[int] | None:
    """The forward's pads as ``[begin_0.., end_0..]`` over all axes, None if not constant."""
    if c.b.opset < 11:
        return list(c.attr("pads"))
    pads = c.b.constant_value(c.x(1))
    if pads is None:
        return None
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    axes_name = c.x(3) if c.b.opset >= 18 else None
    if axes_name is None:
        return pads
    axes = c.b.constant_value(axes_name)
    if axes is None:
        return None
    full = [0] * (2 * r)
    axes = [int(a) + r if int(a) < 0 else int(a) for a in np.asarray(axes).reshape(-1)]
    for i, a in enumerate(axes):
        full[a], full[r + a] = pads[i], pads[len(axes) + i]
    return full


def _pad_back_axis(c: Ctx, g: str, axis: int, n: int, lo: int, hi: int, r: int, mode: str) -> str:
    """The gradient of padding one axis (of length ``n``) by ``lo``/``hi`` in ``mode``."""
    b = c.b
    total = _slice(b, g, axis, lo, lo + n)
    parts = []
    if mode == "edge":
        if lo:
            s = b.reduce("ReduceSum", _slice(b, g, axis, 0, lo), [axis], keepdims=1)
            parts.append(_zero_pad(b, s, axis, 0, n - 1, r))
        if hi:
            s = b.reduce("ReduceSum", _slice(b, g, axis, lo + n, lo + n + hi), [axis], keepdims=1)
            parts.append(_zero_pad(b, s, axis, n - 1, 0, r))
    elif mode == "reflect":  # y[lo - 1 - k] = x[k + 1]; y[lo + n + k] = x[n - 2 - k]
        if lo:
            parts.append(_zero_pad(b, _slice(b, g, axis, lo - 1, INT64_MIN, -1), axis, 1,
                                   n - 1 - lo, r))
        if hi:
            parts.append(_zero_pad(b, _slice(b, g, axis, lo + n + hi - 1, lo + n - 1, -1), axis,
                                   n - 1 - hi, 1, r))
    else:  # wrap: y[k] = x[n - lo + k]; y[lo + n + k] = x[k]
        if lo:
            parts.append(_zero_pad(b, _slice(b, g, axis, 0, lo), axis, n - lo, 0, r))
        if hi:
            parts.append(_zero_pad(b, _slice(b, g, axis, lo + n, lo + n + hi), axis, 0, n - hi, r))
    for p in parts:
        total = b.op("Add", [total, p])
    return total


@rule("Pad")
def pad(c: Ctx):
    """constant: the padding cropped off again (``Pad`` by the negated pads, which also
    restores what negative pads cropped). edge/reflect/wrap: each axis's padding added back
    onto the elements it copied, with static pads and sizes; otherwise (opset >= 16) by
    scattering dy onto the elements a padded index grid names."""
    b = c.b
    x = c.x(0)
    mode = c.attr("mode", "constant")
    out: list = [None] * len(c.node.input)
    if b.opset < 2:
        raise c.fail("Pad-1 (attribute 'paddings') is not supported")
    if mode == "constant":
        if b.opset < 11:
            gx = b.op("Pad", [c.gy], pads=[-p for p in c.attr("pads")], mode="constant")
        else:
            pads = b.constant_value(c.x(1))
            neg = b.ints([-int(p) for p in np.asarray(pads).reshape(-1)]) if pads is not None \
                else b.op("Neg", [c.x(1)])
            axes = [c.x(3)] if b.opset >= 18 and c.x(3) else []
            gx = b.op("Pad", [c.gy, neg] + (["", axes[0]] if axes else []))
        out[0] = gx if c.need(0) else None
        if c.need(2) and c.x(2):  # the constant: dy summed over the padding
            rest = b.op("Sub", [b.reduce("ReduceSum", c.gy, None, keepdims=0),
                                b.reduce("ReduceSum", gx, None, keepdims=0)])
            out[2] = b.reshape_like(rest, c.x(2))
        return out
    if mode not in ("edge", "reflect", "wrap"):
        raise c.fail(f"mode={mode!r} is not a Pad mode")
    if not c.need(0):
        return out
    r = c.rank(x)
    pads = _pad_amounts(c, r)
    dims = b.shape(x)
    limit = {"edge": 0, "reflect": 1, "wrap": 0}[mode]  # how far one copy reaches: n - limit

    def fits(a: int) -> bool:
        lo, hi = pads[a], pads[r + a]
        return (lo == 0 and hi == 0) or (
            isinstance(dims[a], int) and dims[a] >= 1 and max(lo, hi) <= dims[a] - limit)
    per_axis = pads is not None and dims is not None and b.opset >= 10 and \
        min(pads) >= 0 and all(fits(a) for a in range(r))
    if per_axis:
        g = c.gy
        for a in range(r):
            if pads[a] or pads[r + a]:
                g = _pad_back_axis(c, g, a, dims[a], pads[a], pads[r + a], r, mode)
        out[0] = g
        return out
    if b.opset < 16:
        raise c.fail(f"mode={mode!r} with pads or sizes known only at run time (or pads past "
                     "what one reflection covers, or negative) needs opset >= 16 "
                     "(ScatterElements with reduction 'add')")
    grid, _ = _index_grid(b, x)
    extra = [c.x(3)] if b.opset >= 18 and c.x(3) else []
    picked = b.op("Pad", [grid, c.x(1)] + (["", extra[0]] if extra else []), mode=mode)
    out[0] = _scatter_flat(b, x, picked, c.gy, add=True)
    return out


# -- Tile, GatherElements -------------------------------------------------------------------

@rule("Tile")
def tile(c: Ctx):
    """dy viewed as ``[repeats_0, n_0, repeats_1, n_1, ...]`` and summed over the repeats."""
    b = c.b
    x = c.x(0)
    if b.opset < 6:
        raise c.fail("Tile-1 (tiles/axis inputs) is not supported")
    r = c.rank(x)
    if r == 0:
        return [c.gy, None]
    reps, dims = b.constant_value(c.x(1)), b.shape(x)
    if reps is not None and dims is not None and all(isinstance(d, int) for d in dims):
        inter = b.ints([v for pair in zip(np.asarray(reps).reshape(-1), dims) for v in pair])
    else:
        pair = b.op("Concat", [b.unsqueeze(c.x(1), [1]), b.unsqueeze(b.op("Shape", [x]), [1])],
                    axis=1)
        inter = b.op("Reshape", [pair, b.ints([-1])])
    g = b.op("Reshape", [c.gy, inter])
    g = b.reduce("ReduceSum", g, list(range(0, 2 * r, 2)), keepdims=0)
    return [b.reshape_like(g, x), None]


@rule("GatherElements")
def gather_elements(c: Ctx):
    """ScatterElements with reduction 'add' (opset >= 16); before, a OneHot along the axis
    multiplied by dy and summed (memory: indices x axis length)."""
    b = c.b
    x, idx = c.x(0), c.x(1)
    r = c.rank(x)
    axis = c.attr("axis", 0)
    axis = axis + r if axis < 0 else axis
    if b.opset >= 16:
        g = b.op("ScatterElements", [b.zeros_like(x), idx, c.gy], axis=axis, reduction="add")
        return [g, None]
    depth = b.op("Slice", [b.op("Shape", [x]), b.ints([axis]), b.ints([axis + 1])])
    oh = _one_hot(b, idx, depth, axis + 1, x)  # idx[:axis+1] + [V] + idx[axis+1:]
    g = b.reduce("ReduceSum", b.op("Mul", [oh, b.unsqueeze(c.gy, [axis + 1])]), [axis], 0)
    xd, id_ = b.shape(x), b.shape(idx)
    same = xd is not None and id_ is not None and all(
        a == i or k == axis for k, (a, i) in enumerate(zip(xd, id_)))
    if not same:  # indices shorter than the data on other axes: zeros for the rest
        short = b.op("Sub", [b.op("Shape", [x]), b.op("Shape", [g])])
        g = b.op("Pad", [g, b.op("Concat", [b.ints([0] * r), short], axis=0)])
    return [g, None]


# -- DepthToSpace, SpaceToDepth ----------------------------------------------------------------

@rule("DepthToSpace")
def depth_to_space(c: Ctx):
    """DCR is undone by SpaceToDepth; CRD by SpaceToDepth and a channel reordering."""
    b = c.b
    x = c.x(0)
    bs = int(c.attr("blocksize"))
    g = b.op("SpaceToDepth", [c.gy], blocksize=bs)  # channels (bh, bw, c)
    if c.attr("mode", "DCR") == "DCR":
        return [g]
    # CRD's channels are (c, bh, bw): [N, bs*bs, C, H, W] -> [N, C, bs*bs, H, W]
    dims = b.shape(x)
    if dims is not None and all(isinstance(d, int) for d in dims):
        five = b.ints([dims[0], bs * bs, dims[1] // (bs * bs), dims[2], dims[3]])
    else:
        five = b.op("Concat", [b.ints([0, bs * bs, -1]),
                               b.op("Slice", [b.op("Shape", [x]), b.ints([2]), b.ints([4])])],
                    axis=0)
    g = b.op("Transpose", [b.op("Reshape", [g, five])], perm=[0, 2, 1, 3, 4])
    return [b.reshape_like(g, x)]


@rule("SpaceToDepth")
def space_to_depth(c: Ctx):
    return [c.b.op("DepthToSpace", [c.gy], blocksize=int(c.attr("blocksize")))]


# -- Einsum -----------------------------------------------------------------------------------

def _einsum_terms(eq: str, n: int) -> tuple[list[str], str]:
    eq = eq.replace(" ", "")
    lhs, _, out = eq.partition("->")
    terms = lhs.split(",")
    if "->" not in eq:  # implicit output: the ellipsis, then the letters seen once, sorted
        letters = "".join(t.replace("...", "") for t in terms)
        out = ("..." if any("..." in t for t in terms) else "") + "".join(
            sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    return terms, out


@rule("Einsum")
def einsum(c: Ctx):
    """Operand i's gradient is the Einsum of dy with the other operands onto operand i's
    subscripts; its letters found nowhere else (summed away from it alone) are put back by
    Expand, and an ellipsis broadcast against the others is summed back."""
    b = c.b
    eq = c.attr("equation")
    n = len(c.node.input)
    terms, out_t = _einsum_terms(eq, n)
    if len(terms) != n:
        raise c.fail(f"equation {eq!r} has {len(terms)} operands for {n} inputs")
    res: list = [None] * n
    for i in range(n):
        if not c.need(i):
            continue
        t = terms[i]
        letters = t.replace("...", "")
        if len(set(letters)) != len(letters):
            raise c.fail(f"operand {i}'s subscripts {t!r} repeat a letter (a diagonal): its "
                         "gradient is not supported")
        others = [out_t] + [terms[j] for j in range(n) if j != i]
        seen = "".join(others)
        ell = "..." in t
        if ell and "..." not in seen:
            raise c.fail(f"operand {i}'s ellipsis is summed away by {eq!r}: its gradient is "
                         "not supported")
        head, _, tail = t.partition("...") if ell else (t, "", "")
        keep = lambda s: "".join(ch for ch in s if ch in seen)  # noqa: E731
        target = keep(head) + ("..." if ell else "") + keep(tail)
        ins = [c.gy] + [c.x(j) for j in range(n) if j != i]
        g = b.op("Einsum", ins, equation=",".join(others) + "->" + target)
        gone = [k for k, ch in enumerate(head) if ch not in seen] + \
            [k - len(tail) for k, ch in enumerate(tail) if ch not in seen]
        x = c.x(i)
        if gone:
            g = b.op("Expand", [b.unsqueeze(g, gone), b.op("Shape", [x])])
        if ell and _ellipsis_broadcast(c, i, terms, out_t):
            if head:
                raise c.fail(f"operand {i}'s ellipsis ({t!r}) is broadcast against the "
                             "others after a named axis: its gradient is not supported")
            g = b.unbroadcast(g, None, x)
        res[i] = g
    return res


def _ellipsis_broadcast(c: Ctx, i: int, terms: list[str], out_t: str) -> bool:
    """Whether operand i's ellipsis dims may differ from the broadcast ellipsis (True when
    the shapes do not say)."""
    def ell_dims(name: str, t: str):
        dims = c.b.shape(name)
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        head, _, tail = t.partition("...")
        return list(dims[len(head):len(dims) - len(tail)])
    mine = ell_dims(c.x(i), terms[i])
    if mine is None:
        return True
    for j, t in enumerate(terms):
        if j != i and "..." in t:
            other = ell_dims(c.x(j), t)
            if other is None:
                return True
            full = list(np.broadcast_shapes(tuple(mine), tuple(other)))
            if full != mine:
                return True
    return False
