"""``rewrite(model)``: every optimizer and mixed-precision node of a model replaced by its
standard-op expansion, for execution providers that take no custom-op library.

The graph keeps its inputs, outputs and every replaced node's output names (so IOBinding
of an output to its input's buffer still updates in place); the expansion's nodes take the
replaced node's place in the node list, its constants become initializers. A domain of
the library is dropped from ``opset_import`` once no node of it remains.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from ..onnx_defs import ONNX_OPSET, TRAINING_DOMAIN, TRAINOPS_DOMAIN
from .emit import BOOL, FLOAT, INT64, MIN_OPSET, Expansion, ExpansionError
from .dropout import philox_dropout
from .mixed import all_finite, dynamic_loss_scale, mixed_precision_adam
from .adamw import adamw
from .optimizers import adagrad, adam, momentum

__all__ = ["EXPANSIONS", "MIN_OPSET", "NO_FLOAT64", "has_float64", "rewrite", "custom_nodes",
           "value_types"]

# Execution providers without float64 arithmetic: a float64 node of the step would run on
# the CPU beside them (a copy each way), so their portable graph is built with
# rewrite(float64=False).
NO_FLOAT64 = frozenset({
    "WebGpuExecutionProvider",
    "JsExecutionProvider",
    "DmlExecutionProvider",
    "WebNNExecutionProvider",
})


def has_float64(names) -> bool:
    """Whether every execution provider named in ``names`` has float64 arithmetic (False
    as soon as one is in :data:`NO_FLOAT64`): the ``float64=`` of :func:`rewrite` for a
    session of those providers."""
    return not any(n in NO_FLOAT64 for n in names)

Expand = Callable[..., Expansion]  # (node, types, taken, sqrt=...) -> Expansion

# (domain, op_type) -> expansion function.
EXPANSIONS: dict[tuple[str, str], Expand] = {
    (TRAINING_DOMAIN, "Adam"): adam,
    (TRAINING_DOMAIN, "Adagrad"): adagrad,
    (TRAINING_DOMAIN, "Momentum"): momentum,
    (TRAINOPS_DOMAIN, "AdamW"): adamw,
    (TRAINOPS_DOMAIN, "MixedPrecisionAdam"): mixed_precision_adam,
    (TRAINOPS_DOMAIN, "DynamicLossScale"): dynamic_loss_scale,
    (TRAINOPS_DOMAIN, "AllFinite"): all_finite,
    (TRAINOPS_DOMAIN, "PhiloxDropout"): philox_dropout,
}

_DEFAULT = ("", "ai.onnx")


def value_types(model) -> dict[str, int]:
    """Element types of the values of ``model``'s main graph that onnx can tell: inputs,
    outputs, initializers, value_info, and what onnx's shape inference adds (nodes of
    custom domains are skipped by it)."""
    import onnx

    types: dict[str, int] = {}

    def take(graph):
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        for init in graph.initializer:
            types.setdefault(init.name, init.data_type)

    take(model.graph)
    try:
        take(onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False).graph)
    except Exception:  # noqa: BLE001 - inference is a convenience; declared types suffice
        pass
    return types


def value_sizes(model) -> dict[str, int]:
    """Element counts of the main graph's inputs, initializers and value_info whose shapes
    are static (the float32-only expansions join tensors up to a size: :mod:`.flat`)."""
    sizes: dict[str, int] = {}
    for vi in list(model.graph.input) + list(model.graph.value_info):
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else None
        if dims is not None and vi.type.tensor_type.HasField("shape") and all(
                d.HasField("dim_value") for d in dims):
            n = 1
            for d in dims:
                n *= d.dim_value
            sizes.setdefault(vi.name, n)
    for init in model.graph.initializer:
        n = 1
        for d in init.dims:
            n *= d
        sizes.setdefault(init.name, n)
    return sizes


def _output_types(node, types: dict[str, int]) -> None:
    """Records the element types of a replaced node's outputs, for the nodes after it."""
    op, ins, outs = node.op_type, list(node.input), list(node.output)
    if op == "AllFinite":
        types[outs[0]] = BOOL
    elif op == "PhiloxDropout":
        types[outs[0]] = types.get(ins[0], FLOAT)
        for name, elem in zip(outs[1:], (BOOL, 12)):  # mask, state_out (uint32)
            types[name] = elem
    elif op == "DynamicLossScale":
        types[outs[0]], types[outs[1]] = FLOAT, INT64
    else:  # optimizers: output groups of the weights' type; MixedPrecisionAdam: flag first
        mixed = op == "MixedPrecisionAdam"
        amsgrad = op == "AdamW" and any(a.name == "amsgrad" and a.i for a in node.attribute)
        scalars, groups = (3, 4) if mixed else (2, 5 if amsgrad else 4 if op in ("Adam", "AdamW")
                                                else 3)
        n = (len(ins) - scalars) // groups
        flag = 1 if mixed else 0
        if mixed:
            types[outs[0]] = BOOL
        copy = next((a.i for a in node.attribute if a.name == "copy_dtype"), 0)
        for k, name in enumerate(outs[flag:]):
            group, i = divmod(k, n)
            types[name] = copy if mixed and group == 3 else types.get(ins[scalars + i], FLOAT)


