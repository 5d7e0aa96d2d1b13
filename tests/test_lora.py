"""trainops.LoRA: low-rank adapters trained on a frozen model (python/trainops/lora).

References: numpy float64 (the adapter's definition ``y = x W + (alpha / rank) x A^T B^T``,
PEFT's initialisation, torch's AdamW), helpers.rounding's float64 forward and gradient
with the bounds of ANY float32 evaluation of them (Higham's gamma_n), and plain
onnxruntime on the exported models. No torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import trainops
from helpers.rounding import U, forward, gamma, step_bounds
from helpers.torch_exports import load_export
from trainops import Trainer, losses, optim
from trainops.lora import inject as lora_inject
from trainops.lora.merge import merged_weight

DATA = Path(__file__).parent / "data" / "torch_models"
ALPHA, RANK = 4.0, 2
Q, V, O = ("/model/layers.0/self_attn/q_proj/MatMul", "/model/layers.0/self_attn/v_proj/MatMul",
           "/model/layers.0/mlp/o_proj/Gemm")


def mlp(own_loss=False):
    """x [N, 4] -> q_proj (MatMul, W1 [4, 6]) -> Relu -> v_proj (MatMul through
    Transpose(W2), W2 [5, 6] as torch holds it) -> Relu -> o_proj (Gemm transB=1, W3 [3, 5],
    bias) = logits [N, 3]; with ``own_loss`` a SoftmaxCrossEntropyLoss ``loss`` on
    ``labels``."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((4, 6)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((5, 6)) * 0.5).astype(np.float32)
    w3 = (rng.standard_normal((3, 5)) * 0.5).astype(np.float32)
    b3 = (rng.standard_normal(3) * 0.1).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"], name=Q),
             helper.make_node("Relu", ["h1"], ["r1"], name="/model/act1"),
             helper.make_node("Transpose", ["W2"], ["W2T"], name="/model/v_proj/Transpose",
                              perm=[1, 0]),
             helper.make_node("MatMul", ["r1", "W2T"], ["h2"], name=V),
             helper.make_node("Relu", ["h2"], ["r2"], name="/model/act2"),
             helper.make_node("Gemm", ["r2", "W3", "b3"], ["logits"], name=O, transB=1)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])]
    if own_loss:
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"],
                                      reduction="mean"))
        inputs.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
        outputs.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((w1, "W1"), (w2, "W2"), (w3, "W3"), (b3, "b3"))]
    g = helper.make_graph(nodes, "mlp", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def data(n=7, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 4)).astype(np.float32),
            "labels": rng.integers(0, 3, n).astype(np.int64)}


TARGETS = ["q_proj", "v_proj", "o_proj"]
ADAPTERS = ["W1.lora_A", "W1.lora_B", "W2.lora_A", "W2.lora_B", "W3.lora_A", "W3.lora_B"]
SHAPES = {"W1.lora_A": (RANK, 4), "W1.lora_B": (6, RANK), "W2.lora_A": (RANK, 6),
          "W2.lora_B": (5, RANK), "W3.lora_A": (RANK, 5), "W3.lora_B": (3, RANK)}


def trainer(model=None, lora=None, own_loss=False, **kw):
    lora = lora or trainops.LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS)
    loss = "loss" if own_loss else losses.cross_entropy("logits", class_axis=-1)
    kw.setdefault("optimizer", optim.AdamW(lr=0.05))
    kw.setdefault("seed", 3)
    return Trainer(model or mlp(own_loss), loss, lora=lora, threads=1, **kw)


def run(model, feeds, run_options=None):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["logits"], {k: v for k, v in feeds.items() if k in names}, run_options)[0]


def reference_logits(base: dict, ad: dict, x, s=ALPHA / RANK):
    """The adapted MLP in float64, from the definition (PEFT's orientation)."""
    f = {k: np.asarray(v, np.float64) for k, v in {**base, **ad}.items()}

    def delta(w):
        return lambda h: s * (h @ f[f"{w}.lora_A"].T) @ f[f"{w}.lora_B"].T
    x = np.asarray(x, np.float64)
    r1 = np.maximum(x @ f["W1"] + delta("W1")(x), 0)
    r2 = np.maximum(r1 @ f["W2"].T + delta("W2")(r1), 0)
    return r2 @ f["W3"].T + f["b3"] + delta("W3")(r2)


