"""The standard-op expansion of ``com.trainops::AdamW`` (PyTorch's ``torch.optim.AdamW``).

The fused op's layout and attributes (README, AdamW; ``crates/trainops-ort/src/ops/optim/
adamw.rs``): inputs ``R, T, X_1..X_n, G_1..G_n, M_1..M_n, V_1..V_n`` and, with
``amsgrad = 1``, ``Vmax_1..Vmax_n``; outputs ``X_i_new, M_i_new, V_i_new`` (and
``Vmax_i_new``); attributes ``beta1``, ``beta2``, ``epsilon``, ``weight_decay`` (floats,
each read as the decimal it was written as), ``amsgrad``, ``maximize`` (0 or 1).

The kernel's operations (``crates/trainops-kernels/src/optim/adamw/mod.rs``: ``AdamWCoeffs``,
``moments``, ``apply``), one node each, in its order: the per-call scalars in double from
``R`` and ``T`` (``Pow`` as ``f64::powf``, ``** 0.5`` as a ``Pow`` too), each rounded once to
the compute type; per element ``lerp`` and ``addcmul`` as fused multiply-adds
(:mod:`.fma`: exact in float32, so for float32, float16 and bfloat16 tensors; in float64
exact unless a product underflows below 2^-969), every other operation rounded.

``T < 1`` is an error, as in the fused op: a ``Gather`` node named
``.../T_must_be_at_least_1`` fails at run time, before any output is written.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .emit import DOUBLE, FLOAT, INT64, Emitter, Expansion, ExpansionError
from . import flat
from .fma import fma
from .optimizers import _Rates, _tensor_types, compute_type, rate_types, split_groups

__all__ = ["adamw", "ADAMW_DEFAULTS", "adamw_attributes"]

# The op's float attributes with torch's defaults.
ADAMW_DEFAULTS = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 1e-2}
_FLAGS = ("amsgrad", "maximize")
_NP = {FLOAT: np.float32, DOUBLE: np.float64}


def as_written(value: float) -> float:
    """A float32 attribute as the decimal it was written as (the shortest decimal that
    rounds to it, as the kernel's ``adamw::as_written``), read as a double."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


def adamw_attributes(e: Emitter) -> tuple[dict[str, float], dict[str, bool]]:
    """The node's float attributes (as written, torch's defaults) and its 0/1 flags,
    checked as the fused op checks them."""
    from onnx import AttributeProto

    floats = {k: float(v) for k, v in ADAMW_DEFAULTS.items()}
    flags = {k: False for k in _FLAGS}
    for a in e.node.attribute:
        if a.name in floats:
            if a.type != AttributeProto.FLOAT:
                raise ExpansionError(e.where(f"attribute {a.name!r}: expected a float, got "
                                             f"{AttributeProto.AttributeType.Name(a.type)}"))
            floats[a.name] = as_written(a.f)
        elif a.name in flags:
            if a.type != AttributeProto.INT or a.i not in (0, 1):
                kind = AttributeProto.INT
                got = a.i if a.type == kind else AttributeProto.AttributeType.Name(a.type)
                raise ExpansionError(e.where(f"attribute {a.name!r}: expected 0 or 1, got {got}"))
            flags[a.name] = bool(a.i)
    for name, value in floats.items():
        below_one = name.startswith("beta")
        if not (0.0 <= value < 1.0 if below_one else value >= 0.0):
            want = "a value in [0, 1)" if below_one else "a value >= 0"
            raise ExpansionError(e.where(f"attribute {name!r}: expected {want} (as "
                                         f"torch.optim.AdamW), got {value}"))
    return floats, flags


def _step_inputs(e: Emitter) -> tuple[str, str]:
    """``(R, T)`` as double scalars, ``T`` read through a ``Gather`` node named
    ``.../T_must_be_at_least_1`` whose index is out of range for ``T < 1``. Every output
    depends on that node (:meth:`Emitter.ready`), so a failed run writes none."""
    from onnx import helper

    r, t = e.node.input[0], e.node.input[1]
    re = e.elem(r, "R", rate_types(e))
    e.elem(t, "T", (INT64,))
    ts = e.scalar(t)
    index = e.op("Cast", e.op("Less", ts, e.const(1, INT64)), to=INT64)  # 1: out of range
    checked = e.fresh("t_checked")
    e.nodes.append(helper.make_node("Gather", [e.op("Reshape", ts, e.ints([1])), index],
                                    [checked], name=e.fresh("T_must_be_at_least_1"), axis=0))
    e.ordered_after = [r, checked]
    td = e.op("Cast", checked, to=e.wide, hint="t")
    return e.cast(e.scalar(r), re, e.wide), td


def _scalars(e: Emitter, a: dict, rd: str, td: str) -> tuple:
    """``(decay or None, step_size, sqrt of the second bias correction)`` in float64."""
    one = e.const(1.0, DOUBLE)
    pow_t = lambda beta: e.op("Pow", e.const(beta, DOUBLE), td)  # noqa: E731
    decay = (e.op("Sub", one, e.op("Mul", rd, e.const(a["weight_decay"], DOUBLE)), hint="decay")
             if a["weight_decay"] != 0.0 else None)
    step = e.op("Div", rd, e.op("Sub", one, pow_t(a["beta1"])), hint="step_size")
    bc2 = e.op("Pow", e.op("Sub", one, pow_t(a["beta2"])), e.const(0.5, DOUBLE), hint="bc2_sqrt")
    return decay, step, bc2


def _scalars_ff(e: Emitter, a: dict, rd: str, td: str) -> tuple:
    """The same in float-float (:mod:`.ff`), each rounded to a float32 scalar."""
    from .ff import FF

    ff = FF(e)
    one, r = ff.const(1.0), ff.of(rd)
    decay = (ff.sub(one, ff.mul(r, ff.const(a["weight_decay"])))[0]
             if a["weight_decay"] != 0.0 else None)
    step = ff.div(r, ff.sub(one, ff.pow(a["beta1"], td)))[0]
    bc2 = ff.sqrt(ff.sub(one, ff.pow(a["beta2"], td)))[0]
    return decay, step, bc2


def _update(e: Emitter, load: dict, c: int, a: dict, flags: dict, rates: dict) -> list:
    """AdamW's elementwise update of the loaded streams (compute type ``c``): ``[x', m',
    v']`` and ``vmax'`` under amsgrad."""
    cnp = _NP[c]
    g, m = load["G"], load["M"]
    if flags["maximize"]:
        g = e.op("Neg", g, hint="g")
    # A runtime 1 when wd = 0 (the kernel multiplies by 1 too; no constant to fold away).
    scale = rates["decay"][c] if "decay" in rates else e.coefficient(1.0, c)
    x = e.op("Mul", load["X"], scale, hint="x")
    weight = cnp(1.0 - a["beta1"])
    from_end = not (-0.5 < weight < 0.5)
    lerp = weight - cnp(1.0) if from_end else weight
    # Coefficients through Emitter.coefficient: the moments come after R and T.
    m = fma(e, e.coefficient(lerp, c), e.op("Sub", g, m), g if from_end else m, c)
    v_scaled = e.op("Mul", load["V"], e.const(cnp(a["beta2"]), c))
    g_scaled = e.op("Mul", e.coefficient(cnp(1.0 - a["beta2"]), c), g)
    v = fma(e, g_scaled, g, v_scaled, c)
    second = v
    if flags["amsgrad"]:
        # keep_max: vmax where vmax > v' or vmax is NaN, else v'; here as "v' where
        # not (vmax > v') and vmax is not NaN", v' first: Where drops a selected -0 of
        # its first operand, and v' is never -0 (a sum with a non-negative product).
        # No Not before the Where: onnxruntime fuses them, swapping the operands.
        old = load["Vmax"]
        not_greater = e.or_(e.op("LessOrEqual", old, v), e.is_nan(v))
        take_new = e.op("And", not_greater, e.op("Equal", old, old))
        second = e.op("Where", take_new, v, old, hint="vmax")
    denom = e.op("Add", e.op("Div", e.sqrt(second, c), rates["bc2"][c]),
                 e.const(cnp(a["epsilon"]), c), hint="denom")
    x = e.op("Sub", x, e.op("Div", e.op("Mul", rates["step"][c], m), denom), hint="x")
    return [x, m, v] + ([second] if flags["amsgrad"] else [])


def adamw(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``com.trainops::AdamW``, per element (``c()``: rounded once to the compute type)::

        g  = maximize ? -g : g
        x  = x * c(wd != 0 ? 1 - lr * wd : 1)
        m' = fma(c(1 - beta1), g - m, m)          if |c(1 - beta1)| < 0.5
           = fma(c(1 - beta1) - 1, g - m, g)      otherwise
        v' = fma(c(1 - beta2) * g, g, v * c(beta2))
        vmax' = vmax > v' or vmax is NaN ? vmax : v'          (amsgrad)
        x' = x - (c(lr / (1 - beta1^T)) * m') / (sqrt(s) / c((1 - beta2^T) ** 0.5) + c(eps))

    with ``s = vmax'`` under amsgrad, else ``v'``."""
    e = Emitter(node, types, taken, **options)
    a, flags = adamw_attributes(e)
    groups = "X G M V Vmax".split() if flags["amsgrad"] else "X G M V".split()
    n, ins, outs = split_groups(e, ["R", "T"], groups, len(groups) - 1)
    rd, td = _step_inputs(e)
    decay, step, bc2 = (_scalars if e.float64 else _scalars_ff)(e, a, rd, td)
    rates = {"step": _Rates(e, step), "bc2": _Rates(e, bc2)}
    if decay is not None:
        rates["decay"] = _Rates(e, decay)
    members = []
    for i in range(n):
        streams = {p: ins[k][i] for k, p in enumerate(groups)}
        members.append((i, streams) + _tensor_types(e, i + 1, streams, "G"))
    # Without float64 the tensors of one type are updated together (flat: a few hundred
    # nodes per update, each a dispatch on a GPU EP); with it, one by one as before.
    for batch in flat.batches(members, not e.float64 and n > 1, e.sizes):
        xe, ge = batch[0][2:]
        c = compute_type(xe)
        loads = [{p: e.cast(name, ge if p == "G" else xe, c) for p, name in m[1].items()}
                 for m in batch]
        load, parts = flat.join(e, loads) if len(batch) > 1 else (loads[0], None)
        values = _update(e, load, c, a, flags, rates)
        for value, group in zip(values, outs):
            pieces = [value] if parts is None else flat.split(e, value, parts)
            for piece, m in zip(pieces, batch):
                e.output(piece, group[m[0]], c, xe)
    return e.finish()