def custom_nodes(model) -> list:
    """The nodes of ``model``'s main graph outside the default ONNX domain."""
    return [n for n in model.graph.node if n.domain not in _DEFAULT]


def rewrite(model, types: Optional[Mapping[str, int]] = None, sqrt: str = "exact",
            dropout_seed: int = 0, float64: bool = True):
    """A copy of ``model`` with every node in :data:`EXPANSIONS` replaced by standard ONNX
    ops (see the package docstring). ``types`` adds element types (ONNX enums) for values
    whose type the model does not declare. ``sqrt``: ``"exact"`` (float32 square roots
    through float64, bitwise on any runtime with IEEE doubles) or ``"native"`` (float32
    ``Sqrt``, for EPs without float64; see :meth:`~trainops.portable.emit.Emitter.sqrt`).
    ``dropout_seed`` is mixed into the ``seed`` of the ``Dropout`` that replaces each
    ``PhiloxDropout`` (not bit-exact: see :mod:`trainops.portable.dropout`). Other nodes of
    custom domains (the Philox random ops, for instance) are kept, with their domain's
    import. ``float64=False``: the expansions use no float64 value (for EPs without
    float64, :data:`NO_FLOAT64`): native square roots, per-call scalars in float-float
    (:mod:`trainops.portable.ff`), AdamW's fmas by float32 error-free transformations
    (:func:`trainops.portable.fma.fma_split`); double tensors are refused. Raises
    :class:`ExpansionError` naming the node for a node it cannot expand, and when the
    model imports a default-domain opset below :data:`MIN_OPSET`."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    opsets = {o.domain: o.version for o in out.opset_import}
    default = max((v for d, v in opsets.items() if d in _DEFAULT), default=None)
    known = value_types(out)
    known.update(types or {})
    sizes = value_sizes(out)
    taken = {name for n in out.graph.node for name in list(n.input) + list(n.output) + [n.name]}
    taken |= {vi.name for vi in list(out.graph.input) + list(out.graph.output)}
    taken |= {i.name for i in out.graph.initializer}
    nodes, initializers, replaced = [], [], 0
    for node in out.graph.node:
        expand = EXPANSIONS.get((node.domain, node.op_type))
        if expand is None:
            nodes.append(node)
            continue
        if default is not None and default < MIN_OPSET:
            raise ExpansionError(f"{node.op_type} node {node.name!r}: the model imports opset "
                                 f"{default} of the default domain; the expansion needs "
                                 f"{MIN_OPSET} or newer")
        expansion = expand(node, known, taken, sqrt=sqrt, dropout_seed=dropout_seed,
                           float64=float64, sizes=sizes)
        nodes.extend(expansion.nodes)
        initializers.extend(expansion.initializers)
        _output_types(node, known)
        replaced += 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(initializers)
    if replaced:
        if default is None:
            out.opset_import.append(helper.make_opsetid("", ONNX_OPSET))
        used = {n.domain for n in out.graph.node}
        for f in out.functions:
            used |= {n.domain for n in f.node}
        keep = [o for o in out.opset_import
                if o.domain in _DEFAULT or o.domain in used
                or o.domain not in (TRAINING_DOMAIN, TRAINOPS_DOMAIN)]
        del out.opset_import[:]
        out.opset_import.extend(keep)
    return out
