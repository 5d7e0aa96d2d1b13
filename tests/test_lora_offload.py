"""A LoRA Trainer's frozen weights held outside the model (python/trainops/offload.py):
memory maps of a model file's external data, no copy in any graph pass or in the session,
and a model over protobuf's 2 GB limit that trains one LoRA step and exports (slow).

References: the float64 AdamW step of test_lora (helpers.rounding's bounds of any float32
evaluation), the model file's own bytes, and plain onnxruntime on the exports. No torch.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import trainops
from helpers.rounding import U, gamma
from test_lora import checked_adamw_step, data, mlp, run, trainer
from trainops import Trainer, losses, offload, optim

BASE = ("W1", "W2", "W3", "b3")


@pytest.fixture
def hold_all(monkeypatch):
    """Every float weight of the (tiny) test models held outside, as a large model's are."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)


def save_external(model: onnx.ModelProto, folder, name="m.onnx") -> str:
    path = os.path.join(folder, name)
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    return path


@pytest.mark.parametrize("dtype, limit", [("float32", None), ("float32", 0), ("int4", None)])
def test_the_weights_are_memory_maps_of_the_data_file(library_path, tmp_path, hold_all,
                                                      monkeypatch, dtype, limit):
    if limit is not None:  # float32 weights over the session-copy limit: bound as inputs
        monkeypatch.setattr(offload, "SESSION_COPY_LIMIT", limit)
    path = save_external(mlp(own_loss=True), tmp_path)
    tr = trainer(model=path, own_loss=True, base_dtype=dtype)
    held = tr._frozen
    quantised = {f"trainops/base/{w}/q" for w in ("W1", "W2", "W3")}
    assert sorted(held) == sorted(BASE if dtype == "float32" else quantised | {"b3"})
    for name, arr in held.items():
        assert not arr.flags.writeable
        if name in BASE:  # the model file's pages (the quantised data is computed)
            assert isinstance(arr, np.memmap)
            assert os.path.samefile(arr.filename, tmp_path / "weights.bin")
    # no graph of the trainer holds a weight's data: each is a stub
    for m in (tr._model, tr._train_model, tr.step_graph.model):
        stubs = {i.name for i in m.graph.initializer if offload.is_offloaded(i)}
        assert stubs == set(held)
        assert all(not i.raw_data for i in m.graph.initializer if i.name in held)
    # float32 weights up to the limit are the session's own initializers (it prepacks
    # them); above it, and the quantised data, graph inputs bound to the store's arrays
    # themselves (the OrtValue wraps the buffer)
    inputs = {i.name for i in tr.session.get_inputs()}
    bound = {n: v.data_ptr() for n, v in tr.runtime._frozen.items()}
    # (a quantised base chose memory: its float tensors are inputs too)
    want = set(BASE) if limit == 0 else quantised | {"b3"} if dtype == "int4" else set()
    assert bound == {n: held[n].ctypes.data for n in want} and want <= inputs
    assert not inputs & (set(held) - want)


def test_an_in_memory_model_is_not_changed_and_its_weights_are_taken_once(library_path,
                                                                          hold_all):
    model = mlp(own_loss=True)
    before = model.SerializeToString()
    tr = trainer(model=model, own_loss=True)
    assert model.SerializeToString() == before
    want = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert all(tr._frozen[n].tobytes() == want[n].tobytes() for n in BASE)


