"""Device-resident Trainer state (python/trainops/train/buffers.py), as far as the CPU allows:
the states of a device placement live in ONNX Runtime-allocated OrtValues, bound in place, read
and written through one accessor that copies on demand, with the runtime's transfers counted.

Here the device code path runs over ``Memory("cpu")`` (OrtValues ONNX Runtime allocates, not
numpy buffers the session shares), against the CPU Trainer bit for bit; the plugin EP's fake
device is tests/test_plugin_ep_device_state.py; a real GPU is scripts/gpu_check."""

from __future__ import annotations

import functools

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
from trainops import Trainer, optim  # noqa: E402
from trainops.train import buffers as _buffers  # noqa: E402
from trainops.train import runtime as _runtime  # noqa: E402
from trainops.train import trainer as _trainer  # noqa: E402
from trainops.train.buffers import Memory  # noqa: E402
from trainops.train.placement import Placement  # noqa: E402
from helpers.tiny import mlp  # noqa: E402


def batches(k=5, n=8, seed=7):
    rng = np.random.default_rng(seed)
    for _ in range(k):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        yield {"x": x, "t": (x[:, 0] > 0).astype(np.int64)}


@pytest.fixture
def device_path(monkeypatch):
    """Trainers made inside get the device code path over ONNX Runtime's CPU memory."""
    monkeypatch.setattr(_trainer, "StepRuntime",
                        functools.partial(_runtime.StepRuntime, state_memory=Memory("cpu")))


def make(**kw):
    kw.setdefault("optimizer", optim.Adam(lr=0.05))
    return Trainer(mlp(dropout=kw.pop("dropout", True)), "loss", seed=11, **kw)


