"""Which initializers a Trainer trains by default (:func:`default_params`).

The rule: a float initializer is a parameter when an op reads it as a WEIGHT:

- at a weight position of a layer op (:data:`WEIGHT_INPUTS`): Conv/ConvTranspose W and
  B, Gemm's A/B/C, MatMul's operands, the scale and bias of BatchNormalization,
  InstanceNormalization, LayerNormalization and GroupNormalization, Gather's and
  GatherND's data (an embedding or position table), RNN/GRU/LSTM W, R, B (and LSTM's
  peepholes P), PRelu's slope, Einsum's operands;
- as an operand of elementwise Add/Sub/Mul/Div when it has more than one element (a bias,
  a per-channel scale, a positional embedding), or when it is a one-element tensor of
  rank >= 1 added to the output of a layer op of :data:`WEIGHT_INPUTS` (the bias of
  ``nn.Linear(n, 1)``); a 0-d operand, or a one-element one elsewhere, is a setting (an
  epsilon, ``sqrt(d_k)``, GELU's 0.5), not a weight;
- through a view of it that one of those reads (Identity, Cast, Transpose, Reshape,
  Squeeze, Unsqueeze, Flatten, Expand, Slice, Split of the initializer, or a Concat of
  such: how exporters write ``W.T``, and torch's RNN weights in ONNX's gate order when
  constants are not folded).

Such a read counts only when the op's result reaches a graph output as values (not only
as a shape, an index, a Where condition or a comparison's operand), and when some other
operand is not made of positions alone (frequencies times ``Cast(Range(...))``: rotary
tables, ALiBi slopes). A constant the exporter named itself (``onnx::Mul_12``,
``/x/Constant_output_0``, ``val_12``: :func:`.exported.exporter_named`) counts only at a
layer op's weight position (a weight the exporter folded, transposed), never
elementwise (a mask, a folded table, a setting).

Never a parameter: integer and bool initializers, anything read only as a shape, axes,
pads, ratio, scale factor, exponent or clip bound, the BatchNormalization running
statistics (state: :mod:`.batchnorm`), and what :func:`.export_checks.not_torch_params`
finds torch does not train (buffers and constants the dynamo exporter recorded, masks,
frozen sine/cosine tables, a zero ``[1, N]`` logits bias). Where the export merged or
folded torch's parameters, :func:`.export_checks.warn_unfaithful` warns.
``Trainer(params=[...])`` trains any float initializers instead.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import TensorProto

from .export_checks import not_torch_params, warn_unfaithful
from .exported import exporter_named, index_like, value_reach

__all__ = ["ELEMENTWISE", "VIEWS", "WEIGHT_INPUTS", "check_param_names", "default_params"]

FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)

# op type -> the input positions that are weights (None: every input).
WEIGHT_INPUTS: dict[str, tuple[int, ...] | None] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (0, 1, 2), "MatMul": (0, 1),
    "Einsum": None, "BatchNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "LayerNormalization": (1, 2), "GroupNormalization": (1, 2), "Gather": (0,),
    "RNN": (1, 2, 3), "GRU": (1, 2, 3), "LSTM": (1, 2, 3, 7), "PRelu": (1,),
    "GatherND": (0,),
}
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})
# Ops whose product of an initializer with positions alone (integers, a Cast of them) is
# positional arithmetic, not a layer.
POSITIONAL = frozenset({"Add", "Sub", "Mul", "Div", "MatMul", "Gemm", "Einsum"})
# Ops that pass a weight's values on, rearranged (input 0; Concat: every input): the
# initializers behind them are the weights.
VIEWS = frozenset({"Identity", "Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze",
                   "Flatten", "Expand", "Slice", "Split", "Concat"})


def _size(init: onnx.TensorProto) -> int:
    n = 1
    for d in init.dims:
        n *= int(d)
    return n


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """``graph``'s nodes and, after each, those of its subgraphs (an If's branches read
    the main graph's weights from the outer scope), at any depth."""
    out = []
    for n in graph.node:
        out.append(n)
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                out.extend(_all_nodes(sub))
    return out


