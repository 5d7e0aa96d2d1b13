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


def _ours_listed() -> bool:
    """Whether ONNX Runtime already lists a device of ``TrainopsExecutionProvider`` (the library
    was registered as an EP library, by us or by the user, under any name)."""
    return any(d.ep_name == EP_NAME for d in _ort().get_ep_devices())


def register(library: str | None = None) -> bool:
    """Registers ``libtrainops.so`` as a plugin EP library once per process (ONNX Runtime
    keeps EP libraries per environment). False when this runtime cannot.

    A library the user registered themselves (``ort.register_execution_provider_library``,
    under any name) is used as it is: when ``TrainopsExecutionProvider`` already lists a
    device, or ONNX Runtime answers that the library "is already registered", nothing more
    is registered (a second registration under another name would list every device twice).
    """
    if not plugin_ep_supported():
        return False
    from trainops import get_library_path

    path = library or get_library_path()
    with _lock:
        if path in _registered:
            return True
        if _ours_listed():
            _registered[path] = "(registered outside trainops)"
            return True
        name = "trainops" if not _registered else f"trainops{len(_registered)}"
        try:
            _ort().register_execution_provider_library(name, path)
        except Exception as exc:  # onnxruntime's Fail: "EP library is already registered under ..."
            if "already registered" not in str(exc):
                raise
            name = "(registered outside trainops)"
        _registered[path] = name
    return True


def devices(library: str | None = None) -> list:
    """The ``OrtEpDevice`` objects ``TrainopsExecutionProvider`` offers (empty on ONNX Runtime
    older than 1.24, without a GPU, without a driver)."""
    if not register(library):
        return []
    return [d for d in _ort().get_ep_devices() if d.ep_name == EP_NAME]


_CONFIG_KEY = "trainops.door"  # marks a SessionOptions configure() has loaded trainops into


def _door_of(session_options) -> str | None:
    try:
        return session_options.get_session_config_entry(_CONFIG_KEY) or None
    except RuntimeError:  # "SessionOptions does not have configuration with key"
        return None


def _check_device_id(device_id) -> None:
    if isinstance(device_id, bool) or not isinstance(device_id, int):
        raise TypeError(f"configure: device_id must be an int, got {type(device_id).__name__} {device_id!r}")
    if device_id < 0:
        raise ValueError(f"configure: device_id must be >= 0, got {device_id}")


def configure(session_options, device: str = "auto", library: str | None = None, device_id: int = 0) -> str:
    """Loads trainops into ``session_options`` through exactly one door.

    ``device="cpu"``: ``register_custom_ops_library`` (CPU kernels). ``"cuda"``: the plugin EP
    on GPU ``device_id``, or ``RuntimeError`` when it offers no device. ``"auto"``: the plugin
    EP when it offers a device, else the CPU kernels. Returns ``"TrainopsExecutionProvider"``
    or ``"cpu"``.

    ``device_id``: an ``int`` (else ``TypeError``), ``>= 0`` and below the number of devices
    the EP offers (else ``ValueError`` naming it; with no device offered, ``"auto"`` falls
    back to the CPU door whatever the id). Idempotent: calling it again on the same
    ``session_options`` registers nothing more and returns the door chosen the first time
    (the choice is kept in the options' config entry ``trainops.door``); asking a configured
    object for the other door is a ``ValueError``, since ONNX Runtime rejects both doors on
    one object. A library the user registered as an EP library themselves is used as is.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"configure: device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    _check_device_id(device_id)
    done = _door_of(session_options)
    if done is not None:
        wanted = {"cpu": ("cpu",), "cuda": (EP_NAME,), "auto": ("cpu", EP_NAME)}[device]
        if done not in wanted:
            raise ValueError(f"configure: these SessionOptions already load trainops through {done!r}; "
                             f"device={device!r} would add the other door (ONNX Runtime rejects both)")
        return done
    from trainops import get_library_path

    path = library or get_library_path()
    if device != "cpu":
        offered = devices(path)
        if offered and device_id >= len(offered):
            raise ValueError(f"configure: device_id {device_id} is out of range: {EP_NAME} offers "
                             f"{len(offered)} device(s) (ids 0 to {len(offered) - 1})")
        if offered:
            session_options.add_provider_for_devices([offered[device_id]], {})
            session_options.add_session_config_entry(_CONFIG_KEY, EP_NAME)
            return EP_NAME
        if device == "cuda":
            why = (
                f"onnxruntime {_ort().__version__} has no plugin execution providers (1.24 or newer needed)"
                if not plugin_ep_supported()
                else f"{EP_NAME} offers {len(offered)} device(s) (no GPU, no CUDA driver, or TRAINOPS_CUDA unset)"
            )
            raise RuntimeError(f"device='cuda': {why}")
    session_options.register_custom_ops_library(path)
    session_options.add_session_config_entry(_CONFIG_KEY, "cpu")
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
