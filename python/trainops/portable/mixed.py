"""Standard-op expansions of the mixed-precision nodes ``com.trainops::MixedPrecisionAdam``,
``DynamicLossScale`` and ``AllFinite``.

Finiteness is decided with ``IsInf``/``IsNaN`` (not ``x - x``, which an EP's compiler may
fold to 0): each tensor's non-finite elements are counted (``ReduceSum`` of the 0/1 flags
in float32, which cannot return to 0 once positive), the counts are added and compared with
0. The skipped step of MixedPrecisionAdam is ``Where(finite, new, old)``, which copies the
old bits.
"""

from __future__ import annotations

from typing import Mapping

from onnx import AttributeProto, helper

from .emit import (BFLOAT16, BOOL, FLOAT, FLOAT16, FLOAT_TYPES, INT64, Emitter,
                   Expansion, ExpansionError, float_attrs)
from .optimizers import ADAM_DEFAULTS, _tensor_types, adam_rate, adam_update, split_groups

__all__ = ["mixed_precision_adam", "dynamic_loss_scale", "all_finite", "nonfinite_count"]

_COPY_TYPES = {0: None, FLOAT16: FLOAT16, BFLOAT16: BFLOAT16}


def _int_attr(e: Emitter, name: str, default: int) -> int:
    for a in e.node.attribute:
        if a.name == name:
            if a.type != AttributeProto.INT:
                raise ExpansionError(e.where(f"attribute {name!r}: expected an int"))
            return int(a.i)
    return default


def nonfinite_count(e: Emitter, values: list[str]) -> str:
    """A float32 scalar: how many elements of the float/double ``values`` are Inf or NaN
    (exact up to 2^24, and never 0 when one is)."""
    counts = []
    for v in values:
        bad = e.or_(e.is_inf(v, e.types.get(v, FLOAT)), e.is_nan(v))  # float or double
        flags = e.op("Cast", bad, to=FLOAT)
        counts.append(e.op("ReduceSum", flags, keepdims=0, hint="count"))
    if len(counts) == 1:
        return counts[0]
    if e.float64:
        return e.op("Sum", *counts, hint="count")
    total = counts[0]  # WebGPU has no Sum kernel
    for c in counts[1:]:
        total = e.op("Add", total, c, hint="count")
    return total


