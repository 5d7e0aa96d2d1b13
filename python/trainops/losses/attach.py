"""The nodes a :class:`~.spec.Loss` adds to a model (:func:`attach_loss`).

A class loss is one ONNX ``SoftmaxCrossEntropyLoss`` / ``NegativeLogLikelihoodLoss`` node
(named after the loss, so its label checks name it: :mod:`.checks`) whose class axis is
axis 1. Classes on the last axis (``class_axis=-1``, ``[B, T, V]`` logits) are flattened
first: the scores to ``[B*T, V]``, the labels to ``[B*T]``, by Reshape nodes (no copy;
the [N, C] form is the one the fused gradient kernel takes), and the mean over those
targets is PyTorch's mean over ``[B, T]``.

With an ``ignore_index`` under ``"mean"``, or with ``label_smoothing``, the node gives one
loss per target (``reduction="none"``; an ignored target's is 0) and the loss is formed
after it: each target's share ``loss_i / max(count, 1)`` summed, ``count`` the targets not
ignored (int64, exact); NaN when there are none, as PyTorch's. Dividing before summing keeps
the sum as small as the largest share (a float16 sum of thousands of per-token losses
would overflow), and ``max(count, 1)`` keeps the gradient of a batch with every label
ignored at zero, as PyTorch's, where ONNX's own mean divides by a zero count (NaN in every
weight). Label smoothing as PyTorch's: ``(1 - eps) * nll_i + eps / C * (-sum_c
log_prob_ic)``, the second part zero for ignored targets too.
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["attach_loss"]

_END = 2**63 - 1


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _class_layout(loss, out: str, dims: list | None) -> bool:
    """Whether the loss flattens ``out`` (classes on its last axis, not axis 1), from its
    ``class_axis`` and ``out``'s dims (None: rank unknown); ValueError for an axis it
    cannot take."""
    axis, kind = loss.class_axis, loss.kind
    if dims is not None and len(dims) < 2:
        raise ValueError(f"{kind}: {out!r} must be [N, C] or [N, C, d1, ...] (or [..., C] "
                         f"with class_axis=-1), has shape {dims}")
    why = (f"{kind}: class_axis {axis} of {out!r} (shape {dims}): expected 1 (the classes "
           "on axis 1, as PyTorch's losses) or -1 (the last axis, as a language model's "
           "[B, T, V] logits)")
    if dims is None:
        if axis not in (1, -1):
            raise ValueError(why + f": the rank of {out!r} is unknown")
        return axis == -1
    rank = len(dims)
    a = axis + rank if axis < 0 else axis
    if a == 1:
        return False
    if a == rank - 1 and a > 1:
        return True
    raise ValueError(why)


def _class_nodes(loss, out: str, elem: int, flat: bool, classes, opset: int) -> list:
    """The class loss' nodes, from the scores ``out`` (element type ``elem``, ``classes``
    on its class axis: a size, else unknown until the run) and the labels input
    ``loss.target`` to the loss ``loss.name``."""
    p, ii, eps, red = loss.name, loss.ignore_index, loss.label_smoothing, loss.reduction
    op_type = "SoftmaxCrossEntropyLoss" if loss.kind == "cross_entropy" \
        else "NegativeLogLikelihoodLoss"
    nodes = []

    def op(op_type, ins, out, **kw):  # a node named as its output, under the loss' name
        nodes.append(helper.make_node(op_type, ins, [f"{p}/{out}"], name=f"{p}/{out}", **kw))
        return f"{p}/{out}"

    def ints(name, v):
        return op("Constant", [], name, value=numpy_helper.from_array(np.array(v, np.int64)))

    def real(name, v):  # a scalar of the scores' type
        return op("Constant", [], name, value=helper.make_tensor(name, elem, [], [v]))

    def reduce_sum(x, out, axes):
        if axes is None:
            return op("ReduceSum", [x], out, keepdims=0)
        if opset >= 13:
            return op("ReduceSum", [x, ints(f"{out}_axes", axes)], out, keepdims=0)
        return op("ReduceSum", [x], out, axes=axes, keepdims=0)

    scores, labels = out, loss.target
    if flat:  # [d0, ..., C] -> [-1, C]; labels [d0, ...] -> [-1] (the checks look through)
        minus_one = ints("minus_one", [-1])
        if isinstance(classes, int):
            shape = ints("flat_shape", [-1, classes])
        else:  # C known at run time only
            shape = op("Concat", [minus_one, op("Slice", [
                op("Shape", [out], "scores_shape"), minus_one, ints("end", [_END])],
                "classes_dim")], "flat_shape", axis=0)
        scores = op("Reshape", [out, shape], "flat_scores")
        labels = op("Reshape", [labels, minus_one], "flat_labels")
    extra = {} if ii is None else {"ignore_index": ii}
    if eps == 0 and (red == "sum" or ii is None):  # ONNX's own reduction is PyTorch's
        nodes.append(helper.make_node(op_type, [scores, labels], [p], name=p, reduction=red,
                                      **extra))
        return nodes
    outs = [f"{p}/per_target"] + ([f"{p}/log_prob"] if eps else [])
    nodes.append(helper.make_node(op_type, [scores, labels], outs, name=p, reduction="none",
                                  **extra))
    per = outs[0]
    kept = None
    if ii is not None:
        kept = op("Not", [op("Equal", [labels, ints("ignore_index", ii)], "ignored")], "kept")
    if eps:
        classes = op("Cast", [op("Gather", [op("Shape", [scores], "class_scores_shape"),
                                            ints("class_axis", 1)], "classes", axis=0)],
                     "classes_real", to=elem)
        coef = op("Div", [real("minus_eps", -eps), classes], "smooth_coef")  # -eps / C
        smooth = op("Mul", [reduce_sum(outs[1], "sum_log_prob", [1]), coef], "smooth")
        if kept is not None:
            smooth = op("Where", [kept, smooth, real("zero", 0.0)], "smooth_kept")
        per = op("Add", [op("Mul", [per, real("keep", 1.0 - eps)], "nll_part"), smooth],
                 "per_smoothed")
    if red == "sum":
        nodes.append(helper.make_node("ReduceSum", [per], [p], name=f"{p}/sum", keepdims=0))
        return nodes
    count = op("Size", [labels], "count") if kept is None else \
        reduce_sum(op("Cast", [kept], "kept_int", to=TensorProto.INT64), "count", None)
    divisor = op("Max", [op("Cast", [count], "count_real", to=elem), real("one", 1.0)],
                 "divisor")
    total = reduce_sum(op("Div", [per, divisor], "share"), "total", None)
    none = op("Equal", [count, ints("zero_count", 0)], "no_target")
    nodes.append(helper.make_node("Where", [none, real("nan", float("nan")), total], [p],
                                  name=f"{p}/mean"))
    return nodes


def attach_loss(loss, model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with ``loss``'s nodes (after the model's own, so node positions
    keep their Philox keys), its target as a graph input (a class loss': int64, the
    scores' shape without the class axis) and the loss (``loss.name``) as the only
    output."""
    from ..autodiff import infer

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    out = loss.output or (g.output[0].name if g.output else None)
    tensors = {o for n in g.node for o in n.output} | {i.name for i in g.input} \
        | {i.name for i in g.initializer}
    if out is None or out not in tensors:
        raise ValueError(f"{loss.kind}: {out!r} is not a tensor of the model")
    if loss.target in tensors:
        raise ValueError(f"{loss.kind}: the target input {loss.target!r} is already a "
                         "tensor of the model: name it otherwise (target=/labels=)")
    inferred = infer(m).graph  # its outputs and inputs: the declared shapes, or inferred
    info = {v.name: v for v in list(inferred.value_info) + list(inferred.output)
            + list(inferred.input)}
    elem, dims = TensorProto.FLOAT, None
    if out in info and info[out].type.HasField("tensor_type"):
        tt = info[out].type.tensor_type
        elem = tt.elem_type or elem
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in tt.shape.dim]
    p = loss.name
    if loss.kind == "mse":
        g.node.extend([
            helper.make_node("Sub", [out, loss.target], [f"{p}/diff"], name=f"{p}/sub"),
            helper.make_node("Mul", [f"{p}/diff", f"{p}/diff"], [f"{p}/squared"],
                             name=f"{p}/square"),
            helper.make_node("ReduceMean" if loss.reduction == "mean" else "ReduceSum",
                             [f"{p}/squared"], [p], name=f"{p}/reduce", keepdims=0)])
        target = helper.make_tensor_value_info(loss.target, elem, dims)
    else:
        flat = _class_layout(loss, out, dims)
        classes = None if dims is None else dims[-1 if flat else 1]
        g.node.extend(_class_nodes(loss, out, elem, flat, classes, _opset(m)))
        labels = None if dims is None else dims[:-1] if flat else dims[:1] + dims[2:]
        if flat and not isinstance(classes, int):
            # C known at run time only: the flattened tensors' rank (which onnx does not
            # infer from a computed shape before opset 14) and their sizes as names
            targets = f"{p}/targets"  # the same size in both
            g.value_info.extend([
                helper.make_tensor_value_info(f"{p}/flat_scores", elem,
                                              [targets, f"{p}/classes"]),
                helper.make_tensor_value_info(f"{p}/flat_labels", TensorProto.INT64,
                                              [targets])])
        target = helper.make_tensor_value_info(loss.target, TensorProto.INT64, labels)
    g.input.append(target)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(p, elem, []))
    return m
