"""Choosing where trainops' ops run, and keeping tensors on the device.

Two doors into ONNX Runtime:

- ``register_custom_ops_library`` (ONNX Runtime 1.17+): the CPU kernels, as always.
- the plugin execution provider ``TrainopsExecutionProvider`` (ONNX Runtime 1.24+), registered
  with ``register_execution_provider_library``: it offers a device per NVIDIA GPU, an allocator
  on its memory and copies, and runs the nodes its device kernels support there (R, T and other
  scalars stay host inputs); other nodes of trainops' domains run on the CPU kernels.

ONNX Runtime rejects both doors on one ``SessionOptions`` ("Domain already set in registry"),
so :func:`configure` picks exactly one::

    import onnxruntime as ort, trainops.device as td
    so = ort.SessionOptions()
    where = td.configure(so, device="auto")   # "TrainopsExecutionProvider" or "cpu"
    sess = ort.InferenceSession(model, so)
    x = td.to_device(np.zeros(n, np.float32))  # an OrtValue in device memory (or host, on "cpu")

``TRAINOPS_FAKE_DEVICE=1`` (set before the library is registered) makes the EP offer one fake
device: host memory labelled as an NVIDIA GPU, with the CPU kernels behind the device
registration, so the EP's plumbing is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import threading

EP_NAME = "TrainopsExecutionProvider"
NVIDIA_VENDOR_ID = 0x10DE
COUNTER_NAMES = (
    "allocs",
    "frees",
    "copies_to_device",
    "copies_to_host",
    "copies_on_device",
    "device_runs",
    "claimed",
    "declined",
)

_lock = threading.Lock()
_registered: dict[str, str] = {}  # library path -> registration name


def _ort():
    import onnxruntime as ort

    return ort


def runtime_version() -> tuple[int, int]:
    """ONNX Runtime's (major, minor)."""
    parts = _ort().__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def plugin_ep_supported() -> bool:
    """Whether this ONNX Runtime can load trainops as a plugin EP (1.24 or newer)."""
    ort = _ort()
    return runtime_version() >= (1, 24) and hasattr(ort, "register_execution_provider_library")


def register(library: str | None = None) -> bool:
    """Registers ``libtrainops.so`` as a plugin EP library once per process (ONNX Runtime
    keeps EP libraries per environment). False when this runtime cannot."""
    if not plugin_ep_supported():
        return False
    from trainops import get_library_path

    path = library or get_library_path()
    with _lock:
        if path not in _registered:
            name = "trainops" if not _registered else f"trainops{len(_registered)}"
            _ort().register_execution_provider_library(name, path)
            _registered[path] = name
    return True


def devices(library: str | None = None) -> list:
    """The ``OrtEpDevice`` objects ``TrainopsExecutionProvider`` offers (empty on ONNX Runtime
    older than 1.24, without a GPU, without a driver)."""
    if not register(library):
        return []
    return [d for d in _ort().get_ep_devices() if d.ep_name == EP_NAME]


def configure(session_options, device: str = "auto", library: str | None = None, device_id: int = 0) -> str:
    """Loads trainops into ``session_options`` through exactly one door.

    ``device="cpu"``: ``register_custom_ops_library`` (CPU kernels). ``"cuda"``: the plugin EP
    on GPU ``device_id``, or ``RuntimeError`` when it offers no device. ``"auto"``: the plugin
    EP when it offers a device, else the CPU kernels. Returns ``"TrainopsExecutionProvider"``
    or ``"cpu"``.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    from trainops import get_library_path

    path = library or get_library_path()
    if device != "cpu":
        offered = devices(path)
        if len(offered) > device_id:
            session_options.add_provider_for_devices([offered[device_id]], {})
            return EP_NAME
        if device == "cuda":
            why = (
                f"onnxruntime {_ort().__version__} has no plugin execution providers (1.24 or newer needed)"
                if not plugin_ep_supported()
                else f"{EP_NAME} offers {len(offered)} device(s) (no GPU, no CUDA driver, or TRAINOPS_CUDA unset)"
            )
            raise RuntimeError(f"device='cuda': {why}")
    session_options.register_custom_ops_library(path)
    return "cpu"


def _device_args(device_id: int = 0):
    return ("gpu", device_id, NVIDIA_VENDOR_ID)


def empty(shape, dtype, device_id: int = 0):
    """An uninitialised tensor in the EP's device memory."""
    ort = _ort()
    return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, *_device_args(device_id))


def to_device(array, device_id: int = 0):
    """A copy of numpy ``array`` in the EP's device memory (an ``OrtValue``), to bind with
    IOBinding so it stays there between runs. Host memory when no device is offered."""
    ort = _ort()
    if not devices():
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy(array, *_device_args(device_id))


def to_host(value):
    """A numpy copy of an ``OrtValue`` wherever it lives."""
    return value.numpy()


def counters(library: str | None = None) -> dict[str, int]:
    """The plugin EP's counters in this process (allocations, copies, device kernel runs,
    nodes claimed and declined): for tests and benchmarks."""
    from trainops import get_library_path

    lib = ctypes.CDLL(library or get_library_path())
    fn = lib.trainops_ep_counters
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    out = (ctypes.c_uint64 * len(COUNTER_NAMES))()
    fn(out, len(COUNTER_NAMES))
    return dict(zip(COUNTER_NAMES, (int(v) for v in out)))
