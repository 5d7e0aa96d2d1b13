"""Where a training step runs: :func:`resolve` turns a Trainer's ``providers=``,
``portable=`` and ``device=`` into a :class:`Placement` (the execution providers, how
trainops' ops get into the session, whether the step graph is rewritten to standard ops),
and :meth:`Placement.session` makes the session of a model with it.

The doors (docs/gpu.md):

- CPU (default): ``register_custom_ops_library``, the CPU kernels.
- ``device="cuda"`` (or ``CUDAExecutionProvider`` among ``providers``; onnxruntime-gpu):
  the same library with ``TRAINOPS_CUDA=1``, which also registers trainops' CUDA kernels
  for ``CUDAExecutionProvider`` (R, T and other scalars as CPU inputs).
- a list of ``OrtEpDevice`` (``onnxruntime.get_ep_devices()``, 1.23+):
  ``SessionOptions.add_provider_for_devices``; ``TrainopsExecutionProvider``'s devices
  bring trainops' domains themselves, any other EP's devices get the custom-op library too.
- ``portable=True``: the step graph's optimizer, mixed-precision and dropout nodes become
  standard ONNX ops (:func:`trainops.portable.rewrite`), for EPs that take no custom-op
  library (:data:`NO_CUSTOM_OPS`); ``portable=None`` picks it for those EPs.

``device="auto"`` is the CPU for now: CUDA becomes auto's choice once trainops' CUDA
kernels are verified on a GPU (``scripts/gpu_check``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["NO_CUSTOM_OPS", "Placement", "TrainingModel", "check_portable", "check_running",
           "portable_graph", "provider_options", "resolve"]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TRAINOPS_EP = "TrainopsExecutionProvider"

# Execution providers that cannot run a custom-op library's kernels (their nodes would fall
# back to the CPU, a copy each way per node): portable=None rewrites the step for them.
NO_CUSTOM_OPS = frozenset({
    "DmlExecutionProvider",
    "WebGpuExecutionProvider",
    "CoreMLExecutionProvider",
    "OpenVINOExecutionProvider",
    "QNNExecutionProvider",
    "WebNNExecutionProvider",
    "JsExecutionProvider",
    "NnapiExecutionProvider",
    "MIGraphXExecutionProvider",
    "VitisAIExecutionProvider",
})

DEVICES = ("cpu", "cuda", "auto")

# The random ops of a model (RandomUniform/RandomNormal made reproducible) that the portable
# rewrite keeps as they are (trainops.portable.rewrite): they run on the CPU beside the EP.
KEPT_RANDOM_OPS = frozenset({"Philox", "PhiloxUniform", "PhiloxNormal"})


def _is_ep_device(p) -> bool:
    return hasattr(p, "ep_name") and hasattr(p, "device")


def _is_pair(p) -> bool:
    return isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], Mapping)


def _provider_name(p) -> str:
    if isinstance(p, str):
        return p
    if _is_pair(p) and isinstance(p[0], str):
        return p[0]
    raise TypeError("providers: expected provider names, (name, options) pairs or OrtEpDevice "
                    f"objects, got {p!r}")


def provider_options(options, where: str) -> dict[str, str]:
    """An EP's options as onnxruntime takes them: str keys; values str, or int / float /
    bool (their text, as onnxruntime's own providers list converts them), or a dict (its
    JSON text: OpenVINO's ``load_config``). TypeError naming ``where`` otherwise."""
    out = {}
    for k, v in options.items():
        if not isinstance(k, str):
            raise TypeError(f"providers: {where}: option names must be str, got {k!r}")
        if isinstance(v, Mapping):
            v = json.dumps(v)
        elif isinstance(v, (bool, int, float)):
            v = str(v)
        elif not isinstance(v, str):
            raise TypeError(f"providers: {where}: option {k!r} must be a str, number, bool "
                            f"or dict, got {type(v).__name__} {v!r}")
        out[k] = v
    return out


def _cpu_after(names: Sequence[str]) -> bool:
    """Whether the CPU EP is listed after another EP (the caller allows leftovers)."""
    return CPU in names and any(n != CPU for n in names[:names.index(CPU)])


@dataclass(frozen=True)
class Placement:
    """How a step's session is made.

    - ``providers``: the ``providers=`` argument of ``InferenceSession`` (names or
      ``(name, options)`` pairs), or None with ``ep_devices``;
    - ``ep_devices`` / ``ep_options``: ``OrtEpDevice`` objects for
      ``SessionOptions.add_provider_for_devices``, and each EP's options (EP name -> dict);
    - ``names``: the execution providers asked for, in order;
    - ``portable``: the step graph is rewritten to standard ops;
    - ``cuda_kernels``: trainops' CUDA kernels are requested (``TRAINOPS_CUDA=1``);
    - ``cpu_after``: the caller listed the CPU EP after another one: nodes (even all) an EP
      leaves run on the CPU (:mod:`.assignment`).
    """

    providers: list | None = None
    ep_devices: list | None = None
    ep_options: dict = field(default_factory=dict)
    names: tuple[str, ...] = (CPU,)
    portable: bool = False
    cuda_kernels: bool = False
    cpu_after: bool = False

    @property
    def is_cpu(self) -> bool:
        """True for the default: the CPU execution provider alone, without options (given
        options, the session is made with them as any other EP's), trainops' CPU kernels."""
        return self.names == (CPU,) and not self.portable and self.ep_devices is None \
            and all(isinstance(p, str) for p in self.providers or ())

    @property
    def fuses_grads(self) -> bool:
        """True when the backward may use trainops' CPU gradient kernels (``com.trainops``
        ``*Grad``): every execution provider asked for is the CPU's, named or as its
        ``OrtEpDevice``, and the graph is not rewritten to standard ops. The kernels are
        CPU kernels: on any other EP they would run on the CPU with copies each way, and
        the portable graph takes no custom op."""
        return self.host_only and not self.portable

    @property
    def host_only(self) -> bool:
        """True when every execution provider asked for is the CPU's (the portable graph on
        the CPU, the CPU EP's own ``OrtEpDevice``): nothing crosses to a device."""
        return all(n == CPU for n in self.names)

    @property
    def ep_supplies_domains(self) -> bool:
        """True when the plugin EP ``TrainopsExecutionProvider`` brings trainops' domains (the
        custom-op library must then not be registered too: ONNX Runtime rejects a domain
        set twice)."""
        return TRAINOPS_EP in self.names and self.ep_devices is not None

    def configure(self, so, library: str | None, needs_library: bool) -> None:
        """Registers what this placement needs on ``so``: the EP devices, and the custom-op
        library when the model has nodes of trainops' domains left (``needs_library``) and
        the EP does not bring them."""
        from .. import get_library_path

        if self.cuda_kernels and os.environ.get("TRAINOPS_CUDA") != "1":
            # Read by the library when it first registers its domains in this process.
            os.environ["TRAINOPS_CUDA"] = "1"
        if self.ep_devices is not None:
            for name in self.names:  # one call per EP: onnxruntime takes one EP's devices
                so.add_provider_for_devices([d for d in self.ep_devices if d.ep_name == name],
                                            dict(self.ep_options.get(name, {})))
        if needs_library and not self.ep_supplies_domains:
            so.register_custom_ops_library(library or get_library_path())

    def state_memory(self):
        """Where the states of a step on this placement live
        (:class:`~trainops.train.buffers.Memory`), or None for host buffers: the CUDA EP's
        memory on its ``device_id`` (the provider option, default 0) when
        ``CUDAExecutionProvider`` runs the step; the memory of the ``TrainopsExecutionProvider``
        GPU device given (``ep_device.memory_info``: its device id and vendor; ONNX Runtime
        allocates with the EP's allocator), and the WebGPU plugin EP's buffers
        (:func:`~.buffers.ep_device_memory`); None on the CPU and for other execution
        providers and devices (their states stay host buffers, re-bound every step: their
        device memory is not verified here)."""
        from .buffers import Memory

        if self.is_cpu:
            return None
        if self.ep_devices is not None:
            from .buffers import ep_device_memory

            # the first device with verified device memory (buffers.RESIDENT_EPS)
            return next((m for m in map(ep_device_memory, self.ep_devices) if m), None)
        for p in self.providers or ():
            if _provider_name(p) == CUDA:
                opts = p[1] if isinstance(p, (tuple, list)) else {}
                return Memory("cuda", int(opts.get("device_id", 0)))
            if _provider_name(p) != CPU:
                return None  # the first EP is another's: its memory is unknown here
        return None

    def session(self, model_bytes: bytes, so):
        """An ``InferenceSession`` of ``model_bytes`` with ``so`` (already configured)."""
        import onnxruntime as ort

        if self.ep_devices is not None:
            session = ort.InferenceSession(model_bytes, so)
        else:
            session = ort.InferenceSession(model_bytes, so, providers=self.providers)
        try:
            check_running(self, session)  # before any state is put in an EP's memory
        except RuntimeError:
            if so.enable_profiling:  # dropped: it would write its profile when destroyed
                try:
                    os.remove(session.end_profiling())
                except OSError:
                    pass
            raise
        return session


def check_running(placement: Placement, session) -> None:
    """RuntimeError naming each execution provider ``placement`` asks for that is not among
    ``session.get_providers()``, and why (no silent fallback to the CPU)."""
    running = list(session.get_providers())
    for name in placement.names:
        if name != CPU and name not in running:
            raise RuntimeError(f"Trainer: {name} was asked for but does not run the step "
                               f"(the session's providers: {running}): "
                               f"{_why_absent(name, placement.ep_devices is not None)}")


def _why_absent(name: str, by_device: bool) -> str:
    import onnxruntime as ort

    if by_device:
        return ("given as its OrtEpDevice, but onnxruntime did not add it to the session "
                "(its device could not be used)")
    available = list(ort.get_available_providers())
    plugin = hasattr(ort, "get_ep_devices") and \
        any(d.ep_name == name for d in ort.get_ep_devices())
    if plugin:
        return ("it is a plugin EP: register it (onnxruntime.register_execution_provider_library) "
                "and pass its OrtEpDevice (onnxruntime.get_ep_devices()), not its name")
    if name not in available:
        hint = ("; a plugin EP must be registered with onnxruntime.register_execution_provider_"
                "library and passed as its OrtEpDevice (a plugin listing no device has no "
                "usable device)") if hasattr(ort, "register_execution_provider_library") else ""
        return f"not installed: onnxruntime {ort.__version__} offers {available}{hint}"
    return ("installed, but it did not start in the session: no usable device (onnxruntime "
            "fell back to the CPU; its log says why)")


def _available() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def resolve(providers: Sequence[Any] | None = None, portable: bool | None = None,
            device: str | None = None) -> Placement:
    """The :class:`Placement` of a Trainer's arguments (see :class:`trainops.Trainer`).

    ``device`` and ``providers`` are exclusive (``ValueError``). ``device="cuda"`` needs
    ``CUDAExecutionProvider`` in this onnxruntime (onnxruntime-gpu), else ``RuntimeError``
    naming what it offers. ``portable=None``: True when an EP in :data:`NO_CUSTOM_OPS` is
    asked for."""
    if device is not None and providers is not None:
        raise ValueError("Trainer: give device= or providers=, not both "
                         f"(device={device!r}, providers={providers!r})")
    if portable is not None and not isinstance(portable, bool):
        raise TypeError(f"Trainer: portable must be True, False or None, got {portable!r}")
    if device is not None:
        if device not in DEVICES:
            raise ValueError(f"Trainer: device must be 'cpu', 'cuda' or 'auto', got {device!r}")
        if device == "cuda":
            if CUDA not in _available():
                raise RuntimeError("Trainer: device='cuda' needs onnxruntime-gpu's "
                                   f"{CUDA}; this onnxruntime offers {_available()}")
            providers = [CUDA, CPU]
        else:  # "cpu", and "auto" until the CUDA kernels are verified on a GPU
            providers = [CPU]
    explicit = providers is not None and device is None  # the caller's own list
    if providers is None:
        providers = [CPU]
    if isinstance(providers, (str, bytes)) or _is_ep_device(providers):
        raise TypeError(f"Trainer: providers must be a list, got {providers!r}")
    providers = list(providers)
    if not providers:
        raise ValueError("Trainer: providers is empty")
    # (OrtEpDevice, options) pairs: the devices, and each EP's options (one set per EP)
    ep_options: dict[str, dict] = {}
    plain = []
    for i, p in enumerate(providers):
        if _is_pair(p) and _is_ep_device(p[0]):
            opts = provider_options(p[1], f"entry {i} ({p[0].ep_name})")
            if ep_options.setdefault(p[0].ep_name, opts) != opts:
                raise ValueError(f"providers: entry {i}: {p[0].ep_name} devices with different "
                                 "options; onnxruntime takes one set of options per EP")
            p = p[0]
        plain.append(p)
    devices = [p for p in plain if _is_ep_device(p)]
    if devices:
        if len(devices) != len(providers):
            raise TypeError("providers: a list of OrtEpDevice objects cannot be mixed with "
                            "provider names")
        ours = [d for d in devices if d.ep_name == TRAINOPS_EP]
        if len(ours) > 1:
            raise ValueError(
                f"providers: {len(ours)} {TRAINOPS_EP} devices given; a session takes one (pick it "
                "by ep_metadata['pci_bus_id'] or ['device_id']): ONNX Runtime 1.24 refuses devices "
                "with different memory and falls back to the CPU, and a factory's custom-op "
                "domains would be collected once per device")
        names = tuple(dict.fromkeys(d.ep_name for d in devices))
        auto_portable = any(n in NO_CUSTOM_OPS for n in names)
        return Placement(providers=None, ep_devices=devices, ep_options=ep_options,
                         names=names, portable=auto_portable if portable is None else portable,
                         cuda_kernels=False, cpu_after=_cpu_after(names))
    names = tuple(_provider_name(p) for p in providers)
    providers = [(p[0], provider_options(p[1], f"entry {i} ({p[0]})")) if _is_pair(p) else p
                 for i, p in enumerate(providers)]
    auto_portable = any(n in NO_CUSTOM_OPS for n in names)
    return Placement(providers=providers, names=names,
                     portable=auto_portable if portable is None else portable,
                     cuda_kernels=CUDA in names, cpu_after=explicit and _cpu_after(names))


class TrainingModel:
    """``trainer.training_model``: the ``onnx.ModelProto`` the step's session runs, both as
    an attribute (``trainer.training_model.graph.node``: every attribute of the proto is
    read through) and as a call (``trainer.training_model()`` returns the ModelProto itself,
    for ``onnx.save``, ``isinstance`` and ``CopyFrom``).

    Why a wrapper: the attribute predates the call, and a ModelProto subclass with
    ``__call__`` is impossible (protobuf's generated classes refuse subclasses), so the
    wrapper forwards attribute reads and comparisons to the proto it holds."""

    __slots__ = ("_model",)

    def __init__(self, model) -> None:
        object.__setattr__(self, "_model", model)

    def __call__(self):
        """The ModelProto the session runs (not a copy: do not modify it)."""
        return self._model

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("training_model is read-only; training_model() is the ModelProto")

    def __eq__(self, other) -> bool:
        other = other._model if isinstance(other, TrainingModel) else other
        return self._model == other

    __hash__ = None  # type: ignore[assignment]

    def __dir__(self):
        return sorted(set(dir(self._model)) | {"__call__"})

    def __repr__(self) -> str:
        return f"TrainingModel({len(self._model.graph.node)} nodes; call it for the ModelProto)"


def check_portable(optimizer, names: Sequence[str] = ()) -> None:
    """ValueError when the portable graph cannot hold ``optimizer``: its state in int8 or
    bfloat16 (``Adam8bit``, ``AdamWBf16State``, ...) has no standard-op form, so the step
    would keep trainops' op, which the EPs the portable graph is for cannot run. ``names``:
    the execution providers, for the message."""
    dtype = getattr(optimizer, "state_dtype", "float32")
    if dtype == "float32":
        return
    why = f" (portable=None picks it for {', '.join(names)})" if names else ""
    raise ValueError(
        f"portable=True{why} with state_dtype={dtype!r}: the {dtype} optimizer state "
        f"({optimizer.op_type}) has no standard-ONNX-op form, so the portable graph cannot "
        "hold it; use state_dtype='float32', or portable=False on an EP that takes "
        "trainops' custom-op library")


def portable_graph(graph, key_seed: int, names: Sequence[str] = ()):
    """``graph`` with its model rewritten to standard ONNX ops (inputs, outputs and state
    names unchanged, so the runtime binds it as before). ``names``: the execution providers
    of the session; with one of :data:`trainops.portable.NO_FLOAT64` among them the rewrite
    uses no float64 (``rewrite(float64=False)``). ValueError naming them when nodes
    of trainops' domains would be left (an optimizer without a standard-op form)."""
    import dataclasses

    from ..onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN
    from ..portable import has_float64, rewrite

    check_portable(graph.options.optimizer)
    model = rewrite(graph.model, dropout_seed=key_seed, float64=has_float64(names))
    left = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node
                   if n.domain in (TRAINING_DOMAIN, TRAINOPS_DOMAIN)
                   and n.op_type not in KEPT_RANDOM_OPS})
    if left:
        raise ValueError(f"portable=True: {', '.join(left)} has no standard-ONNX-op form "
                         "(trainops.portable.EXPANSIONS), so the portable graph cannot hold "
                         "it; use portable=False on an EP that takes trainops' custom-op "
                         "library")
    return dataclasses.replace(graph, model=model)
