"""``Trainer.save_adapter`` / ``load_adapter``: the adapter tensors in a file.

- ``.safetensors``: each adapter tensor by its name (``<W>.lora_A``, ``<W>.lora_B``),
  float32, metadata ``rank`` and ``alpha`` as decimal strings (``"8"``, ``"16"``);
- ``format="peft"`` (a folder): PEFT's ``adapter_model.safetensors`` (keys
  ``base_model.model.<module>.lora_A.weight``, from the torch bridge's names, metadata
  ``trainops.torch``) and ``adapter_config.json``;
- ``.onnx_adapter``: ``onnxruntime.AdapterFormat`` with the names ``export(merge=False)``
  gives its inputs, for ``onnxruntime.LoraAdapter`` + ``RunOptions.add_active_adapter``.

Every file is written atomically (:mod:`trainops.train.atomic`).
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from ..train import torch_meta as _torch_meta
from ..train.atomic import write_files
from . import inject as _inject
from .spec import format_number

__all__ = ["load", "save"]

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def _adapter_format():
    import onnxruntime as ort

    if not hasattr(ort, "AdapterFormat"):
        raise NotImplementedError(f"onnxruntime {ort.__version__} has no AdapterFormat "
                                  "(.onnx_adapter files need onnxruntime >= 1.20)")
    return ort


def _kind(path, format):
    if format == "peft":
        return "peft"
    if format is not None:
        raise ValueError(f"save_adapter: format {format!r}: expected None or 'peft'")
    p = os.fspath(path)
    for suffix, kind in ((".safetensors", "safetensors"), (".onnx_adapter", "onnx_adapter")):
        if p.endswith(suffix):
            return kind
    raise ValueError(f"adapter file {p!r}: expected a name ending in .safetensors or "
                     ".onnx_adapter (or format='peft' and a folder)")


def save(trainer, path, format=None) -> None:
    """Write ``trainer``'s adapters to ``path`` (see the module)."""
    from safetensors.numpy import save as st_save

    kind = _kind(path, format)
    record = _inject.read(trainer._model)
    values = {n: np.ascontiguousarray(v, np.float32) for n, v in trainer.parameters().items()}
    meta = {"rank": str(record["rank"]), "alpha": format_number(record["alpha"])}
    if kind == "safetensors":
        write_files([(os.fspath(path), [st_save(values, metadata=meta)])], "save_adapter")
    elif kind == "peft":
        torch = _torch_meta.read(trainer._model)
        if torch is None:
            raise ValueError("save_adapter(format='peft'): the model carries no torch names "
                             f"(metadata {_torch_meta.KEY!r}, written by trainops.torch.export)")
        modules = {}
        for tname, entry in torch["params"].items():
            if tname.endswith(".weight"):
                modules.setdefault(entry["initializer"], tname[:-len(".weight")])
        missing = [w for w in record["adapters"] if w not in modules]
        if missing:
            raise ValueError(f"save_adapter(format='peft'): the weights {missing} have no "
                             "torch parameter name in the model's metadata")
        peft = {f"base_model.model.{modules[w]}.lora_{k}.weight": values[f"{w}.lora_{k}"]
                for w in record["adapters"] for k in "AB"}
        config = {"r": record["rank"], "lora_alpha": record["alpha"],
                  "target_modules": list(record["targets"]), "lora_dropout": record["dropout"],
                  "peft_type": "LORA", "task_type": None, "bias": "none",
                  "fan_in_fan_out": False}
        if float(config["lora_alpha"]).is_integer():
            config["lora_alpha"] = int(config["lora_alpha"])
        folder = os.fspath(path)
        os.makedirs(folder, exist_ok=True)
        write_files([(os.path.join(folder, PEFT_WEIGHTS), [st_save(peft, metadata=meta)]),
                     (os.path.join(folder, PEFT_CONFIG),
                      [json.dumps(config, indent=2).encode()])], "save_adapter")
    else:
        ort = _adapter_format()
        fmt = ort.AdapterFormat()
        fmt.set_adapter_version(1)
        fmt.set_model_version(1)
        fmt.set_parameters({n: ort.OrtValue.ortvalue_from_numpy(v) for n, v in values.items()})
        target = os.fspath(path)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(target))) as tmp:
            staged = os.path.join(tmp, "adapter.onnx_adapter")
            fmt.export_adapter(staged)
            with open(staged, "rb") as f:
                data = f.read()
        write_files([(target, [data])], "save_adapter")


def _read(path, kind) -> tuple[dict, dict]:
    p = os.fspath(path)
    if kind == "safetensors":
        from safetensors import safe_open

        with safe_open(p, framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    if kind == "peft":
        raise ValueError("load_adapter: PEFT folders are not read back; load a "
                         ".safetensors or .onnx_adapter file")
    ort = _adapter_format()
    fmt = ort.AdapterFormat.read_adapter(p)
    return {k: np.array(v.numpy()) for k, v in fmt.get_parameters().items()}, {}


def load(trainer, path) -> None:
    """Set ``trainer``'s adapters from ``path`` (``.safetensors`` or ``.onnx_adapter``):
    every name, shape and dtype checked first; ONE ValueError lists every mismatch, and
    then nothing has changed."""
    tensors, meta = _read(path, _kind(path, None))
    record = _inject.read(trainer._model)
    want = _inject.adapter_shapes(record)
    problems = []
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"{name!r} ({list(shape)}) is missing")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name!r}: expected shape {list(shape)}, got "
                            f"{list(tensors[name].shape)}")
        elif tensors[name].dtype.kind != "f":
            problems.append(f"{name!r}: expected a float tensor, got {tensors[name].dtype}")
    extra = sorted(n for n in tensors if n not in want)
    if extra:
        problems.append(f"{extra} are not adapter tensors of this trainer")
    if "alpha" in meta and meta["alpha"] != format_number(record["alpha"]):
        problems.append(f"metadata alpha {meta['alpha']!r}: this trainer's is "
                        f"{format_number(record['alpha'])!r}")
    if problems:
        raise ValueError(f"load_adapter: {os.fspath(path)!r} does not fit this trainer's "
                         "adapters (nothing was loaded): " + "; ".join(problems))
    for name in want:
        dtype = trainer._arrays.spec(name)[0]
        trainer._arrays.write(name, np.ascontiguousarray(tensors[name], dtype))