def test_adamw_steps_with_the_weights_held_outside(library_path, tmp_path, hold_all):
    """test_lora's float64 reference, the trainer reading its base from the data file."""
    opt = optim.AdamW(lr=0.05, weight_decay=0.01)
    tr = trainer(model=save_external(mlp(own_loss=True), tmp_path), own_loss=True,
                 optimizer=opt)
    model = offload.materialise(tr._train_model, tr._frozen)  # the reference's values
    for t in range(1, 4):
        checked_adamw_step(tr, model, opt, t, data(seed=10 + t))
    # the data file is as written: the base never changes
    again = onnx.load(os.path.join(tmp_path, "m.onnx"))
    want = {i.name: numpy_helper.to_array(i).tobytes() for i in mlp().graph.initializer}
    assert {i.name: numpy_helper.to_array(i).tobytes() for i in again.graph.initializer} == want


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_exports_checkpoints_and_artifacts(library_path, tmp_path, hold_all, dtype):
    """The exports carry the weights again (plain onnxruntime runs them, equal to a trainer
    whose weights stayed in the model), and a checkpoint / artifacts resume bit for bit."""
    path = save_external(mlp(own_loss=True), tmp_path)
    tr = trainer(model=path, own_loss=True, base_dtype=dtype)
    assert tr._frozen  # quantised: the quantised data is held outside instead
    if dtype != "float32":
        assert not any(n in tr._frozen for n in ("W1", "W2", "W3"))
    feeds = [data(seed=40 + t) for t in range(4)]
    for f in feeds[:2]:
        tr.step(f)
    merged, kept = tr.export(), tr.export(merge=False)
    assert not any(offload.is_offloaded(i) for m in (merged, kept) for i in m.graph.initializer)
    assert np.all(np.isfinite(run(merged, feeds[3])))
    tr.save(tmp_path / "ck.safetensors")
    tr.save_artifacts(tmp_path / "art")
    back = [Trainer.load(tmp_path / "ck.safetensors", threads=1),
            Trainer.from_artifacts(tmp_path / "art", threads=1)]
    want = [tr.step(f) for f in feeds[2:]]
    for b in back:
        assert [b.step(f) for f in feeds[2:]] == want
        assert all(b.parameters()[n].tobytes() == v.tobytes()
                   for n, v in tr.parameters().items())
    kept_sess = run(kept, feeds[3])
    assert np.array_equal(run(tr.export(merge=False), feeds[3]),
                          run(back[0].export(merge=False), feeds[3]))
    assert kept_sess.shape == (7, 3)


def test_bad_external_data_is_named(library_path, tmp_path, hold_all):
    path = save_external(mlp(own_loss=True), tmp_path)
    data_file = tmp_path / "weights.bin"
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"initializer 'W\d'.*past the end of 'weights.bin'"):
        trainer(model=path, own_loss=True)
    data_file.unlink()
    with pytest.raises(ValueError, match=r"initializer 'W\d'.*does not exist"):
        trainer(model=path, own_loss=True)
    m = onnx.load(path, load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../outside.bin"
    onnx.save_model(m, tmp_path / "escape.onnx")
    with pytest.raises(ValueError, match="outside the model's folder"):
        trainer(model=str(tmp_path / "escape.onnx"), own_loss=True)


def test_without_lora_nothing_is_held_outside(library_path, hold_all):
    tr = Trainer(mlp(own_loss=True), "loss", optimizer=optim.AdamW(lr=0.1), threads=1)
    assert tr._frozen is None


# -- a model over protobuf's 2 GB limit (slow) ------------------------------------------------
HIDDEN, WIDE, LAYERS, VOCAB = 4096, 16384, 4, 8192


def big_model(folder) -> tuple[str, int]:
    """A causal-LM-shaped stack over 2 GB, written straight to its data file (random
    weights, never a 2 GB proto in memory): Gather(E [VOCAB, HIDDEN]) -> per layer
    up_proj (MatMul, [HIDDEN, WIDE]) -> Relu -> down_proj (MatMul through Transpose, torch's
    [HIDDEN, WIDE]) + residual -> lm_head (MatMul through Transpose(E), tied) = logits."""
    rng = np.random.default_rng(0)
    shapes = [("E", (VOCAB, HIDDEN))]
    for k in range(LAYERS):
        shapes += [(f"up{k}", (HIDDEN, WIDE)), (f"down{k}", (HIDDEN, WIDE))]
    inits, offset = [], 0
    with open(os.path.join(folder, "big.bin"), "wb") as f:
        for name, shape in shapes:
            scale = 1.0 / np.sqrt(shape[0] if name.startswith("up") else shape[1])
            for row in range(0, shape[0], 512):
                n = min(512, shape[0] - row)
                f.write((rng.standard_normal((n, shape[1]), np.float32) * scale)
                        .astype(np.float32).tobytes())
            nbytes = int(np.prod(shape)) * 4
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape,
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "big.bin"), ("offset", str(offset)),
                               ("length", str(nbytes))):
                t.external_data.add(key=key, value=value)
            inits.append(t)
            offset += nbytes
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h0"], name="/embed")]
    for k in range(LAYERS):
        nodes += [
            helper.make_node("MatMul", [f"h{k}", f"up{k}"], [f"u{k}"], name=f"/l{k}/up_proj"),
            helper.make_node("Relu", [f"u{k}"], [f"r{k}"]),
            helper.make_node("Transpose", [f"down{k}"], [f"dT{k}"], perm=[1, 0]),
            helper.make_node("MatMul", [f"r{k}", f"dT{k}"], [f"d{k}"], name=f"/l{k}/down_proj"),
            helper.make_node("Add", [f"h{k}", f"d{k}"], [f"h{k + 1}"])]
    nodes += [helper.make_node("Transpose", ["E"], ["ET"], perm=[1, 0]),
              helper.make_node("MatMul", [f"h{LAYERS}", "ET"], ["logits"], name="/lm_head")]
    g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                       [2, 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                         [2, 8, VOCAB])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = os.path.join(folder, "big.onnx")
    onnx.save_model(m, path)
    return path, offset


