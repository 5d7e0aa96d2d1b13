"""trainops' LoRA against PEFT's (no torch needed: scripts/make_lora_references.py made the
exports and the references, tests/data/lora).

The model: scripts/make_torch_fixtures.py's tiny transformers Llama (grouped-query
attention, dropout 0, train mode) with no adapters in it, exported by the classic exporter
(the committed tests/data/torch_models/llama.classic.onnx.gz, byte for byte) and by
``trainops.torch.export``. PEFT trained ``LoraConfig(r=4, lora_alpha=8,
target_modules=["q_proj", "v_proj"], lora_dropout=0.0)`` on the module from fixed initial
adapters (A and B both nonzero, so the first step's gradients of both are): 5 steps of
``torch.optim.AdamW(lr=1e-3, weight_decay=0.01)`` over the adapters only, on
``F.cross_entropy`` of the ``[B, T, V]`` logits with -100 labels, once in float32 and once
on a float64 copy, then ``merge_and_unload()`` and the merged model's logits.

Here ``trainops.Trainer(lora=LoRA(rank=4, alpha=8, ...))`` loads the same initial
adapters (``load_adapter``) and takes the same 5 steps; checked: the trained tensors are
exactly the adapters; each step's loss and each final adapter against torch's float64 run;
the merged export's logits (plain onnxruntime) against PEFT's merged model's; the unmerged
export with the ``.onnx_adapter`` file through ``onnxruntime.LoraAdapter`` against the
merged export; the base weights untouched by training, bit for bit.

The tolerance (the argument of tests/test_torch_models.py). Both runs evaluate the same
arithmetic in float32 (``u = 2^-24``) in other orders and fusions (MLAS against torch's
kernels); float64's own rounding is nothing here, so torch's float64 run stands for the
exact one. How far torch's float32 run is from it, ``e`` (measured: the loss per step, the
RMS difference per final adapter, the RMS difference of the merged logits), is this
model's float32 rounding along this very trajectory, forward, backward and AdamW included.
Another order of the same roundings has the same worst-case bound (Higham's ``gamma(n)``
depends on term counts and magnitudes, not on the order), so trainops' distance from the
exact run is allowed ``RATIO * max(e, one float32 ulp of the value's size)`` (the ulp: the
last rounding alone, and what a lucky ``e`` near 0 would hide; for the losses the largest
``e`` so far, as errors carry from step to step). ``RATIO = 8`` leaves room for fused
kernels' different but same-sized roundings. An estimate from one measured sample, not a
proof; still, a wrong gradient moves a loss by about ``lr * sum |g|`` (~4e-3 a step here)
and an adapter by about lr (1e-3 a step, AdamW) against bounds of ~4e-6 and ~1e-6.

The merged weights are checked on their own too: each targeted ``W`` of the merged export
against ``W + (alpha / rank) B A`` in float64 from the trainer's own final adapters, within
the rounding of a float32 evaluation of it (``gamma(rank + 2)`` times the magnitudes).
"""

from __future__ import annotations

import functools
import gzip
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import trainops
from trainops import Trainer, losses, optim
from helpers.torch_exports import runtime_ir

if not hasattr(trainops, "LoRA"):
    pytest.skip("trainops.LoRA does not exist yet (python/trainops/lora): nothing to compare "
                "with PEFT", allow_module_level=True)

DATA = Path(__file__).resolve().parent / "data" / "lora"
EXPORTS = ("classic", "bridge")
TARGETS = ["q_proj", "v_proj"]
RATIO = 8.0
U = 2.0 ** -24

# Cases where trainops' LoRA still disagrees with PEFT, with how (xfail strict: they turn
# red once they pass). Keyed by (test name, export).
XFAIL: dict[tuple[str, str], str] = {}


@functools.lru_cache(maxsize=None)
def _ref() -> dict:
    with np.load(DATA / "llama.npz") as z:
        return {k: z[k] for k in z.files}


def _path(export: str) -> Path:
    if export == "classic":
        return (DATA / str(_ref()["classic_path"])).resolve()
    return DATA / f"llama.{export}.onnx.gz"


@functools.lru_cache(maxsize=None)
def _model_bytes(export: str) -> bytes:
    return gzip.decompress(_path(export).read_bytes())


