"""Trainer(providers=[OrtEpDevice]) on the plugin EP's fake device (TRAINOPS_FAKE_DEVICE=1:
host memory labelled as an NVIDIA GPU, the CPU kernels behind the device registration): the
EP supplies trainops' domains (no custom-op library on the options), claims the optimizer
node, and the training is bit for bit the CPU Trainer's."""

from __future__ import annotations

import os

os.environ["TRAINOPS_FAKE_DEVICE"] = "1"  # read when the EP library is first registered

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ort = pytest.importorskip("onnxruntime")
from trainops import Trainer, optim  # noqa: E402
from trainops import device as td  # noqa: E402
from helpers.tiny import mlp as _mlp  # noqa: E402

pytestmark = pytest.mark.skipif(not td.plugin_ep_supported(),
                                reason=f"onnxruntime {ort.__version__} has no plugin EPs (1.24+)")


def mlp():
    return _mlp(dropout=True)  # the same model (its Dropout unnamed before: no effect)


def batches(k=5, n=8):
    rng = np.random.default_rng(7)
    for _ in range(k):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        yield {"x": x, "t": (x[:, 0] > 0).astype(np.int64)}


def test_trainer_on_the_plugin_ep_devices_matches_the_cpu_trainer(library_path, standard_grads):
    devs = td.devices(library_path)
    assert len(devs) >= 1
    before = td.counters(library_path)
    ep = Trainer(mlp(), "loss", optimizer=optim.Adam(lr=0.05), seed=11, providers=devs[:1])
    assert ep.placement.ep_supplies_domains and not ep.placement.portable
    assert "TrainopsExecutionProvider" in ep.session.get_providers()
    claimed = td.counters(library_path)["claimed"] - before["claimed"]
    assert claimed >= 1  # the Adam node (float32)
    # every weight the CPU's forward pass reads too is read there under its host alias
    # (train.host_reads: on a GPU the optimizer was otherwise handed the host copy)
    assert set(ep.runtime._host_aliases.values()) == set(ep.param_names)
    cpu = Trainer(mlp(), "loss", optimizer=optim.Adam(lr=0.05), seed=11)
    runs = td.counters(library_path)["device_runs"]
    for f in batches():
        assert ep.step(f) == cpu.step(f)
    assert td.counters(library_path)["device_runs"] - runs >= 5  # one device run per step at least
    for k, v in cpu.parameters().items():
        np.testing.assert_array_equal(ep.parameters()[k], v)
    for k, v in cpu.optimizer_state().items():
        np.testing.assert_array_equal(ep.optimizer_state()[k], v)


def test_a_foreign_ep_device_gets_the_custom_op_library(library_path):
    """Devices of another EP: trainops' domains come from the custom-op library (here the
    CPU EP's own device, listed by ONNX Runtime)."""
    cpu_devs = [d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    if not cpu_devs:
        pytest.skip("this onnxruntime lists no CPUExecutionProvider device")
    tr = Trainer(mlp(), "loss", optimizer=optim.Adam(lr=0.05), seed=11, providers=cpu_devs)
    assert not tr.placement.ep_supplies_domains
    ref = Trainer(mlp(), "loss", optimizer=optim.Adam(lr=0.05), seed=11)
    for f in batches(2):
        assert tr.step(f) == ref.step(f)
