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

__all__ = ["choose_params", "prepare", "thin", "thickened"]

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


def _same_tensor(a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    """The same name, type, dimensions and storage (not the data: see :func:`thin`)."""
    return (a.name == b.name and a.data_type == b.data_type and list(a.dims) == list(b.dims)
            and a.data_location == b.data_location and not a.external_data
            and not b.external_data)


def thin(train: onnx.ModelProto, imported: onnx.ModelProto) -> list[str]:
    """Clears, in ``train`` (the imported model with a loss attached: a copy made by
    :func:`prepare`), the data of every initializer ``imported`` holds too, and returns
    their names: a trainer keeps the weights' initial bytes once, not twice (a language
    model's 255 MB table and layers were held by both). :func:`thickened` puts them back
    from ``imported``. Only for a training model :func:`prepare` copied from ``imported``
    and nothing changed since (no LoRA, no weights held outside): its initializers are
    the imported ones, byte for byte."""
    if train is imported:
        return []
    ref = {i.name: i for i in imported.graph.initializer}
    names = []
    for init in train.graph.initializer:
        r = ref.get(init.name)
        if r is not None and _same_tensor(init, r) and init.ByteSize() > 4096:
            kept = onnx.TensorProto(name=init.name, data_type=init.data_type, dims=init.dims)
            init.CopyFrom(kept)
            names.append(init.name)
    return names


def thickened(train: onnx.ModelProto, imported: onnx.ModelProto,
              names: list[str]) -> onnx.ModelProto:
    """A copy of ``train`` with the data :func:`thin` cleared copied back from
    ``imported``."""
    out = onnx.ModelProto()
    out.CopyFrom(train)
    if not names:
        return out
    ref = {i.name: i for i in imported.graph.initializer if i.name in set(names)}
    for init in out.graph.initializer:
        if init.name in ref:
            init.CopyFrom(ref[init.name])
    return out
