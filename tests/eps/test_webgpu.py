"""The WebGPU lane: onnxruntime's WebGPU plugin EP (``onnxruntime-ep-webgpu``) trains the
demo CNN, an MLP and a transformer encoder like the CPU portable Trainer (tests/eps/ep_pairs.py
says within what), with no node pinned to the CPU, the step's nodes on the EP
(``trainer.assignment``), no float64 node (the EP has no float64: the rewrite's float32
form), no parameter or optimizer-state bytes crossing per step after the first
(``trainer.transfers``: the states live in the EP's device memory) nor any
parameter-sized copy inside the step (the profiler's memcpy nodes); and a WebGPU EP that
cannot run (not registered, no device, no adapter) raises instead of training on the CPU.

Runs where the plugin and a WebGPU adapter are there: ``scripts/test_eps`` sets them up
without a GPU (Mesa's lavapipe, ``scripts/webgpu_env``) and sets ``EPS_REQUIRE=webgpu``, so
that a missing EP fails there; anywhere else (the default pytest run) the module skips.
The plugin is registered with ``onnxruntime.register_execution_provider_library`` and given
to the Trainer as its ``OrtEpDevice``: the only form onnxruntime takes for a plugin EP.
"""

from __future__ import annotations

import pytest

from ep_pairs import MODELS, OPTIMIZERS, Run, unavailable

WEBGPU = "WebGpuExecutionProvider"


@pytest.fixture(scope="module")
def device():
    try:
        import onnxruntime as ort
        import onnxruntime_ep_webgpu as plugin
    except ImportError as exc:
        unavailable("webgpu", f"onnxruntime-ep-webgpu not installed ({exc})")
    if not hasattr(ort, "register_execution_provider_library"):
        unavailable("webgpu", f"onnxruntime {ort.__version__} has no plugin EPs")
    if not [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]:
        ort.register_execution_provider_library(plugin.get_ep_name(), plugin.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]
    if not devices:
        unavailable("webgpu", "the WebGPU plugin lists no device (no adapter: without a GPU "
                              "set ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 and a Vulkan driver "
                              "such as lavapipe; scripts/webgpu_env)")
    return devices[0]


_RUNS: dict = {}


def run(name: str, device) -> Run:
    """The model ``name`` trained on the CPU portable Trainer and on WebGPU, once per module."""
    if name not in _RUNS:
        model, batches, params = MODELS[name]()
        _RUNS[name] = Run(model, batches, params, providers=[device])
    return _RUNS[name]


NAMES = ("mlp", "cnn", "transformer")


@pytest.mark.parametrize("name", NAMES)
def test_trains_like_the_cpu(name, device):
    run(name, device).check_matches_cpu()


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_other_optimizers_train_like_the_cpu(opt, device):
    model, batches, params = MODELS["mlp"]()
    r = Run(model, batches, params, make_optimizer=OPTIMIZERS[opt], providers=[device])
    r.check_matches_cpu()
    assert r.dev.transfers.last_step["state_bytes"] == 0, r.dev.transfers.last_step


@pytest.mark.parametrize("name", NAMES)
def test_step_runs_on_the_ep(name, device):
    dev = run(name, device).trained()
    assert dev.session.get_providers()[0] == WEBGPU
    counts = dev.assignment
    assert counts.get(WEBGPU, 0) > 0, counts
    # the EP takes every op of these models; onnxruntime may keep shape arithmetic on the
    # CPU (int64 scalars), never more than a handful of nodes
    assert counts.get("CPUExecutionProvider", 0) <= counts[WEBGPU] // 10, counts


@pytest.mark.parametrize("name", NAMES)
def test_no_float64(name, device):
    import onnx

    dev = run(name, device).trained()
    model = dev.training_model()
    casts = [n.name for n in model.graph.node
             if n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.DOUBLE
                                            for a in n.attribute)]
    inferred = onnx.shape_inference.infer_shapes(model).graph
    doubles = [v.name for v in list(inferred.value_info) + list(inferred.initializer)
               if (v.data_type if hasattr(v, "data_type") else v.type.tensor_type.elem_type)
               == onnx.TensorProto.DOUBLE]
    assert not casts and not doubles, \
        f"float64 in the step graph: casts {casts[:5]}, values {doubles[:5]} ({len(doubles)})"


@pytest.mark.parametrize("name", NAMES)
def test_no_state_crosses_per_step(name, device):
    r = run(name, device)
    dev = r.trained()
    batch = MODELS[name]()[1][0]
    dev.step(batch)  # a step after the first ones
    step = dev.transfers.last_step
    assert step["state_bytes"] == 0, step
    # what crosses is the batch, lr and T in and the loss (and flags) out: far less than
    # the parameters
    weights = sum(v.nbytes for v in dev.parameters().values())
    assert step["to_device_bytes"] + step["to_host_bytes"] < weights, (step, weights)


@pytest.mark.parametrize("name", NAMES)
def test_only_data_sized_copies_per_step(name, device):
    """ONNX Runtime's own copies inside the step (memcpy nodes between the EP and the CPU,
    from its profiler; ``trainer.transfers`` counts only what the runtime binds): with the
    states resident, what may cross is the batch, the loss's small tensors and scalars,
    far less than the parameters' bytes; a parameter-shaped tensor crossing is a node the
    EP does not take, run on the CPU between two of its own."""
    from trainops.bench.train_ep import placement

    r = run(name, device)
    dev = r.trained()
    where = placement(dev, MODELS[name]()[1][0])
    weights = sum(v.nbytes for v in dev.parameters().values())
    assert where["memcpy_bytes"] < weights, (where, weights)


CANNOT_RUN = """
import sys
import onnxruntime as ort
import onnxruntime_ep_webgpu as plugin
from trainops import Trainer
from ep_pairs import MODELS, optimizer

if sys.argv[1] == "register":
    ort.register_execution_provider_library(plugin.get_ep_name(), plugin.get_library_path())
try:
    trainer = Trainer(MODELS["mlp"]()[0], "loss", optimizer=optimizer(),
                      providers=["WebGpuExecutionProvider"])
except RuntimeError as exc:
    print("RAISED", exc)
else:
    print("TRAINS ON", trainer.session.get_providers())
"""


@pytest.mark.parametrize("case", ["not registered", "no software adapter allowed",
                                  "no Vulkan driver"])
def test_a_webgpu_that_cannot_run_raises(case, device):
    """No silent CPU fallback: the EP not registered, registered but listing no device
    (lavapipe is a CPU adapter, refused without ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER), or
    listing one that finds no adapter (no Vulkan driver): the Trainer raises, naming the
    EP, where it would have trained on the CPU. A process each: a registration and
    the adapter are the process's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ)
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent.parent / "python"),
                                         env.get("PYTHONPATH", "")])
    if case == "no software adapter allowed":
        env.pop("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", None)
    if case == "no Vulkan driver":
        env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"] = str(here / "no-such-icd.json")
    out = subprocess.run([sys.executable, "-c", CANNOT_RUN,
                          "none" if case == "not registered" else "register"],
                         env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("RAISED", "TRAINS ON"))]
    assert lines and lines[0].startswith("RAISED"), (out.stdout, out.stderr[-2000:])
    assert WEBGPU in lines[0], lines[0]
