"""Small helpers to build training-operator models with ``onnx.helper`` and run them in
ONNX Runtime with the trainops library registered.

    import numpy as np
    from trainops.models import adam_model, adam_feeds, session

    model = adam_model([(3,), (2, 5)], alpha=0.95)
    sess = session(model)
    outs = sess.run(None, adam_feeds(0.01, 1, xs, gs, vs, hs))

Input names are ``R, T, X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n``, output names
``X_1_new..X_n_new, V_1_new..V_n_new, H_1_new..H_n_new``. Models are written with IR
version 8 (onnx >= 1.16 writes a newer IR than older runtimes accept).

Two modules, every name importable from here: :mod:`.core` (``node_model``, sessions, the
optimizers and ``Philox``) and :mod:`.loss_scale` (``MixedPrecisionAdam``,
``DynamicLossScale``, ``AllFinite``).
"""

from __future__ import annotations

from .core import (IR_VERSION, ONNX_OPSET, TRAINING_DOMAIN, TRAINOPS_DOMAIN, Shape, adagrad_feeds,
                   adagrad_model, adam_feeds, adam_model, adam_names, adamw_feeds, adamw_groups,
                   adamw_model, momentum_feeds, momentum_model,
                   node_model, philox_model, session, session_options, tensor_type)
from .loss_scale import (all_finite_model, dynamic_loss_scale_model, mixed_precision_adam_feeds,
                         mixed_precision_adam_model, mixed_precision_adam_names)

from . import core, loss_scale

# The same list, in the same order, as before it was derived from the modules' own lists.
__all__ = ["adamw_feeds", "adamw_groups", "adamw_model", *core.__all__, "TRAINOPS_DOMAIN", *loss_scale.__all__]
