"""Training in ONNX Runtime: :class:`Trainer` and the parts it delegates to.

- :mod:`.spec`: :class:`StepOptions`, :class:`StateEntry`, :class:`StepGraph` (data only:
  the step graph's description, its state table, ``to_manifest()``);
- :mod:`.graph`: :func:`build_step_graph`, the one-session step graph builder (a pure
  function), with :mod:`.backward` (forward + backward, shared with the data-parallel
  builder), :mod:`.fp16` (the float16 rewrite), :mod:`.rng` (Philox states) ,
  :mod:`.barrier` (every in-place write after every other node), :mod:`.batchnorm`
  (BatchNorm in training mode, its running statistics as state) and :mod:`.params` (the
  default parameters);
- :mod:`.importer` (on :mod:`trainops.autodiff.importing`), :mod:`.prepare`: models as
  exported, made trainable, the loss attached (the Trainer's first step);
- :mod:`.runtime`: :class:`StepRuntime`, the session and the in-place bindings of a
  StepGraph;
- :mod:`.dist_graph`, :mod:`.dist_runtime`: data-parallel training on MPI (a gradient
  model and an optimizer model around the collectives of :mod:`trainops.distributed`);
- :mod:`.checkpoint`: safetensors checkpoints (``write``/``read`` usable without a
  Trainer; old ``.npz`` ones still read);
- :mod:`.artifacts`: training artifacts (training/eval/inference models, checkpoint,
  ``manifest.json``) that stock ONNX Runtime trains from in any language;
- :mod:`.trainer`: :class:`Trainer`, the façade.

Modules import only those listed before them (``spec`` first, ``trainer`` last).
"""

from __future__ import annotations

from .graph import build_step_graph
from .runtime import StepRuntime
from .spec import StateEntry, StepGraph, StepOptions
from .trainer import Trainer

__all__ = ["StateEntry", "StepGraph", "StepOptions", "StepRuntime", "Trainer",
           "build_step_graph"]
