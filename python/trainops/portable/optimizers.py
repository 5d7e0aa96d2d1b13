"""Standard-op expansions of the optimizer nodes ``ai.onnx.preview.training::Adam``,
``Adagrad`` and ``Momentum`` (``com.trainops::AdamW``'s is :mod:`.adamw`, on these helpers).

Each function takes the node, the element types of the values it reads and the set of
names taken in the graph, and returns an :class:`~trainops.portable.emit.Expansion`. The
expansions do the kernels' operations (``crates/trainops-kernels/src/optim/*/mod.rs``,
``update`` and the per-call coefficients) one ONNX node each, in the kernels' order:

- scalar coefficients from attributes are formed in float64 from the float32 attribute
  and rounded once to the compute type (initializers);
- the per-call learning rate is computed in float64 from ``R`` and ``T`` (``Pow`` on
  doubles, as ``f64::powf``) and rounded once to the compute type with ``Cast``;
- float16 and bfloat16 tensors are widened to float32 with ``Cast``, updated in float32
  and narrowed back (round to nearest even); double tensors are updated in double.

- float32 square roots go through float64 unless ``sqrt="native"``
  (:meth:`~trainops.portable.emit.Emitter.sqrt`);
- without float64 (``float64=False``, for EPs that have none) the per-call scalars are
  computed in float-float (:mod:`.ff`), square roots are native, and double tensors are
  refused;
- every output depends on every input of the node, as the fused node reads them all
  before it writes (:meth:`~trainops.portable.emit.Emitter.ready`): with in-place
  IOBinding no tensor's new value may be written before another gradient, computed from
  the old weights, exists.

So on a runtime that rounds every ``Mul``/``Add``/``Sub``/``Div`` and the double ``Sqrt``
correctly (no fused multiply-add) and whose double ``Pow`` is the kernels' ``f64::powf``
(the platform's ``pow``), the result has the fused kernels' bits. (AdamW's kernel fuses two
multiply-adds: :mod:`.adamw` emits them through :mod:`.fma`, exact in float32 and, unless
a product underflows below 2^-969, in float64.)
"""

from __future__ import annotations

from typing import Mapping

from .emit import (BFLOAT16, DOUBLE, FLOAT, FLOAT16, FLOAT_TYPES, INT64, Emitter, Expansion,
                   ExpansionError, float_attrs)

__all__ = ["adam", "adagrad", "momentum", "ADAM_DEFAULTS", "ADAGRAD_DEFAULTS",
           "split_groups", "adam_rate", "adam_update", "compute_type"]

ADAM_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "norm_coefficient": 0.0,
                 "norm_coefficient_post": 0.0}
ADAGRAD_DEFAULTS = {"decay_factor": 0.0, "epsilon": 1e-6, "norm_coefficient": 0.0}
MOMENTUM_ATTRS = {"alpha": None, "beta": None, "norm_coefficient": None}


def split_groups(e: Emitter, scalars: list[str], groups: str, out_groups: int,
                 extra_outputs: int = 0) -> tuple[int, list[list[str]], list[list[str]]]:
    """Checks the variadic arity ``len(scalars) + len(groups) * n`` inputs and
    ``extra_outputs + out_groups * n`` outputs (``n >= 1``); returns ``n``, the input
    groups and the output groups (after the extra outputs)."""
    node = e.node
    k, m = len(scalars), len(groups)
    n, rest = divmod(len(node.input) - k, m)
    want = (f"{k} + {m}n inputs ({', '.join(scalars)}, then "
            f"{', '.join(f'{p}_1..{p}_n' for p in groups)}, n >= 1)")
    if n < 1 or rest:
        raise ExpansionError(e.where(f"expected {want}, got {len(node.input)}"))
    if len(node.output) != extra_outputs + out_groups * n:
        raise ExpansionError(e.where(f"expected {extra_outputs + out_groups * n} outputs for "
                                     f"n = {n} tensors, got {len(node.output)}"))
    ins = list(node.input[k:])
    outs = list(node.output[extra_outputs:])
    return (n, [ins[j * n:(j + 1) * n] for j in range(m)],
            [outs[j * n:(j + 1) * n] for j in range(out_groups)])


def rate_types(e: Emitter) -> tuple[int, ...]:
    """The types ``R`` may have: float or double, float alone without float64."""
    return (FLOAT, DOUBLE) if e.float64 else (FLOAT,)


def _rate_inputs(e: Emitter) -> tuple[str, str, str]:
    """(R as a scalar of ``e.wide``, T as an int64 scalar, T as a scalar of ``e.wide``):
    float64, or float32 without float64."""
    r, t = e.node.input[0], e.node.input[1]
    e.ordered_after = [r, t]
    re = e.elem(r, "R", rate_types(e))
    e.elem(t, "T", (INT64,))
    rd = e.cast(e.scalar(r), re, e.wide)
    ts = e.scalar(t)
    return rd, ts, e.op("Cast", ts, to=e.wide, hint="t")