def _model(export: str) -> onnx.ModelProto:
    m = onnx.load_from_string(_model_bytes(export))
    if m.ir_version > runtime_ir():
        pytest.skip(f"llama.{export}: IR version {m.ir_version}; onnxruntime "
                    f"{ort.__version__} loads older ones only")
    return m


def _cases():
    out = []
    for export in EXPORTS:
        out.append(pytest.param(export, id=export))
    return out


def _mark(request, export: str) -> None:
    key = (request.node.originalname, export)
    if key in XFAIL:
        request.applymarker(pytest.mark.xfail(strict=True, reason=XFAIL[key]))


def _lora() -> "trainops.LoRA":
    ref = _ref()
    return trainops.LoRA(rank=int(ref["rank"]), alpha=float(ref["alpha"]), targets=TARGETS,
                         dropout=0.0)


def _feeds(export: str) -> dict:
    """The token ids under the export's one input name (``input_ids`` in the classic
    export, ``input_0`` in the bridge's, for the wrapper's ``*args``), and the labels."""
    ref = _ref()
    m = onnx.load_from_string(_model_bytes(export))
    inits = {i.name for i in m.graph.initializer}
    (name,) = [i.name for i in m.graph.input if i.name not in inits]
    return {name: ref["input:input_ids"], "labels": ref["labels"]}


def _names(export: str) -> list[str]:
    return [str(n) for n in _ref()[f"names:{export}"]]


def _want(export: str, prefix: str) -> dict[str, np.ndarray]:
    """The reference adapters (stored under the classic names) by this export's names."""
    ref = _ref()
    return {n: ref[f"{prefix}:{c}"] for n, c in zip(_names(export), _names("classic"))}


@functools.lru_cache(maxsize=None)
def _trained(export: str):
    """(the Trainer after PEFT's 5 steps from the stored initial adapters, its losses, its
    parameter names before training, its adapters after loading)."""
    ref = _ref()
    model = _model(export)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = Trainer(model, losses.cross_entropy(None, class_axis=-1),  # the logits
                     optimizer=optim.AdamW(lr=float(ref["lr"]),
                                           weight_decay=float(ref["weight_decay"])),
                     lora=_lora(), base_dtype="float32", recompute=False)
    names = tuple(tr.param_names)
    tr.load_adapter(str(DATA / f"llama.{export}.initial.safetensors"))
    loaded = tr.parameters()
    feeds = _feeds(export)
    got = np.array([tr.step(feeds) for _ in range(int(ref["steps"]))], np.float64)
    return tr, got, names, loaded


def _rms(d: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(d)))) if d.size else 0.0


def _ulp(x) -> float:
    return float(np.spacing(np.float32(abs(x))))


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # not the exporter's unused constants, one warning each
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def _run(export: str, sess: ort.InferenceSession, run_options=None) -> np.ndarray:
    """The logits (the first output) on the stored token ids."""
    feeds = _feeds(export)
    wanted = {i.name for i in sess.get_inputs()}
    out = sess.run([sess.get_outputs()[0].name],
                   {k: v for k, v in feeds.items() if k in wanted}, run_options)
    return out[0]


@pytest.mark.parametrize("export", _cases())
def test_trains_exactly_the_adapters(library_path, request, export):
    """The Trainer's parameters are the adapters, ``<W>.lora_A`` [rank, in] and
    ``<W>.lora_B`` [out, rank] for each q_proj / v_proj weight, nothing else; the stored
    initial adapters load as they are, bit for bit."""
    _mark(request, export)
    _, _, names, loaded = _trained(export)
    assert sorted(names) == sorted(_names(export))
    for name, want in _want(export, "init").items():
        assert loaded[name].dtype == np.float32, (name, loaded[name].dtype)
        assert np.array_equal(loaded[name], want), name


@pytest.mark.parametrize("export", _cases())
def test_losses_follow_peft(library_path, request, export):
    """Each of the 5 steps' losses within the float32 bound (module docstring) of torch's
    float64 run."""
    _mark(request, export)
    ref = _ref()
    got = _trained(export)[1]
    l32, l64 = ref["losses"], ref["losses64"]
    e = np.abs(l32 - l64)
    ulp = np.spacing(np.abs(l32).astype(np.float32)).astype(np.float64)
    bound = RATIO * np.maximum(np.maximum.accumulate(e), ulp)
    bad = np.abs(got - l64) > bound
    assert not bad.any(), (
        f"llama.{export}: step {int(np.argmax(bad)) + 1} first off; trainops {got}, torch "
        f"float64 {l64}, |difference| {np.abs(got - l64)}, bound {bound}")


