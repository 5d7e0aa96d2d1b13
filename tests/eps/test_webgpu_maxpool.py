"""MaxPool's standard-op gradient on the WebGPU plugin EP: every node of the forward
MaxPool and of the rule's backward (Gather, Equal, And, MatMul, Where, Pad, Add, Reshape)
on the EP, for the window shapes of tests/test_grad_maxpool_portable.py (overlapping,
padded, dilated, ceil_mode, auto_pad, 1-3D), and the same bits as the CPU EP's run of the
same graph: the gradient is a selection and sums in a fixed order, so no EP may round it
otherwise. The data follow a Relu (ties in many windows). Skipped where the plugin or an
adapter is missing; a failure under ``EPS_REQUIRE=webgpu`` (scripts/webgpu_env)."""

from __future__ import annotations

import numpy as np
import pytest

from ep_pairs import unavailable

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


def cases():
    from test_grad_maxpool_portable import CASES

    return [(s, a) for s, a in CASES if 0 not in s]  # (an empty batch: nothing to run)


@pytest.mark.parametrize("shape,attrs", cases())
def test_same_bits_as_the_cpu_every_node_on_the_ep(device, shape, attrs):
    import onnxruntime as ort
    from helpers.gradcheck import session
    from test_grad_maxpool_portable import pool_model, rule_model

    rng = np.random.default_rng(3)
    x = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    y = session(pool_model(shape, attrs)).run(["Y"], {"X": x})[0]
    gy = rng.standard_normal(y.shape).astype(np.float32)
    model = rule_model(shape, attrs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    so.add_provider_for_devices([device], {})
    sess = ort.InferenceSession(model.SerializeToString(), so)
    on_cpu = [n.op_type for sub in sess.get_provider_graph_assignment_info()
              if sub.ep_name != WEBGPU for n in sub.get_nodes()]
    assert not on_cpu, on_cpu
    got = sess.run(None, {"X": x, "dY": gy})[0]
    want = session(model).run(None, {"X": x, "dY": gy})[0]
    assert got.tobytes() == want.tobytes()
