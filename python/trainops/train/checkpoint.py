"""Trainer checkpoints: safetensors files in the format of ``docs/artifacts.md``.

Usable without a Trainer:

- :func:`write` ``(path, tensors, metadata)``: atomically (a temporary file in the same
  folder, flushed, fsync'ed, renamed over ``path``; a failed write leaves the previous file
  as it was and no temporary file behind);
- :func:`read` ``(path) -> (tensors, metadata)``: a safetensors checkpoint, or an old
  ``.npz`` one (told apart by their first bytes) converted to the same form; every
  metadata entry checked (:func:`check_metadata`), the model's bytes against their hash.

Tensors are keyed by the state's INPUT name in the training graph; the source model's
serialized bytes are the uint8 tensor ``trainops/model``. For a Trainer: :func:`state_of`
(what :meth:`Trainer.save` writes), :func:`mismatches` and :func:`restore` (every entry
validated against the trainer, ONE error listing every mismatch, nothing changed unless
everything matches).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import struct
from typing import Any, Mapping

import numpy as np

from . import update_options

__all__ = ["CheckpointError", "FORMAT", "FORMAT_VERSION", "MODEL_KEY", "check_metadata",
           "load_trainer", "mismatches", "read", "restore", "save", "state_of", "write"]

FORMAT = "trainops-checkpoint"
FORMAT_VERSION = "1"
MODEL_KEY = "trainops/model"  # the source model's serialized bytes (uint8, 1-D)
METADATA_KEYS = ("format", "format_version", "step", "learning_rate", "loss_scale", "seed",
                 "skipped", "config", "model_sha256")
_NPZ_MAGIC = b"PK\x03\x04"  # an .npz is a zip archive
# safetensors dtype names -> numpy dtypes (BF16 through ml_dtypes, when installed).
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
           "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not match the trainer (the message
    lists every problem found)."""


def _problems(path, what: str, problems: list[str]) -> CheckpointError:
    return CheckpointError(f"checkpoint {os.fspath(path)!r} {what}:\n" +
                           "\n".join(f"  - {p}" for p in problems))


# --- the file ----------------------------------------------------------------------------

