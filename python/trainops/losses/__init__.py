"""Losses a :class:`trainops.Trainer` attaches to a model that has none (an exported
network ends at its logits):

    trainer = Trainer(model, loss=losses.cross_entropy("logits"))
    trainer.step({"input": x, "labels": y})        # y: int64 class indices [N]

Each function returns a :class:`Loss`; ``Trainer(loss=...)`` adds its nodes and its data
input (``labels`` / ``target``) to the TRAINING graph only: :meth:`Trainer.export` gives
the model without them. A model that computes its own loss passes the tensor's name
instead.

- :func:`cross_entropy`: PyTorch's ``F.cross_entropy`` (ONNX ``SoftmaxCrossEntropyLoss``):
  logits ``[N, C]`` or ``[N, C, d1, ...]``, int64 labels ``[N]`` or ``[N, d1, ...]``; or,
  ``class_axis=-1``, a language model's ``[B, T, V]`` logits and ``[B, T]`` labels;
  ``label_smoothing`` as PyTorch's;
- :func:`nll`: ``F.nll_loss`` (``NegativeLogLikelihoodLoss``), the same layouts;
- :func:`mse`: ``ReduceMean((output - target)^2)`` (``F.mse_loss``), the target shaped
  and typed as the output.

``reduction``: ``"mean"`` or ``"sum"`` (a Trainer minimises a scalar). ``logits`` /
``output`` None: the model's first output. ``ignore_index`` (cross_entropy, nll; PyTorch's
default -100; None: none): the label value that contributes nothing, in the sum and in the
mean's count; all of a batch's labels ignored give NaN under ``"mean"`` and a zero
gradient, as PyTorch's.

Labels are checked on every placement, those of an attached loss and of the model's own
loss nodes alike (:mod:`.checks`): each a class index in ``[0, C)`` or the ignore_index,
the labels shaped as the scores without their class axis; a clear ValueError naming the
loss, the labels input, the position and the value otherwise, and nothing changed.

The modules: :mod:`.spec` (:class:`Loss`, the functions, the JSON form), :mod:`.attach`
(the nodes a loss adds), :mod:`.checks` (the label checks and the graph guard).
"""

from .checks import (CHECK, LOSS_OPS, failed_check, guard, guard_labels, label_check,
                     step_refusal)
from .spec import KINDS, REDUCTIONS, Loss, cross_entropy, from_dict, mse, nll

__all__ = ["CHECK", "KINDS", "LOSS_OPS", "Loss", "REDUCTIONS", "cross_entropy",
           "failed_check", "from_dict", "guard", "guard_labels", "label_check", "mse",
           "nll", "step_refusal"]