def mixed_precision_adam(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``com.trainops::MixedPrecisionAdam``: ``g = G / loss_scale`` in float32; ``finite``
    when every such g is finite; then (an ``If`` on ``finite``) Adam on g, or every output
    a copy of its input; ``X_copy = Cast(X_new, copy_dtype)`` when ``copy_dtype`` is 10
    or 16."""
    e = Emitter(node, types, taken, **options)
    a = float_attrs(node, ADAM_DEFAULTS)
    copy_dtype = _int_attr(e, "copy_dtype", 0)
    if copy_dtype not in _COPY_TYPES:
        raise ExpansionError(e.where(f"attribute 'copy_dtype': expected 0 (no copies), 10 "
                                     f"(float16) or 16 (bfloat16), got {copy_dtype}"))
    groups = 4 if copy_dtype else 3
    n, (xs, gs, vs, hs), outs = split_groups(e, ["R", "T", "loss_scale"], "XGVH", groups, 1)
    e.elem(node.input[2], "loss_scale", (FLOAT,))
    scale = e.scalar(node.input[2])
    rate = e.cast(adam_rate(e, a["alpha"], a["beta"]), e.wide, FLOAT)
    e.ordered_after = list(node.input[:3])  # R, T, loss_scale: see Emitter.ready
    loaded, unscaled = [], []
    for i in range(n):
        streams = {"X": xs[i], "G": gs[i], "V": vs[i], "H": hs[i]}
        xe, ge = _tensor_types(e, i + 1, streams, "G")
        if xe != FLOAT:
            raise ExpansionError(e.where(f"input X_{i + 1} ({xs[i]!r}): expected tensor(float) "
                                         "(mixed precision keeps float32 weights)"))
        g = e.op("Div", e.cast(gs[i], ge, FLOAT), scale, hint="g")
        loaded.append((xs[i], vs[i], hs[i]))
        unscaled.append(g)
    finite = e.op("And", e.op("Equal", nonfinite_count(e, unscaled), e.const(0.0, FLOAT)),
                  e.ready(), hint="finite")  # after R and T too, as the fused node
    e.output(finite, node.output[0], BOOL, BOOL)
    # The step, or the old values: an If on the scalar flag (Where would turn a kept -0.0
    # into +0.0, see Emitter.select), which also skips the arithmetic of a skipped step.
    mark = len(e.nodes)
    updated = []
    for i in range(n):
        updated.extend(adam_update(e, FLOAT, a, rate, *loaded[i][:1], unscaled[i], *loaded[i][1:]))
    then_nodes = e.nodes[mark:]
    del e.nodes[mark:]
    kept = [e.fresh("kept") for _ in updated]
    olds = [old for i in range(n) for old in loaded[i]]
    else_nodes = [helper.make_node("Identity", [old], [k], name=e.fresh("Identity"))
                  for old, k in zip(olds, kept)]

    def branch(name, nodes, outputs):
        return helper.make_graph(nodes, e.fresh(name), [],
                                 [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs])

    results = [outs[j][i] for i in range(n) for j in range(3)]  # X, V, H of tensor i
    e.nodes.append(helper.make_node("If", [finite], results, name=e.fresh("If"),
                                    then_branch=branch("step", then_nodes, updated),
                                    else_branch=branch("skip", else_nodes, kept)))
    if copy_dtype:
        for i in range(n):
            e.nodes.append(helper.make_node("Cast", [outs[0][i]], [outs[3][i]], to=copy_dtype,
                                            name=e.fresh("Cast")))
    return e.finish()


def dynamic_loss_scale(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``com.trainops::DynamicLossScale``: finite: ``good_steps + 1 == growth_interval`` ?
    (``scale * growth_factor`` if finite else ``scale``, 0) : (``scale``, ``good_steps + 1``);
    not finite: (``max(scale * backoff_factor, min_scale)``, 0). The count saturates at
    the int64 maximum; outputs keep the shapes of ``scale`` and ``good_steps``."""
    e = Emitter(node, types, taken, **options)
    if len(node.input) != 3 or len(node.output) != 2:
        raise ExpansionError(e.where("expected 3 inputs (scale, good_steps, finite) and 2 "
                                     f"outputs, got {len(node.input)} and {len(node.output)}"))
    a = float_attrs(node, {"growth_factor": 2.0, "backoff_factor": 0.5, "min_scale": 0.0})
    interval = _int_attr(e, "growth_interval", 2000)
    if interval < 1:
        raise ExpansionError(e.where(f"attribute 'growth_interval': expected a positive "
                                     f"interval, got {interval}"))
    for name, v in a.items():
        if not (v >= 0.0 and v != float("inf")):
            raise ExpansionError(e.where(f"attribute {name!r}: expected a finite value >= 0, "
                                         f"got {v}"))
    scale_in, good_in, finite_in = node.input
    e.elem(scale_in, "scale", (FLOAT,))
    e.elem(good_in, "good_steps", (INT64,))
    e.elem(finite_in, "finite", (BOOL,))
    s, good, finite = e.scalar(scale_in), e.scalar(good_in), e.scalar(finite_in)
    zero = e.const(0, INT64)
    top = e.const(2**63 - 1, INT64)
    steps = e.op("Where", e.op("Equal", good, top), good, e.op("Add", good, e.const(1, INT64)))
    grow = e.op("Equal", steps, e.const(interval, INT64))
    grown = e.op("Mul", s, e.const(a["growth_factor"], FLOAT))
    grown_bad = e.or_(e.is_inf(grown, FLOAT), e.is_nan(grown))
    kept = e.select(grow, e.select(grown_bad, s, grown, FLOAT), s, FLOAT)
    backed = e.op("Mul", s, e.const(a["backoff_factor"], FLOAT))
    floor = e.const(a["min_scale"], FLOAT)
    low = e.or_(e.op("Less", backed, floor), e.is_nan(backed))
    backed = e.select(low, floor, backed, FLOAT)  # f32::max: the non-NaN one
    new_scale = e.select(finite, kept, backed, FLOAT)
    new_good = e.op("Where", finite, e.op("Where", grow, zero, steps), zero)

    for value, like, out in ((new_scale, scale_in, node.output[0]),
                             (new_good, good_in, node.output[1])):
        shape = e.op("Shape", like)
        e.nodes.append(helper.make_node("Reshape", [value, shape], [out], name=e.fresh("Reshape")))
    return e.finish()


def all_finite(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``com.trainops::AllFinite``: a bool scalar, true when every element of every input
    (float, double, float16, bfloat16; 16-bit ones widened to float32 first) is finite."""
    e = Emitter(node, types, taken, **options)
    if len(node.input) < 1 or len(node.output) != 1:
        raise ExpansionError(e.where("expected at least 1 input and 1 output"))
    values = []
    for k, name in enumerate(node.input):
        elem = e.elem(name, f"X_{k + 1}", FLOAT_TYPES if e.float64 else (FLOAT, FLOAT16, BFLOAT16))
        values.append(e.cast(name, elem, FLOAT if elem in (FLOAT16, BFLOAT16) else elem))
    finite = e.op("Equal", nonfinite_count(e, values), e.const(0.0, FLOAT))
    e.output(finite, node.output[0], BOOL, BOOL)
    return e.finish()
