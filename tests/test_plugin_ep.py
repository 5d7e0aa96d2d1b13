"""The plugin execution provider ``TrainopsExecutionProvider`` in fake-device mode
(``TRAINOPS_FAKE_DEVICE=1``: host memory labelled as an NVIDIA GPU, the CPU kernels behind the
device registration), and ``trainops.configure``'s choice of door.

On ONNX Runtime 1.24 and newer: device listing, claim and decline, CPU-input scalars, copies,
IOBinding residency (allocation and copy counters flat over many steps), results bitwise equal
to the CPU door. On 1.17-1.23: the library offers no device and ``configure`` falls back to
``register_custom_ops_library``.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Read by the library when the EP library is first registered in this process.
os.environ["TRAINOPS_FAKE_DEVICE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

ort = pytest.importorskip("onnxruntime")
from trainops import device as td  # noqa: E402

NEW = td.plugin_ep_supported()
needs_ep = pytest.mark.skipif(not NEW, reason=f"onnxruntime {ort.__version__} has no plugin EPs (1.24+)")
TRAINING = "ai.onnx.preview.training"


def adam_model(n: int, dtype=TensorProto.FLOAT, prefix: str = "", inputs_only: bool = False):
    names = [f"{prefix}{s}" for s in ("X", "G", "V", "H")]
    outs = [f"{prefix}{s}_new" for s in ("X", "V", "H")]
    node = helper.make_node("Adam", ["R", "T", *names], outs, domain=TRAINING, alpha=0.9, beta=0.999, epsilon=1e-6)
    vis = [helper.make_tensor_value_info(x, dtype, [n]) for x in names]
    return node, vis, [helper.make_tensor_value_info(x, dtype, [n]) for x in outs]


def model(*parts):
    nodes, ins, outs = [], [], []
    for node, i, o in parts:
        nodes.append(node)
        ins += i
        outs += o
    scalars = [
        helper.make_tensor_value_info("R", TensorProto.FLOAT, []),
        helper.make_tensor_value_info("T", TensorProto.INT64, []),
    ]
    graph = helper.make_graph(nodes, "g", scalars + ins, outs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    m.ir_version = 8
    return m.SerializeToString()


def session(model_bytes, library_path, device):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    where = td.configure(so, device=device, library=library_path)
    return ort.InferenceSession(model_bytes, so), where


def feeds(n, rng, dtype=np.float32, prefix=""):
    return {
        f"{prefix}X": rng.standard_normal(n).astype(dtype),
        f"{prefix}G": rng.standard_normal(n).astype(dtype),
        f"{prefix}V": rng.standard_normal(n).astype(dtype),
        f"{prefix}H": rng.random(n).astype(dtype),
    }


@needs_ep
def test_one_fake_nvidia_device_is_listed(library_path):
    devs = td.devices(library_path)
    assert len(devs) == 1
    d = devs[0]
    assert d.ep_name == "TrainopsExecutionProvider" and d.ep_vendor == "trainops"
    assert d.device.type == ort.OrtHardwareDeviceType.GPU
    assert d.device.vendor_id == 0x10DE


def test_configure_cpu_is_the_custom_op_door(library_path):
    m = model(adam_model(8))
    sess, where = session(m, library_path, "cpu")
    assert where == "cpu" and sess.get_providers() == ["CPUExecutionProvider"]


@pytest.mark.skipif(NEW, reason="fallback of runtimes without plugin EPs")
def test_old_runtime_falls_back_to_register_custom_ops_library(library_path):
    assert td.devices(library_path) == []
    m = model(adam_model(8))
    sess, where = session(m, library_path, "auto")
    assert where == "cpu"
    rng = np.random.default_rng(0)
    out = sess.run(None, {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64), **feeds(8, rng)})
    assert out[0].shape == (8,)
    with pytest.raises(RuntimeError, match="1.24"):
        td.configure(ort.SessionOptions(), device="cuda", library=library_path)


@needs_ep
def test_claims_float_nodes_declines_double_and_matches_the_cpu_door(library_path):
    n = 257
    m = model(adam_model(n, TensorProto.FLOAT, "f_"), adam_model(n, TensorProto.DOUBLE, "d_"))
    before = td.counters(library_path)
    sess, where = session(m, library_path, "auto")
    assert where == "TrainopsExecutionProvider"
    after = td.counters(library_path)
    assert after["claimed"] - before["claimed"] >= 1
    assert after["declined"] - before["declined"] >= 1
    cpu, _ = session(m, library_path, "cpu")
    rng = np.random.default_rng(1)
    f = {"R": np.array(0.01, np.float32), "T": np.array(3, np.int64), **feeds(n, rng, np.float32, "f_"), **feeds(n, rng, np.float64, "d_")}
    runs = td.counters(library_path)["device_runs"]
    got = sess.run(None, f)
    assert td.counters(library_path)["device_runs"] == runs + 1  # the float node only
    want = cpu.run(None, f)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


@needs_ep
def test_copies_to_and_from_the_device(library_path):
    td.devices(library_path)
    a = np.arange(1000, dtype=np.float32)
    before = td.counters(library_path)
    v = td.to_device(a)
    assert v.device_name().lower() != "cpu"
    back = td.to_host(v)
    after = td.counters(library_path)
    np.testing.assert_array_equal(back, a)
    assert after["copies_to_device"] - before["copies_to_device"] == 1
    assert after["copies_to_host"] - before["copies_to_host"] == 1
    assert after["allocs"] - before["allocs"] >= 1


@needs_ep
def test_iobinding_keeps_parameters_resident_counters_flat(library_path):
    n, steps = 4096, 40
    m = model(adam_model(n))
    sess, where = session(m, library_path, "cuda")
    assert where == "TrainopsExecutionProvider"
    rng = np.random.default_rng(2)
    host = feeds(n, rng)
    state = {k: td.to_device(v) for k, v in host.items()}
    binding = sess.io_binding()
    for k in ("X", "G", "V", "H"):
        binding.bind_ortvalue_input(k, state[k])
    for k in ("X", "V", "H"):
        binding.bind_ortvalue_output(f"{k}_new", state[k])  # updated in place, on the device

    def step(t):
        # R and T are CPU inputs of the device kernel: fed from numpy, never copied.
        binding.bind_cpu_input("R", np.array(0.01, np.float32))
        binding.bind_cpu_input("T", np.array(t, np.int64))
        sess.run_with_iobinding(binding)

    step(1)
    step(2)
    before = td.counters(library_path)
    for t in range(3, steps + 1):
        step(t)
    after = td.counters(library_path)
    for k in ("allocs", "frees", "copies_to_device", "copies_to_host", "copies_on_device"):
        assert after[k] == before[k], (k, before, after)
    assert after["device_runs"] - before["device_runs"] == steps - 2

    # The same steps through the CPU door, in numpy buffers updated in place.
    cpu, _ = session(m, library_path, "cpu")
    x, v, h = (host[k].copy() for k in ("X", "V", "H"))
    for t in range(1, steps + 1):
        x, v, h = cpu.run(None, {"R": np.array(0.01, np.float32), "T": np.array(t, np.int64), "X": x, "G": host["G"], "V": v, "H": h})
    np.testing.assert_array_equal(td.to_host(state["X"]), x)
    np.testing.assert_array_equal(td.to_host(state["V"]), v)
    np.testing.assert_array_equal(td.to_host(state["H"]), h)


@needs_ep
def test_both_doors_on_one_options_object_is_never_done(library_path):
    so = ort.SessionOptions()
    assert td.configure(so, device="auto", library=library_path) == "TrainopsExecutionProvider"
    # configure chose the EP, which supplies the domains itself: a model loads with no
    # register_custom_ops_library on these options.
    ort.InferenceSession(model(adam_model(4)), so)


def _has_cuda_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.parametrize("cuda", ["", "1"])
def test_cpu_only_process_never_loads_libcuda(library_path, cuda):
    """Without TRAINOPS_CUDA nothing opens the driver; with it, a machine without a driver
    gets no device and the custom-op door, as if nothing had been asked."""
    if cuda and _has_cuda_driver():
        pytest.skip("this machine has a CUDA driver")
    code = f"""
