"""Where a Trainer's states live, and the one way to read and write them: :class:`Buffers`.

On the CPU every state is a host numpy buffer wrapped (not copied) by an ``OrtValue``: the
session updates it in place and numpy reads it with no copy. On a device placement
(:meth:`trainops.train.placement.Placement.state_memory`: the CUDA EP's memory, a plugin
EP device's memory) every state is an ``OrtValue`` allocated in device memory, bound once as
the input and the output of its state pair, never re-bound: a step moves only the data
inputs, the learning rate and ``T`` to the device and the loss (plus the finite flag and
the gradient norm) back. Reading a state then copies it device->host on demand
(:meth:`Buffers.__getitem__`), loading one copies host->device (:meth:`Buffers.write`).

:class:`Transfers` counts the host<->device transfers the runtime causes: per step
(``last_step``) and in all (``total``, the on-demand reads and writes included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

__all__ = ["Buffers", "Memory", "Transfers", "RESIDENT_EPS", "ep_device_memory"]

BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16


@dataclass(frozen=True)
class Memory:
    """Device memory for states: ``device_type`` / ``device_id`` / ``vendor_id`` as
    ``OrtValue.ortvalue_from_shape_and_type`` takes them (``("cuda", 0)`` for the CUDA EP,
    ``("gpu", id, 0x10DE)`` for a plugin EP device's memory), or ``memory_info``, an
    ``OrtMemoryInfo`` of an ``OrtEpDevice`` whose allocator is used directly (onnxruntime
    1.24+; the WebGPU plugin EP's buffers, which no device type names).
    ``device_type="cpu"`` is host memory that ONNX Runtime allocates (not numpy's): the
    device code path on the CPU, for tests."""

    device_type: str
    device_id: int = 0
    vendor_id: int | None = None
    memory_info: Any = field(default=None, compare=False)

    def args(self) -> tuple:
        """The device arguments of ``ortvalue_from_shape_and_type``."""
        if self.vendor_id is None:
            return (self.device_type, self.device_id)
        return (self.device_type, self.device_id, self.vendor_id)

    def allocate(self, shape, elem) -> Any:
        """An uninitialised OrtValue of ``shape`` and ``elem`` (a numpy type or an ONNX
        enum) in this memory."""
        new = _ort().OrtValue.ortvalue_from_shape_and_type
        if self.memory_info is not None:
            return new(list(shape), elem, memory_info=self.memory_info)
        return new(list(shape), elem, *self.args())


# Plugin execution providers whose device memory holds a step's states (verified: the
# session reads and updates them in place, and reads back give the values):
# TrainopsExecutionProvider's GPU devices, the WebGPU plugin EP (onnxruntime-ep-webgpu).
RESIDENT_EPS = frozenset({"TrainopsExecutionProvider", "WebGpuExecutionProvider"})


def ep_device_memory(ep_device) -> "Memory | None":
    """The :class:`Memory` of an ``OrtEpDevice`` in :data:`RESIDENT_EPS` that has device
    memory (its DEFAULT memory info, not the host's), else None: host buffers for the
    others (their device memory is not verified here), and for a trainops device that
    is the CPU."""
    ort = _ort()
    if ep_device.ep_name not in RESIDENT_EPS:
        return None
    if ep_device.ep_name == "TrainopsExecutionProvider":
        if ep_device.device.type != ort.OrtHardwareDeviceType.GPU:
            return None
        mi = ep_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        return Memory("gpu", int(mi.device_id), int(mi.device_vendor_id))
    mi = ep_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
    if mi is None or mi.name.lower() == "cpu":
        return None
    # WebGPU over a software adapter reports a CPU hardware device: the memory is still
    # the EP's own buffers (OrtValue.device_name() "webgpu").
    return Memory(mi.name, int(mi.device_id), int(mi.device_vendor_id), memory_info=mi)

    def __str__(self) -> str:
        return f"{self.device_type}:{self.device_id}"


COUNTERS = ("to_device", "to_device_bytes", "to_host", "to_host_bytes", "state_bytes",
            "data_bytes")


class Transfers:
    """Host<->device transfers the runtime causes, as ``{name: int}`` dicts (keys
    :data:`COUNTERS`): ``to_device`` / ``to_device_bytes``: host buffers handed to a
    device session (ONNX Runtime copies each to the device that reads it); ``to_host`` /
    ``to_host_bytes``: device values copied back; ``state_bytes``: the part of both that
    is state: parameters and optimizer state (0 per step when the states are
    device-resident; every state's bytes twice when host states are re-bound to a device
    session each step); ``data_bytes``: the rest of both (the batch, ``lr``, ``T``, the
    loss and the other outputs).

    ``last_step``: the last :meth:`StepRuntime.run`; ``total``: since the runtime was
    made, the on-demand reads and writes of :class:`Buffers` included. On the CPU
    placement nothing crosses: all zero."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(COUNTERS, 0)
        self.last_step = dict.fromkeys(COUNTERS, 0)
        self._step: dict[str, int] | None = None

    def begin_step(self) -> None:
        """Starts counting a step."""
        self._step = dict.fromkeys(COUNTERS, 0)

    def end_step(self) -> None:
        """Ends the step: ``last_step`` becomes its counts."""
        if self._step is not None:
            self.last_step, self._step = self._step, None

    def add(self, direction: str, nbytes: int, state: bool = False) -> None:
        """One transfer of ``nbytes`` (``direction``: ``"to_device"`` or ``"to_host"``)."""
        for counts in (self.total, self._step):
            if counts is None:
                continue
            counts[direction] += 1
            counts[direction + "_bytes"] += int(nbytes)
            counts["state_bytes" if state else "data_bytes"] += int(nbytes)


def _ort():
    import onnxruntime as ort

    return ort


def _elem_type(dtype: np.dtype):
    """The element type ``ortvalue_from_shape_and_type`` takes for ``dtype`` (bfloat16: the
    ONNX enum, numpy has no bfloat16)."""
    from ..bfloat16 import is_bfloat16

    return BFLOAT16 if is_bfloat16(dtype) else dtype.type


def _raw(arr: np.ndarray) -> np.ndarray:
    """``arr`` as ``update_inplace`` takes it (bfloat16 through its uint16 bits)."""
    from ..bfloat16 import is_bfloat16

    arr = np.ascontiguousarray(arr)
    return arr.view(np.uint16) if is_bfloat16(arr.dtype) else arr


class Buffers(Mapping):
    """The states and outputs of a runtime by name: ``buffers[name]`` is a host numpy
    array of the value; ``values[name]`` its ``OrtValue`` (what the session binds).

    ``memory=None`` (the CPU): the array IS the session's buffer (read without a copy;
    ``buffers[name] is buffers[name]``), written in place. With a :class:`Memory`: the
    value lives there; ``buffers[name]`` is a fresh host copy (one device->host
    transfer, counted in ``transfers``) and :meth:`write` copies host->device.
    :meth:`spec` gives a value's dtype and shape without a copy. Outputs (the loss, the
    finite flag, the norm) are host buffers either way (ONNX Runtime copies them back)."""

    def __init__(self, memory: Memory | None = None, transfers: Transfers | None = None):
        self.memory = memory
        self.transfers = transfers if transfers is not None else Transfers()
        self.values: dict[str, Any] = {}
        self._host: dict[str, np.ndarray] = {}
        self._spec: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}

    # -- making values ------------------------------------------------------------------
    def put_host(self, name: str, arr) -> Any:
        """A host buffer (a copy of ``arr``) and the OrtValue over it, under ``name``."""
        from ..bfloat16 import to_ortvalue

        # The OrtValue wraps this array's memory (and keeps it alive): the session
        # updates it in place, and numpy reads it without a copy (a bfloat16 array
        # through a uint16 view: the bfloat16-state optimizers' moments).
        arr = np.array(arr, order="C", copy=True)
        self._host[name] = arr
        self._spec[name] = (arr.dtype, arr.shape)
        self.values[name] = to_ortvalue(arr)
        return self.values[name]

    def put(self, name: str, arr) -> Any:
        """A state under ``name`` starting at ``arr``: in :attr:`memory` (one counted
        host->device copy), or a host buffer without one."""
        if self.memory is None:
            return self.put_host(name, arr)
        arr = np.array(arr, order="C", copy=True)
        value = self.memory.allocate(arr.shape, _elem_type(arr.dtype))
        self.values[name] = value
        self._spec[name] = (arr.dtype, arr.shape)
        self._copy_in(name, arr)
        return value

    # -- the accessor ---------------------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        host = self._host.get(name)
        if host is not None:
            return host
        if name not in self.values:
            raise KeyError(name)
        return self._copy_out(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._spec)

    def __len__(self) -> int:
        return len(self._spec)

    def __contains__(self, name) -> bool:
        return name in self._spec

    def spec(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of ``name``, with no copy."""
        return self._spec[name]

    def nbytes(self, name: str) -> int:
        """The bytes ``name`` takes (host or device), with no copy."""
        dtype, shape = self._spec[name]
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def on_device(self, name: str) -> bool:
        """Whether ``name`` lives in device memory (reads and writes copy)."""
        return name not in self._host

    def write(self, name: str, value) -> None:
        """Sets ``name`` to ``value`` (same dtype and shape): in place on the host, a
        host->device copy on the device. ValueError naming the state otherwise."""
        dtype, shape = self._spec[name]
        arr = np.asarray(value)
        if arr.dtype != dtype or arr.shape != shape:
            raise ValueError(f"state {name!r}: expected {dtype} {list(shape)}, got "
                             f"{arr.dtype} {list(arr.shape)}")
        host = self._host.get(name)
        if host is not None:
            np.copyto(host, arr)
        else:
            self._copy_in(name, arr)

    # -- copies ----------------------------------------------------------------------------
    def _copy_in(self, name: str, arr: np.ndarray) -> None:
        self.values[name].update_inplace(_raw(arr))
        self.transfers.add("to_device", arr.nbytes, state=True)

    def _copy_out(self, name: str) -> np.ndarray:
        from ..bfloat16 import bfloat16_dtype, is_bfloat16

        dtype, shape = self._spec[name]
        value = self.values[name]
        if is_bfloat16(dtype):
            # No numpy type for bfloat16: a host bfloat16 OrtValue over uint16 bits, filled
            # by OrtValue.update_inplace(OrtValue) (in 1.32, not in 1.24.4: TypeError there).
            bits = np.zeros(shape, np.uint16)
            host = _ort().OrtValue.ortvalue_from_numpy_with_onnx_type(bits, BFLOAT16)
            try:
                host._ortvalue.update_inplace(value._ortvalue)
            except TypeError:
                raise NotImplementedError(
                    f"state {name!r}: reading a bfloat16 state from device memory needs "
                    f"OrtValue.update_inplace(OrtValue), which onnxruntime "
                    f"{_ort().__version__} lacks") from None
            out = bits.view(bfloat16_dtype())
        else:
            out = np.array(value.numpy(), copy=True).reshape(shape)
        self.transfers.add("to_host", out.nbytes, state=True)
        return out


def host_buffers(arrays: Mapping[str, np.ndarray]) -> Buffers:
    """:class:`Buffers` over existing host arrays (the data-parallel runtime's views into
    its flat buffers): reads give the arrays themselves, writes copy into them."""
    b = Buffers()
    for name, arr in arrays.items():
        b._host[name] = arr
        b._spec[name] = (arr.dtype, arr.shape)
    return b
