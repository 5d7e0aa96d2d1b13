"""LoRA on a quantised frozen base: ``Trainer(base_dtype="int8" | "int4")``
(python/trainops/lora/quantize.py).

References: a per-block loop in numpy float64 / Python (absmax scale, round-half-even by
Python's ``round``, clamp), float64 products bounded by helpers.rounding's gamma_n, and a
float32-base trainer whose frozen weights are that reference's dequantised values.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import trainops
from helpers.rounding import U, gamma
from test_lora import ALPHA, RANK, TARGETS, data, exported_model, mlp, trainer
from trainops import Trainer, losses, optim
from trainops.lora import quantize as qz

DATA_ARCHS = {"llama": (["q_proj", "v_proj"], "int4"), "gpt2": (["c_attn"], "int8")}
QMAX = {"int8": 127, "int4": 7}
# in_features -> (blocks, block size): at most 128 per block, equal blocks
LAYOUT = {1: (1, 1), 127: (1, 127), 128: (1, 128), 129: (2, 65), 300: (3, 100)}


def reference(w_oi: np.ndarray, dtype: str):
    """``(q [out, nb, bs] ints, scale [out, nb] float32, dequantised [out, in] float32)``,
    one block at a time."""
    out, n = w_oi.shape
    nb = math.ceil(n / 128)
    bs = math.ceil(n / nb)
    q = np.zeros((out, nb, bs), np.int64)
    scale = np.zeros((out, nb), np.float32)
    deq = np.zeros((out, n), np.float32)
    qmax = QMAX[dtype]
    for o in range(out):
        for b in range(nb):
            block = [float(v) for v in w_oi[o, b * bs:(b + 1) * bs]]
            s = np.float32(max(abs(v) for v in block) / qmax)
            scale[o, b] = s
            for j, v in enumerate(block):
                k = 0 if s == 0 else max(-qmax, min(qmax, round(v / float(s))))
                q[o, b, j] = k
                deq[o, b * bs + j] = np.float32(k) * s
    return q, scale, deq


def weights(out, n, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, n)) * 0.3).astype(np.float32)
    w[0, : min(n, 128)] = 0.0  # a block of zeros: scale 0, q 0
    return w


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("n", sorted(LAYOUT))
def test_quantiser_against_the_reference(dtype, n):
    w = weights(3, n, n)
    q, scale = qz.quantize_array(w, dtype)
    rq, rs, _ = reference(w, dtype)
    nb, bs = LAYOUT[n]
    assert qz.blocks(n) == (nb, bs)
    assert q.shape == (3 * nb, bs) and scale.shape == (3 * nb,)
    assert scale.tobytes() == rs.reshape(-1).tobytes()
    assert np.array_equal(q, rq.reshape(3 * nb, bs))  # pad elements: 0


@pytest.mark.parametrize("dtype, ties", [("int8", [(2.5, 2), (3.5, 4), (-2.5, -2)]),
                                         ("int4", [(0.5, 0), (1.5, 2), (-1.5, -2)])])
def test_round_half_even_and_clamp(dtype, ties):
    s = 1 / 64  # exact in float32: absmax = qmax * s, so the scale is s exactly
    w = np.array([[QMAX[dtype] * s] + [t * s for t, _ in ties]], np.float32)
    q, scale = qz.quantize_array(w, dtype)
    assert scale[0] == np.float32(s)
    assert q[0].tolist() == [QMAX[dtype]] + [k for _, k in ties]
    assert np.abs(qz.quantize_array(w * 1e30, dtype)[0]).max() == QMAX[dtype]


@pytest.mark.parametrize("bs", [1, 2, 65, 127, 128])
def test_int4_packing_round_trip(bs):
    q = np.random.default_rng(bs).integers(-7, 8, (5, bs)).astype(np.int8)
    p = qz.pack_int4(q)
    assert p.dtype == np.uint8 and p.shape == (5, math.ceil(bs / 2))
    assert np.array_equal(qz.unpack_int4(p, bs), q)
    if bs >= 2:  # element 0 in the low nibble, element 1 in the high one, both + 8
        assert int(p[0, 0]) == (int(q[0, 0]) + 8) + 16 * (int(q[0, 1]) + 8)


def matmul_model(w, transposed):
    """``y = x @ W'``: W' = W ([in, out]) or Transpose(W) (W [out, in])."""
    n = w.shape[1] if transposed else w.shape[0]
    nodes = [helper.make_node("MatMul", ["x", "WT" if transposed else "W"], ["y"], name="mm")]
    if transposed:
        nodes.insert(0, helper.make_node("Transpose", ["W"], ["WT"], perm=[1, 0]))
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", 1, [4, n])],
                          [helper.make_tensor_value_info("y", 1, None)],
                          [numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("n, transposed", [(1, True), (129, False), (129, True), (300, True)])
def test_dequantised_forward(dtype, n, transposed):
    """The graph's dequantised weights are the reference's bit for bit (one rounding of
    float32(q) * scale); x @ W within gamma(n) * |x| @ |W| of float64."""
    w_oi = weights(5, n, 7 + n)
    model = qz.quantize(matmul_model(w_oi if transposed else w_oi.T.copy(), transposed),
                        dtype, [])
    assert "W" not in {i.name for i in model.graph.initializer}
    _, _, deq = reference(w_oi, dtype)
    rec = qz.read(model)
    inits = {i.name: i for i in model.graph.initializer}
    got = qz.dequantized(rec, "W", inits)
    assert got.tobytes() == (deq if transposed else deq.T.copy()).tobytes()
    x = np.random.default_rng(n).standard_normal((4, n)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x})[0]
    exact = x.astype(np.float64) @ deq.T.astype(np.float64)
    assert np.all(np.abs(y - exact) <= gamma(n) * (np.abs(x) @ np.abs(deq.T)) + 1e-45)


def dequantised_mlp():
    """mlp() with W1, W2, W3 replaced by their reference dequantised values, per dtype."""
    out = {}
    for dtype in ("int8", "int4"):
        m = mlp()
        for init in m.graph.initializer:
            a = numpy_helper.to_array(init)
            if init.name == "W1":  # [in, out]
                init.CopyFrom(numpy_helper.from_array(reference(a.T, dtype)[2].T.copy(), "W1"))
            elif init.name in ("W2", "W3"):  # [out, in]
                init.CopyFrom(numpy_helper.from_array(reference(a, dtype)[2], init.name))
        out[dtype] = m
    return out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_training_equals_a_float32_base_of_the_dequantised_weights(library_path, dtype):
    """Both trainers compute with the same float32 weights (the dequantisation is exact
    against numpy, one rounding), the same graph around them and the same kernels: the
    same losses and adapters bit for bit."""
    q = trainer(base_dtype=dtype)
    f = trainer(model=dequantised_mlp()[dtype])
    assert q.base_dtype == dtype and q.param_names == f.param_names
    for t in range(4):
        feeds = data(seed=20 + t)
        assert q.step(feeds) == f.step(feeds)
    assert all(q.parameters()[n].tobytes() == v.tobytes() for n, v in f.parameters().items())
    # the base is untouched: the quantised data in the step graph, the export's weights
    inits = {i.name: numpy_helper.to_array(i) for i in q.training_model.graph.initializer}
    start = {i.name: numpy_helper.to_array(i) for i in qz.quantize(
        mlp(), dtype, []).graph.initializer}
    assert all(inits[k].tobytes() == v.tobytes() for k, v in start.items()
               if k.startswith(qz.PREFIX))
    base = {i.name: numpy_helper.to_array(i) for i in q.export(merge=False).graph.initializer}
    want = {i.name: numpy_helper.to_array(i) for i in f.export(merge=False).graph.initializer}
    assert all(base[k].tobytes() == want[k].tobytes() for k in ("W1", "W2", "W3"))
    assert q.export().SerializeToString() == f.export().SerializeToString()


def test_memory_counts_the_frozen_bytes(library_path):
    """W1 [4, 6] (out 6, in 4), W2 [5, 6] (out 5, in 6), W3 [3, 5] (out 3, in 5): one block
    per row; int8 1 byte per element, int4 half a byte per element (a row of odd length
    padded by one), each a float32 scale per row."""
    rows = {"W1": (6, 4), "W2": (5, 6), "W3": (3, 5)}
    want = {"float32": sum(4 * o * n for o, n in rows.values()),
            "int8": sum(o * n + 4 * o for o, n in rows.values()),
            "int4": sum(o * math.ceil(n / 2) + 4 * o for o, n in rows.values())}
    assert want == {"float32": 276, "int8": 125, "int4": 92}
    for dtype, n in want.items():
        mem = trainer(base_dtype=dtype).memory()
        assert mem["frozen"] == n and mem["embeddings"] == 0
        assert mem["parameters"] == 4 * sum(RANK * (o + i) for o, i in rows.values())


def test_export_merges_into_the_dequantised_weights(library_path):
    tr = trainer(base_dtype="int4")
    for t in range(3):
        tr.step(data(seed=40 + t))
    merged = {i.name: numpy_helper.to_array(i) for i in tr.export().graph.initializer}
    assert not any(k.startswith(qz.PREFIX) or "lora" in k for k in merged)
    p = tr.parameters()
    deq = {i.name: numpy_helper.to_array(i) for i in dequantised_mlp()["int4"].graph.initializer}
    for w, transposed in (("W1", False), ("W2", True), ("W3", True)):
        delta = (ALPHA / RANK) * (p[f"{w}.lora_B"].astype(np.float64)
                                  @ p[f"{w}.lora_A"].astype(np.float64))
        exact = deq[w].astype(np.float64) + (delta if transposed else delta.T)
        assert np.all(np.abs(merged[w] - exact) <= U * np.abs(exact))  # one rounding
    assert merged["b3"].tobytes() == numpy_helper.to_array(
        next(i for i in mlp().graph.initializer if i.name == "b3")).tobytes()


def test_bad_base_dtype_is_refused(library_path):
    for bad in ("float16", "nf4", 8):
        with pytest.raises(ValueError, match=f"base_dtype {bad!r}"):
            trainer(base_dtype=bad)
    with pytest.raises(ValueError, match="base_dtype 'int8'.*needs lora="):
        Trainer(mlp(), losses.cross_entropy("logits", class_axis=-1), threads=1,
                base_dtype="int8")
    with pytest.raises(NotImplementedError, match="base_dtype 'int4' with policy"):
        trainer(base_dtype="int4", policy="mixed_float16", optimizer=optim.Adam(lr=0.05))
    old = mlp()  # the Trainer's importer lifts opsets below 13; the rewrite checks its own
    del old.opset_import[:]
    old.opset_import.append(helper.make_opsetid("", 12))
    with pytest.raises(ValueError, match="opset 12"):
        qz.quantize(old, "int8", [])
    bad = mlp()
    bad.graph.initializer[1].float_data[:] = [np.inf] * 30
    bad.graph.initializer[1].ClearField("raw_data")
    with pytest.raises(ValueError, match="'W2' has non-finite"):
        trainer(model=bad, base_dtype="int4")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_checkpoints_and_artifacts_resume_bit_for_bit(library_path, tmp_path, dtype):
    lora = trainops.LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS, dropout=0.2)
    tr = trainer(lora=lora, base_dtype=dtype)
    for t in range(2):
        tr.step(data(seed=60 + t))
    tr.save(tmp_path / "ck.safetensors")
    tr.save_artifacts(tmp_path / "art")
    back = [Trainer.load(tmp_path / "ck.safetensors", threads=1),
            Trainer.from_artifacts(tmp_path / "art", threads=1)]
    same = trainer(lora=lora, base_dtype=dtype)
    same.load_state(tmp_path / "ck.safetensors")
    feeds = data(seed=70)
    want = tr.step(feeds)
    for other in back + [same]:
        assert other.base_dtype == dtype and other.memory() == tr.memory()
        assert other.step(feeds) == want
        assert all(other.parameters()[n].tobytes() == v.tobytes()
                   for n, v in tr.parameters().items())
    assert back[0].export().SerializeToString() == tr.export().SerializeToString()


@pytest.mark.parametrize("arch", sorted(DATA_ARCHS))
def test_committed_exports(library_path, arch):
    """llama (MatMul through Transpose(W), tied nothing) with int4, gpt2 (Gemm; wte a
    Gather table) with int8: every frozen MatMul/Gemm weight quantised, the embeddings
    float32, the bytes as counted, training moves the loss, the merged export runs."""
    targets, dtype = DATA_ARCHS[arch]
    model = exported_model(arch)
    with np.load(f"{__file__.rsplit('/', 1)[0]}/data/torch_models/{arch}.npz") as z:
        feeds = {"input_ids": z["input:input_ids"], "labels": z["labels"]}
    make = lambda d: Trainer(model, losses.cross_entropy("logits", class_axis=-1),  # noqa: E731
                             optimizer=optim.AdamW(lr=1e-2), threads=1, seed=0, base_dtype=d,
                             lora=trainops.LoRA(rank=4, alpha=8, targets=targets))
    tr, f32 = make(dtype), make("float32")
    rec = qz.read(tr._model)
    assert rec["dtype"] == dtype and rec["weights"]
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    assert not gathered & set(rec["weights"])
    want = 0
    for w, e in rec["weights"].items():
        out, n = e["shape"] if e["transposed"] else e["shape"][::-1]
        nb, bs = qz.blocks(n)
        want += out * nb * (bs if dtype == "int8" else math.ceil(bs / 2)) + 4 * out * nb
    mq, mf = tr.memory(), f32.memory()
    assert mq["frozen"] == want and mq["embeddings"] == mf["embeddings"] > 0
    assert mf["frozen"] == sum(4 * math.prod(e["shape"]) for e in rec["weights"].values())
    assert mq["frozen"] < mf["frozen"] / (3.5 if dtype == "int8" else 6)
    losses_ = [tr.step(feeds) for _ in range(3)]
    assert losses_[-1] < losses_[0]
    sess = ort.InferenceSession(tr.export().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"input_ids": feeds["input_ids"]})[0]
    assert np.all(np.isfinite(logits))
    assert TensorProto.INT8 in {i.data_type for i in tr.training_model.graph.initializer} or \
        dtype == "int4"


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_onnxruntime_keeps_the_weights_quantised(tmp_path, dtype):
    """onnxruntime's constant folding (on by default) leaves DequantizeLinear alone, so
    the session's initializers are the quantised data: no float32 weight folded back."""
    tr = trainer(base_dtype=dtype)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(tr._model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    import onnx

    inits = onnx.load(str(tmp_path / "opt.onnx")).graph.initializer
    shapes = {(4, 6), (6, 4), (5, 6), (6, 5), (3, 5), (5, 3)}
    assert not [i.name for i in inits if i.data_type == TensorProto.FLOAT
                and tuple(i.dims) in shapes and "lora" not in i.name]
    kind = TensorProto.INT8 if dtype == "int8" else TensorProto.UINT8
    assert sorted(i.name for i in inits if i.data_type == kind and len(i.dims) == 2) == \
        [f"{qz.PREFIX}{w}/q" for w in ("W1", "W2", "W3")]


def test_state_dict_gives_the_dequantised_base(library_path, monkeypatch):
    """A model with a trainops.torch record (torch names): state_dict() of an int8 trainer
    has the dequantised weights under their torch names (torch stubbed: from_numpy is the
    identity, so no torch is needed)."""
    import sys
    import types

    from trainops.train import torch_meta

    model = mlp()
    torch_meta.write(model, {"params": {"q.weight": {"initializer": "W1", "transposed": True},
                                        "v.weight": {"initializer": "W2", "transposed": False},
                                        "o.bias": {"initializer": "b3", "transposed": False}},
                             "buffers": {}})
    tr = trainer(model=model, base_dtype="int8")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(from_numpy=lambda a: a))
    got = tr.state_dict()
    deq = {i.name: numpy_helper.to_array(i) for i in dequantised_mlp()["int8"].graph.initializer}
    assert got["q.weight"].tobytes() == deq["W1"].T.copy().tobytes()
    assert got["v.weight"].tobytes() == deq["W2"].tobytes()
    assert got["o.bias"].tobytes() == deq["b3"].tobytes()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_backward_dequantises_its_own_copy(library_path, dtype):
    """No node after the loss reads a dequantised value the forward computed: the
    backward's readers get a copy of the chain whose DequantizeLinear reads its scale
    through a backward value (so onnxruntime neither runs it early nor merges it with the
    forward's), and the forward's copy dies after the forward."""
    tr = trainer(base_dtype=dtype)
    g = tr.training_model.graph
    producer = {o: n for n in g.node for o in n.output}
    forward, todo = set(), [tr.loss_name]
    while todo:
        t = todo.pop()
        if t not in forward:
            forward.add(t)
            todo.extend(producer[t].input if t in producer else [])
    fwd_values = {"W1", "W2", "W2T", "W3"}
    late = [n for n in g.node if not any(o in forward for o in n.output)]
    assert not [n.name for n in late if fwd_values & set(n.input)]
    dqs = [n for n in g.node if n.op_type == "DequantizeLinear"]
    copies = [n for n in dqs if n.name.endswith(("/bwd0", "/bwd1"))]
    assert len(dqs) == 5 and len(copies) == 2  # W1's dX is not needed (x is data)
    for n in copies:
        assert n.input[1].startswith(f"{qz.PREFIX}gate/") and n.input[1] not in forward
    # the copies compute the forward's bits: the steps equal a float32 base (test above)


def test_recompute_with_a_quantised_base(library_path):
    """Gradient checkpointing on top: the same steps bit for bit."""
    model = exported_model("llama")
    with np.load(f"{__file__.rsplit('/', 1)[0]}/data/torch_models/llama.npz") as z:
        feeds = {"input_ids": z["input:input_ids"], "labels": z["labels"]}
    make = lambda r: Trainer(model, losses.cross_entropy("logits", class_axis=-1),  # noqa: E731
                             optimizer=optim.AdamW(lr=1e-2), threads=1, seed=0,
                             base_dtype="int8", recompute=r,
                             lora=trainops.LoRA(rank=4, alpha=8, targets=["q_proj"]))
    a, b = make(False), make(True)
    for _ in range(2):
        assert a.step(feeds) == b.step(feeds)
    assert all(b.parameters()[n].tobytes() == v.tobytes() for n, v in a.parameters().items())