@pytest.mark.parametrize("export", _cases())
def test_final_adapters_follow_peft(library_path, request, export):
    """After the 5 steps, each adapter's RMS difference from torch's float64 run within
    RATIO times torch's own float32 RMS deviation (at least one ulp of the tensor's RMS)."""
    _mark(request, export)
    tr = _trained(export)[0]
    got = tr.parameters()
    f32, f64 = _want(export, "final"), _want(export, "final64")
    off = []
    for name in _names(export):
        assert got[name].shape == f64[name].shape, (name, got[name].shape, f64[name].shape)
        dev = _rms(f32[name].astype(np.float64) - f64[name])
        bound = RATIO * max(dev, _ulp(_rms(f64[name])))
        d = _rms(got[name].astype(np.float64) - f64[name])
        if d > bound:
            off.append(f"{name}: RMS {d:.3g} > {bound:.3g} (largest element difference "
                       f"{np.abs(got[name] - f64[name]).max():.3g})")
    assert not off, f"llama.{export}: " + "; ".join(off)


def _merged(export: str) -> onnx.ModelProto:
    return _trained(export)[0].export()


@pytest.mark.parametrize("export", _cases())
def test_merged_export_is_peft_merge_and_unload(library_path, request, export):
    """The merged export runs in plain onnxruntime (no trainops op, no adapter left) and
    its logits are PEFT's merge_and_unload() model's within the float32 bound (RMS, as the
    adapters; torch's own float32 deviation includes its training's)."""
    _mark(request, export)
    ref = _ref()
    model = _merged(export)
    assert not any(n.domain not in ("", "ai.onnx") for n in model.graph.node)
    assert not any(".lora_" in i.name for i in [*model.graph.initializer, *model.graph.input])
    got = _run(export, _session(model)).astype(np.float64)
    l32, l64 = ref["merged_logits"], ref["merged_logits64"]
    assert got.shape == l64.shape
    dev = _rms(l32 - l64)
    bound = RATIO * max(dev, _ulp(_rms(l64)))
    d = _rms(got - l64)
    assert d <= bound, (f"llama.{export}: merged logits RMS {d:.3g} from PEFT's float64 "
                        f"merged model (largest {np.abs(got - l64).max():.3g}); bound "
                        f"{bound:.3g}; torch float32's own RMS {dev:.3g}")


@pytest.mark.parametrize("export", _cases())
def test_base_weights_untouched_and_merge_exact(library_path, request, export):
    """Training moves no base weight: the unmerged export's initializers are the original
    model's, bit for bit, and the merged export's untargeted ones too. Each targeted W of
    the merged export is ``W + (alpha / rank) B A`` from the trainer's own adapters (its
    layout, [out, in] here as torch's), within a float32 evaluation's rounding."""
    _mark(request, export)
    tr = _trained(export)[0]
    ref = _ref()
    scale = float(ref["alpha"]) / float(ref["rank"])
    orig = {i.name: numpy_helper.to_array(i)
            for i in onnx.load_from_string(_model_bytes(export)).graph.initializer}
    plain = tr.export(merge=False)
    if isinstance(plain, tuple):  # (model, adapters): the model part
        plain = plain[0]
    for init in plain.graph.initializer:
        if init.name in orig:
            a = numpy_helper.to_array(init)
            assert a.dtype == orig[init.name].dtype and a.tobytes() == \
                orig[init.name].tobytes(), f"{init.name} moved"
    adapters = tr.parameters()
    targeted = {n[:-len(".lora_A")] for n in _names(export) if n.endswith(".lora_A")}
    merged = {i.name: numpy_helper.to_array(i) for i in _merged(export).graph.initializer}
    assert set(orig) <= set(merged), sorted(set(orig) - set(merged))
    for name, w in orig.items():
        if name not in targeted:
            assert merged[name].tobytes() == w.tobytes(), f"{name} moved"
            continue
        a = adapters[f"{name}.lora_A"].astype(np.float64)
        b = adapters[f"{name}.lora_B"].astype(np.float64)
        delta = scale * (b @ a)
        want = w.astype(np.float64) + delta
        mag = np.abs(w) + scale * (np.abs(b) @ np.abs(a))
        rank = a.shape[0]
        tol = (rank + 2) * U / (1 - (rank + 2) * U) * mag + np.spacing(np.abs(want)
                                                                       .astype(np.float32))
        assert merged[name].shape == w.shape, (name, merged[name].shape, w.shape)
        d = np.abs(merged[name] - want)
        assert (d <= tol).all(), (f"{name}: merged W off W + (alpha/rank) B A by "
                                  f"{d.max():.3g} (bound {tol.max():.3g})")


