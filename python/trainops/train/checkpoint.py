"""Trainer checkpoints (``.npz``): :func:`save` writes the model, the config (loss,
optimizer, params, policy, update count, learning rate, skipped steps, seed) and every
buffer of the trainer as ``value:<name>``; :func:`read` and :func:`restore` bring them
back, bit for bit."""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

import onnx

__all__ = ["read", "restore", "save"]


def save(trainer, path) -> None:
    """Write ``trainer``'s checkpoint (a :class:`trainops.Trainer`) to ``path``."""
    if trainer.shard_optimizer:
        raise NotImplementedError("save() of a shard_optimizer trainer: each rank holds "
                                  "1/N of the optimizer state; not implemented yet")
    config = {"loss": trainer.loss_config, "batchnorm": trainer.batchnorm,
              "optimizer": trainer.optimizer.to_dict(),
              "params": trainer.param_names, "policy": trainer.policy, "T": trainer.T,
              "lr": trainer.lr, "skipped": trainer.skipped, "seed": trainer.seed}
    arrays = {f"value:{k}": v for k, v in trainer._arrays.items()}
    arrays["model"] = np.frombuffer(trainer._model.SerializeToString(), np.uint8)
    arrays["config"] = np.frombuffer(json.dumps(config).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def read(path) -> tuple[onnx.ModelProto, dict, dict]:
    """(model, config, state) of the checkpoint at ``path``; ``state``: ``values`` (name
    -> array), ``T``, ``lr``, ``skipped``, as :func:`restore` takes it."""
    with np.load(path) as z:
        config = json.loads(bytes(z["config"]).decode())
        model = onnx.load_from_string(bytes(z["model"]))
        values = {k[len("value:"):]: z[k] for k in z.files if k.startswith("value:")}
    state = {"values": values, "T": config["T"], "lr": config["lr"],
             "skipped": config["skipped"]}
    return model, config, state


def restore(arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> tuple[int, float, int]:
    """Copy ``state["values"]`` into the buffers ``arrays`` (ValueError for a name that is
    not one of them); returns (T, lr, skipped)."""
    for name, arr in state["values"].items():
        if name not in arrays:
            raise ValueError(f"checkpoint value {name!r} is not part of this trainer")
        np.copyto(arrays[name], arr)
    return int(state["T"]), float(state["lr"]), int(state["skipped"])
