"""Losses a :class:`trainops.Trainer` attaches to a model that has none (an exported
network ends at its logits):

    trainer = Trainer(model, loss=losses.cross_entropy("logits"))
    trainer.step({"input": x, "labels": y})        # y: int64 class indices [N]

Each function returns a :class:`Loss`; ``Trainer(loss=...)`` adds its nodes and its data
input (``labels`` / ``target``) to the TRAINING graph only: :meth:`Trainer.export` gives
the model without them. A model that computes its own loss passes the tensor's name
instead.

- :func:`cross_entropy`: ``SoftmaxCrossEntropyLoss(logits, labels)`` (PyTorch's
  ``F.cross_entropy``): logits ``[N, C]`` or ``[N, C, d1, ...]``, int64 labels ``[N]`` or
  ``[N, d1, ...]``;
- :func:`nll`: ``NegativeLogLikelihoodLoss(log_probs, labels)`` (``F.nll_loss``);
- :func:`mse`: ``ReduceMean((output - target)^2)`` (``F.mse_loss``), the target shaped
  and typed as the output.

``reduction``: ``"mean"`` or ``"sum"`` (a Trainer minimises a scalar). ``logits`` /
``output`` None: the model's first output. ``ignore_index`` (cross_entropy, nll; default
None, none): the label value that contributes nothing, as PyTorch's (whose default is
-100: pass ``ignore_index=-100`` for its behaviour).

Labels are checked on every placement (fused CPU kernels, portable graph, devices), those
of an attached loss and of the model's own SoftmaxCrossEntropyLoss /
NegativeLogLikelihoodLoss alike: each must be a class index in ``[0, C)`` (``C`` the size of
the scores' axis 1) or the node's ``ignore_index``, and the labels must have the scores'
shape without that axis. ONNX's ops would read ``-1`` as the last class and broadcast one
label over a batch, and fail on ``C`` deep inside naming nothing. Two layers:
:func:`label_check` (the Trainer's, on the feeds before the run: the label, its position,
its value and ``C``) and :func:`guard_labels` (in the training graph: a node that fails the
run, named for what was expected, :func:`guard`), for what only the run can tell and for
runtimes without Python.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CHECK", "Loss", "cross_entropy", "failed_check", "from_dict", "guard",
           "guard_labels", "label_check", "mse", "nll"]

KINDS = ("cross_entropy", "nll", "mse")
REDUCTIONS = ("mean", "sum")

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


@dataclass(frozen=True)
class Loss:
    """A loss to attach: ``kind`` (``"cross_entropy"``, ``"nll"``, ``"mse"``), the model
    tensor it reads (``output``; None: the first graph output), the name of the data input
    it adds (``target``) and the ``reduction``."""

    kind: str
    output: str | None
    target: str
    reduction: str = "mean"
    ignore_index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss kind {self.kind!r}: expected one of {KINDS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"{self.kind}: reduction {self.reduction!r}: expected 'mean' "
                             "or 'sum' (a Trainer minimises a scalar)")
        if not self.target:
            raise ValueError(f"{self.kind}: the target input needs a name")
        if self.ignore_index is not None:
            if self.kind == "mse":
                raise ValueError("mse: ignore_index is for class labels (cross_entropy, nll)")
            ii = self.ignore_index
            if isinstance(ii, bool) or not isinstance(ii, numbers.Integral) \
                    or not -2**63 <= ii < 2**63:
                raise ValueError(f"{self.kind}: ignore_index {ii!r}: expected None or an "
                                 "int64 label value")
            object.__setattr__(self, "ignore_index", int(ii))

    @property
    def name(self) -> str:
        """The loss tensor's name in the training graph."""
        return f"trainops/loss/{self.kind}"

    def to_dict(self) -> dict:
        """JSON-ready (:func:`from_dict` reverses it); ``ignore_index`` only when set."""
        d = asdict(self)
        if d["ignore_index"] is None:
            del d["ignore_index"]
        return d

    def attach(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of ``model`` with the loss nodes (after the model's own, so node
        positions keep their Philox keys), the target as a graph input and the loss
        (:attr:`name`) as its only output."""
        from .autodiff import infer

        m = onnx.ModelProto()
        m.CopyFrom(model)
        g = m.graph
        out = self.output or (g.output[0].name if g.output else None)
        tensors = {o for n in g.node for o in n.output} | {i.name for i in g.input} \
            | {i.name for i in g.initializer}
        if out is None or out not in tensors:
            raise ValueError(f"{self.kind}: {out!r} is not a tensor of the model")
        if self.target in tensors:
            raise ValueError(f"{self.kind}: the target input {self.target!r} is already a "
                             "tensor of the model: name it otherwise (target=/labels=)")
        info = {v.name: v for v in list(infer(m).graph.value_info) + list(g.output)
                + list(g.input)}
        elem, dims = TensorProto.FLOAT, None
        if out in info and info[out].type.HasField("tensor_type"):
            tt = info[out].type.tensor_type
            elem = tt.elem_type or elem
            if tt.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                        for d in tt.shape.dim]
        p = self.name
        if self.kind == "mse":
            g.node.extend([
                helper.make_node("Sub", [out, self.target], [f"{p}/diff"], name=f"{p}/sub"),
                helper.make_node("Mul", [f"{p}/diff", f"{p}/diff"], [f"{p}/squared"],
                                 name=f"{p}/square"),
                helper.make_node("ReduceMean" if self.reduction == "mean" else "ReduceSum",
                                 [f"{p}/squared"], [p], name=f"{p}/reduce", keepdims=0)])
            target = helper.make_tensor_value_info(self.target, elem, dims)
        else:
            op = "SoftmaxCrossEntropyLoss" if self.kind == "cross_entropy" \
                else "NegativeLogLikelihoodLoss"
            if dims is not None and len(dims) < 2:
                raise ValueError(f"{self.kind}: {out!r} must be [N, C] or [N, C, d1, ...], "
                                 f"has shape {dims}")
            extra = {} if self.ignore_index is None else {"ignore_index": self.ignore_index}
            g.node.append(helper.make_node(op, [out, self.target], [p], name=p,
                                           reduction=self.reduction, **extra))
            target = helper.make_tensor_value_info(
                self.target, TensorProto.INT64, None if dims is None else dims[:1] + dims[2:])
        g.input.append(target)
        del g.output[:]
        g.output.append(helper.make_tensor_value_info(p, elem, []))
        return m


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


def guard_labels(graph: onnx.GraphProto, prefix: str = "trainops/labels") -> None:
    """Check the labels of every SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss node
    of ``graph`` in the graph itself (in place; the nodes are appended, so no node moves):
    each label a class index in ``[0, C)`` (``C`` the size of the scores' axis 1) or the
    node's ignore_index, the labels shaped as the scores without axis 1 (ONNX's ops would
    read -1 as the last class and broadcast one label over the batch). The node then reads
    the labels as int64 plus the check's 0 (:func:`guard`), so it and everything after it
    wait for the check, which fails the run naming the labels otherwise."""
    for k, node in enumerate(_loss_nodes(graph)):
        logits, labels = node.input[0], node.input[1]
        ii = _ignore_index(node)
        p = f"{prefix}/{k}"
        what = (f"{_who(node, k)}: labels {labels!r}: expected {_expected(ii)} (C: the size "
                f"of axis 1 of {logits!r}) and the shape of {logits!r} without that axis")

        def at(name, p=p):  # this check's own tensor ``name``
            return f"{p}/{name}"

        def const(name, v):
            return helper.make_node("Constant", [], [at(name)], name=at(name),
                                    value=numpy_helper.from_array(np.array(v, np.int64)))

        def op(op_type, ins, out, **kw):
            return helper.make_node(op_type, ins, [at(out)], name=at(out), **kw)

        nodes = [const("zero", 0), const("one", 1), const("at0", [0]), const("at1", [1]),
                 const("at2", [2]), const("end", [2**63 - 1]),
                 op("Cast", [labels], "labels", to=TensorProto.INT64),
                 op("Shape", [logits], "logits_shape"),
                 op("Gather", [at("logits_shape"), at("one")], "classes", axis=0),
                 op("Slice", [at("logits_shape"), at("at0"), at("at1")], "batch"),
                 op("Slice", [at("logits_shape"), at("at2"), at("end")], "rest"),
                 op("Concat", [at("batch"), at("rest")], "want", axis=0),
                 op("Shape", [labels], "got"),
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
        node.input[1] = at("checked")


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
    labels' shape and the one expected, from the scores' declared or inferred dims (a
    named dim takes its size from the fed input that has it). What the shapes cannot tell
    before the run (``C`` or a dim unknown until then) is left to the graph's own check
    (:func:`guard_labels`). None when no loss node reads a data input."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    data = {i.name: _dims(i) for i in g.input if i.name not in inits}
    nodes = [(k, n) for k, n in enumerate(_loss_nodes(g)) if n.input[1] in data]
    if not nodes:
        return None
    from .autodiff import infer

    shapes = {v.name: _dims(v) for v in list(infer(model).graph.value_info)
              + list(g.input) + list(g.output)}
    checks = []
    for k, node in nodes:
        dims = shapes.get(node.input[0])
        if dims is not None and len(dims) < 2:
            dims = None
        classes = dims[1] if dims is not None and isinstance(dims[1], int) and dims[1] > 0 \
            else None
        checks.append((_who(node, k), node.input[0], node.input[1], dims, classes,
                       _ignore_index(node)))

    def check(feeds: Mapping[str, Any]) -> None:
        bound: dict[str, tuple[int, str]] = {}  # a named dim takes its size from a feed
        for name, ds in data.items():
            x = feeds.get(name)
            if ds is None or x is None or np.ndim(x) != len(ds):
                continue
            for d, n in zip(ds, np.shape(x)):
                if isinstance(d, str):
                    bound.setdefault(d, (int(n), name))
        for who, logits, labels, dims, classes, ii in checks:
            y = np.asarray(feeds[labels])
            if y.dtype.kind not in "iu":
                raise ValueError(f"{who}: labels {labels!r}: expected int64 class indices, "
                                 f"got {y.dtype}")
            if dims is not None:
                want = dims[:1] + dims[2:]
                expect = [d if isinstance(d, int) else bound.get(d, (None,))[0] for d in want]
                if y.ndim != len(want) or any(e is not None and e != n
                                              for e, n in zip(expect, y.shape)):
                    said = ", ".join("?" if e is None else str(e) for e in expect)
                    why = [f"{d!r} = {bound[d][0]} from input {bound[d][1]!r}" for d in want
                           if isinstance(d, str) and d in bound]
                    raise ValueError(
                        f"{who}: labels {labels!r} has shape {list(y.shape)}: expected "
                        f"[{said}], the shape of {logits!r} {dims} without its class axis "
                        f"(axis 1){' (' + ', '.join(why) + ')' if why else ''}: one label "
                        "per position, never broadcast")
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
                    "1)")

    return check


def from_dict(d: Mapping[str, Any]) -> Loss:
    """The :class:`Loss` :meth:`Loss.to_dict` described."""
    return Loss(d["kind"], d.get("output"), d["target"], d.get("reduction", "mean"),
                d.get("ignore_index"))


def cross_entropy(logits: str | None = None, labels: str = "labels",
                  reduction: str = "mean", ignore_index: int | None = None) -> Loss:
    """Softmax cross-entropy of ``logits`` (``[N, C, ...]``, None: the first output)
    against int64 class indices fed as ``labels``, each in ``[0, C)`` or ``ignore_index``
    (None: none; PyTorch's default is -100), which contributes nothing (nor to the mean's
    count)."""
    return Loss("cross_entropy", logits, labels, reduction, ignore_index)


def nll(log_probs: str | None = None, labels: str = "labels",
        reduction: str = "mean", ignore_index: int | None = None) -> Loss:
    """Negative log-likelihood of ``log_probs`` (``[N, C, ...]``, e.g. a LogSoftmax
    output; None: the first output) at the int64 class indices fed as ``labels``, each in
    ``[0, C)`` or ``ignore_index`` (as :func:`cross_entropy`)."""
    return Loss("nll", log_probs, labels, reduction, ignore_index)


def mse(output: str | None = None, target: str = "target",
        reduction: str = "mean") -> Loss:
    """Mean (or summed) squared error between ``output`` (None: the first output) and the
    data input ``target`` (the output's type and shape)."""
    return Loss("mse", output, target, reduction)