def on_cpu(fn, *args, **kw):
    """``fn(*args, **kw)`` with the CPU's StepRuntime (inside the device_path fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_trainer, "StepRuntime", _runtime.StepRuntime)
        return fn(*args, **kw)


def state_bytes(tr):
    return sum(tr._arrays.nbytes(n) for n in tr._state_names())


def test_the_cpu_trainer_shares_its_buffers_and_counts_nothing():
    tr = make()
    assert tr.runtime.memory is None
    name = tr.param_names[0]
    assert tr._arrays[name] is tr._arrays[name]  # the session's buffer itself, no copy
    assert not tr._arrays.on_device(name)
    for f in batches(2):
        tr.step(f)
        assert tr.transfers.last_step == dict.fromkeys(_buffers.COUNTERS, 0)
    assert tr.transfers.total == dict.fromkeys(_buffers.COUNTERS, 0)


@pytest.mark.parametrize("opt", [optim.Adam(lr=0.05), optim.Adagrad(lr=0.1),
                                 optim.Momentum(lr=0.1), optim.AdamW(lr=0.05),
                                 optim.Adam(lr=0.05, state_dtype="int8")],
                         ids=["adam", "adagrad", "momentum", "adamw", "adam8bit"])
def test_device_path_trains_as_the_cpu_with_data_only_crossing(device_path, opt):
    dev = make(optimizer=opt)
    assert dev.runtime.memory == Memory("cpu")
    names = dev._state_names()
    assert all(dev._arrays.on_device(n) for n in names)
    ptrs = {n: dev.runtime.values[n].data_ptr() for n in names}
    cpu = on_cpu(make, optimizer=opt)
    for f in batches():
        assert dev.step(f) == cpu.step(f)
        step = dev.transfers.last_step
        data = sum(v.nbytes for v in f.values())
        assert step["state_bytes"] == 0, step
        assert step["to_device"] == len(f) + 2  # the data inputs, lr, T
        assert step["to_device_bytes"] == data + 4 + 8
        assert (step["to_host"], step["to_host_bytes"]) == (1, 4)  # the loss
    # updated in place: the same device buffers, other values
    assert {n: dev.runtime.values[n].data_ptr() for n in names} == ptrs
    for k, v in cpu.parameters().items():
        assert dev.parameters()[k].tobytes() == v.tobytes(), k
    for k, v in cpu.optimizer_state().items():
        assert dev.optimizer_state()[k].tobytes() == v.tobytes(), k
    for k, _, _ in cpu._rng:
        assert dev._arrays[k].tobytes() == cpu._arrays[k].tobytes()


def test_reads_are_copies_counted_and_writes_reach_the_session(device_path):
    dev = make(dropout=False)
    p = dev.param_names[0]
    before = dict(dev.transfers.total)
    a = dev._arrays[p]
    assert a is not dev._arrays[p]  # a fresh host copy each read
    a[...] = 123.0  # changes the copy only
    assert not (dev._arrays[p] == 123.0).any()
    dev.parameters()[p][...] = 123.0
    assert not (dev._arrays[p] == 123.0).any()
    total = dev.transfers.total
    n_reads = 3 + 1 + len(dev.param_names)  # parameters() reads each weight once
    assert total["to_host"] - before["to_host"] == n_reads
    assert total["to_host_bytes"] - before["to_host_bytes"] == sum(
        dev._arrays.nbytes(q) for q in dev.param_names) + 4 * a.nbytes
    zero = np.zeros_like(a)
    dev._arrays.write(p, zero)
    assert dev.transfers.total["to_device_bytes"] - before["to_device_bytes"] == a.nbytes
    np.testing.assert_array_equal(dev._arrays[p], zero)
    with pytest.raises(ValueError, match=repr(p)):
        dev._arrays.write(p, zero.astype(np.float64))
    # the session reads the written value: a zero first layer gives logits 0, loss ln 3
    f = next(batches(1))
    assert dev.step(f) == pytest.approx(np.log(3), rel=1e-6)


def test_checkpoints_cross_between_device_and_cpu(device_path, tmp_path):
    dev = make()
    fs = list(batches(6))
    for f in fs[:3]:
        dev.step(f)
    dev.save(tmp_path / "dev.safetensors")
    dev2 = make()
    up = dict(dev2.transfers.total)
    dev2.load_state(tmp_path / "dev.safetensors")  # host -> device, every state once
    assert dev2.transfers.total["to_device_bytes"] - up["to_device_bytes"] == state_bytes(dev2)
    assert dev2.transfers.total["to_host"] == up["to_host"]  # validated without a read
    cpu = on_cpu(Trainer.load, tmp_path / "dev.safetensors")
    assert cpu.runtime.memory is None
    for f in fs[3:]:
        want = cpu.step(f)
        assert dev.step(f) == want and dev2.step(f) == want
    for k, v in cpu._states().items():
        assert dev._arrays[k].tobytes() == v.tobytes() == dev2._arrays[k].tobytes(), k
    m = dev.export()
    assert m.SerializeToString() == cpu.export().SerializeToString()


def test_artifacts_of_a_device_trainer(device_path, tmp_path):
    dev = make()
    for f in batches(2):
        dev.step(f)
    man = dev.save_artifacts(tmp_path / "a")
    assert man["loss"]["shape"] == [] or man["loss"]["shape"] == [1]
    back = Trainer.from_artifacts(tmp_path / "a")
    for k in dev._state_names():
        assert back._arrays[k].tobytes() == dev._arrays[k].tobytes(), k


def test_mixed_precision_on_the_device_path(device_path):
    def build():
        return Trainer(mlp(), "loss", optimizer=optim.Adam(lr=0.01), seed=3,
                       policy="mixed_float16")
    dev, cpu = build(), on_cpu(build)
    for i, f in enumerate(batches(4)):
        if i == 2:
            f = {**f, "x": np.full_like(f["x"], np.inf)}  # a skipped step
        assert np.array_equal(dev.step(f), cpu.step(f), equal_nan=True)
        assert dev.runtime.finite == cpu.runtime.finite
        assert dev.transfers.last_step["state_bytes"] == 0
    assert dev.skipped == cpu.skipped == 1 and dev.loss_scale == cpu.loss_scale
    for k, v in cpu._states().items():
        assert dev._arrays[k].tobytes() == v.tobytes(), k


def test_bfloat16_state_on_the_device_path(device_path):
    opt = optim.Adam(lr=0.05, state_dtype="bfloat16")
    try:
        dev = make(optimizer=opt, dropout=False)
        cpu = on_cpu(make, optimizer=opt, dropout=False)
        for f in batches(3):
            assert dev.step(f) == cpu.step(f)
        states = cpu.optimizer_state()
        got = dev.optimizer_state()
    except NotImplementedError as e:  # onnxruntime without OrtValue.update_inplace(OrtValue)
        pytest.skip(str(e))
    for k, v in states.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


def test_state_memory_of_placements():
    cuda = "CUDAExecutionProvider"
    assert Placement().state_memory() is None
    assert Placement(providers=[cuda, "CPUExecutionProvider"], names=(cuda, "CPUExecutionProvider"),
                     cuda_kernels=True).state_memory() == Memory("cuda", 0)
    assert Placement(providers=[(cuda, {"device_id": 1})], names=(cuda,),
                     cuda_kernels=True).state_memory() == Memory("cuda", 1)
    dml = "DmlExecutionProvider"
    assert Placement(providers=[dml], names=(dml,), portable=True).state_memory() is None
    assert Placement(providers=["CPUExecutionProvider"], portable=True).state_memory() is None
    assert Memory("cuda", 1).args() == ("cuda", 1)
    assert Memory("gpu", 0, 0x10DE).args() == ("gpu", 0, 0x10DE)


def test_portable_on_the_cpu_crosses_nothing():
    tr = make(portable=True)
    assert not tr.placement.is_cpu and tr.placement.host_only and tr.runtime.memory is None
    for f in batches(2):
        tr.step(f)
    assert tr.transfers.total == dict.fromkeys(_buffers.COUNTERS, 0)