def random_adapters(seed=5):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in SHAPES.items()}


# -- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("kw, what", [
    ({"rank": 0}, "rank"), ({"rank": 2.0}, "rank"), ({"rank": True}, "rank"),
    ({"alpha": 0}, "alpha"), ({"alpha": math.inf}, "alpha"), ({"alpha": -1}, "alpha"),
    ({"dropout": 1.0}, "dropout"), ({"dropout": -0.1}, "dropout"),
    ({"targets": []}, "targets"), ({"targets": "q_proj"}, "targets"), ({"targets": [1]}, "targets")])
def test_lora_arguments_are_checked(kw, what):
    args = {"rank": 8, "alpha": 16, "targets": ["q_proj"], **kw}
    with pytest.raises(ValueError, match=what):
        trainops.LoRA(**args)


def test_trainer_arguments_are_checked(library_path):
    with pytest.raises(ValueError, match=r"targets \['k_proj'\]"):
        trainer(lora=trainops.LoRA(rank=2, alpha=4, targets=["q_proj", "k_proj"]))
    with pytest.raises(ValueError, match="params= with lora="):
        trainer(params=["W1"])
    with pytest.raises(ValueError, match="base_dtype"):
        trainer(base_dtype="float16")
    with pytest.raises(ValueError, match="recompute=True: the model has no repeated blocks"):
        trainer(recompute=True)  # this MLP has no layers.N (tests/test_lora_recompute.py)
    plain = Trainer(mlp(), losses.cross_entropy("logits", class_axis=-1), threads=1)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        plain.save_adapter("x.safetensors")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        plain.export(merge=False)


# -- injection -----------------------------------------------------------------------------
def test_adapters_names_shapes_and_initialisation(library_path):
    tr = trainer()
    assert tr.param_names == ADAPTERS
    assert sorted(tr.optimizer_state()) == sorted(f"trainops/{s}/{n}" for s in "MV"
                                                  for n in ADAPTERS)
    p = tr.parameters()
    assert {n: v.shape for n, v in p.items()} == SHAPES
    for w, fan_in in (("W1", 4), ("W2", 6), ("W3", 5)):
        a = p[f"{w}.lora_A"]
        assert np.all(np.abs(a) <= 1 / math.sqrt(fan_in)) and np.any(a != 0)
        assert not np.any(p[f"{w}.lora_B"])
    again, other = trainer().parameters(), trainer(seed=4).parameters()
    for n in ADAPTERS:
        assert again[n].tobytes() == p[n].tobytes()
        if n.endswith("A"):
            assert other[n].tobytes() != p[n].tobytes()
    # PEFT's Kaiming-uniform: a uniform sample's variance is bound^2 / 3
    big = lora_inject.initial_a(0, "w", 64, 256, np.float32)
    assert abs(big.var() * 256 * 3 - 1) < 0.05


def test_forward_at_initialisation_is_the_base_models_bit_for_bit(library_path):
    feeds = data()
    tr = trainer()
    base = run(mlp(), feeds)
    for merge in (False, True):
        assert run(tr.export(merge=merge), feeds).tobytes() == base.tobytes()


def test_forward_with_adapters_follows_the_definition(library_path, tmp_path):
    from safetensors.numpy import save_file

    tr = trainer()
    ad = random_adapters()
    save_file(ad, str(tmp_path / "a.safetensors"))
    tr.load_adapter(tmp_path / "a.safetensors")
    feeds = data()
    m = tr.export(merge=False)
    vals, width = forward(m, ad, {"x": feeds["x"]}, forward_errors=True)
    base = {i.name: numpy_helper.to_array(i) for i in mlp().graph.initializer}
    want = reference_logits(base, ad, feeds["x"])
    # helpers.rounding's float64 forward of the exported graph is the definition's
    assert np.allclose(vals["logits"], want, rtol=1e-12, atol=1e-12)
    got = run(m, feeds)
    assert np.all(np.abs(got - want) <= width["logits"])
    assert np.abs(got - run(mlp(), feeds)).max() > 100 * width["logits"].max()  # it matters


