"""The states of a Trainer on the WebGPU plugin EP live in the EP's device memory
(``Placement.state_memory``: the ``OrtEpDevice``'s memory info, its allocator used
directly): after the first step no parameter or optimizer-state byte crosses
(``trainer.transfers``), every state ``OrtValue`` is a WebGPU buffer, the losses are the
CPU portable Trainer's (rtol 1e-4, atol 1e-5: tests/eps/ep_pairs.py says why), and what
reads the states (parameters, optimizer state, save, export) copies them back on demand.
For comparison, host states (the EP's memory not used) cross twice a step.

Skipped where the plugin or an adapter is missing; a failure under ``EPS_REQUIRE=webgpu``
(scripts/webgpu_env sets up lavapipe).
"""

from __future__ import annotations

import numpy as np
import pytest

from ep_pairs import ATOL, MODELS, RTOL, optimizer, unavailable
from trainops import Trainer
from trainops.train import buffers

WEBGPU = "WebGpuExecutionProvider"


@pytest.fixture(scope="module")
def device():
    try:
        import onnxruntime as ort
        import onnxruntime_ep_webgpu as plugin
    except ImportError as exc:
        unavailable("webgpu", f"onnxruntime-ep-webgpu not installed ({exc})")
    if not [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]:
        ort.register_execution_provider_library(plugin.get_ep_name(), plugin.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]
    if not devices:
        unavailable("webgpu", "the WebGPU plugin lists no device (scripts/webgpu_env)")
    return devices[0]


def data_bytes(batch: dict, lr_dtype) -> int:
    """What a step hands the device: the batch, ``lr`` and ``T`` (int64)."""
    return sum(np.asarray(v).nbytes for v in batch.values()) + np.dtype(lr_dtype).itemsize + 8


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_states_stay_on_the_device(device, name):
    model, batches, params = MODELS[name]()
    cpu = Trainer(model, "loss", optimizer=optimizer(), params=params, seed=5, portable=True)
    cpu_losses = [cpu.step(b) for b in batches]
    tr = Trainer(model, "loss", optimizer=optimizer(), params=params, seed=5, providers=[device])
    assert tr.runtime.memory is not None and tr.runtime.memory.memory_info is not None
    states = [e.input for e in tr.step_graph.states]
    for k in states:
        assert tr.runtime.values[k].device_name().lower() == "webgpu", k
    losses = []
    for i, b in enumerate(batches):
        losses.append(tr.step(b))
        step = tr.transfers.last_step
        assert step["state_bytes"] == 0, (i, step)
        assert step["to_device_bytes"] == data_bytes(b, tr.step_graph.lr_dtype), (i, step)
        assert step["to_host_bytes"] == 4, (i, step)  # the float32 loss
        assert step["data_bytes"] == step["to_device_bytes"] + 4, (i, step)
    np.testing.assert_allclose(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    # reading the states copies them back, counted as state bytes outside the steps
    before = tr.transfers.total["to_host_bytes"]
    got, want = tr.parameters(), cpu.parameters()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL, err_msg=k)
    assert tr.transfers.total["to_host_bytes"] - before == sum(v.nbytes for v in got.values())


def test_host_states_cross_every_step(device, monkeypatch):
    """Without the device memory (the EP not in buffers.RESIDENT_EPS) every state crosses
    twice a step: what the resident states save."""
    monkeypatch.setattr(buffers, "RESIDENT_EPS", frozenset())
    model, batches, params = MODELS["mlp"]()
    tr = Trainer(model, "loss", optimizer=optimizer(), params=params, seed=5, providers=[device])
    assert tr.runtime.memory is None
    tr.step(batches[0])
    states = sum(tr.runtime.arrays.nbytes(e.input) for e in tr.step_graph.states)
    assert tr.transfers.last_step["state_bytes"] == 2 * states > 0


def test_save_and_export_read_the_device_states(device, tmp_path):
    model, batches, params = MODELS["mlp"]()
    tr = Trainer(model, "loss", optimizer=optimizer(), params=params, seed=5, providers=[device])
    for b in batches[:3]:
        tr.step(b)
    params_now, opt_now = tr.parameters(), tr.optimizer_state()
    path = tmp_path / "ckpt"
    tr.save(path)
    back = Trainer.load(path)
    for k, v in params_now.items():
        np.testing.assert_array_equal(back.parameters()[k], v, err_msg=k)
    for k, v in opt_now.items():
        np.testing.assert_array_equal(back.optimizer_state()[k], v, err_msg=k)
    from onnx import numpy_helper

    exported = {i.name: numpy_helper.to_array(i) for i in tr.export().graph.initializer}
    for k, v in params_now.items():
        np.testing.assert_array_equal(exported[k], v, err_msg=k)
    # and the loaded state trains on as the device one does
    assert back.step(batches[3]) == pytest.approx(tr.step(batches[3]), rel=RTOL, abs=ATOL)
