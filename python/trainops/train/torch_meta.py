"""What :func:`trainops.torch.export` records in a model about the torch module it came
from, and its two readers: the Trainer's default parameters (:func:`trainable_params`)
and :meth:`Trainer.state_dict <trainops.train.Trainer.state_dict>` (:func:`state_dict`).

The record is one entry of ``model.metadata_props``, key :data:`KEY`, a JSON object::

    {"params":  {torch_name: {"initializer": name, "transposed": bool}, ...},
     "buffers": {torch_name: {"initializer": name}, ...}}

``params``: every trainable torch parameter (``requires_grad=True``), tied ones under each
of their names with the same initializer; ``transposed``: the initializer holds the 2-D
parameter's transpose. ``buffers``: the buffers the graph holds as initializers
(BatchNorm's running statistics). Frozen parameters are not listed: they stay constants.

This module never imports torch at module level (``import trainops`` must not);
:func:`state_dict` imports it when called.
"""

from __future__ import annotations

import json

import numpy as np

import onnx

__all__ = ["KEY", "read", "state_dict", "trainable_params", "write"]

KEY = "trainops.torch"


def _bad(why: str) -> ValueError:
    return ValueError(f"model metadata {KEY!r}: {why} (write it with trainops.torch.export)")


def read(model: onnx.ModelProto) -> dict | None:
    """The record of ``model`` (see the module), or None when it has none. ValueError
    naming what is wrong when the entry is there but malformed."""
    found = [p.value for p in model.metadata_props if p.key == KEY]
    if not found:
        return None
    if len(found) > 1:
        raise _bad(f"{len(found)} entries, expected one")
    try:
        meta = json.loads(found[0])
    except ValueError as exc:
        raise _bad(f"not JSON ({exc})") from None
    if not isinstance(meta, dict) or set(meta) != {"params", "buffers"}:
        raise _bad("expected an object with the keys 'params' and 'buffers'")
    inits = {i.name for i in model.graph.initializer}
    for kind, keys in (("params", {"initializer", "transposed"}), ("buffers", {"initializer"})):
        if not isinstance(meta[kind], dict):
            raise _bad(f"{kind!r} is not an object")
        for name, entry in meta[kind].items():
            if not isinstance(entry, dict) or set(entry) != keys:
                raise _bad(f"{kind}[{name!r}]: expected the keys {sorted(keys)}")
            if entry["initializer"] not in inits:
                raise _bad(f"{kind}[{name!r}]: {entry['initializer']!r} is not an "
                           "initializer of the model")
    return meta


def write(model: onnx.ModelProto, meta: dict) -> None:
    """Sets ``model``'s record to ``meta`` (replacing an earlier one)."""
    keep = [p for p in model.metadata_props if p.key != KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    model.metadata_props.add(key=KEY, value=json.dumps(meta, sort_keys=False))


def trainable_params(model: onnx.ModelProto) -> list[str] | None:
    """The initializers of the module's trainable parameters (each once, tied parameters
    being one), in the order torch lists them; None when ``model`` has no record."""
    meta = read(model)
    if meta is None:
        return None
    return list(dict.fromkeys(e["initializer"] for e in meta["params"].values()))


def state_dict(model: onnx.ModelProto, current: dict) -> dict:
    """``{torch name: torch.Tensor}``: ``current`` (numpy arrays by initializer: the
    Trainer's parameters and running statistics) under the torch names ``model``'s record
    gives them, transposed back where the initializer is a transpose: every trainable
    parameter (both names of tied ones) and every buffer the graph holds; one that is not
    in ``current`` (not trained: ``params=`` left it out, or ``batchnorm="frozen"``) keeps
    its value in ``model``. ValueError when ``model`` was not exported by
    :func:`trainops.torch.export` (no record)."""
    meta = read(model)
    if meta is None:
        raise ValueError("Trainer.state_dict: the model has no 'trainops.torch' metadata: it "
                         "was not exported by trainops.torch.export, so its initializers "
                         "cannot be named as the torch module's parameters (read "
                         "Trainer.parameters() by initializer name instead)")
    import torch
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for kind in ("params", "buffers"):
        for name, entry in meta[kind].items():
            init = entry["initializer"]
            v = current[init] if init in current else numpy_helper.to_array(inits[init])
            if entry.get("transposed"):
                v = v.T
            out[name] = torch.from_numpy(np.ascontiguousarray(v).copy())
    return out