def _tensor_types(e: Emitter, i: int, streams: dict[str, str], gradient: str) -> tuple[int, int]:
    """Checks tensor ``i``'s streams (``{group letter: name}``): weights float, double,
    float16 or bfloat16, every stream but the gradient of X's type, the gradient of X's
    type or 16-bit with float32 weights. Returns (X's type, G's type)."""
    xe = e.elem(streams["X"], f"X_{i}", FLOAT_TYPES if e.float64 else (FLOAT, FLOAT16, BFLOAT16))
    ge = xe
    for p, name in streams.items():
        if p == "X":
            continue
        if p == gradient:
            allowed = (xe, FLOAT16, BFLOAT16) if xe == FLOAT else (xe,)
            ge = e.elem(name, f"{p}_{i}", allowed)
        else:
            e.elem(name, f"{p}_{i}", (xe,))
    return xe, ge


def compute_type(elem: int) -> int:
    """The type the kernels compute in for tensors of ``elem``: double for double, else
    float."""
    return DOUBLE if elem == DOUBLE else FLOAT


def adam_rate(e: Emitter, alpha: float, beta: float) -> str:
    """``T > 0 ? R * sqrt(1 - beta^T) / (1 - alpha^T) : R`` in float64 (a scalar; without
    float64 in float-float, rounded to a float32 scalar)."""
    rd, ts, td = _rate_inputs(e)
    if not e.float64:
        from .ff import FF

        ff, one = FF(e), FF(e).const(1.0)
        r = ff.div(ff.mul(ff.of(rd), ff.sqrt(ff.sub(one, ff.pow(beta, td)))),
                   ff.sub(one, ff.pow(alpha, td)))[0]
        return e.select(e.op("Greater", ts, e.const(0, INT64)), r, rd, FLOAT)
    one = e.const(1.0, DOUBLE)
    pa = e.op("Pow", e.const(alpha, DOUBLE), td)
    pb = e.op("Pow", e.const(beta, DOUBLE), td)
    r = e.op("Div", e.op("Mul", rd, e.op("Sqrt", e.op("Sub", one, pb))), e.op("Sub", one, pa))
    return e.select(e.op("Greater", ts, e.const(0, INT64)), r, rd, DOUBLE)


def adam_update(e: Emitter, c: int, a: Mapping[str, float], rate: str, x: str, g: str,
                v: str, h: str, loss_scale: str | None = None) -> tuple[str, str, str]:
    """The Adam kernel's ``update`` on compute-type values; returns ``(x', v', h')``."""
    k = lambda value: e.const(value, c)  # noqa: E731 - a coefficient rounded once to c
    if loss_scale is not None:
        g = e.op("Div", g, loss_scale, hint="g")
    # norm * x + g, norm ordered after every input (every output depends on g; Emitter.ready)
    g = e.op("Add", e.op("Mul", e.coefficient(a["norm_coefficient"], c), x), g, hint="g")
    v = e.op("Add", e.op("Mul", k(a["alpha"]), v), e.op("Mul", k(1.0 - a["alpha"]), g), hint="v")
    gg = e.op("Mul", g, g)
    h = e.op("Add", e.op("Mul", k(a["beta"]), h), e.op("Mul", k(1.0 - a["beta"]), gg), hint="h")
    denom = e.op("Add", e.sqrt(h, c), k(a["epsilon"]))
    x = e.op("Sub", x, e.op("Mul", rate, e.op("Div", v, denom)))
    x = e.op("Mul", k(1.0 - a["norm_coefficient_post"]), x, hint="x")
    return x, v, h


class _Rates:
    """A scalar of ``e.wide`` rounded once per compute type (cached)."""

    def __init__(self, e: Emitter, rate: str):
        self.e, self.rate, self.cache = e, rate, {}

    def __getitem__(self, c: int) -> str:
        if c not in self.cache:
            self.cache[c] = self.e.cast(self.rate, self.e.wide, c)
        return self.cache[c]


