"""What a loss is (:class:`Loss`), the functions that make one (:func:`cross_entropy`,
:func:`nll`, :func:`mse`) and its JSON form (:meth:`Loss.to_dict`, :func:`from_dict`,
which a checkpoint's config and the training artifacts carry)."""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import onnx

from .attach import attach_loss

__all__ = ["KINDS", "REDUCTIONS", "Loss", "cross_entropy", "from_dict", "mse", "nll"]

KINDS = ("cross_entropy", "nll", "mse")
REDUCTIONS = ("mean", "sum")
# The fields of Loss.to_dict, those left out when they hold their default: a config
# written before a field existed reads back as the loss it described.
_DEFAULTS = {"ignore_index": None, "class_axis": 1, "label_smoothing": 0.0}
_KEYS = ("kind", "output", "target", "reduction", *_DEFAULTS)


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class Loss:
    """A loss to attach: ``kind`` (``"cross_entropy"``, ``"nll"``, ``"mse"``), the model
    tensor it reads (``output``; None: the first graph output), the name of the data input
    it adds (``target``), the ``reduction``, and for the class losses the label value that
    counts for nothing (``ignore_index``; None: none), the scores' class axis
    (``class_axis``: 1, or -1 for the last) and, for ``cross_entropy``, PyTorch's
    ``label_smoothing``. The fields are the stored form: :func:`cross_entropy` and
    :func:`nll` give ``ignore_index`` PyTorch's default -100, the field's None is what a
    config without the key meant."""

    kind: str
    output: str | None
    target: str
    reduction: str = "mean"
    ignore_index: int | None = None
    class_axis: int = 1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        k = self.kind
        if k not in KINDS:
            raise ValueError(f"loss kind {k!r}: expected one of {KINDS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"{k}: reduction {self.reduction!r}: expected 'mean' "
                             "or 'sum' (a Trainer minimises a scalar)")
        if not self.target:
            raise ValueError(f"{k}: the target input needs a name")
        ii, axis, eps = self.ignore_index, self.class_axis, self.label_smoothing
        if k == "mse" and (ii is not None or axis != 1):
            what = "ignore_index" if ii is not None else "class_axis"
            raise ValueError(f"mse: {what} is for class labels (cross_entropy, nll)")
        if ii is not None:
            if not _int(ii) or not -2**63 <= ii < 2**63:
                raise ValueError(f"{k}: ignore_index {ii!r}: expected None or an "
                                 "int64 label value")
            object.__setattr__(self, "ignore_index", int(ii))
        if not _int(axis):
            raise ValueError(f"{k}: class_axis {axis!r}: expected an int (1: the classes "
                             "on axis 1, as PyTorch's; -1: on the last axis, [B, T, V])")
        object.__setattr__(self, "class_axis", int(axis))
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) \
                or not (0.0 <= float(eps) <= 1.0):  # NaN fails this too
            raise ValueError(f"{k}: label_smoothing {eps!r}: expected a number in [0, 1] "
                             "(PyTorch's)")
        if k != "cross_entropy" and eps != 0:
            raise ValueError(f"{k}: label_smoothing is cross_entropy's (PyTorch's "
                             "F.cross_entropy; nll_loss has none)")
        object.__setattr__(self, "label_smoothing", float(eps))

    @property
    def name(self) -> str:
        """The loss tensor's name in the training graph."""
        return f"trainops/loss/{self.kind}"

    def to_dict(self) -> dict:
        """JSON-ready (:func:`from_dict` reverses it); ``ignore_index``, ``class_axis`` and
        ``label_smoothing`` only when they are not None, 1 and 0 (as configs written
        before them)."""
        return {key: v for key, v in asdict(self).items()
                if key not in _DEFAULTS or v != _DEFAULTS[key]}

    def attach(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of ``model`` with the loss nodes (after the model's own, so node
        positions keep their Philox keys), the target as a graph input and the loss
        (:attr:`name`) as its only output (:func:`.attach.attach_loss`)."""
        return attach_loss(self, model)


def from_dict(d: Mapping[str, Any]) -> Loss:
    """The :class:`Loss` :meth:`Loss.to_dict` described; a key missing takes the field's
    stored default (None, 1, 0: what a config from before that key meant), a key it does
    not know is refused (a newer config would otherwise build another loss)."""
    unknown = sorted(set(d) - set(_KEYS))
    if unknown:
        raise ValueError(f"loss {dict(d)!r}: unknown keys {unknown}: expected some of "
                         f"{list(_KEYS)}")
    return Loss(d["kind"], d.get("output"), d["target"], d.get("reduction", "mean"),
                **{key: d.get(key, v) for key, v in _DEFAULTS.items()})


def cross_entropy(logits: str | None = None, labels: str = "labels", *,
                  reduction: str = "mean", ignore_index: int | None = -100,
                  class_axis: int = 1, label_smoothing: float = 0.0) -> Loss:
    """PyTorch's ``F.cross_entropy``: softmax cross-entropy of ``logits`` (None: the first
    output) against int64 class indices fed as ``labels``, each in ``[0, C)`` or
    ``ignore_index`` (PyTorch's -100 by default; None: none), which counts for nothing,
    in the sum and in the mean's count; a batch whose labels are all ignored gives NaN
    under ``"mean"`` and a zero gradient, as PyTorch's. ``class_axis``: 1 for ``[N, C]``
    or ``[N, C, d1, ...]`` logits (PyTorch's layout; labels ``[N]`` or ``[N, d1, ...]``),
    -1 for classes on the last axis (a language model's ``[B, T, V]`` logits, labels
    ``[B, T]``: PyTorch's ``F.cross_entropy(logits.flatten(0, -2), labels.flatten())``).
    ``label_smoothing`` in ``[0, 1]``: the target is ``(1 - eps)`` on the label plus
    ``eps / C`` on every class, as PyTorch's (ignored labels count for nothing in either
    part)."""
    return Loss("cross_entropy", logits, labels, reduction, ignore_index, class_axis,
                label_smoothing)


def nll(log_probs: str | None = None, labels: str = "labels", *,
        reduction: str = "mean", ignore_index: int | None = -100,
        class_axis: int = 1) -> Loss:
    """PyTorch's ``F.nll_loss``: negative log-likelihood of ``log_probs`` (e.g. a
    LogSoftmax output; None: the first output) at the int64 class indices fed as
    ``labels``; ``ignore_index`` and ``class_axis`` as :func:`cross_entropy`'s."""
    return Loss("nll", log_probs, labels, reduction, ignore_index, class_axis)


def mse(output: str | None = None, target: str = "target",
        reduction: str = "mean") -> Loss:
    """Mean (or summed) squared error between ``output`` (None: the first output) and the
    data input ``target`` (the output's type and shape)."""
    return Loss("mse", output, target, reduction)
