"""One elementwise update for many tensors, for the float32-only expansions.

Without float64 (EPs like WebGPU: :data:`~trainops.portable.NO_FLOAT64`) an optimizer's
update takes a few hundred elementwise nodes per tensor (AdamW's exact fmas in float32,
:func:`~trainops.portable.fma.fma_split`), and on a GPU each node is a dispatch. So the
tensors of one element type are joined: each stream's tensors, loaded in the compute type,
flattened (``Reshape`` to 1-D, a gradient first ``Expand``-ed to its weight's shape) and
concatenated, the update run once over the joined vectors (up to :data:`LIMIT` elements:
the transient memory), and each tensor's part taken back (``Slice`` at offsets from the
weights' ``Shape``, ``Reshape`` to it). The arithmetic per element is the same, so the
values are too. ``Slice`` rather than one ``Split``: WebGPU's ``Split`` binds every output
in one shader, beyond the storage buffers a shader stage may have (a few dozen tensors).
"""

from __future__ import annotations

from .emit import Emitter

__all__ = ["batches", "join", "split"]


# The most elements joined into one update: its intermediates (a few dozen alive at once
# in AdamW's fmas) are each that long, so this bounds the transient memory (16 MiB each).
LIMIT = 2 ** 22


def batches(members: list, joined: bool, sizes: dict) -> list[list]:
    """``members`` (tuples ``(index, streams, weight type, gradient type)``) in batches
    updated together: with ``joined``, consecutive tensors of one pair of types up to
    :data:`LIMIT` elements in all (``sizes``: element counts by name; a tensor of unknown
    size alone); else one each."""
    if not joined:
        return [[m] for m in members]
    by: dict = {}
    for m in members:
        by.setdefault((m[2], m[3]), []).append(m)
    out = []
    for group in by.values():
        batch, total = [], 0
        for m in group:
            size = sizes.get(m[1]["X"], LIMIT)
            if batch and total + size > LIMIT:
                out.append(batch)
                batch, total = [], 0
            batch.append(m)
            total += size
        out.append(batch)
    return out


def join(e: Emitter, streams: list[dict], gradient: str = "G") -> tuple[dict, list]:
    """``({stream: joined 1-D vector}, parts)`` for the tensors' streams (``{stream
    letter: name}`` each, ``"X"`` the weight); ``parts`` (each weight's shape, start and
    end in the joined vectors) is what :func:`split` takes."""
    flat = e.ints([-1])
    shapes = [e.op("Shape", s["X"], hint="shape") for s in streams]
    joined = {}
    for p in streams[0]:
        pieces = []
        for s, shape in zip(streams, shapes):
            name = e.op("Expand", s[p], shape) if p == gradient else s[p]
            pieces.append(e.op("Reshape", name, flat, hint="flat"))
        joined[p] = e.op("Concat", *pieces, axis=0, hint=f"joined_{p}")
    parts, start = [], e.ints([0])
    for shape in shapes:
        end = e.op("Add", start, e.op("ReduceProd", shape, keepdims=1, hint="size"), hint="end")
        parts.append((shape, start, end))
        start = end
    return joined, parts


def split(e: Emitter, value: str, parts: list) -> list[str]:
    """The parts of the joined ``value`` (1-D), each reshaped to its tensor's shape."""
    axis = e.ints([0])
    return [e.op("Reshape", e.op("Slice", value, start, end, axis, hint="part"), shape,
                 hint="part") for shape, start, end in parts]
