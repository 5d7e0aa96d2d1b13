"""Gradient rules for gathers, scatters and masks by position: GatherND, ScatterND,
ScatterElements and Trilu. Registered into :data:`.rules.RULES`.

torch's dynamo exporter writes advanced indexing (``weight[positions]`` after a transpose,
Whisper's and GPT-2's position tables) as GatherND. Its gradient adds dY into zeros at the
gathered positions, which repeat (a position read twice gets both gradients): ScatterND
with reduction ``add``, opset >= 16 (:data:`~.coverage.OPSET_NEEDS` asks the importer
for it). ``batch_dims`` is turned into explicit batch coordinates, and negative indices
into positive ones, since ScatterND takes neither.
"""

from __future__ import annotations

import numpy as np

from .graph import Builder
from .rules import Ctx, rule


def _shape_slice(b: Builder, shape: str, start: int, end: int) -> str:
    return b.op("Slice", [shape, b.ints([start]), b.ints([end])])


def _full_indices(c: Ctx, data: str, idx: str, batch_dims: int) -> str:
    """``idx`` as indices into all of ``data`` with batch_dims=0: negative entries made
    positive, the batch coordinates put in front of each tuple."""
    b = c.b
    q = c.rank(idx)
    ids = b.shape(idx)
    k = ids[-1] if ids else None
    if not isinstance(k, int):
        raise c.fail(f"the last dimension of its indices '{idx}' (the index tuple's length) "
                     "must be known statically")
    dshape = b.shape_of(data)
    zero = b.const(np.int64(0))
    bounds = _shape_slice(b, dshape, batch_dims, batch_dims + k)  # broadcasts on the last axis
    idx = b.op("Where", [b.op("Less", [idx, zero]), b.op("Add", [idx, bounds]), idx])
    if batch_dims == 0:
        return idx
    ishape = b.op("Shape", [idx])
    lead = _shape_slice(b, ishape, 0, q - 1)
    coords = []
    for i in range(batch_dims):
        n_i = _shape_slice(b, ishape, i, i + 1)
        steps = b.op("Range", [zero, b.op("Squeeze", [n_i]), b.const(np.int64(1))])
        where = b.op("Concat", [b.ints([1] * i), n_i, b.ints([1] * (q - 2 - i))], axis=0)
        grid = b.op("Expand", [b.op("Reshape", [steps, where]), lead])
        coords.append(b.unsqueeze(grid, [q - 1]))
    return b.op("Concat", coords + [idx], axis=q - 1)


@rule("GatherND")
def gather_nd(c: Ctx):
    """dY added into zeros at the gathered positions (ScatterND 'add')."""
    b = c.b
    data, idx = c.x(0), c.x(1)
    if b.opset < 16:
        raise c.fail("its gradient needs opset >= 16 (ScatterND with reduction 'add'); the "
                     f"model imports {b.opset}")
    batch_dims = int(c.attr("batch_dims", 0))
    full = _full_indices(c, data, idx, batch_dims)
    g = b.op("ScatterND", [b.zeros_like(data), full, c.gy], reduction="add")
    return [g, None]


@rule("ScatterND")
def scatter_nd(c: Ctx):
    """none: data gets dY with the written positions zeroed (ScatterND of zeros), updates
    get dY gathered there (GatherND); add: data gets dY as it is. mul/max/min are refused."""
    b = c.b
    data, idx, upd = c.x(0), c.x(1), c.x(2)
    reduction = c.attr("reduction", "none")
    if reduction not in ("none", "add"):
        raise c.fail(f"reduction={reduction!r}: only 'none' and 'add' have a gradient rule")
    out: list = [None, None, None]
    full = _full_indices(c, data, idx, 0) if c.need(0) or c.need(2) else None
    if c.need(0):
        out[0] = c.gy if reduction == "add" else \
            b.op("ScatterND", [c.gy, full, b.zeros_like(upd)])
    if c.need(2):
        out[2] = b.op("GatherND", [c.gy, full])
    return out


@rule("ScatterElements")
def scatter_elements(c: Ctx):
    """As ScatterND along one axis: data gets dY with the written positions zeroed (none)
    or dY (add); updates get dY gathered there (GatherElements). mul/max/min are refused."""
    b = c.b
    data, idx, upd = c.x(0), c.x(1), c.x(2)
    axis = int(c.attr("axis", 0))
    reduction = c.attr("reduction", "none")
    if reduction not in ("none", "add"):
        raise c.fail(f"reduction={reduction!r}: only 'none' and 'add' have a gradient rule")
    out: list = [None, None, None]
    if c.need(0):
        out[0] = c.gy if reduction == "add" else \
            b.op("ScatterElements", [c.gy, idx, b.zeros_like(upd)], axis=axis)
    if c.need(2):
        out[2] = b.op("GatherElements", [c.gy, idx], axis=axis)
    return out


@rule("Trilu")
def trilu(c: Ctx):
    """The same triangle of dY (Trilu is a mask)."""
    ins = [c.gy] + ([c.x(1)] if c.x(1) else [])
    return [c.b.op("Trilu", ins, upper=int(c.attr("upper", 1))), None]
