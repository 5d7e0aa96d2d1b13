"""The checks of class labels and the graph guard they use (:mod:`trainops.losses`).

Labels are checked on every placement (fused CPU kernels, portable graph, devices), those
of an attached loss and of the model's own SoftmaxCrossEntropyLoss /
NegativeLogLikelihoodLoss alike: each must be a class index in ``[0, C)`` (``C`` the size of
the scores' class axis) or the node's ``ignore_index``, and the labels must have the
scores' shape without that axis. ONNX's ops would read ``-1`` as the last class and
broadcast one label over a batch, and fail on ``C`` deep inside naming nothing. Two layers:
:func:`label_check` (the Trainer's, on the feeds before the run: the label, its position,
its value and ``C``) and :func:`guard_labels` (in the training graph: a node that fails the
run, named for what was expected, :func:`guard`), for what only the run can tell and for
runtimes without Python.

The class axis is axis 1 (ONNX's and PyTorch's), or the last axis for a loss attached with
``class_axis=-1`` (``[B, T, V]`` logits): that loss flattens its scores to ``[B*T, V]``
and its labels to ``[B*T]`` by two Reshape nodes named after it (``<loss>/flat_scores``,
``<loss>/flat_labels``), and both checks look through them at the tensors the model and
the feeds have (:func:`_views`): a ``[T, B]`` labels tensor is refused, not reshaped.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CHECK", "LOSS_OPS", "failed_check", "guard", "guard_labels", "label_check",
           "step_refusal"]

# The name of a node that fails the run when an input breaks what the graph needs starts
# with this, followed by what was expected (ONNX Runtime's error names the node).
CHECK = "trainops/check: "


def guard(bad: str, what: str, prefix: str) -> tuple[list[onnx.NodeProto], str]:
    """Standard-op nodes that fail the run when ``bad`` (a bool scalar) is true, and the
    name of the int64 scalar 0 they compute otherwise (``<prefix>/ok``: add it to a value
    that must wait for the check). The failing node is a ``Gather`` of index ``bad`` (1 is
    out of range) from a one-element tensor, named ``CHECK + what``: ONNX Runtime's error
    then says ``what``, and :func:`failed_check` reads it back."""
    return [helper.make_node("Constant", [], [f"{prefix}/zero"], name=f"{prefix}/zero",
                             value=numpy_helper.from_array(np.array([0], np.int64))),
            helper.make_node("Cast", [bad], [f"{prefix}/index"], name=f"{prefix}/index",
                             to=TensorProto.INT64),
            helper.make_node("Gather", [f"{prefix}/zero", f"{prefix}/index"], [f"{prefix}/ok"],
                             name=CHECK + what, axis=0)], f"{prefix}/ok"


def failed_check(error: BaseException) -> str | None:
    """What a :func:`guard` that failed the run expected (its node's name after
    ``CHECK``), from ONNX Runtime's error; None if no guard failed."""
    found = re.search(re.escape(CHECK) + r"(.*?)' Status Message", str(error), re.S)
    return found.group(1) if found else None


def step_refusal(error: BaseException, feeds, input_names) -> ValueError | None:
    """The ValueError :meth:`Trainer.step` raises when a :func:`guard` in the graph refused
    this step's data (``error``: ONNX Runtime's), with the shape and range of the labels
    fed; None when ``error`` is another failure."""
    what = failed_check(error)
    if what is None:
        return None
    fed = [f"{n!r} fed: shape {list(np.shape(feeds[n]))}, values from "
           f"{np.min(feeds[n])} to {np.max(feeds[n])}" for n in input_names
           if f"labels {n!r}:" in what and np.size(feeds[n])]
    said = f" ({'; '.join(fed)})" if fed else ""
    return ValueError(f"Trainer.step: {what}{said}; the step changed nothing")


LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def _loss_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The default-domain SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss nodes."""
    return [n for n in graph.node if n.op_type in LOSS_OPS and n.domain in ("", "ai.onnx")
            and len(n.input) >= 2]


def _ignore_index(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "ignore_index"), None)


def _who(node: onnx.NodeProto, k: int) -> str:
    """How an error names a loss node (the ``k``-th): the attached loss' kind, else the
    node by its name, or its position when it has none."""
    if node.name.startswith("trainops/loss/"):
        return node.name[len("trainops/loss/"):]
    return f"{node.op_type} node {node.name!r}" if node.name else \
        f"{node.op_type} node #{k} (unnamed)"


def _expected(ignore_index: int | None, classes: int | str = "C") -> str:
    ii = "" if ignore_index is None else f" or the ignore_index {ignore_index}"
    return f"a class index in [0, {classes}){ii}"


class _View(NamedTuple):
    """A loss node as its checks see it: ``who`` names it in errors, ``scores`` and
    ``labels`` are the tensors to check (the model's and the feed's, before an attached
    loss' flattening), ``axis`` the class axis of ``scores`` (1, or -1 for the last), and
    the labels reach the loss through input ``slot`` of ``reader`` (the loss node itself,
    or its ``flat_labels`` Reshape), which the graph's check rewires."""

    who: str
    scores: str
    labels: str
    axis: int
    ignore_index: int | None
    reader: onnx.NodeProto
    slot: int


def _views(graph: onnx.GraphProto) -> Iterator[_View]:
    """Each loss node of ``graph`` as a :class:`_View`."""
    made = {o: n for n in graph.node for o in n.output}
    for k, node in enumerate(_loss_nodes(graph)):
        who, ii = _who(node, k), _ignore_index(node)
        flat, src = made.get(node.input[1]), made.get(node.input[0])
        if flat is not None and src is not None and node.name \
                and flat.op_type == src.op_type == "Reshape" \
                and flat.name == f"{node.name}/flat_labels" \
                and src.name == f"{node.name}/flat_scores":
            yield _View(who, src.input[0], flat.input[0], -1, ii, flat, 0)
        else:
            yield _View(who, node.input[0], node.input[1], 1, ii, node, 1)


def guard_labels(graph: onnx.GraphProto, prefix: str = "trainops/labels") -> None:
    """Check the labels of every SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss node
    of ``graph`` in the graph itself (in place; the nodes are appended, so no node moves):
    each label a class index in ``[0, C)`` (``C`` the size of the scores' class axis) or
    the node's ignore_index, the labels shaped as the scores without that axis (ONNX's ops
    would read -1 as the last class and broadcast one label over the batch). The loss
    then reads the labels as int64 plus the check's 0 (:func:`guard`), so it and everything
    after it wait for the check, which fails the run naming the labels otherwise."""
    for k, view in enumerate(list(_views(graph))):
        logits, labels, ii, axis = view.scores, view.labels, view.ignore_index, view.axis
        p = f"{prefix}/{k}"
        what = (f"{view.who}: labels {labels!r}: expected {_expected(ii)} (C: the size "
                f"of axis {axis} of {logits!r}) and the shape of {logits!r} without that "
                "axis")

        def at(name, p=p):  # this check's own tensor ``name``
            return f"{p}/{name}"

        def const(name, v):
            return helper.make_node("Constant", [], [at(name)], name=at(name),
                                    value=numpy_helper.from_array(np.array(v, np.int64)))

        def op(op_type, ins, out, **kw):
            return helper.make_node(op_type, ins, [at(out)], name=at(out), **kw)

        nodes = [const("zero", 0), const("axis", axis), const("at0", [0]),
                 op("Cast", [labels], "labels", to=TensorProto.INT64),
                 op("Shape", [logits], "logits_shape"),
                 op("Gather", [at("logits_shape"), at("axis")], "classes", axis=0)]
        if axis == 1:  # the shape without axis 1: [d0] + [d2, ...]
            nodes += [const("at1", [1]), const("at2", [2]), const("end", [2**63 - 1]),
                      op("Slice", [at("logits_shape"), at("at0"), at("at1")], "batch"),
                      op("Slice", [at("logits_shape"), at("at2"), at("end")], "rest"),
                      op("Concat", [at("batch"), at("rest")], "want", axis=0)]
        else:  # without the last axis
            nodes += [const("last", [-1]),
                      op("Slice", [at("logits_shape"), at("at0"), at("last")], "want")]
        nodes += [op("Shape", [labels], "got"),
                  # [rank, d0, d1, ...] of each: a rank that differs is caught too (here,
                  # or as this Equal's broadcasting error, which names the check as well)
                  op("Shape", [at("want")], "want_rank"), op("Shape", [at("got")], "got_rank"),
                  op("Concat", [at("want_rank"), at("want")], "want_all", axis=0),
                  op("Concat", [at("got_rank"), at("got")], "got_all", axis=0),
                  helper.make_node("Equal", [at("got_all"), at("want_all")], [at("same")],
                                   name=CHECK + what + " (its shape)"),
                  op("Not", [at("same")], "differ"),
                  op("Cast", [at("differ")], "differ_int", to=TensorProto.INT64),
                  op("ReduceSum", [at("differ_int")], "bad_dims", keepdims=0),
                  op("Less", [at("labels"), at("zero")], "negative"),
                  op("Less", [at("labels"), at("classes")], "below_c"),
                  op("Not", [at("below_c")], "too_large"),
                  op("Or", [at("negative"), at("too_large")], "outside")]
        bad = at("outside")
        if ii is not None:
            nodes += [const("ignore_index", ii),
                      op("Equal", [at("labels"), at("ignore_index")], "ignored"),
                      op("Not", [at("ignored")], "counted"),
                      op("And", [at("outside"), at("counted")], "counted_outside")]
            bad = at("counted_outside")
        nodes += [op("Cast", [bad], "outside_int", to=TensorProto.INT64),
                  op("ReduceSum", [at("outside_int")], "bad_labels", keepdims=0),
                  op("Add", [at("bad_dims"), at("bad_labels")], "bad_count"),
                  op("Greater", [at("bad_count"), at("zero")], "bad")]
        checks, ok = guard(at("bad"), what, at("guard"))
        nodes += checks + [op("Add", [at("labels"), ok], "checked")]
        graph.node.extend(nodes)
        view.reader.input[view.slot] = at("checked")


def _dims(vi) -> list | None:
    """A value info's dims (int, a dim_param's name, or None), or None without a shape."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in vi.type.tensor_type.shape.dim]


def label_check(model: onnx.ModelProto) -> Callable[[Mapping[str, Any]], None] | None:
    """The check a Trainer runs on a step's feeds before the run, for every
    SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss node of ``model`` (the training
    model: a :mod:`trainops.losses` loss attached, or the model's own) whose labels are a
    data input: ValueError naming the loss, the labels input, the first label outside
    ``[0, C)`` (and not the ignore_index), its position, its value and ``C``; or the
    labels' shape and the one expected (the scores' without their class axis), from the
    scores' declared or inferred dims (a named dim takes its size from the fed input that
    has it). What the shapes cannot tell before the run (``C`` or a dim unknown until
    then) is left to the graph's own check (:func:`guard_labels`). None when no loss node
    reads a data input."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    data = {i.name: _dims(i) for i in g.input if i.name not in inits}
    views = [v for v in _views(g) if v.labels in data]
    if not views:
        return None
    from ..autodiff import infer

    shapes = {v.name: _dims(v) for v in list(infer(model).graph.value_info)
              + list(g.input) + list(g.output)}
    checks = []
    for v in views:
        dims = shapes.get(v.scores)
        if dims is not None and len(dims) < 2:
            dims = None
        c = None if dims is None else dims[v.axis]
        classes = c if isinstance(c, int) and c > 0 else None
        checks.append((v.who, v.scores, v.labels, dims, classes, v.ignore_index, v.axis))

    def check(feeds: Mapping[str, Any]) -> None:
        bound: dict[str, tuple[int, str]] = {}  # a named dim takes its size from a feed
        for name, ds in data.items():
            x = feeds.get(name)
            if ds is None or x is None or np.ndim(x) != len(ds):
                continue
            for d, n in zip(ds, np.shape(x)):
                if isinstance(d, str):
                    bound.setdefault(d, (int(n), name))
        for who, logits, labels, dims, classes, ii, axis in checks:
            y = np.asarray(feeds[labels])
            if y.dtype.kind not in "iu":
                raise ValueError(f"{who}: labels {labels!r}: expected int64 class indices, "
                                 f"got {y.dtype}")
            if dims is not None:
                want = dims[:1] + dims[2:] if axis == 1 else dims[:-1]
                expect = [d if isinstance(d, int) else bound.get(d, (None,))[0] for d in want]
                if y.ndim != len(want) or any(e is not None and e != n
                                              for e, n in zip(expect, y.shape)):
                    said = ", ".join("?" if e is None else str(e) for e in expect)
                    why = [f"{d!r} = {bound[d][0]} from input {bound[d][1]!r}" for d in want
                           if isinstance(d, str) and d in bound]
                    raise ValueError(
                        f"{who}: labels {labels!r} has shape {list(y.shape)}: expected "
                        f"[{said}], the shape of {logits!r} {dims} without its class axis "
                        f"(axis {axis}){' (' + ', '.join(why) + ')' if why else ''}: one "
                        "label per position, never broadcast")
            if classes is None or y.size == 0:
                continue
            flat = y.reshape(-1)
            outside = (flat < 0) | (flat >= classes)
            if ii is not None:
                outside &= flat != ii
            if outside.any():
                k = int(np.argmax(outside))
                at = [int(i) for i in np.unravel_index(k, y.shape)]
                raise ValueError(
                    f"{who}: labels {labels!r}{at} = {int(flat[k])}: expected "
                    f"{_expected(ii, classes)} ({logits!r} has {classes} classes, its axis "
                    f"{axis})")

    return check