@pytest.mark.slow
def test_a_model_over_2_gb_trains_a_lora_step_and_exports(library_path, tmp_path):
    path, nbytes = big_model(tmp_path)
    assert nbytes > 2**31
    lora = trainops.LoRA(rank=4, alpha=8, targets=["up_proj", "down_proj"])
    tr = Trainer(path, losses.cross_entropy("logits", class_axis=-1), lora=lora,
                 optimizer=optim.AdamW(lr=1e-3), seed=1, threads=2)
    assert sum(a.nbytes for a in tr._frozen.values()) == nbytes
    assert all(isinstance(a, np.memmap) for a in tr._frozen.values())
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (2, 8)).astype(np.int64)
    feeds = {"ids": ids, "labels": np.roll(ids, -1, axis=1)}
    first = tr.step(feeds)
    second = tr.step(feeds)
    assert np.isfinite(first) and second < first
    assert tr.memory()["frozen"] + tr.memory()["embeddings"] == nbytes
    # the adapters; the merged model with external data, which plain onnxruntime runs
    tr.save_adapter(tmp_path / "adapter.safetensors")
    with pytest.raises(NotImplementedError, match="2 GB"):
        tr.save(tmp_path / "ck.safetensors")
    out = tmp_path / "merged"
    out.mkdir()
    merged = tr.export()
    onnx.save_model(merged, out / "merged.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="merged.bin")
    del merged
    sess = ort.InferenceSession(str(out / "merged.onnx"), providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], {"ids": ids})[0]
    del sess
    weights = mapped(out / "merged.onnx")
    want, width = merged_forward64(weights, ids)
    assert np.all(np.abs(logits - want) <= width)
    # the merged weights are W + (alpha / rank) B A of the trained adapters
    ad = {n: v.astype(np.float64) for n, v in tr.parameters().items()}
    for w in ("up0", f"down{LAYERS - 1}"):
        delta = 2.0 * ad[f"{w}.lora_B"] @ ad[f"{w}.lora_A"]  # [out, in], PEFT's orientation
        exact = tr._frozen[w] + (delta if w.startswith("down") else delta.T)
        assert np.all(np.abs(weights[w] - exact) <= U * np.abs(exact)), w


def mapped(path) -> dict:
    """The model file's initializers as read-only maps of its external data file."""
    from onnx.external_data_helper import ExternalDataInfo

    m = onnx.load(str(path), load_external_data=False)
    out = {}
    for t in m.graph.initializer:
        info = ExternalDataInfo(t)
        out[t.name] = np.memmap(os.path.join(os.path.dirname(path), info.location), np.float32,
                                "r", int(info.offset or 0), tuple(t.dims))
    return out


def merged_forward64(weights: dict, ids):
    """big_model's forward in float64 from the merged model's weights, with the bound of
    any float32 evaluation of it (Higham: a K-term dot product within gamma(K) |x| |w|, the
    inputs' own errors carried through |W|, each Add within u of its result)."""
    def arr(name):
        return np.asarray(weights[name], np.float64)

    emb = arr("E")
    h, e = emb[ids], np.zeros(ids.shape + (HIDDEN,))
    for k in range(LAYERS):
        up, down = arr(f"up{k}"), arr(f"down{k}").T
        u = h @ up
        eu = gamma(HIDDEN) * (np.abs(h) + e) @ np.abs(up) + e @ np.abs(up)
        r, er = np.maximum(u, 0), eu
        d = r @ down
        ed = gamma(WIDE) * (np.abs(r) + er) @ np.abs(down) + er @ np.abs(down)
        h = h + d
        e = e + ed + U * (np.abs(h) + e + ed)
    logits = h @ emb.T
    return logits, gamma(HIDDEN) * (np.abs(h) + e) @ np.abs(emb.T) + e @ np.abs(emb.T)