# -- training ------------------------------------------------------------------------------
def adamw_bounds(opt, t, p, m, v, g, E, m_new, v_new):
    """torch's AdamW step ``t`` (1-based) in float64 and how far a float32 evaluation may
    be: the moments from the float64 gradient ``g`` (a float32 one within ``E``) and the
    trainer's previous moments (exact inputs); the parameter from the trainer's previous
    parameter and its NEW moments (exact inputs), so only that formula's roundings remain
    (decay, bias corrections, sqrt, add, divide, scale, subtract: at most 12 roundings of
    the terms' magnitudes)."""
    (b1, b2), lr, eps, wd = opt.betas, opt.lr, opt.eps, opt.weight_decay
    m64 = b1 * m + (1 - b1) * g
    m_bound = (1 - b1) * E + gamma(4) * (b1 * np.abs(m) + (1 - b1) * (np.abs(g) + E))
    v64 = b2 * v + (1 - b2) * g * g
    v_bound = (1 - b2) * (2 * np.abs(g) + E) * E + \
        gamma(6) * (b2 * v + (1 - b2) * (np.abs(g) + E) ** 2)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    step = (lr / bc1) * m_new / (np.sqrt(v_new) / math.sqrt(bc2) + eps)
    p64 = p * (1 - lr * wd) - step
    p_bound = gamma(4) * np.abs(p) + gamma(12) * np.abs(step)
    return (m64, m_bound), (v64, v_bound), (p64, p_bound)


def checked_adamw_step(tr, model, opt, t: int, feeds) -> dict:
    """Step ``t`` of ``tr`` on ``feeds`` against float64 from its own state before the
    step (``model``: its training model with the base's values): the loss within the
    forward's bound, each adapter's moments and update within AdamW's. The float64
    gradients."""
    p = {n: x.astype(np.float64) for n, x in tr.parameters().items()}
    st = {n: x.astype(np.float64) for n, x in tr.optimizer_state().items()}
    loss64, width, g, E = step_bounds(model, tr.parameters(), feeds, "loss",
                                      forward_errors=True)
    loss = tr.step(feeds)
    assert abs(loss - loss64) <= width + gamma(1) * abs(loss64)
    p_new, st_new = tr.parameters(), tr.optimizer_state()
    for n in ADAPTERS:
        mn, vn = st_new[f"trainops/M/{n}"], st_new[f"trainops/V/{n}"]
        (m64, mb), (v64, vb), (p64, pb) = adamw_bounds(
            opt, t, p[n], st[f"trainops/M/{n}"], st[f"trainops/V/{n}"], g[n], E[n],
            mn.astype(np.float64), vn.astype(np.float64))
        assert np.all(np.abs(mn - m64) <= mb), (t, n, "M")
        assert np.all(np.abs(vn - v64) <= vb), (t, n, "V")
        assert np.all(np.abs(p_new[n] - p64) <= pb), (t, n)
    return g


def test_adamw_steps_follow_a_float64_reference(library_path):
    """Five AdamW steps: at each, the trainer's gradient (seen through its moments) and
    update against float64 from its own state before the step; the base weights never
    change; only the adapters have optimizer state."""
    opt = optim.AdamW(lr=0.05, weight_decay=0.01)
    tr = trainer(own_loss=True, optimizer=opt)
    model = tr._train_model
    base = {i.name: numpy_helper.to_array(i).tobytes() for i in model.graph.initializer
            if i.name in ("W1", "W2", "W3", "b3")}
    for t in range(1, 6):
        g = checked_adamw_step(tr, model, opt, t, data(seed=10 + t))
        if t == 1:  # B = 0: A's gradient is zero, B's is not
            assert not np.any(g["W1.lora_A"]) and np.any(g["W1.lora_B"])
    assert np.any(tr.parameters()["W1.lora_A"] != trainer(own_loss=True).parameters()["W1.lora_A"])
    exported = {i.name: numpy_helper.to_array(i).tobytes()
                for i in tr.export(merge=False).graph.initializer if i.name in base}
    assert exported == base


