"""Make the PEFT references that tests/test_lora_peft.py reads (tests/data/lora).

Run with the scratch torch venv (torch, transformers, peft; never the project's own venv;
neither the package nor the tests import this file)::

    PYTHONPATH=python TRAINOPS_LIBRARY=$PWD/target/debug/libtrainops.so \\
        /work/torchvenv/bin/python scripts/make_lora_references.py [--data tests/data/lora]

The model is scripts/make_torch_fixtures.py's tiny Llama (grouped-query attention, dropout
0, seed 0, its inputs and -100 labels), exported twice with no adapters in it:

- ``classic``: torch.onnx.export(dynamo=False, TrainingMode.TRAINING, opset 17, no constant
  folding), as make_torch_fixtures writes it; when the bytes are those of
  tests/data/torch_models/llama.classic.onnx.gz that file is the one the test reads
  (``classic_path`` in the npz), otherwise DATA/llama.classic.onnx.gz is written;
- ``bridge``: trainops.torch.export, DATA/llama.bridge.onnx.gz.

Then PEFT: ``LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
lora_dropout=0.0)`` on the same module. The initial adapters are fixed values from numpy
(seed 20261127), not PEFT's: A uniform within PEFT's own bound (kaiming_uniform_ with
a=sqrt(5): 1/sqrt(in_features)) and B nonzero too (uniform within 0.05; PEFT starts it at
zero, which would leave A's first gradient zero and test half of the backward). Five steps
of torch.optim.AdamW(lr=1e-3, weight_decay=0.01) over the adapters only, on F.cross_entropy
of the [B, T, V] logits (flattened; -100 labels ignored), once in float32 and once on a
float64 copy from the same start. Then merge_and_unload() of the float32 (and float64)
model and its logits on the inputs.

DATA/llama.npz keys: ``input:input_ids``, ``labels``, ``rank``, ``alpha``, ``steps``,
``lr``, ``weight_decay``, ``losses`` / ``losses64`` (each step's loss before its update),
``init:<name>``, ``final:<name>``, ``final64:<name>`` (adapters by their ONNX names:
``<weight initializer>.lora_A`` [rank, in], ``.lora_B`` [out, rank]), ``merged_logits`` /
``merged_logits64`` (PEFT's merged model after training), ``names:<export>`` (the adapter
names in that export, in PEFT's order), ``classic_path``, ``peft_keys``
(``"<key in PEFT's adapter_model.safetensors>=<ONNX name>"``, from save_pretrained after
training), ``peft_config`` (adapter_config.json's r, lora_alpha, target_modules,
lora_dropout, peft_type, bias, fan_in_fan_out, as JSON). DATA/llama.<export>.initial
.safetensors: the initial adapters under that export's names, with metadata rank and alpha,
for trainer.load_adapter.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import sys
import tempfile
import warnings

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_torch_fixtures as fx  # noqa: E402  (the Llama, its inputs, the classic export)

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "v_proj")
STEPS, LR, WEIGHT_DECAY = 5, 1e-3, 0.01
SEED = 20261127
B_BOUND = 0.05


def peft_names(model) -> list[tuple[str, str]]:
    """(PEFT's lora_A / lora_B parameter name, the torch name of the base weight + suffix)
    for each adapter, in PEFT's order."""
    out = []
    for name, _ in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            kind = "lora_A" if ".lora_A." in name else "lora_B"
            base = name.split(f".{kind}.")[0]
            # PEFT wraps the Linear: <prefix>.base_model.model.<path>.base_layer.weight
            path = base.split("base_model.model.", 1)[1]
            out.append((name, f"{path}.weight", kind))
    return out


def initial_adapters(model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    out = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            bound = 1.0 / np.sqrt(p.shape[1])
            out[name] = rng.uniform(-bound, bound, tuple(p.shape)).astype(np.float32)
        elif ".lora_B." in name:
            out[name] = rng.uniform(-B_BOUND, B_BOUND, tuple(p.shape)).astype(np.float32)
    return out


def with_lora(base, init: dict, dtype):
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base).to(dtype), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in init:
                p.copy_(torch.from_numpy(init[name]).to(dtype))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(init), (trainable, sorted(init))
    return model


def train(model, ids, labels) -> list[float]:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WEIGHT_DECAY)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def adapters(model) -> dict[str, np.ndarray]:
    return {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()
            if p.requires_grad}


def onnx_names(path: str, mapping) -> dict[str, str]:
    """PEFT name -> ONNX adapter name: the target's weight initializer in the export (the
    bridge's metadata for the bridge, the torch name for the classic export) + .lora_A/B."""
    import onnx
    m = onnx.load(path)
    inits = {i.name for i in m.graph.initializer}
    meta = {}
    for p in m.metadata_props:
        if p.key == "trainops.torch":
            meta = json.loads(p.value).get("params", {})
    out = {}
    for peft_name, weight, kind in mapping:
        init = meta[weight]["initializer"] if weight in meta else weight
        assert init in inits, f"{path}: no initializer {init} for {weight}"
        out[peft_name] = f"{init}.{kind}"
    return out


