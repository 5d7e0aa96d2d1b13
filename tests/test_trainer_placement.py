"""Trainer(device=, providers=, portable=): the choice of execution providers and of the
portable (standard-op) step graph, and ``training_model`` as attribute and call. Results are
checked against the default CPU Trainer (itself checked against numpy in test_trainer.py)
and, for the portable graph, against the fused kernels bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from trainops import Trainer, optim
from trainops.train import placement as pl

from helpers.tiny import mlp

TRAINOPS_DOMAINS = {"ai.onnx.preview.training", "com.trainops"}


def batches(k=4, n=8):
    rng = np.random.default_rng(7)
    for _ in range(k):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        yield {"x": x, "t": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)}


def train(**kw):
    tr = Trainer(mlp(kw.pop("dropout", False)), "loss", optimizer=kw.pop("optimizer", optim.Adam(lr=0.05)),
                 seed=3, **kw)
    losses = [tr.step(f) for f in batches()]
    return tr, losses


def same(a: Trainer, b: Trainer):
    for k, v in a.parameters().items():
        np.testing.assert_array_equal(v, b.parameters()[k])
    for k, v in a.optimizer_state().items():
        np.testing.assert_array_equal(v, b.optimizer_state()[k])


def test_default_cpu_auto_and_explicit_providers_are_the_same_step(library_path):
    base, losses = train()
    assert base.placement.is_cpu and base.session.get_providers() == ["CPUExecutionProvider"]
    for kw in ({"device": "cpu"}, {"device": "auto"}, {"providers": ["CPUExecutionProvider"]},
               {"providers": [("CPUExecutionProvider", {})]}, {"portable": False}):
        tr, ls = train(**kw)
        assert tr.session.get_providers() == ["CPUExecutionProvider"], kw
        assert ls == losses, kw
        same(tr, base)


def linear():
    """x -> MatMul w -> loss: one parameter, so no node reads it after its gradient exists."""
    m = mlp()
    del m.graph.initializer[:]
    m.graph.initializer.append(numpy_helper.from_array(
        np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "w1"))
    del m.graph.node[:2]
    m.graph.node[0].input[0] = "x"
    m.graph.node[0].input[1] = "w1"
    return m


OPTS = [optim.Adam(lr=0.05), optim.Adagrad(lr=0.1), optim.Momentum(lr=0.1)]


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.op_type)
def test_portable_step_of_one_parameter_matches_the_fused_kernels(library_path, standard_grads, opt):
    runs = []
    for portable in (False, True):
        tr = Trainer(linear(), "loss", optimizer=opt, seed=3, portable=portable)
        runs.append((tr, [tr.step(f) for f in batches()]))
    (fused, losses), (tr, ls) = runs
    assert not {n.domain for n in tr.training_model().graph.node} & TRAINOPS_DOMAINS
    assert ls == losses
    same(tr, fused)


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.op_type)
def test_portable_graph_has_no_custom_nodes_and_matches_the_fused_kernels(library_path, standard_grads, opt):
    fused, losses = train(optimizer=opt)
    tr, ls = train(optimizer=opt, portable=True)
    m = tr.training_model()
    assert isinstance(m, onnx.ModelProto) and m is tr.step_graph.model
    assert not {n.domain for n in m.graph.node} & TRAINOPS_DOMAINS
    assert ls == losses
    same(tr, fused)


def test_portable_dropout_trains_with_onnx_dropout(library_path):
    tr, ls = train(dropout=True, portable=True)
    ops = {(n.op_type, n.domain) for n in tr.training_model().graph.node}
    assert ("Dropout", "") in ops and not {d for _, d in ops} & TRAINOPS_DOMAINS
    assert all(np.isfinite(ls))


def test_training_model_is_an_attribute_and_a_call(library_path, tmp_path):
    tr, _ = train()
    nodes = tr.training_model.graph.node  # attribute access, as before
    assert any(n.op_type == "Adam" for n in nodes)
    proto = tr.training_model()
    assert isinstance(proto, onnx.ModelProto) and tr.training_model == proto
    assert tr.training_model.SerializeToString() == proto.SerializeToString()
    onnx.save(proto, tmp_path / "step.onnx")
    assert onnx.load(tmp_path / "step.onnx").graph == proto.graph
    with pytest.raises(AttributeError, match="read-only"):
        tr.training_model.ir_version = 3


def test_portable_none_follows_the_execution_provider():
    for name in sorted(pl.NO_CUSTOM_OPS):
        assert pl.resolve(providers=[name, "CPUExecutionProvider"]).portable, name
        assert not pl.resolve(providers=[name], portable=False).portable
    assert not pl.resolve(providers=["CUDAExecutionProvider", "CPUExecutionProvider"]).portable
    assert pl.resolve(providers=["CUDAExecutionProvider"]).cuda_kernels
    assert pl.resolve(device="auto").names == ("CPUExecutionProvider",)  # CPU until verified


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="not both"):
        pl.resolve(providers=["CPUExecutionProvider"], device="cpu")
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'auto'"):
        pl.resolve(device="gpu")
    with pytest.raises(TypeError, match="portable"):
        pl.resolve(portable="yes")
    with pytest.raises(TypeError, match="provider names"):
        pl.resolve(providers=[42])
    with pytest.raises(ValueError, match="empty"):
        pl.resolve(providers=[])


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="onnxruntime-gpu here")
def test_device_cuda_without_onnxruntime_gpu_says_so(library_path):
    with pytest.raises(RuntimeError, match="CUDAExecutionProvider"):
        Trainer(mlp(), "loss", device="cuda")


def test_comm_with_a_device_is_refused():
    with pytest.raises(NotImplementedError, match="CPU only"):
        Trainer(mlp(), "loss", comm=object(), portable=True)
