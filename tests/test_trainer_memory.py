"""The Trainer holds one copy of the weights and the optimizer state, not several: the
optimizer's initial zeros take no memory, the step graph's parameter entries share the
runtime's buffers, and the source model is kept by reference (serialized again for a
checkpoint, refused if it changed meanwhile), a model file by its path (read again), and
the training model without the weights' data the imported model holds too."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, ONNX_OPSET
from trainops.train import checkpoint


def wide(n: int = 512, seed: int = 0):
    """x [N,n] -> MatMul w [n,n] -> ReduceMean -> loss: one weight of n*n float32."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((n, n)) / n).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("Mul", ["y", "y"], ["y2"]),
         helper.make_node("ReduceMean", ["y2"], ["loss"], keepdims=0)],
        "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    return m


@pytest.mark.parametrize("opt", [optim.Adam(), optim.Adam(state_dtype="bfloat16")])
def test_initial_optimizer_state_is_zeros_that_take_no_memory(opt):
    state = optim.initial_state(opt, np.ones((300, 7), np.float32))
    assert set(state) == set(opt.state)
    for v in state.values():
        assert v.shape == (300, 7) and not v.flags.writeable
        assert v.strides == (0, 0)  # one element, broadcast
        assert not np.asarray(v, np.float32).any()


def test_trainer_holds_one_copy_of_weights_and_state(library_path):
    model = wide()
    weight = 512 * 512 * 4
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tr = Trainer(model, "loss", optim.Adam(lr=1e-3), threads=1)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The runtime's buffers: the weight and Adam's two moments (3 x weight). Before: also
    # the zeros of the moments, the step graph's copy of the weight and the model's bytes
    # (7 x weight).
    assert 3 * weight <= held < 3.5 * weight, held / weight
    # The step graph's parameter entry is the runtime's buffer, which starts at the model's
    # initializer and then trains in place.
    (entry,) = tr.step_graph.of_kind("param")
    assert entry.initial is tr.runtime.arrays[entry.input]
    np.testing.assert_array_equal(entry.initial, numpy_helper.to_array(model.graph.initializer[0]))
    tr.step({"x": np.ones((2, 512), np.float32)})
    np.testing.assert_array_equal(entry.initial, tr.parameters()["w"])
    assert (entry.initial != numpy_helper.to_array(model.graph.initializer[0])).any()


def test_checkpoint_stores_the_source_model_and_refuses_a_changed_proto(library_path, tmp_path):
    model = wide(64)
    original = model.SerializeToString()
    tr = Trainer(model, "loss", optim.Adam(lr=1e-3), threads=1)
    tr.step({"x": np.ones((2, 64), np.float32)})
    tr.save(tmp_path / "a.safetensors")
    tensors, _ = checkpoint.read(tmp_path / "a.safetensors")
    assert tensors[checkpoint.MODEL_KEY].tobytes() == original
    model.doc_string = "edited after the Trainer was built"
    with pytest.raises(RuntimeError, match="has been changed since"):
        tr.save(tmp_path / "b.safetensors")
    assert not (tmp_path / "b.safetensors").exists()
    # bytes are immutable: kept as given
    tr2 = Trainer(original, "loss", optim.Adam(lr=1e-3), threads=1)
    tr2.save(tmp_path / "c.safetensors")
    assert checkpoint.read(tmp_path / "c.safetensors")[0][checkpoint.MODEL_KEY].tobytes() == original


def test_a_model_file_is_read_again_for_a_checkpoint_and_refused_if_changed(library_path, tmp_path):
    """Built from a file, the Trainer keeps the path, not a second copy of the weights; a
    checkpoint reads the file again and refuses it once it changed."""
    path = tmp_path / "wide.onnx"
    model = wide(64)
    path.write_bytes(model.SerializeToString())
    tr = Trainer(str(path), "loss", optim.Adam(lr=1e-3), threads=1)
    tr.step({"x": np.ones((2, 64), np.float32)})
    tr.save(tmp_path / "a.safetensors")
    stored = checkpoint.read(tmp_path / "a.safetensors")[0][checkpoint.MODEL_KEY].tobytes()
    assert stored == model.SerializeToString()
    model.doc_string = "the file replaced after the Trainer was built"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(RuntimeError, match="model file .*wide.onnx.* has changed since"):
        tr.save(tmp_path / "b.safetensors")
    assert not (tmp_path / "b.safetensors").exists()


def test_the_training_model_holds_the_initial_weights_once(library_path, tmp_path):
    """With a trainops loss the training model is a copy of the imported one: it is held
    without the weights' data, which reading it puts back (the artifacts read it)."""
    from trainops import losses

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 100)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "clf",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 100])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    tr = Trainer(m, losses.cross_entropy("logits"), optim.Adam(lr=1e-3), threads=1)
    held = {i.name: i for i in tr.__dict__["_train_model_held"].graph.initializer}
    assert held["w"].ByteSize() < 100 and list(held["w"].dims) == [64, 100]
    full = {i.name: i for i in tr._train_model.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(full["w"]), numpy_helper.to_array(w))
    assert "labels" in [i.name for i in tr._train_model.graph.input]  # the loss attached
    tr.step({"x": np.ones((2, 64), np.float32), "labels": np.array([1, 2])})
    tr.save_artifacts(tmp_path / "art")  # reads the training model whole
    assert any((tmp_path / "art").iterdir())
