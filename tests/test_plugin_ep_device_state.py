"""Device-resident Trainer state on the plugin EP's fake device (TRAINOPS_FAKE_DEVICE=1: host
memory labelled as an NVIDIA GPU, the EP's allocator and copies; the optimizer node claimed
by the EP, the forward and backward passes on the CPU EP): every state an OrtValue in the
device's memory, training bit for bit as the CPU Trainer, and the EP's own copy counters
(independent of the runtime's) showing that the optimizer state never crosses."""

from __future__ import annotations

import os

os.environ["TRAINOPS_FAKE_DEVICE"] = "1"  # read when the EP library is first registered

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ort = pytest.importorskip("onnxruntime")
from trainops import Trainer, optim  # noqa: E402
from trainops import device as td  # noqa: E402
from trainops.train import placement as _placement  # noqa: E402
from trainops.train.buffers import Memory  # noqa: E402
from helpers.tiny import mlp  # noqa: E402

pytestmark = pytest.mark.skipif(not td.plugin_ep_supported(),
                                reason=f"onnxruntime {ort.__version__} has no plugin EPs (1.24+)")


def batches(k=5, n=8):
    rng = np.random.default_rng(7)
    for _ in range(k):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        yield {"x": x, "t": (x[:, 0] > 0).astype(np.int64)}


def pair(library_path, dropout=False):
    devs = td.devices(library_path)
    assert devs, "the fake device is offered"
    ep = Trainer(mlp(dropout=dropout), "loss", optimizer=optim.Adam(lr=0.05), seed=11,
                 providers=devs[:1])
    cpu = Trainer(mlp(dropout=dropout), "loss", optimizer=optim.Adam(lr=0.05), seed=11)
    return ep, cpu


def per_step(library_path, tr, f):
    before = td.counters(library_path)
    loss = tr.step(f)
    after = td.counters(library_path)
    return loss, {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_states_live_on_the_device_and_train_as_the_cpu(library_path, dropout, standard_grads):
    ep, cpu = pair(library_path, dropout)
    mem = ep.runtime.memory
    assert mem == Memory("gpu", mem.device_id, td.NVIDIA_VENDOR_ID)
    for name in ep._state_names():
        assert ep._arrays.on_device(name)
        assert ep.runtime.values[name].device_name().lower() != "cpu", name
    for f in batches():
        loss, _ = per_step(library_path, ep, f)
        assert loss == cpu.step(f)
        step = ep.transfers.last_step
        assert step["state_bytes"] == 0
        assert step["to_device_bytes"] == sum(v.nbytes for v in f.values()) + 4 + 8
    for k, v in cpu._states().items():
        assert ep._arrays[k].tobytes() == v.tobytes(), k


def test_the_optimizer_state_never_crosses(library_path, monkeypatch):
    """The EP's counters per step: the CPU forward pass reads each weight from the device
    (one copy each, at bind time), and nothing else moves: not the moments, not the
    gradients' or the updates' buffers (no allocation). With host states (the placement
    before device residency) every state crossed."""
    ep, _ = pair(library_path)
    fs = list(batches(4))
    ep.step(fs[0])
    for f in fs[1:]:
        _, c = per_step(library_path, ep, f)
        assert c["copies_to_host"] == len(ep.param_names), c
        assert c["copies_to_device"] == 0 and c["allocs"] == 0, c
        assert c["device_runs"] >= 1
    monkeypatch.setattr(_placement.Placement, "state_memory", lambda self: None)
    host, _ = pair(library_path)
    assert host.runtime.memory is None
    host.step(fs[0])
    _, c = per_step(library_path, host, fs[1])
    assert c["copies_to_device"] + c["copies_to_host"] > len(ep.param_names)
    states = sum(host._arrays.nbytes(n) for n in host._state_names())
    assert host.transfers.last_step["state_bytes"] == 2 * states


def test_checkpoint_from_the_device_resumes_on_the_cpu(library_path, tmp_path, standard_grads):
    pytest.importorskip("safetensors")  # the checkpoint format (not in CI's 1.24 venv)
    ep, cpu = pair(library_path, dropout=True)
    fs = list(batches(6))
    for f in fs[:3]:
        assert ep.step(f) == cpu.step(f)
    ep.save(tmp_path / "ep.safetensors")
    resumed = Trainer.load(tmp_path / "ep.safetensors")  # on the CPU
    ep2, _ = pair(library_path, dropout=True)
    ep2.load_state(tmp_path / "ep.safetensors")  # back onto the device
    for f in fs[3:]:
        want = cpu.step(f)
        assert resumed.step(f) == want and ep.step(f) == want and ep2.step(f) == want
    for k, v in cpu._states().items():
        assert ep2._arrays[k].tobytes() == v.tobytes(), k