def default_params(model: onnx.ModelProto) -> list[str]:
    """The float initializers of ``model``'s main graph that are weights (the module's
    rule, applied to the nodes of its subgraphs too), in initializer order. Warns
    (UserWarning, :mod:`.export_checks`) when the export itself hides torch's
    parameters: merged constant initializers, batch-sized folded tables, a
    BatchNormalization folded into a Conv."""
    g = model.graph
    nodes = _all_nodes(g)
    inits = {i.name: i for i in g.initializer if i.data_type in FLOATS}
    # Each view's output stands for the initializers it views.
    origin: dict[str, set[str]] = {name: {name} for name in inits}
    for n in nodes:
        if n.domain not in ("", "ai.onnx") or n.op_type not in VIEWS:
            continue
        srcs = n.input if n.op_type == "Concat" else n.input[:1]
        found = set().union(*(origin.get(i, set()) for i in srcs if i))
        if found:
            for o in n.output:
                if o:
                    origin[o] = found
    layer_out = {o for n in nodes if n.op_type in WEIGHT_INPUTS for o in n.output if o}
    reach = value_reach(g, nodes)
    positions = index_like(g, nodes)

    def is_bias(node, k, src) -> bool:  # a one-element rank >= 1 Add operand of a layer
        other = [i for j, i in enumerate(node.input) if j != k]
        return (node.op_type == "Add" and len(inits[src].dims) >= 1
                and any(i in layer_out for i in other))

    # initializer -> its weight reads: (op type, input position; -1: any elementwise
    # operand), and whether another operand is a layer's output
    uses: dict[str, list[tuple[str, int, bool]]] = {}
    for n in nodes:
        if n.domain not in ("", "ai.onnx") or not any(o in reach for o in n.output if o):
            continue  # its results reach no output's values: a shape, an index, a mask
        slots = WEIGHT_INPUTS.get(n.op_type, ())
        for k, name in enumerate(n.input):
            srcs = origin.get(name, set()) if name else set()
            if not srcs:
                continue
            others = [i for j, i in enumerate(n.input) if j != k and i]
            if n.op_type in POSITIONAL and others and all(i in positions for i in others):
                continue  # frequencies times positions (rotary, ALiBi): a table, no layer
            after_layer = any(i in layer_out for i in others)
            if n.op_type in WEIGHT_INPUTS and (slots is None or k in slots):
                for src in srcs:
                    uses.setdefault(src, []).append((n.op_type, k, after_layer))
            elif n.op_type in ELEMENTWISE:
                for src in srcs:
                    # an exporter's own constant read elementwise is a mask, a folded
                    # table or a setting; a folded weight is read by a layer op
                    if not exporter_named(src) and (_size(inits[src]) > 1
                                                    or is_bias(n, k, src)):
                        uses.setdefault(src, []).append((n.op_type, -1, after_layer))
    weights = not_torch_params(g, inits, uses)
    chosen = [name for name in inits if name in weights]
    warn_unfaithful(model, chosen, inits, uses)
    return chosen


def check_param_names(params, where: str = "Trainer") -> list[str] | None:
    """``params=`` as given to a Trainer, checked before anything is built: None (the
    default choice) or a list of distinct initializer names. A bare string is refused
    (TypeError): ``list('W1')`` would be ``['W', '1']``, so ``params='W'`` either trained
    by luck or failed naming characters; so is any other non-iterable or an element that
    is not a string. A name given twice is a ValueError. Whether each name is a float
    initializer of the model is checked later, against the model."""
    if params is None:
        return None
    if isinstance(params, (str, bytes)):
        raise TypeError(f"{where}: params {params!r}: expected a list of initializer names "
                        f"(e.g. params=[{params!r}]), got a {type(params).__name__}")
    try:
        names = list(params)
    except TypeError:
        raise TypeError(f"{where}: params {params!r}: expected a list of initializer names, "
                        f"got {type(params).__name__}") from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{where}: params: {n!r} is no initializer name: expected "
                            f"strings, got {type(n).__name__}")
    twice = sorted(n for n, count in Counter(names).items() if count > 1)
    if twice:
        raise ValueError(f"{where}: params names {twice} more than once")
    return names
