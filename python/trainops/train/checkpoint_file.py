"""The checkpoint file: safetensors in the format of ``docs/artifacts.md``, and the checks
of its reader contract (the Rust trainer makes the same ones). :mod:`.checkpoint` builds a
Trainer's checkpoint on it and re-exports these names.

- :func:`write` ``(path, tensors, metadata)``: atomically (:mod:`.atomic`: symlinks
  resolved, special files refused, a temporary file in the same folder flushed, fsync'ed
  and renamed over ``path``; a failed write is an OSError with its errno naming ``path``,
  leaves the previous file as it was and no temporary file behind);
- :func:`read` ``(path) -> (tensors, metadata)``: a safetensors checkpoint, or an old
  ``.npz`` one (told apart by their first bytes) converted to the same form; every
  metadata entry checked (:func:`check_metadata`, :func:`check_config`), the model's
  bytes against their hash and as an ONNX model (:func:`check_model`): the checks of the
  reader contract in ``docs/artifacts.md``, which the Rust trainer makes too.

Tensors are keyed by the state's INPUT name in the training graph; the source model's
serialized bytes are the uint8 tensor ``trainops/model``. The writer lays the file out as
safetensors' own does (its header is checked against safetensors' in the tests) but
streams each array's buffer to the file: safetensors' ``serialize`` would first make one
more copy of every state in memory, and its errors are not OSErrors.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from typing import Any, Mapping

import numpy as np

from . import atomic
from . import schema as _schema

__all__ = ["CheckpointError", "FORMAT", "FORMAT_VERSION", "INT64_MAX", "METADATA_KEYS",
           "MODEL_KEY", "check_config", "check_metadata", "check_model", "parse_json", "read",
           "refuse_special", "serialize", "write"]

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


def problems_error(path, what: str, problems: list[str]) -> CheckpointError:
    return CheckpointError(f"checkpoint {os.fspath(path)!r} {what}:\n" +
                           "\n".join(f"  - {p}" for p in problems))


# --- the file ----------------------------------------------------------------------------

# safetensors' dtype order (its Dtype enum): its writer lays tensors out by dtype, largest
# first, then by name; this writer does the same, so its headers are safetensors' own.
_ORDER = ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64",
          "U64")


def _safetensors_name(array: np.ndarray, name: str) -> str:
    if array.dtype.name == "bfloat16":
        return "BF16"
    for st, np_type in _DTYPES.items():
        if array.dtype == np_type:
            return st
    raise TypeError(f"checkpoint.write: tensor {name!r} has dtype {array.dtype}, which "
                    f"safetensors cannot hold (expected one of {sorted(_DTYPES)} or bfloat16)")


def serialize(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> list:
    """The safetensors file of ``tensors`` and ``metadata`` as a list of byte chunks (the
    header, then each tensor's own buffer, not copied): the layout of safetensors' writer
    (tensors by dtype, largest first, then by name; the header padded with spaces to a
    multiple of 8 bytes)."""
    arrays = {}
    for name, value in tensors.items():
        a = np.asarray(value)
        if a.dtype.byteorder == ">":  # safetensors is little-endian
            a = a.astype(a.dtype.newbyteorder("<"))
        arrays[str(name)] = a if a.flags.c_contiguous else a.copy(order="C")  # 0-d stays 0-d
    kinds = {n: _safetensors_name(a, n) for n, a in arrays.items()}
    names = sorted(arrays, key=lambda n: (-_ORDER.index(kinds[n]), n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for n in names:
        size = arrays[n].nbytes
        header[n] = {"dtype": kinds[n], "shape": list(arrays[n].shape),
                     "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text] + [arrays[n].reshape(-1).view(np.uint8)
                                                   for n in names]


def write(path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str],
          what: str = "checkpoint.write") -> None:
    """Write ``tensors`` (name -> array) and ``metadata`` (str -> str) as a safetensors
    file at ``path``, atomically (:mod:`.atomic`): symlinks resolved, a target that is no
    regular file refused, a temporary file in the same folder flushed to disk (fsync) and
    renamed over the file. If anything fails, ``path`` keeps its previous content, the
    temporary file is removed, and the error is an :class:`OSError` with its errno naming
    ``path`` (a full disk: ENOSPC; a file-size limit: EFBIG)."""
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(f"{what}: metadata values must be strings: {bad}")
    atomic.write_files([(path, serialize(tensors, metadata))], what)


def refuse_special(path, what: str) -> None:
    """:class:`OSError` (EISDIR, EINVAL) naming ``path`` when it exists and is not a
    regular file once its symlinks are resolved (reading a FIFO would block)."""
    try:
        found = atomic.not_regular(os.stat(path).st_mode)
    except FileNotFoundError:
        return  # open() says so, naming it
    if found:
        raise OSError(found[0], f"{what} {os.fspath(path)!r} is not a regular file", path)


def _header(data: bytes, path) -> dict:
    if len(data) < 8:
        raise problems_error(path, "is not a safetensors file", [f"{len(data)} bytes"])
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise problems_error(path, "is not a safetensors file", [f"header: {exc}"]) from None
    if not isinstance(header, dict):
        raise problems_error(path, "is not a safetensors file", ["header is not a JSON object"])
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
    ``model_sha256`` or not an ONNX model (:func:`check_model`). A path that is not a
    regular file (a FIFO, whose read would wait for a writer) is refused first."""
    refuse_special(path, "checkpoint")
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
            raise problems_error(path, "is not a valid safetensors file", [str(exc)]) from None
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
            raise problems_error(path, "has tensors of unsupported types", unknown)
    problems = check_metadata(metadata)
    if not problems:
        problems = check_model(tensors, metadata)
    if problems:
        raise problems_error(path, "is not a valid trainops checkpoint", problems)
    return tensors, dict(metadata)


# The decimal grammars of the metadata (the Rust reader's are the same): integers are ASCII
# digits only (no sign, space, underscore or other script's digits); floats are decimal
# (optional sign, digits with an optional fraction, optional exponent), and loss_scale
# may also be Python's repr of a non-finite float.
_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NON_FINITE = ("inf", "-inf", "nan")
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
# What a checkpoint's config may name (trainops.optim.from_dict, trainops.schedules).
OPTIMIZER_TYPES = ("Adam", "AdamW", "Adagrad", "Momentum")
SCHEDULE_TYPES = ("Constant", "Cosine", "Exponential", "LinearWarmup", "OneCycle", "Step",
                  "callable")
POLICIES = ("float32", "float64", "mixed_float16")
BATCHNORM = ("train", "frozen")


def parse_json(text: str):
    """``text`` as strict JSON (RFC 8259: no NaN or Infinity, no lone surrogates), as
    every JSON reader of other languages reads it. ValueError otherwise."""
    def constant(name):
        raise ValueError(f"{name} is not JSON")

    value = json.loads(text, parse_constant=constant)
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError: a surrogate
    return value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_config(config: Any) -> list[str]:
    """The problems of a checkpoint's ``config`` (empty: none), each naming its key:
    ``loss`` a string or an object; ``optimizer`` an object of a known ``type`` with a
    finite ``lr`` >= 0; ``params`` an array of strings; ``policy`` a known policy; when
    present, ``batchnorm`` train/frozen, ``clip_grad_norm`` null or a finite number > 0,
    ``accumulate`` an integer >= 1, ``schedule`` null or an object of a known ``type``."""
    if not isinstance(config, dict):
        return [f"metadata 'config': expected a JSON object, got {type(config).__name__}"]
    problems = [f"config {k!r} is missing" for k in ("loss", "optimizer", "params", "policy")
                if k not in config]

    def bad(key, expected):
        problems.append(f"config {key!r}: expected {expected}, got {_schema.show(config[key])}")

    if "loss" in config and not (isinstance(config["loss"], dict) or
                                 (isinstance(config["loss"], str) and config["loss"])):
        bad("loss", "a non-empty string (an output name) or an object (a trainops.losses loss)")
    opt = config.get("optimizer")
    if "optimizer" in config:
        if not isinstance(opt, dict):
            bad("optimizer", "an object")
        else:
            if opt.get("type") not in OPTIMIZER_TYPES:
                problems.append(f"config 'optimizer' 'type': expected one of "
                                f"{list(OPTIMIZER_TYPES)}, got {_schema.show(opt.get('type'))}")
            lr = opt.get("lr")
            if not (_is_number(lr) and math.isfinite(lr) and lr >= 0):
                problems.append(f"config 'optimizer' 'lr': expected a finite number >= 0, "
                                f"got {_schema.show(lr)}")
    if "params" in config and not (isinstance(config["params"], list) and
                                   all(isinstance(p, str) for p in config["params"])):
        bad("params", "an array of strings")
    if "policy" in config and config["policy"] not in POLICIES:
        bad("policy", f"one of {list(POLICIES)}")
    if "batchnorm" in config and config["batchnorm"] not in BATCHNORM:
        bad("batchnorm", f"one of {list(BATCHNORM)}")
    clip = config.get("clip_grad_norm")
    if clip is not None and not (_is_number(clip) and math.isfinite(clip) and clip > 0):
        bad("clip_grad_norm", "null or a finite number > 0")
    acc = config.get("accumulate", 1)
    if not (isinstance(acc, int) and not isinstance(acc, bool) and acc >= 1):
        bad("accumulate", "an integer >= 1")
    sched = config.get("schedule")
    if sched is not None and not (isinstance(sched, dict) and
                                  sched.get("type") in SCHEDULE_TYPES):
        bad("schedule", f"null or an object whose 'type' is one of {list(SCHEDULE_TYPES)}")
    return problems


def _shown(text: str) -> str:
    """``repr(text)``, cut to 80 characters (a metadata value may be long)."""
    return repr(text) if len(text) <= 77 else repr(text[:77]) + "..."


def check_metadata(metadata: Mapping[str, Any]) -> list[str]:
    """The problems of a checkpoint's metadata (empty: none): every key of
    ``METADATA_KEYS`` present, ``format``/``format_version`` this format's, ``step`` a
    decimal integer in [1, 2^63-1], ``skipped`` one in [0, 2^63-1], ``seed`` one in
    [0, 2^64-1] ("" only in a converted ``.npz``), ``learning_rate`` a decimal float,
    finite and >= 0, ``loss_scale`` a decimal float, ``inf``, ``-inf``, ``nan`` or "",
    ``config`` a JSON object (:func:`check_config`), ``model_sha256`` 64 lowercase hex
    digits. Decimal integers are ASCII digits only (``docs/artifacts.md``)."""
    m = metadata
    problems = [f"metadata {k!r} is missing" for k in METADATA_KEYS if k not in m]
    if problems:
        return problems
    not_str = [k for k in METADATA_KEYS if not isinstance(m[k], str)]
    if not_str:
        return [f"metadata {k!r}: expected a string, got {type(m[k]).__name__}" for k in not_str]

    def integer(key, low, high):
        if not _DIGITS.fullmatch(m[key]):
            problems.append(f"metadata {key!r}: expected a decimal integer in [{low}, {high}] "
                            f"(ASCII digits only), got {_shown(m[key])}")
        elif len(m[key]) > 40 or not low <= int(m[key]) <= high:  # (int() of 4300+ digits
            # raises, and no value in range has 40)
            shown = m[key] if len(m[key]) <= 40 else m[key][:37] + "..."
            problems.append(f"metadata {key!r}: {shown} is out of range [{low}, {high}]")

    if m["format"] != FORMAT:
        problems.append(f"metadata 'format': expected {FORMAT!r}, got {_shown(m['format'])}")
    if m["format_version"] != FORMAT_VERSION:
        problems.append(f"metadata 'format_version': this trainops reads version "
                        f"{FORMAT_VERSION!r}, got {_shown(m['format_version'])}")
    integer("step", 1, INT64_MAX)
    integer("skipped", 0, INT64_MAX)
    if m["seed"] != "" or m.get("legacy") != "npz":
        integer("seed", 0, UINT64_MAX)
    lr = m["learning_rate"]
    if not (_DECIMAL.fullmatch(lr) and math.isfinite(float(lr)) and float(lr) >= 0):
        problems.append(f"metadata 'learning_rate': expected a decimal float, finite and "
                        f">= 0, got {_shown(lr)}")
    if m["loss_scale"] != "" and not (_DECIMAL.fullmatch(m["loss_scale"]) or
                                      m["loss_scale"] in _NON_FINITE):
        problems.append(f"metadata 'loss_scale': expected a decimal float (or inf, -inf, "
                        f"nan) or \"\", got {_shown(m['loss_scale'])}")
    try:
        config = parse_json(m["config"])
    except (ValueError, UnicodeError) as exc:
        problems.append(f"metadata 'config': expected a JSON object ({exc})")
    else:
        problems += check_config(config)
    h = m["model_sha256"]
    if not (len(h) == 64 and all(c in "0123456789abcdef" for c in h)):
        problems.append(f"metadata 'model_sha256': expected 64 lowercase hex digits, got "
                        f"{_shown(h)}")
    return problems


def check_model(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> list[str]:
    """The problems of the source model tensor ``trainops/model`` (empty: none, or
    absent): uint8 of one dimension, hashing to ``model_sha256``, a serialized ONNX
    ModelProto (protobuf) with a graph."""
    model = tensors.get(MODEL_KEY)
    if model is None:
        return []
    if model.dtype != np.uint8 or model.ndim != 1:
        return [f"tensor {MODEL_KEY!r}: expected uint8 of one dimension, got {model.dtype} "
                f"{list(model.shape)}"]
    data = model.tobytes()  # one copy for the hash and the parse
    if hashlib.sha256(data).hexdigest() != metadata["model_sha256"]:
        return [f"tensor {MODEL_KEY!r}: its sha256 is not model_sha256 "
                f"{metadata['model_sha256']} (the file is corrupt)"]
    import onnx
    from google.protobuf.message import DecodeError

    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except DecodeError as exc:
        return [f"tensor {MODEL_KEY!r}: not a serialized ONNX model ({exc})"]
    if not proto.HasField("graph"):
        return [f"tensor {MODEL_KEY!r}: not a serialized ONNX model (it has no graph)"]
    return []


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
        raise problems_error(path, "is not a trainops .npz checkpoint", [repr(exc)]) from None
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
