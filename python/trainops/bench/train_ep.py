"""``python -m trainops bench train --providers EP``: a training step on an execution
provider other than the CPU (docs/gpu.md): its time and what crosses between the host and
the EP's device per step.

``EP``: ``webgpu`` (onnxruntime's WebGPU plugin EP, ``onnxruntime-ep-webgpu``: its library
registered with ``onnxruntime.register_execution_provider_library`` and its ``OrtEpDevice``
given to the Trainer), ``openvino`` (the ``onnxruntime-openvino`` build's
``OpenVINOExecutionProvider`` on its CPU device, or the ``onnxruntime-ep-openvino`` plugin's
CPU device; float32), ``cpu``, or any provider name onnxruntime lists. ``scripts/webgpu_env`` sets up both EPs without a GPU (WebGPU over Mesa's
software Vulkan driver, lavapipe: its step times say nothing about a GPU's speed; the
transfers do).

Per model (the families of :mod:`.train_models`, optimizer AdamW; the batch's shape fixed
with ``free_dimensions``), from one Trainer on the EP:

- the step time: the median of ``--repeat`` x ``--steps`` steps after a warm-up;
- ``trainer.transfers.last_step``: the host->device and device->host copies the runtime
  makes per step (counts and bytes; ``state_bytes``: parameters and optimizer state
  among them);
- from ONNX Runtime's profiler over a second session of the same step graph and placement
  (:func:`placement`): the nodes run per step by execution provider, the memcpy nodes
  ONNX Runtime inserted between devices (``MemcpyFromHost`` / ``MemcpyToHost``) and their
  bytes, the float64 nodes and where they ran, and ``trainer.assignment`` where the
  Trainer has it.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import tempfile
import time

__all__ = ["providers_for", "placement", "run_providers"]

WEBGPU = "WebGpuExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
ALIASES = {"webgpu": WEBGPU, "openvino": OPENVINO, "cpu": "CPUExecutionProvider",
           "cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider"}
# The models a lavapipe run finishes in seconds (the defaults of --models are the CPU's).
EP_MODELS = "mlp,cnn,transformer"


def _plugin_devices(ort, ep: str, package: str, cpu_only: bool = False) -> list:
    """The ``OrtEpDevice`` of plugin EP ``ep``, its library (from the Python package
    ``package``) registered first where none is listed yet."""
    def listed():
        return [d for d in ort.get_ep_devices() if d.ep_name == ep and
                (not cpu_only or d.device.type == ort.OrtHardwareDeviceType.CPU)]

    if listed():
        return listed()[:1]
    try:
        plugin = __import__(package)
    except ImportError as exc:
        raise RuntimeError(f"bench train --providers: no {ep} device and no {package} package "
                           "to register (scripts/webgpu_env sets one up)") from exc
    ort.register_execution_provider_library(plugin.get_ep_name(), plugin.get_library_path())
    if not listed():
        raise RuntimeError(f"bench train --providers: {plugin.get_library_path()} registered but "
                           f"lists no {'CPU ' if cpu_only else ''}device" +
                           (" (no WebGPU adapter: without a GPU set "
                            "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 and a Vulkan driver, "
                            "scripts/webgpu_env)" if ep == WEBGPU else ""))
    return listed()[:1]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def providers_for(name: str) -> tuple[list, str]:
    """The Trainer's ``providers=`` for ``name`` (an alias of :data:`ALIASES` or an
    onnxruntime provider name) and a line of versions. ``openvino``: the onnxruntime-openvino
    build's EP where this onnxruntime has it, else the onnxruntime-ep-openvino plugin's CPU
    device; float32 either way (OpenVINO's CPU plugin otherwise infers in bfloat16 where the
    CPU has it)."""
    import onnxruntime as ort

    ep = ALIASES.get(name.lower(), name)
    version = f"onnxruntime {ort.__version__}"
    plugin = {WEBGPU: "onnxruntime_ep_webgpu", OPENVINO: "onnxruntime_ep_openvino"}.get(ep)
    # a plugin registered in this process is listed by name too (and trains so, its
    # states then host buffers): its OrtEpDevice first
    registered = any(d.ep_name == ep for d in ort.get_ep_devices()) if plugin else False
    if plugin and (registered or ep not in ort.get_available_providers()) and \
            (registered or _has_module(plugin) or ep == WEBGPU):
        devices = _plugin_devices(ort, ep, plugin, cpu_only=ep == OPENVINO)
        meta = dict(devices[0].ep_metadata)
        where = f"{version}, {ep} {meta.get('version', '?')} (plugin, OrtEpDevice)"
        if ep == OPENVINO:
            f32 = json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": "f32"}})
            return [(devices[0], {"load_config": f32})], where
        return devices, where
    if ep not in ort.get_available_providers():
        raise RuntimeError(f"bench train --providers {name}: {ep} is not in this onnxruntime "
                           f"({ort.__version__}: {', '.join(ort.get_available_providers())})")
    if ep == OPENVINO:
        return [(OPENVINO, {"device_type": "CPU", "precision": "FP32"}),
                "CPUExecutionProvider"], version
    return [ep] + (["CPUExecutionProvider"] if ep != "CPUExecutionProvider" else []), version


def _output_types(event) -> list[str]:
    return [k for o in event.get("args", {}).get("output_type_shape", []) for k in o]


def placement(trainer, feeds: dict, steps: int = 3, lr: float = 1e-3) -> dict:
    """Where the step of ``trainer`` runs, per step, from ONNX Runtime's profiler over a
    second session of its step graph with its placement and session options (the first step left out: a
    session's first run may place differently while it warms up):
    ``nodes`` {provider: nodes run}, ``memcpy`` (nodes copying between devices),
    ``memcpy_bytes`` (their output bytes), ``float64`` {provider: nodes with a float64
    output}, ``partitions`` (fused subgraph nodes: OpenVINO's compiled partitions), ``cpu_ops``
    {op type: nodes run on the CPU EP}."""
    from ..train.runtime import StepRuntime

    prefix = os.path.join(tempfile.mkdtemp(prefix="trainops-bench-ep-"), "step")

    # the Trainer's own session options (session_config, free_dimensions) first
    eps = getattr(trainer, "_eps", None)
    trainers = eps.configure(trainer.step_graph.model) if eps is not None else None

    def configure(so):
        if trainers is not None:
            trainers(so)
        so.enable_profiling = True
        so.profile_file_prefix = prefix

    rt = StepRuntime(trainer.step_graph, None, placement=trainer.placement, configure=configure)
    for t in range(1, steps + 2):
        rt.run(feeds, lr, t)
    path = rt.session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    runs = [e for e in events if e.get("name") == "model_run"]
    after = runs[0]["ts"] + runs[0]["dur"]
    nodes: collections.Counter = collections.Counter()
    cpu_ops: collections.Counter = collections.Counter()
    f64: collections.Counter = collections.Counter()
    memcpy = memcpy_bytes = partitions = 0
    for e in events:
        if e.get("cat") != "Node" or e["ts"] <= after or not e["name"].endswith("_kernel_time"):
            continue
        args = e.get("args", {})
        provider, op = args.get("provider", "?"), args.get("op_name", "?")
        nodes[provider] += 1
        if provider == "CPUExecutionProvider":
            cpu_ops[op] += 1
        if op.startswith("Memcpy"):
            memcpy += 1
            memcpy_bytes += int(args.get("output_size", 0))
        if "double" in _output_types(e):
            f64[provider] += 1
        if "subgraph" in e["name"].lower() or op.startswith(("OpenVINO", "TRT", "QNN")):
            partitions += 1
    n = len(runs) - 1
    return {"nodes": {k: v // n for k, v in nodes.most_common()}, "memcpy": memcpy // n,
            "memcpy_bytes": memcpy_bytes // n, "float64": {k: v // n for k, v in f64.items()},
            "partitions": partitions // n,
            "cpu_ops": {k: v // n for k, v in cpu_ops.most_common()}}


def fixed_dimensions(model, feeds: dict) -> dict[str, int]:
    """Each symbolic dimension of ``model``'s inputs at its size in ``feeds``: the bench
    feeds one batch shape, and an EP that compiles (OpenVINO) may refuse a graph whose
    shapes are symbolic (its CPU plugin: a weight-gradient Conv's "dynamic weights shape")."""
    dims = {}
    for vi in model.graph.input:
        if vi.name not in feeds:
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.dim_param:
                dims[d.dim_param] = int(feeds[vi.name].shape[axis])
    return dims


def _median_step(trainer, feeds, repeat: int, steps: int) -> float:
    for _ in range(3):
        trainer.step(feeds)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step(feeds)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def _kb(n: int) -> str:
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB"


def run_providers(args) -> int:
    """The ``--providers`` form of ``bench train``: one block of lines per model."""
    from .. import optim
    from ..train import Trainer
    from .train_models import family

    providers, versions = providers_for(args.providers)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {versions}; one training "
          f"step (forward, loss, backward, AdamW), median of {args.repeat} x {args.steps} steps")
    rows, failed = [], []
    for model in args.models.split(","):
        fam = family(model, args.batch)
        try:
            trainer = Trainer(fam.model, "loss", optim.AdamW(lr=args.lr), params=fam.params,
                              providers=providers, portable=True,
                              free_dimensions=fixed_dimensions(fam.model, fam.feeds))
            sec = _median_step(trainer, fam.feeds, args.repeat, args.steps)
        except Exception as exc:  # noqa: BLE001 - a model the EP cannot train is a result
            why = (str(exc).strip().splitlines() or [""])[-1][:300]
            print(f"\n{model}: FAILED ({type(exc).__name__}: {why})")
            failed.append(model)
            rows.append({"model": model, "failed": f"{type(exc).__name__}: {why}"})
            continue
        tr = trainer.transfers.last_step if trainer.transfers is not None else {}
        where = placement(trainer, fam.feeds)
        assignment = getattr(trainer, "assignment", None)
        row = {"model": model, "batch": len(fam.feeds["t"]), "ms": sec * 1e3, "transfers": tr,
               "placement": where, "assignment": assignment}
        rows.append(row)
        print(f"\n{model} (batch {row['batch']}): {sec * 1e3:.3f} ms per step")
        if tr:
            print(f"  transfers per step (trainer.transfers): host->device {tr['to_device']} "
                  f"({_kb(tr['to_device_bytes'])}), device->host {tr['to_host']} "
                  f"({_kb(tr['to_host_bytes'])}); parameters and state {_kb(tr['state_bytes'])}")
        print(f"  profiler, per step: nodes {where['nodes']}; memcpy nodes {where['memcpy']} "
              f"({_kb(where['memcpy_bytes'])}); float64 nodes {where['float64'] or 0}"
              + (f"; fused partitions {where['partitions']}" if where["partitions"] else ""))
        if where["cpu_ops"] and len(where["nodes"]) > 1:
            top = list(where["cpu_ops"].items())[:6]
            print("  on the CPU: " + ", ".join(f"{op} {k}" for op, k in top))
        if assignment is not None:
            print(f"  trainer.assignment: {assignment}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "rows": rows}, f, indent=2, default=str)
    return 1 if failed else 0