def _serialize_file(tensors: Mapping[str, np.ndarray], path: str,
                    metadata: Mapping[str, str]) -> None:
    """safetensors' writer (a function of its own so tests can make it fail midway)."""
    from safetensors.numpy import save_file

    save_file(dict(tensors), path, metadata=dict(metadata))


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write(path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` (name -> array) and ``metadata`` (str -> str) as a safetensors
    file at ``path``, atomically: into a temporary file in the same folder, flushed to
    disk (fsync), then renamed over ``path`` (and the folder fsync'ed). If anything fails,
    ``path`` keeps its previous content and the temporary file is removed."""
    path = os.fspath(path)
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(f"checkpoint.write: metadata values must be strings: {bad}")
    arrays = {str(k): np.asarray(v) for k, v in tensors.items()}
    arrays = {k: v if v.flags.c_contiguous else v.copy(order="C") for k, v in arrays.items()}
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        _serialize_file(arrays, tmp, metadata)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


def _header(data: bytes, path) -> dict:
    if len(data) < 8:
        raise _problems(path, "is not a safetensors file", [f"{len(data)} bytes"])
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _problems(path, "is not a safetensors file", [f"header: {exc}"]) from None
    if not isinstance(header, dict):
        raise _problems(path, "is not a safetensors file", ["header is not a JSON object"])
    return header


def _dtype(name: str):
    if name == "BF16":
        try:
            import ml_dtypes
        except ImportError:
            raise CheckpointError("a bfloat16 tensor needs the ml_dtypes package") from None
        return ml_dtypes.bfloat16
    return _DTYPES[name]


def read(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of the checkpoint at ``path``: a safetensors file (this
    format) or an old ``.npz`` checkpoint (converted: see :func:`_read_npz`), told apart by
    their first bytes. :class:`CheckpointError` listing every problem: not a checkpoint,
    metadata missing or malformed (:func:`check_metadata`), the model tensor not matching
    ``model_sha256``."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] == _NPZ_MAGIC:
        tensors, metadata = _read_npz(path)
    else:
        from safetensors import deserialize

        header = _header(data, path)
        try:
            flat = deserialize(data)
        except Exception as exc:  # safetensors' own error type differs across versions
            raise _problems(path, "is not a valid safetensors file", [str(exc)]) from None
        tensors = {}
        unknown = []
        for name, view in flat:
            if view["dtype"] not in _DTYPES and view["dtype"] != "BF16":
                unknown.append(f"tensor {name!r}: dtype {view['dtype']} is not supported")
                continue
            tensors[name] = np.frombuffer(view["data"], _dtype(view["dtype"])) \
                .reshape(view["shape"]).copy()
        metadata = header.get("__metadata__") or {}
        if unknown:
            raise _problems(path, "has tensors of unsupported types", unknown)
    problems = check_metadata(metadata)
    model = tensors.get(MODEL_KEY)
    if model is not None and not problems:
        if model.dtype != np.uint8 or model.ndim != 1:
            problems.append(f"tensor {MODEL_KEY!r}: expected uint8 of one dimension, got "
                            f"{model.dtype} {list(model.shape)}")
        elif hashlib.sha256(model.tobytes()).hexdigest() != metadata["model_sha256"]:
            problems.append(f"tensor {MODEL_KEY!r}: its sha256 is not model_sha256 "
                            f"{metadata['model_sha256']} (the file is corrupt)")
    if problems:
        raise _problems(path, "is not a valid trainops checkpoint", problems)
    return tensors, dict(metadata)


def check_metadata(metadata: Mapping[str, Any]) -> list[str]:
    """The problems of a checkpoint's metadata (empty: none): every key of
    ``METADATA_KEYS`` present, ``format``/``format_version`` this format's, ``step`` an
    int >= 1, ``skipped`` an int >= 0, ``learning_rate`` a finite float >= 0,
    ``loss_scale`` a float or "", ``seed`` a 64-bit unsigned int ("" only in a converted
    ``.npz``), ``config`` a JSON object, ``model_sha256`` 64 hex digits."""
    m = metadata
    problems = [f"metadata {k!r} is missing" for k in METADATA_KEYS if k not in m]
    if problems:
        return problems

    def integer(key, low, high=None):
        try:
            v = int(m[key], 10)
        except (TypeError, ValueError):
            problems.append(f"metadata {key!r}: expected an integer, got {m[key]!r}")
            return
        if v < low or (high is not None and v > high):
            problems.append(f"metadata {key!r}: {v} is out of range [{low}, {high or 'inf'}]")

    def number(key):
        try:
            return float(m[key])
        except (TypeError, ValueError):
            problems.append(f"metadata {key!r}: expected a float, got {m[key]!r}")
            return None

    if m["format"] != FORMAT:
        problems.append(f"metadata 'format': expected {FORMAT!r}, got {m['format']!r}")
    if m["format_version"] != FORMAT_VERSION:
        problems.append(f"metadata 'format_version': this trainops reads version "
                        f"{FORMAT_VERSION!r}, got {m['format_version']!r}")
    integer("step", 1)
    integer("skipped", 0)
    if m["seed"] != "" or m.get("legacy") != "npz":
        integer("seed", 0, 2**64 - 1)
    lr = number("learning_rate")
    if lr is not None and not (math.isfinite(lr) and lr >= 0):
        problems.append(f"metadata 'learning_rate': expected a finite float >= 0, got {lr}")
    if m["loss_scale"] != "":
        number("loss_scale")
    try:
        if not isinstance(json.loads(m["config"]), dict):
            raise ValueError("not an object")
    except (TypeError, ValueError) as exc:
        problems.append(f"metadata 'config': expected a JSON object ({exc})")
    h = m["model_sha256"]
    if not (isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)):
        problems.append(f"metadata 'model_sha256': expected 64 hex digits, got {h!r}")
    return problems


def _read_npz(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """An old ``.npz`` checkpoint (``value:<name>`` arrays, ``model`` and ``config`` as
    bytes) as ``(tensors, metadata)`` of this format; ``metadata["legacy"] = "npz"``.
    Those trainers counted skipped steps in ``T``; here they do not: ``step`` is
    ``T - skipped``."""
    try:
        with np.load(path) as z:
            config = json.loads(bytes(z["config"]).decode())
            model = np.frombuffer(bytes(z["model"]), np.uint8).copy()
            values = {k[len("value:"):]: z[k] for k in z.files if k.startswith("value:")}
        t, lr, skipped = int(config["T"]), float(config["lr"]), int(config["skipped"])
    except (KeyError, ValueError, OSError) as exc:
        raise _problems(path, "is not a trainops .npz checkpoint", [repr(exc)]) from None
    scale = values.get("trainops/loss_scale")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": str(t - skipped),
            "learning_rate": repr(lr), "skipped": str(skipped),
            "loss_scale": "" if scale is None else repr(float(scale.reshape(-1)[0])),
            "seed": "" if config.get("seed") is None else str(int(config["seed"])),
            "config": json.dumps({k: config[k] for k in ("loss", "optimizer", "params",
                                                         "policy")}),
            "model_sha256": hashlib.sha256(model.tobytes()).hexdigest(), "legacy": "npz"}
    values[MODEL_KEY] = model
    return values, meta


# --- a Trainer's checkpoint --------------------------------------------------------------

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
    write(path, *state_of(trainer))


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
        raise _problems(path, "does not match this trainer", problems)
    for name in trainer._state_names():  # host->device on a device placement
        trainer._arrays.write(name, tensors[name])
    trainer.T = int(metadata["step"])
    trainer.lr = float(metadata["learning_rate"])
    trainer.skipped = int(metadata["skipped"])


def load_trainer(cls, path, threads=None, schedule=None):
    """The ``cls`` (Trainer) saved at ``path``: :meth:`trainops.Trainer.load`'s body."""
    from .. import losses as _losses
    from .. import optim as _optim

    tensors, metadata = read(path)
    if MODEL_KEY not in tensors:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} has no model (tensor "
            f"{MODEL_KEY!r}): load it into a Trainer of its model with "
            "trainer.load_state(path)")
    config = json.loads(metadata["config"])
    try:
        optimizer = _optim.from_dict(config["optimizer"])
        loss = config["loss"]
        loss = _losses.from_dict(loss) if isinstance(loss, dict) else loss
        trainer = cls(tensors[MODEL_KEY].tobytes(), loss,
                      optimizer, params=config["params"], policy=config["policy"],
                      threads=threads,
                      seed=int(metadata["seed"]) if metadata["seed"] else None,
                      batchnorm=config.get("batchnorm", "train"),
                      **update_options.load_options(config, schedule, path))
    except (KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r}: its config cannot build a trainer "
            f"({exc!r})") from None
    restore(trainer, tensors, metadata, path)
    return trainer