def test_exports_agree_with_the_trainer(library_path):
    """merge=True against merge=False against the trainer's own forward (the loss of its
    eval step): the merged weights are rounded once from float64, so the merged model
    differs only by that rounding carried through the forward."""
    tr = trainer(own_loss=True)
    for t in range(3):
        tr.step(data(seed=20 + t))
    feeds = data(seed=30)
    merged, kept = tr.export(merge=True), tr.export(merge=False)
    assert not any(n.name.startswith("trainops/lora/") for n in merged.graph.node)
    assert not any(p.key == "trainops.lora" for p in merged.metadata_props)
    assert [i.name for i in kept.graph.input][-6:] == ADAPTERS
    ad = tr.parameters()
    base = {i.name: numpy_helper.to_array(i) for i in mlp().graph.initializer}
    want = reference_logits(base, ad, feeds["x"])
    _, width = forward(kept, ad, feeds, forward_errors=True)
    a, b = run(merged, feeds), run(kept, feeds)
    assert np.all(np.abs(b - want) <= width["logits"])
    # the merged model is the same forward at weights each within half an ulp of W + sBA
    mw = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    for w, tp in (("W1", False), ("W2", True), ("W3", True)):
        exact = merged_weight(base[w].astype(np.float64), ad[f"{w}.lora_A"],
                              ad[f"{w}.lora_B"], ALPHA / RANK, tp)
        assert np.all(np.abs(mw[w] - exact) <= U * np.abs(exact))
    merged_want = reference_logits({**base, **{w: mw[w] for w in ("W1", "W2", "W3")}},
                                   {n: np.zeros_like(v) for n, v in ad.items()}, feeds["x"])
    _, mwidth = forward(merged, {}, feeds, forward_errors=True)
    assert np.all(np.abs(a - merged_want) <= mwidth["logits"])
    assert np.all(np.abs(a - b) <= mwidth["logits"] + width["logits"] +
                  np.abs(merged_want - want))
    # the trainer's forward (its eval through the training model at these parameters)
    loss64, lw, _, _ = step_bounds(tr._train_model, ad, feeds, "loss", forward_errors=True)
    sess = ort.InferenceSession(kept.SerializeToString(), providers=["CPUExecutionProvider"])
    exported_loss = sess.run(["loss"], feeds)[0]
    trainer_loss = tr.step(feeds)  # the loss before this update: the trainer's forward
    for got in (exported_loss, trainer_loss):
        assert abs(got - loss64) <= lw + gamma(1) * abs(loss64)


def test_dropout_trains_with_philox_masks_and_is_off_at_inference(library_path):
    lora = trainops.LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS, dropout=0.3)
    a, b = trainer(lora=lora), trainer(lora=lora)
    feeds = data()
    assert any(n.op_type == "PhiloxDropout" for n in a.training_model.graph.node)
    la = [a.step(feeds) for _ in range(3)]
    assert la == [b.step(feeds) for _ in range(3)]  # the same seed, the same masks
    m = a.export(merge=False)
    want = reference_logits({i.name: numpy_helper.to_array(i) for i in mlp().graph.initializer},
                            a.parameters(), feeds["x"])
    _, width = forward(m, a.parameters(), {"x": feeds["x"]}, forward_errors=True)
    assert np.all(np.abs(run(m, feeds) - want) <= width["logits"])


