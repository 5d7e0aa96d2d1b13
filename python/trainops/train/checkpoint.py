"""Trainer checkpoints: a Trainer's states and configuration in the checkpoint file of
``docs/artifacts.md`` (:mod:`.checkpoint_file`: writing, reading and the reader contract's
checks, whose names this module re-exports for use without a Trainer).

For a Trainer: :func:`state_of` (what :meth:`Trainer.save` writes), :func:`mismatches` and
:func:`restore` (every entry validated against the trainer, ONE error listing every
mismatch, nothing changed unless everything matches), :func:`build_trainer` and
:func:`load_trainer` (a Trainer of the checkpoint's model and config).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from . import update_options
from .checkpoint_file import (FORMAT, FORMAT_VERSION, INT64_MAX, METADATA_KEYS, MODEL_KEY,
                              CheckpointError, check_config, check_metadata, check_model,
                              parse_json, problems_error, read, refuse_special, serialize,
                              write)

__all__ = ["CheckpointError", "FORMAT", "FORMAT_VERSION", "INT64_MAX", "METADATA_KEYS",
           "MODEL_KEY", "build_trainer", "check_config", "check_metadata", "check_model",
           "config_of", "load_trainer", "mismatches", "parse_json", "read", "refuse_special",
           "restore", "save", "serialize", "state_of", "write"]


def config_of(trainer) -> dict:
    """The configuration a checkpoint records and a resumed trainer must share: loss,
    optimizer (its dict), params, policy, and the update options
    (:func:`.update_options.config_of`)."""
    config = {"loss": trainer.loss_config, "optimizer": trainer.optimizer.to_dict(),
              "params": list(trainer.param_names), "policy": trainer.policy}
    if trainer.batchnorm != "train":  # written when not the default: older configs match
        config["batchnorm"] = trainer.batchnorm
    return {**config,
            **update_options.config_of(trainer)}


def state_of(trainer) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of ``trainer``'s checkpoint: every state buffer by its input
    name, the model's bytes as ``trainops/model``, the metadata of ``docs/artifacts.md``."""
    if trainer.shard_optimizer:
        raise NotImplementedError("save() of a shard_optimizer trainer: each rank holds "
                                  "1/N of the optimizer state; not implemented yet")
    tensors = dict(trainer._states())
    tensors[MODEL_KEY] = np.frombuffer(trainer._model_bytes, np.uint8)
    scale = trainer.loss_scale
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": str(trainer.T),
                "learning_rate": repr(float(trainer.lr)),
                "loss_scale": "" if scale is None else repr(scale),
                "seed": str(trainer.seed), "skipped": str(trainer.skipped),
                "config": json.dumps({**config_of(trainer),
                                      **update_options.schedule_config(trainer)},
                                     sort_keys=True),
                "model_sha256": trainer.model_sha256}
    return tensors, metadata


def save(trainer, path) -> None:
    """Write ``trainer``'s checkpoint to ``path`` (atomically: :func:`write`)."""
    write(path, *state_of(trainer), what="Trainer.save")


def mismatches(trainer, tensors: Mapping[str, np.ndarray],
               metadata: Mapping[str, str]) -> list[str]:
    """Every way the checkpoint ``(tensors, metadata)`` does not fit ``trainer`` (empty:
    it fits): the model's hash, the configuration, the seed (when there are random nodes),
    each state's presence, dtype and shape, names that are no state, the loss scale."""
    problems = check_metadata(metadata)
    if problems:
        return problems
    legacy = metadata.get("legacy") == "npz"
    if metadata["model_sha256"] != trainer.model_sha256:
        problems.append(f"model_sha256 {metadata['model_sha256']} is not this trainer's "
                        f"model ({trainer.model_sha256})")
    config, mine = json.loads(metadata["config"]), config_of(trainer)
    for key, want in mine.items():
        have = config.get(key)
        if isinstance(have, dict) and isinstance(want, dict):  # the optimizer: what differs
            problems += [f"config {key!r} {k!r}: the checkpoint has {have.get(k)!r}, this "
                         f"trainer {want.get(k)!r}" for k in sorted(set(have) | set(want))
                         if have.get(k) != want.get(k)]
        elif have != want:
            problems.append(f"config {key!r}: the checkpoint has {have!r}, this trainer "
                            f"{want!r}")
    states = trainer._state_specs()  # (dtype, shape): no device->host copy
    has_rng = any(e[0] in states for e in trainer._rng)
    if has_rng and metadata["seed"] != "" and int(metadata["seed"]) != trainer.seed:
        problems.append(f"seed {metadata['seed']}: this trainer's is {trainer.seed} (its "
                        "random nodes are keyed by it)")
    for name, (dtype, shape) in states.items():
        if name not in tensors:
            problems.append(f"state {name!r} ({dtype} {list(shape)}) is missing")
            continue
        got = tensors[name]
        if got.dtype != dtype or got.shape != shape:
            problems.append(f"state {name!r}: expected {dtype} {list(shape)}, got "
                            f"{got.dtype} {list(got.shape)}")
    ignore = {MODEL_KEY} | (set(trainer._arrays) if legacy else set())
    extra = sorted(n for n in tensors if n not in states and n not in ignore)
    if extra:
        problems.append(f"tensors {extra} are not states of this trainer")
    scale = states.get("trainops/loss_scale")
    if scale is None and metadata["loss_scale"] != "":
        problems.append(f"loss_scale {metadata['loss_scale']}: this trainer has none")
    elif scale is not None and "trainops/loss_scale" in tensors and \
            tensors["trainops/loss_scale"].shape == scale[1]:
        want = repr(float(tensors["trainops/loss_scale"].reshape(-1)[0]))
        if metadata["loss_scale"] != want:
            problems.append(f"loss_scale {metadata['loss_scale']!r} disagrees with the "
                            f"tensor 'trainops/loss_scale' ({want})")
    return problems