def gz(src: str, dst: str) -> None:
    with open(src, "rb") as f, open(dst, "wb") as raw, \
            gzip.GzipFile("", "wb", 9, raw, mtime=0) as g:
        g.write(f.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(HERE, "..", "tests", "data", "lora"))
    a = ap.parse_args()
    os.makedirs(a.data, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="lora-peft-")

    torch.manual_seed(0)  # as make_torch_fixtures.make: the same weights
    base = fx.llama()
    base.train()
    feeds, labels = fx.inputs_for("llama", base)
    ids = feeds["input_ids"]

    # The classic export, byte-compared with the committed one.
    classic = os.path.join(tmp, "llama.classic.onnx")
    fx.export(base, (ids,), ("input_ids",), classic, "classic")
    committed = os.path.join(HERE, "..", "tests", "data", "torch_models",
                             "llama.classic.onnx.gz")
    with open(classic, "rb") as f:
        mine = f.read()
    same = os.path.exists(committed) and gzip.decompress(open(committed, "rb").read()) == mine
    if same:
        classic_path = "../torch_models/llama.classic.onnx.gz"
    else:
        classic_path = "llama.classic.onnx.gz"
        gz(classic, os.path.join(a.data, classic_path))
    print(f"classic export {'is' if same else 'is NOT'} the committed torch_models one")

    # The bridge export.
    import trainops.torch as tt
    bridge = os.path.join(tmp, "llama.bridge.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tt.export(base, (ids,), bridge)
    gz(bridge, os.path.join(a.data, "llama.bridge.onnx.gz"))

    # PEFT, float32 and float64 from the same start.
    from peft import LoraConfig, get_peft_model
    shape_model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0))
    init = initial_adapters(shape_model)
    mapping = peft_names(shape_model)
    del shape_model
    m32 = with_lora(base, init, torch.float32)
    m64 = with_lora(base, init, torch.float64)
    losses = train(m32, ids, labels)
    losses64 = train(m64, ids, labels)
    fin32, fin64 = adapters(m32), adapters(m64)
    # PEFT's own adapter files (save_pretrained): their keys, by the ONNX names of what
    # they hold, and the config's fields, for Trainer.save_adapter(format="peft").
    from safetensors.numpy import load_file
    m32.save_pretrained(os.path.join(tmp, "peft"))
    saved = load_file(os.path.join(tmp, "peft", "adapter_model.safetensors"))
    with open(os.path.join(tmp, "peft", "adapter_config.json")) as f:
        peft_config = json.load(f)
    peft_config["target_modules"] = sorted(peft_config["target_modules"])  # a set's order
    peft_keys = {}
    for key, value in saved.items():
        (match,) = [p for p in fin32 if np.array_equal(fin32[p], value)]
        peft_keys[key] = match
    with torch.no_grad():
        merged32 = m32.merge_and_unload()
        merged32.train()
        logits32 = merged32(ids).numpy()
        merged64 = m64.merge_and_unload()
        merged64.train()
        logits64 = merged64(ids).numpy()

    from safetensors.numpy import save_file
    out = {"input:input_ids": ids.numpy(), "labels": labels.numpy().astype(np.int64),
           "rank": np.int64(RANK), "alpha": np.float64(ALPHA), "steps": np.int64(STEPS),
           "lr": np.float64(LR), "weight_decay": np.float64(WEIGHT_DECAY),
           "losses": np.asarray(losses, np.float64),
           "losses64": np.asarray(losses64, np.float64),
           "merged_logits": logits32, "merged_logits64": logits64,
           "classic_path": np.asarray(classic_path)}
    names = {}
    for export, path in (("classic", classic), ("bridge", bridge)):
        names[export] = onnx_names(path, mapping)
        out[f"names:{export}"] = np.asarray([names[export][p] for p, _, _ in mapping])
        save_file({names[export][p]: init[p] for p, _, _ in mapping},
                  os.path.join(a.data, f"llama.{export}.initial.safetensors"),
                  metadata={"rank": str(RANK), "alpha": str(ALPHA)})
    out["peft_keys"] = np.asarray([f"{k}={names['classic'][p]}"
                                   for k, p in sorted(peft_keys.items())])
    out["peft_config"] = np.asarray(json.dumps(
        {k: peft_config[k] for k in ("r", "lora_alpha", "target_modules", "lora_dropout",
                                     "peft_type", "bias", "fan_in_fan_out")}, sort_keys=True))
    # The npz's adapter keys: the classic names (the bridge's are listed beside them, in
    # the same order, under names:bridge).
    for p, _, _ in mapping:
        n = names["classic"][p]
        out[f"init:{n}"] = init[p]
        out[f"final:{n}"] = fin32[p]
        out[f"final64:{n}"] = fin64[p]
    np.savez_compressed(os.path.join(a.data, "llama.npz"), **out)
    d = np.abs(np.asarray(losses) - np.asarray(losses64))
    print(f"losses {np.array2string(np.asarray(losses), precision=6)}; f32 - f64 {d}")
    print("merged logits |f32 - f64| max", float(np.abs(logits32 - logits64).max()))
    for p, _, _ in mapping:
        print(names["classic"][p], "|", names["bridge"][p], "dev64",
              float(np.abs(fin32[p] - fin64[p]).max()), "moved",
              float(np.abs(fin32[p] - init[p]).max()))


if __name__ == "__main__":
    main()