# -- files ---------------------------------------------------------------------------------
def test_safetensors_round_trip_and_metadata(library_path, tmp_path):
    from safetensors import safe_open

    tr = trainer()
    tr.step(data())
    tr.step(data(seed=2))
    path = tmp_path / "adapter.safetensors"
    tr.save_adapter(path)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"rank": "2", "alpha": "4"}
        assert sorted(f.keys()) == sorted(ADAPTERS)
        assert all(f.get_tensor(k).dtype == np.float32 for k in f.keys())
    other = trainer(seed=9)
    other.load_adapter(path)
    for n, v in tr.parameters().items():
        assert other.parameters()[n].tobytes() == v.tobytes()
    t2 = trainer(lora=trainops.LoRA(rank=8, alpha=2.5, targets=["q_proj"]))
    t2.save_adapter(tmp_path / "b.safetensors")
    with safe_open(str(tmp_path / "b.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"rank": "8", "alpha": "2.5"}


def test_load_adapter_lists_every_mismatch_and_changes_nothing(library_path, tmp_path):
    from safetensors.numpy import save_file

    tr = trainer()
    before = tr.parameters()
    bad = random_adapters()
    bad["W1.lora_A"] = np.zeros((3, 4), np.float32)
    del bad["W2.lora_B"]
    bad["W9.lora_A"] = np.zeros((2, 2), np.float32)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError) as err:
        tr.load_adapter(tmp_path / "bad.safetensors")
    msg = str(err.value)
    for part in ("'W1.lora_A': expected shape [2, 4], got [3, 4]", "'W2.lora_B' ([5, 2]) is missing",
                 "W9.lora_A"):
        assert part in msg
    assert all(tr.parameters()[n].tobytes() == v.tobytes() for n, v in before.items())
    with pytest.raises(ValueError, match=r"\.safetensors or \.onnx_adapter"):
        tr.load_adapter(tmp_path / "adapter.bin")


def test_onnx_adapter_serves_the_merged_model(library_path, tmp_path):
    if not hasattr(ort, "AdapterFormat"):
        pytest.skip(f"onnxruntime {ort.__version__} has no AdapterFormat / LoraAdapter")
    tr = trainer()
    kept_at_init = tr.export(merge=False)  # its defaults: the initial adapters
    for t in range(3):
        tr.step(data(seed=40 + t))
    path = tmp_path / "a.onnx_adapter"
    tr.save_adapter(path)
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    ro = ort.RunOptions()
    ro.add_active_adapter(adapter)
    feeds = data(seed=50)
    served = run(kept_at_init, feeds, ro)
    assert served.tobytes() == run(tr.export(merge=False), feeds).tobytes()
    merged = run(tr.export(), feeds)
    _, mwidth = forward(tr.export(), {}, {"x": feeds["x"]}, forward_errors=True)
    _, width = forward(tr.export(merge=False), tr.parameters(), {"x": feeds["x"]},
                       forward_errors=True)
    ad = tr.parameters()
    base = {i.name: numpy_helper.to_array(i) for i in mlp().graph.initializer}
    mw = {i.name: numpy_helper.to_array(i) for i in tr.export().graph.initializer}
    drift = np.abs(reference_logits({**base, **{w: mw[w] for w in ("W1", "W2", "W3")}},
                                    {n: np.zeros_like(v) for n, v in ad.items()}, feeds["x"])
                   - reference_logits(base, ad, feeds["x"]))
    assert np.all(np.abs(served - merged) <= mwidth["logits"] + width["logits"] + drift)
    fresh = trainer(seed=11)
    fresh.load_adapter(path)
    assert all(fresh.parameters()[n].tobytes() == v.tobytes() for n, v in ad.items())


def test_peft_file_pair(library_path, tmp_path):
    from safetensors.numpy import load_file

    tr = trainer()
    with pytest.raises(ValueError, match="torch names"):
        tr.save_adapter(tmp_path / "peft", format="peft")
    m = mlp()
    meta = {"params": {"model.layers.0.self_attn.q_proj.weight": {"initializer": "W1",
                                                                  "transposed": True},
                       "model.layers.0.self_attn.v_proj.weight": {"initializer": "W2",
                                                                  "transposed": False},
                       "model.layers.0.mlp.o_proj.weight": {"initializer": "W3",
                                                            "transposed": False},
                       "model.layers.0.mlp.o_proj.bias": {"initializer": "b3",
                                                          "transposed": False}},
            "buffers": {}}
    m.metadata_props.add(key="trainops.torch", value=json.dumps(meta))
    tr = trainer(model=m)
    tr.step(data())
    tr.save_adapter(tmp_path / "peft", format="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config == {"r": RANK, "lora_alpha": 4, "target_modules": TARGETS,
                      "lora_dropout": 0.0, "peft_type": "LORA", "task_type": None,
                      "bias": "none", "fan_in_fan_out": False}
    got = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    p = tr.parameters()
    mods = {"W1": "model.layers.0.self_attn.q_proj", "W2": "model.layers.0.self_attn.v_proj",
            "W3": "model.layers.0.mlp.o_proj"}
    assert sorted(got) == sorted(f"base_model.model.{mods[w]}.lora_{k}.weight"
                                 for w in mods for k in "AB")
    for w, mod in mods.items():
        for k in "AB":
            assert got[f"base_model.model.{mod}.lora_{k}.weight"].tobytes() == \
                p[f"{w}.lora_{k}"].tobytes()


def test_checkpoints_and_artifacts_round_trip(library_path, tmp_path):
    tr = trainer(lora=trainops.LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS, dropout=0.2))
    for t in range(2):
        tr.step(data(seed=60 + t))
    tr.save(tmp_path / "ck.safetensors")
    tr.save_artifacts(tmp_path / "art")
    back = [Trainer.load(tmp_path / "ck.safetensors", threads=1),
            Trainer.from_artifacts(tmp_path / "art", threads=1)]
    same = trainer(lora=trainops.LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS, dropout=0.2))
    same.load_state(tmp_path / "ck.safetensors")
    feeds = data(seed=70)
    want = tr.step(feeds)
    for other in back + [same]:
        assert other.lora == tr.lora and other.param_names == ADAPTERS
        assert other.step(feeds) == want
        assert all(other.parameters()[n].tobytes() == v.tobytes()
                   for n, v in tr.parameters().items())
    assert back[0].export().SerializeToString() == tr.export().SerializeToString()


