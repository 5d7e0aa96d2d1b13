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
``output`` None: the model's first output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import onnx
from onnx import TensorProto, helper

__all__ = ["Loss", "cross_entropy", "from_dict", "mse", "nll"]

KINDS = ("cross_entropy", "nll", "mse")
REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class Loss:
    """A loss to attach: ``kind`` (``"cross_entropy"``, ``"nll"``, ``"mse"``), the model
    tensor it reads (``output``; None: the first graph output), the name of the data input
    it adds (``target``) and the ``reduction``."""

    kind: str
    output: str | None
    target: str
    reduction: str = "mean"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss kind {self.kind!r}: expected one of {KINDS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"{self.kind}: reduction {self.reduction!r}: expected 'mean' "
                             "or 'sum' (a Trainer minimises a scalar)")
        if not self.target:
            raise ValueError(f"{self.kind}: the target input needs a name")

    @property
    def name(self) -> str:
        """The loss tensor's name in the training graph."""
        return f"trainops/loss/{self.kind}"

    def to_dict(self) -> dict:
        """JSON-ready (:func:`from_dict` reverses it)."""
        return asdict(self)

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
            g.node.append(helper.make_node(op, [out, self.target], [p], name=p,
                                           reduction=self.reduction))
            target = helper.make_tensor_value_info(
                self.target, TensorProto.INT64, None if dims is None else dims[:1] + dims[2:])
        g.input.append(target)
        del g.output[:]
        g.output.append(helper.make_tensor_value_info(p, elem, []))
        return m


def from_dict(d: Mapping[str, Any]) -> Loss:
    """The :class:`Loss` :meth:`Loss.to_dict` described."""
    return Loss(d["kind"], d.get("output"), d["target"], d.get("reduction", "mean"))


def cross_entropy(logits: str | None = None, labels: str = "labels",
                  reduction: str = "mean") -> Loss:
    """Softmax cross-entropy of ``logits`` (``[N, C, ...]``, None: the first output)
    against int64 class indices fed as ``labels``."""
    return Loss("cross_entropy", logits, labels, reduction)


def nll(log_probs: str | None = None, labels: str = "labels",
        reduction: str = "mean") -> Loss:
    """Negative log-likelihood of ``log_probs`` (``[N, C, ...]``, e.g. a LogSoftmax
    output; None: the first output) at the int64 class indices fed as ``labels``."""
    return Loss("nll", log_probs, labels, reduction)


def mse(output: str | None = None, target: str = "target",
        reduction: str = "mean") -> Loss:
    """Mean (or summed) squared error between ``output`` (None: the first output) and the
    data input ``target`` (the output's type and shape)."""
    return Loss("mse", output, target, reduction)
