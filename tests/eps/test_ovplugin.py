"""The OpenVINO plugin lane: the ``onnxruntime-ep-openvino`` plugin EP (a newer OpenVINO than
the onnxruntime-openvino build's) on onnxruntime 1.32.0, its CPU device given as
``(OrtEpDevice, {options})``, trains the MLP, the demo CNN and the transformer encoder like
the CPU portable Trainer (tests/eps/ep_pairs.py says within what), every node of the step
on the EP.

The options matter: on a CPU with AMX or AVX-512 bfloat16, OpenVINO's CPU plugin infers in
bfloat16 unless told otherwise (the weights then end 0.1 off), so the lane passes
``load_config={"CPU": {"INFERENCE_PRECISION_HINT": "f32"}}``; the batch dimension is fixed
with ``free_dimensions`` (a weight-gradient Conv with a symbolic batch is refused).

Runs where the plugin is installed and lists a CPU device: ``scripts/test_eps ovplugin``
(``EPS_REQUIRE=ovplugin``: a missing EP fails there); anywhere else it skips. The plugin
offers Intel devices only, so on an AMD CPU even the lane skips (saying so).
"""

from __future__ import annotations

import json

import pytest

from ep_pairs import MODELS, Run, unavailable

OPENVINO = "OpenVINOExecutionProvider"
INTEL = 0x8086  # PCI vendor id, as onnxruntime reports a hardware device's
F32 = {"load_config": json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": "f32"}})}


@pytest.fixture(scope="module")
def device():
    try:
        import onnxruntime as ort
        import onnxruntime_ep_openvino as plugin
    except ImportError as exc:
        unavailable("ovplugin", f"onnxruntime-ep-openvino not installed ({exc})")
    if not hasattr(ort, "register_execution_provider_library"):
        unavailable("ovplugin", f"onnxruntime {ort.__version__} has no plugin EPs")

    def cpus():
        return [d for d in ort.get_ep_devices() if d.ep_name == OPENVINO
                and d.device.type == ort.OrtHardwareDeviceType.CPU]

    if not cpus():
        ort.register_execution_provider_library(plugin.get_ep_name(), plugin.get_library_path())
    if not cpus():
        # The plugin's factory offers Intel devices only (its GetSupportedDevices skips every
        # hardware device whose vendor id is not Intel's): on an AMD CPU there is nothing to
        # test, by the plugin's design, so even the lane skips; on an Intel CPU it fails.
        vendors = {(d.device.vendor, d.device.vendor_id) for d in ort.get_ep_devices()
                   if d.device.type == ort.OrtHardwareDeviceType.CPU}
        if vendors and all(vid != INTEL for _, vid in vendors):
            pytest.skip("the OpenVINO plugin offers Intel devices only; this CPU is "
                        + ", ".join(f"{name} ({vid:#06x})" for name, vid in sorted(vendors)))
        unavailable("ovplugin", "the OpenVINO plugin lists no CPU device")
    return cpus()[0]


_RUNS: dict = {}


def run(name: str, device) -> Run:
    if name not in _RUNS:
        model, batches, params = MODELS[name]()
        batch = len(batches[0]["t"])
        _RUNS[name] = Run(model, batches, params, providers=[(device, F32)],
                          free_dimensions={"N": batch})
    return _RUNS[name]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_trains_like_the_cpu(name, device):
    run(name, device).check_matches_cpu()


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_every_node_on_the_ep(name, device):
    dev = run(name, device).trained()
    assert dev.assignment == {OPENVINO: dev.assignment.get(OPENVINO, 0)}, dev.assignment
    assert dev.assignment[OPENVINO] > 0
