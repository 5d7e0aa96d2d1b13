"""What the Trainer does to a model before building its step graph: import it as exported
(:mod:`.importer`), attach a :mod:`trainops.losses` loss, choose the parameters (logged
once) and check that every op between them and the loss has a gradient rule."""

from __future__ import annotations

import logging

import numpy as np

import onnx

from .. import losses as _losses
from ..autodiff import coverage as _coverage
from .backward import resolve_params
from .importer import import_model

__all__ = ["choose_params", "prepare"]

log = logging.getLogger("trainops")


def prepare(model, loss, batchnorm: str) -> tuple[onnx.ModelProto, onnx.ModelProto, str]:
    """``(imported model, training model, loss tensor name)``: the training model is the
    imported one with ``loss`` attached when it is a :class:`trainops.losses.Loss` (its
    nodes and data input), the imported model itself when ``loss`` is a tensor name."""
    imported = import_model(model, batchnorm)
    if isinstance(loss, _losses.Loss):
        return imported, loss.attach(imported), loss.name
    if isinstance(loss, str):
        return imported, imported, loss
    raise TypeError(f"loss: expected a tensor name or a trainops.losses loss, got "
                    f"{type(loss).__name__}")


def choose_params(model: onnx.ModelProto, loss: str, params, batchnorm: str):
    """``(parameters, coverage rows)``: ``params`` or the default choice (logged once),
    and every op type between them and ``loss`` with its rule (a GradientError listing all
    that have none)."""
    chosen = resolve_params(model, loss, params)
    if params is None:
        size = sum(int(np.prod(i.dims)) for i in model.graph.initializer
                   if i.name in set(chosen))
        log.info("training %d parameters (%d values) chosen by default: %s%s", len(chosen),
                 size, ", ".join(chosen[:8]), ", ..." if len(chosen) > 8 else "")
    return chosen, _coverage.check(model, loss, chosen, batchnorm == "train")
