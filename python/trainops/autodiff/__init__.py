"""Reverse-mode automatic differentiation of ONNX graphs into ordinary ONNX ops.

- :func:`expand_gradients` replaces every ``ai.onnx.preview.training::Gradient`` node of a
  model by its backward graph (default-domain ops), so that a stock ONNX Runtime runs it;
  the model may be given as exporters write it (:mod:`.importing`, shared with the
  Trainer's importer: a path with external data, old opsets upgraded, ...).
- :func:`build_backward` emits the backward nodes of one target for the Trainer.
- :data:`RULES` maps each supported op type to its gradient (VJP) rule; an op on the path
  without one is a :class:`GradientError` naming the op type and the node. The rules live
  in ``rules.py`` and, by family, in ``rules_*.py`` modules (``rules_rnn.py``: RNN, GRU,
  LSTM) that register into the same table when this package is imported.
"""

from .backward import build_backward
from .expand import expand_gradients
from .graph import Builder, GradientError, infer
from .hygiene import toposort
from .rules import RULES
# the rules_*.py modules register their rules into RULES
from . import (rules_elementwise, rules_index, rules_nn,  # noqa: F401,E402
               rules_reduce, rules_resize, rules_rnn, rules_tensor, rules_transformer)

__all__ = ["expand_gradients", "build_backward", "GradientError", "RULES", "Builder",
           "infer", "toposort"]
