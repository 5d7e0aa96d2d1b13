"""The torch bridge: :func:`export` a ``torch.nn.Module`` for :class:`trainops.Trainer`,
and :meth:`Trainer.state_dict <trainops.train.Trainer.state_dict>` to put the trained
values back into the module::

    import trainops.torch
    model = trainops.torch.export(net, (x,))          # faithful to net.train()
    trainer = Trainer(model, losses.cross_entropy("logits"), optim.AdamW(lr=1e-3))
    ...                                               # trainer.step(...)
    net.load_state_dict(trainer.state_dict(), strict=False)

torch is an optional dependency (``pip install trainops[torch]``): this package imports it,
``import trainops`` does not. The export keeps BatchNorm in its training form with its
running statistics as initializers, Dropout in training mode, every parameter an
initializer of its own (tied parameters one), nothing trainable folded into a constant;
``model.metadata_props["trainops.torch"]`` maps the module's parameter and buffer names to
the initializers (:mod:`trainops.train.torch_meta`), so the Trainer trains exactly the
parameters that have ``requires_grad=True``. The export is checked: onnxruntime's outputs
of it on the example inputs must be the module's own (:mod:`trainops.torch.check`).
"""

from __future__ import annotations

from .exporter import OPSET, export

__all__ = ["OPSET", "export"]