def restore(trainer, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str],
            path="<checkpoint>") -> None:
    """Load ``(tensors, metadata)`` into ``trainer``: validated first (:func:`mismatches`);
    any mismatch raises ONE :class:`CheckpointError` listing them all, and then nothing of
    the trainer has changed. Otherwise every state buffer, ``T``, the learning rate and
    the skipped count take the checkpoint's values."""
    problems = mismatches(trainer, tensors, metadata)
    if problems:
        raise problems_error(path, "does not match this trainer", problems)
    for name in trainer._state_names():  # host->device on a device placement
        trainer._arrays.write(name, tensors[name])
    trainer.T = int(metadata["step"])
    trainer.lr = float(metadata["learning_rate"])
    trainer.skipped = int(metadata["skipped"])


def build_trainer(cls, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], path,
                  threads=None, schedule=None, **extra):
    """A ``cls`` (Trainer) of the checkpoint's model and config (``tensors`` and
    ``metadata`` as :func:`read` returned them; ``extra``: more Trainer arguments). Any
    error building it (an optimizer, loss or schedule its class refuses, a config the
    Trainer refuses with this model) is a :class:`CheckpointError` naming ``path`` and the
    config key (or ``config`` and ``trainops/model`` together when the Trainer refuses the
    pair); nothing is half-built."""
    from .. import losses as _losses
    from .. import optim as _optim

    where = os.fspath(path)
    if MODEL_KEY not in tensors:
        raise CheckpointError(
            f"checkpoint {where!r} has no model (tensor {MODEL_KEY!r}): load it into a "
            "Trainer of its model with trainer.load_state(path)")
    config = json.loads(metadata["config"])
    problems = check_config(config)  # read() checked it; a caller's own tensors may not be
    if problems:
        raise problems_error(path, "has a config that cannot build a trainer", problems)
    kwargs = {}
    for key, make in (("optimizer", lambda: _optim.from_dict(config["optimizer"])),
                      ("loss", lambda: _losses.from_dict(config["loss"])
                       if isinstance(config["loss"], dict) else config["loss"]),
                      ("schedule", lambda: update_options.load_options(config, schedule, path))):
        try:
            kwargs[key] = make()
        except CheckpointError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            why = f"the key {exc.args[0]!r} is missing" if isinstance(exc, KeyError) else exc
            raise problems_error(path, "has a config that cannot build a trainer",
                                 [f"config {key!r}: {why}"]) from exc
    try:
        return cls(tensors[MODEL_KEY].tobytes(), kwargs["loss"], kwargs["optimizer"],
                   params=config["params"], policy=config["policy"], threads=threads,
                   seed=int(metadata["seed"]) if metadata["seed"] else None,
                   batchnorm=config.get("batchnorm", "train"), **kwargs["schedule"], **extra)
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 (whatever the model and config make it raise)
        raise problems_error(path, "cannot build a trainer", [
            f"its model (tensor {MODEL_KEY!r}) and 'config' "
            f"{json.dumps({k: config[k] for k in ('loss', 'params', 'policy')})}: "
            f"{type(exc).__name__}: {exc}"]) from exc


def load_trainer(cls, path, threads=None, schedule=None):
    """The ``cls`` (Trainer) saved at ``path``: :meth:`trainops.Trainer.load`'s body."""
    tensors, metadata = read(path)
    trainer = build_trainer(cls, tensors, metadata, path, threads, schedule)
    restore(trainer, tensors, metadata, path)
    return trainer