import os, numpy as np, onnxruntime as ort
os.environ.pop("TRAINOPS_FAKE_DEVICE", None)
import sys; sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..', 'python')!r})
from trainops import device as td
so = ort.SessionOptions()
where = td.configure(so, device="auto", library={library_path!r})
maps = open("/proc/self/maps").read()
print(where, "libcuda" in maps)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINOPS_FAKE_DEVICE", "TRAINOPS_CUDA")}
    if cuda:
        env["TRAINOPS_CUDA"] = cuda
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    where, loaded = out.stdout.split()
    assert where == "cpu"  # no device without a GPU (or without TRAINOPS_CUDA)
    assert loaded == "False", "libcuda.so was loaded by a CPU-only process"


def test_cuda_registration_leaves_cpu_sessions_alone(library_path):
    """With TRAINOPS_CUDA=1 the custom-op library also registers the CUDA kernels for
    CUDAExecutionProvider (door 3); a CPU session still runs the CPU kernels, and registering
    the plugin EP then probes the driver only if the process asked for CUDA."""
    code = f"""
import numpy as np, onnxruntime as ort, base64, sys
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), 'runtime_range')!r})
from old_runtime_check import check_supported
problems = check_supported({library_path!r})
print("ok" if not problems else problems)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRAINOPS_FAKE_DEVICE"}
    env["TRAINOPS_CUDA"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout + out.stderr


@needs_ep
@pytest.mark.parametrize("overflow", [False, True])
def test_mixed_precision_step_on_the_ep_matches_the_cpu_door(library_path, overflow):
    """The mixed_float16 optimizer graph (AllFinite, DynamicLossScale, MixedPrecisionAdam,
    with float16 gradients and float32 master weights) through the EP, claimed nodes and all,
    against the same graph through the custom-op door."""
    from trainops.mixed_precision import optimizer_model, optimizer_state

    shapes = {"w": (33,), "b": (5,)}
    m = optimizer_model(shapes, "mixed_float16", lr=0.01)
    m.ir_version = 8
    rng = np.random.default_rng(5)
    state = optimizer_state({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, "mixed_float16", lr=0.01)
    inputs = {i.name for i in m.graph.input}
    feeds = {k: v for k, v in state.items() if k in inputs}
    for name in inputs - set(feeds):
        shape = shapes[name.split(".")[0]] if name.split(".")[0] in shapes else ()
        g = rng.standard_normal(shape).astype(np.float16)
        if overflow and name.startswith("w"):
            g[3] = np.inf
        feeds[name] = g
    before = td.counters(library_path)
    ep, where = session(m.SerializeToString(), library_path, "auto")
    assert where == "TrainopsExecutionProvider"
    assert td.counters(library_path)["claimed"] > before["claimed"]
    cpu, _ = session(m.SerializeToString(), library_path, "cpu")
    for got, want in zip(ep.run(None, feeds), cpu.run(None, feeds)):
        np.testing.assert_array_equal(got, want)


@needs_ep
def test_philox_on_the_ep_shape_stays_a_host_input(library_path):
    from trainops.models import philox_model

    m = philox_model(None).SerializeToString()
    ep, where = session(m, library_path, "auto")
    assert where == "TrainopsExecutionProvider"
    cpu, _ = session(m, library_path, "cpu")
    f = {"state": np.array([1, 2, 3, 4, 5, 6], np.uint32), "shape": np.array([3, 7], np.int64)}
    for got, want in zip(ep.run(None, f), cpu.run(None, f)):
        np.testing.assert_array_equal(got, want)