# -- committed torch exports -----------------------------------------------------------------
def exported_model(arch):
    return load_export(arch)


@pytest.mark.parametrize("arch, targets, count", [
    ("llama", ["q_proj", "v_proj"], 4), ("gpt2", ["c_attn"], 2)])
def test_committed_exports(library_path, arch, targets, count):
    """The classic exporter's llama (MatMul through Transpose(W)) and gpt2 (Gemm): the
    adapters of every layer, the forward at initialisation the base model's bit for bit,
    training moves the adapters only, the two exports agree within the merge's rounding."""
    model = exported_model(arch)
    with np.load(DATA / f"{arch}.npz") as z:
        ids = z["input:input_ids"]
        labels = z["labels"]
    feeds = {"input_ids": ids, "labels": labels}
    tr = Trainer(model, losses.cross_entropy("logits", class_axis=-1),
                 optimizer=optim.AdamW(lr=1e-2), threads=1, seed=0,
                 lora=trainops.LoRA(rank=4, alpha=8, targets=targets))
    assert len(tr.param_names) == 2 * count
    assert all(n.endswith((".lora_A", ".lora_B")) for n in tr.param_names)
    base = run(model, feeds)
    assert run(tr.export(merge=False), feeds).tobytes() == base.tobytes()
    losses_ = [tr.step(feeds) for _ in range(3)]
    assert losses_[-1] < losses_[0]
    frozen = {i.name: numpy_helper.to_array(i).tobytes() for i in model.graph.initializer}
    kept = tr.export(merge=False)
    assert all(frozen[i.name] == numpy_helper.to_array(i).tobytes()
               for i in kept.graph.initializer if i.name in frozen)
    merged = tr.export()
    ad = tr.parameters()
    mw = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    for w, entry in lora_inject.read(kept)["adapters"].items():  # half an ulp of W + sBA
        exact = merged_weight(numpy_helper.to_array(
            next(i for i in model.graph.initializer if i.name == w)).astype(np.float64),
            ad[f"{w}.lora_A"], ad[f"{w}.lora_B"], 2.0, entry["transposed"])
        assert np.all(np.abs(mw[w] - exact) <= U * np.abs(exact))
    a, b = run(merged, feeds), run(kept, feeds)
    # a sanity check, not a rounding bound (no float64 reference of these graphs here):
    # the merge's rounding moves the logits far less than the adapters do
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b - base).max()