@pytest.mark.parametrize("export", _cases())
def test_onnxruntime_lora_adapter_is_merged_export(library_path, request, export, tmp_path):
    """The unmerged export with the trained ``.onnx_adapter`` file active through
    ``onnxruntime.LoraAdapter`` and ``RunOptions.add_active_adapter`` computes the merged
    export's logits (within the bound of the merge test: the two evaluate
    ``x W^T + s x A^T B^T`` and ``x (W + s B A)^T``, rounded differently)."""
    _mark(request, export)
    if not hasattr(ort, "LoraAdapter"):
        pytest.skip(f"onnxruntime {ort.__version__} has no LoraAdapter (1.20+)")
    ref = _ref()
    tr = _trained(export)[0]
    path = tmp_path / "llama.onnx_adapter"
    tr.save_adapter(str(path))
    plain = tr.export(merge=False)
    if isinstance(plain, tuple):
        plain = plain[0]
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    opts = ort.RunOptions()
    opts.add_active_adapter(adapter)
    got = _run(export, _session(plain), opts).astype(np.float64)
    want = _run(export, _session(_merged(export))).astype(np.float64)
    l32, l64 = ref["merged_logits"], ref["merged_logits64"]
    bound = RATIO * max(_rms(l32 - l64), _ulp(_rms(l64)))
    d = _rms(got - want)
    assert d <= bound, (f"llama.{export}: LoraAdapter logits RMS {d:.3g} from the merged "
                        f"export's (largest {np.abs(got - want).max():.3g}); bound {bound:.3g}")
    # The adapters do something here: the merged logits are far from the base model's.
    base = _run(export, _session(_model(export))).astype(np.float64)
    assert _rms(base - want) > 10 * bound


@pytest.mark.parametrize("export", _cases())
def test_peft_folder_is_peft_save_pretrained(library_path, request, export, tmp_path):
    """``save_adapter(folder, format="peft")`` writes PEFT's ``adapter_model.safetensors``
    under the keys PEFT's own ``save_pretrained`` wrote (each holding the same adapter:
    its value within the final adapters' bound of PEFT's trained one) and an
    ``adapter_config.json`` whose r, lora_alpha, target_modules, lora_dropout, peft_type,
    bias and fan_in_fan_out are PEFT's. The classic export carries no torch names (no
    ``trainops.torch`` metadata): there it is refused, saying why, and nothing written."""
    import json

    from safetensors.numpy import load_file

    _mark(request, export)
    ref = _ref()
    tr = _trained(export)[0]
    folder = tmp_path / "peft"
    if export == "classic":
        with pytest.raises(ValueError, match="torch names"):
            tr.save_adapter(str(folder), format="peft")
        assert not folder.exists() or not any(folder.iterdir())
        return
    tr.save_adapter(str(folder), format="peft")
    keys = dict(str(p).split("=", 1) for p in ref["peft_keys"])
    to_export = dict(zip(_names("classic"), _names(export)))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(keys)
    got = tr.parameters()
    f32, f64 = _want(export, "final"), _want(export, "final64")
    for key, classic_name in keys.items():
        name = to_export[classic_name]
        assert np.array_equal(saved[key], got[name]), key
        bound = RATIO * max(_rms(f32[name].astype(np.float64) - f64[name]),
                            _ulp(_rms(f64[name])))
        assert _rms(saved[key].astype(np.float64) - f64[name]) <= bound, key
    config = json.loads((folder / "adapter_config.json").read_text())
    want = json.loads(str(ref["peft_config"]))
    got_config = {k: config.get(k) for k in want}
    # PEFT keeps target_modules as a set: its JSON list's order is the set's
    for c in (got_config, want):
        if isinstance(c["target_modules"], list):
            c["target_modules"] = sorted(c["target_modules"])
    assert got_config == want