def adam(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``ai.onnx.preview.training::Adam`` (all attributes, any number of tensors)."""
    e = Emitter(node, types, taken, **options)
    a = float_attrs(node, ADAM_DEFAULTS)
    n, (xs, gs, vs, hs), (xo, vo, ho) = split_groups(e, ["R", "T"], "XGVH", 3)
    rates = _Rates(e, adam_rate(e, a["alpha"], a["beta"]))
    for i in range(n):
        xe, ge = _tensor_types(e, i + 1, {"X": xs[i], "G": gs[i], "V": vs[i], "H": hs[i]}, "G")
        c = compute_type(xe)
        x, v, h = adam_update(e, c, a, rates[c], e.cast(xs[i], xe, c), e.cast(gs[i], ge, c),
                              e.cast(vs[i], xe, c), e.cast(hs[i], xe, c))
        for value, out in ((x, xo[i]), (v, vo[i]), (h, ho[i])):
            e.output(value, out, c, xe)
    return e.finish()


def adagrad(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``ai.onnx.preview.training::Adagrad``: ``r = R / (1 + T * decay_factor)`` in
    float64, then ``g = norm * x + g; h' = h + g * g; x' = x - (r * g) / (sqrt(h') + eps)``."""
    e = Emitter(node, types, taken, **options)
    a = float_attrs(node, ADAGRAD_DEFAULTS)
    n, (xs, gs, hs), (xo, ho) = split_groups(e, ["R", "T"], "XGH", 2)
    rd, _, td = _rate_inputs(e)
    if e.float64:
        rate = e.op("Div", rd, e.op("Add", e.const(1.0, DOUBLE),
                                    e.op("Mul", td, e.const(a["decay_factor"], DOUBLE))),
                    hint="rate")
    else:  # float-float (T exact as a float below 2^24)
        from .ff import FF

        ff = FF(e)
        rate = ff.div(ff.of(rd), ff.add(ff.const(1.0),
                                        ff.mul(ff.of(td), ff.const(a["decay_factor"]))))[0]
    rates = _Rates(e, rate)
    for i in range(n):
        xe, ge = _tensor_types(e, i + 1, {"X": xs[i], "G": gs[i], "H": hs[i]}, "G")
        c = compute_type(xe)
        k = lambda value: e.const(value, c)  # noqa: E731
        x, g, h = e.cast(xs[i], xe, c), e.cast(gs[i], ge, c), e.cast(hs[i], xe, c)
        g = e.op("Add", e.op("Mul", e.coefficient(a["norm_coefficient"], c), x), g, hint="g")
        h = e.op("Add", h, e.op("Mul", g, g), hint="h")
        step = e.op("Div", e.op("Mul", rates[c], g), e.op("Add", e.sqrt(h, c), k(a["epsilon"])))
        x = e.op("Sub", x, step, hint="x")
        e.output(x, xo[i], c, xe)
        e.output(h, ho[i], c, xe)
    return e.finish()


def momentum(node, types: Mapping[str, int], taken: set[str], **options) -> Expansion:
    """``ai.onnx.preview.training::Momentum``, ``mode`` standard or nesterov:
    ``g = norm * x + g; v' = alpha * v + beta' * g`` (``beta' = T > 0 ? beta : 1``), then
    ``x' = x - R * v'`` or ``x' = x - R * (g + alpha * v')``."""
    from onnx import AttributeProto

    e = Emitter(node, types, taken, **options)
    a = float_attrs(node, MOMENTUM_ATTRS)
    modes = [x for x in node.attribute if x.name == "mode"]
    if not modes or modes[0].type != AttributeProto.STRING:
        raise ExpansionError(e.where("attribute 'mode' is required (a string)"))
    mode = modes[0].s.decode()
    if mode not in ("standard", "nesterov"):
        raise ExpansionError(e.where(f"attribute 'mode': expected \"standard\" or "
                                     f"\"nesterov\", got {mode!r}"))
    n, (xs, gs, vs), (xo, vo) = split_groups(e, ["R", "T"], "XGV", 2)
    r, t = node.input[0], node.input[1]
    e.ordered_after = [r, t]
    re = e.elem(r, "R", rate_types(e))
    e.elem(t, "T", (INT64,))
    rs, positive = e.scalar(r), e.op("Greater", e.scalar(t), e.const(0, INT64))
    coeffs: dict[int, tuple[str, str]] = {}
    for i in range(n):
        xe, ge = _tensor_types(e, i + 1, {"X": xs[i], "G": gs[i], "V": vs[i]}, "G")
        c = compute_type(xe)
        k = lambda value: e.const(value, c)  # noqa: E731
        if c not in coeffs:  # R rounded to c; beta or 1 by T
            coeffs[c] = (e.cast(rs, re, c), e.select(positive, k(a["beta"]), k(1.0), c))
        rate, beta = coeffs[c]
        x, g, v = e.cast(xs[i], xe, c), e.cast(gs[i], ge, c), e.cast(vs[i], xe, c)
        g = e.op("Add", e.op("Mul", e.coefficient(a["norm_coefficient"], c), x), g, hint="g")
        v = e.op("Add", e.op("Mul", k(a["alpha"]), v), e.op("Mul", beta, g), hint="v")
        if mode == "standard":
            step = e.op("Mul", rate, v)
        else:
            step = e.op("Mul", rate, e.op("Add", g, e.op("Mul", k(a["alpha"]), v)))
        x = e.op("Sub", x, step, hint="x")
        e.output(x, xo[i], c, xe)
        e.output(v, vo[i], c, xe)
    return e.finish()
