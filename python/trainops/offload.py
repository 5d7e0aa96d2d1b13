"""Frozen weights held outside the ONNX model (a LoRA Trainer's base), so that a model over
protobuf's 2 GB limit trains and no step of the Trainer copies the weights.

:func:`take` splits a model into a *stub* ``onnx.ModelProto`` and a :class:`FrozenStore`
(name -> read-only numpy array). Each float initializer of at least :data:`MIN_BYTES`
(the frozen MatMul / Gemm weights, the embedding tables; not the BatchNormalization
running statistics, which train) leaves the proto: its TensorProto keeps its name, type
and dims, and its data becomes an external-data reference to the location :data:`MARK`,
which names no file (:func:`is_offloaded`). Its values are

- for a model file with external data: ``numpy.memmap`` views of the data files
  (read-only, file-backed pages: no anonymous copy at all);
- for a ModelProto or bytes: one copy, taken out of the proto (the caller's proto is not
  changed; bytes are parsed once and dropped).

Every pass that reads initializer values skips stubs (they are large weights, never shape
constants), so the graph builders copy no weight. The step's session gets them in one of
two ways: float32 weights totalling at most 1 GiB as its own initializers
(:func:`session_copies`: it folds and prepacks them, a faster step); every other held
tensor (above that size, and a quantised base's data) as a graph input (:func:`as_inputs`)
bound to an OrtValue over the store's array (``OrtValue.ortvalue_from_numpy`` wraps the
buffer, no copy; a MatMul then packs B panels per call, as it does for every trained
weight). :func:`materialise` puts the values back into a copy of a model
(``Trainer.export``, checkpoints, artifacts).
"""

from __future__ import annotations

import json
import os

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from .onnx_defs import numpy_dtype, tensor_type

__all__ = ["MARK", "MIN_BYTES", "SESSION_COPY_LIMIT", "FrozenStore", "as_inputs",
           "is_offloaded", "materialise", "serialize", "session_copies", "stub", "take", "value",
           "wanted"]

MARK = "trainops:frozen"
MIN_BYTES = 64 * 1024
PROTOBUF_LIMIT = 2**31 - 1
SESSION_COPY_LIMIT = 2**30  # see session_copies
# The float types a store holds (numpy has them; bfloat16 tensors stay in the proto).
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)


class FrozenStore(dict):
    """Name -> read-only numpy array: the values of a stub model's offloaded tensors.
    ``session_copies``: whether a session may take its own copy of the float32 ones
    (:func:`session_copies`)."""

    session_copies = True

    def put(self, name: str, array: np.ndarray) -> TensorProto:
        """Hold ``array`` (read-only from now on) as ``name``; returns its stub."""
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        array.flags.writeable = False  # (a memmap stays one: its pages are the file's)
        self[name] = array
        return stub(name, array.dtype, array.shape)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.values())


def is_offloaded(t: TensorProto) -> bool:
    """Whether ``t`` is a stub whose values a :class:`FrozenStore` holds."""
    return t.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == MARK for e in t.external_data)


def stub(name: str, dtype, shape) -> TensorProto:
    """The TensorProto of an offloaded tensor: name, type and dims, no data."""
    t = TensorProto(name=name, data_type=tensor_type(dtype),
                    dims=[int(d) for d in shape], data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value=MARK)
    return t


def value(t: TensorProto, store) -> np.ndarray:
    """``t``'s values: from ``store`` for a stub, else from the proto."""
    if is_offloaded(t):
        if store is None or t.name not in store:
            raise ValueError(f"initializer {t.name!r} is held outside the model (a LoRA "
                             "Trainer's frozen weight) and no store holds it")
        return store[t.name]
    return numpy_helper.to_array(t)


def wanted(model, lora) -> bool:
    """Whether the Trainer holds ``model``'s frozen weights outside it: under LoRA, given
    (``lora``) or carried by the model (a LoRA trainer's checkpoint)."""
    if lora is not None:
        return True
    if isinstance(model, onnx.ModelProto):
        return any(p.key == "trainops.lora" for p in model.metadata_props)
    if isinstance(model, bytes):  # parsed only when the key is there at all
        return b"trainops.lora" in model and wanted(onnx.load_from_string(model), None)
    return False


def _no_offload(model: onnx.ModelProto) -> set[str]:
    """Initializers that must stay in the proto: states, updated in place (BatchNormalization
    running statistics; the adapters of a model that carries them, named by its LoRA
    record, metadata ``trainops.lora``)."""
    graph = model.graph
    keep = {n.input[k] for n in graph.node if n.op_type == "BatchNormalization"
            for k in (3, 4) if len(n.input) > k}
    for p in model.metadata_props:
        if p.key == "trainops.lora":
            try:
                keep.update(f"{w}.lora_{k}" for w in json.loads(p.value)["adapters"]
                            for k in "AB")
            except (ValueError, TypeError, KeyError):
                pass  # a malformed record: the LoRA attach names it
    return keep


def _copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without its graph's initializers (nothing large copied)."""
    m = onnx.ModelProto()
    _copy_fields(model, m, "graph")
    _copy_fields(model.graph, m.graph, "initializer")
    return m


def _copy_fields(src, dst, skip: str) -> None:
    """Every set field of ``src`` but ``skip`` into ``dst``."""
    for fd, val in src.ListFields():
        if fd.name == skip:
            continue
        if hasattr(val, "CopyFrom"):  # a message
            getattr(dst, fd.name).CopyFrom(val)
        elif hasattr(val, "extend"):  # a repeated field
            getattr(dst, fd.name).extend(val)
        else:
            setattr(dst, fd.name, val)


def _external_array(t: TensorProto, base: str, what: str) -> np.ndarray:
    """A read-only memmap of ``t``'s external data beside the model file ``base``."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(t)
    dtype = numpy_dtype(t.data_type).newbyteorder("<")  # ONNX's raw data is little-endian
    shape = tuple(int(d) for d in t.dims)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    folder = os.path.realpath(base)
    path = os.path.realpath(os.path.join(folder, info.location))
    if os.path.isabs(info.location) or os.path.commonpath([folder, path]) != folder:
        raise ValueError(f"{what}: initializer {t.name!r}: its external data location "
                         f"{info.location!r} lies outside the model's folder")
    if not os.path.isfile(path):
        raise ValueError(f"{what}: initializer {t.name!r}: its external data file "
                         f"{info.location!r} does not exist beside the model")
    offset = int(info.offset or 0)
    if info.length not in (None, 0) and int(info.length) != nbytes:
        raise ValueError(f"{what}: initializer {t.name!r}: external data length "
                         f"{info.length}, but its type and dims {list(shape)} need {nbytes}")
    size = os.path.getsize(path)
    if offset < 0 or offset + nbytes > size:
        raise ValueError(f"{what}: initializer {t.name!r}: external data at offset {offset}, "
                         f"{nbytes} bytes, past the end of {info.location!r} ({size} bytes)")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def take(model, what: str = "the model") -> tuple[onnx.ModelProto, FrozenStore]:
    """``(stub model, store)`` of ``model`` (a path, bytes or a ModelProto; see the
    module). A path's other external tensors (small ones, Constant attributes, subgraphs)
    are loaded into the stub model as onnx would."""
    from onnx.external_data_helper import (_get_all_tensors, load_external_data_for_tensor,
                                           uses_external_data)

    store = FrozenStore()
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        what = f"'{path}'"
        full = _load_structure(path)
        base = os.path.dirname(os.path.abspath(path))
    elif isinstance(model, bytes):
        full, base = _parse(model), None
    elif isinstance(model, onnx.ModelProto):
        full, base = model, None
    else:
        raise TypeError(f"model: expected an onnx.ModelProto, bytes or a path, got "
                        f"{type(model).__name__}")
    m = _copy_without_initializers(full)
    keep = _no_offload(full)
    for t in full.graph.initializer:
        external = uses_external_data(t)
        if t.data_type in _FLOATS and t.name not in keep and not t.name.startswith("trainops/") \
                and int(np.prod(t.dims, dtype=np.int64)) * numpy_dtype(t.data_type).itemsize \
                >= MIN_BYTES:
            if external:
                if base is None:
                    raise ValueError(f"initializers [{t.name!r}] hold their data in external "
                                     "files that are not loaded: pass the model's path")
                m.graph.initializer.append(store.put(t.name, _external_array(t, base, what)))
            else:
                m.graph.initializer.append(store.put(t.name, numpy_helper.to_array(t)))
        else:
            m.graph.initializer.add().CopyFrom(t)
    for t in _get_all_tensors(m):
        if uses_external_data(t) and not is_offloaded(t):
            if base is None:
                raise ValueError(f"tensor {t.name!r} holds its data in an external file that "
                                 "is not loaded: pass the model's path")
            load_external_data_for_tensor(t, base)
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]
    return m, store


def _parse(data: bytes) -> onnx.ModelProto:
    from google.protobuf.message import DecodeError

    try:
        return onnx.load_from_string(data)
    except DecodeError as exc:
        raise ValueError(f"model: {len(data)} bytes that are not an ONNX model: protobuf "
                         f"cannot parse them as an onnx.ModelProto ({exc})") from None


def _load_structure(path: str) -> onnx.ModelProto:
    """``path`` parsed without its external data (errors as :func:`autodiff.importing.load`)."""
    from google.protobuf.message import DecodeError

    try:
        m = onnx.load(path, load_external_data=False)
    except DecodeError as exc:
        raise ValueError(f"'{path}' is not an ONNX model: protobuf cannot parse it as an "
                         f"onnx.ModelProto ({exc})") from None
    if not m.HasField("graph"):
        raise ValueError(f"'{path}' is not an ONNX model: it parses as an onnx.ModelProto "
                         "that holds no graph")
    return m


def materialise(model: onnx.ModelProto, store) -> onnx.ModelProto:
    """A copy of ``model`` with each stub's values from ``store`` (the weights copied)."""
    m = _copy_without_initializers(model)
    for t in model.graph.initializer:
        if is_offloaded(t):
            m.graph.initializer.append(numpy_helper.from_array(np.asarray(value(t, store)),
                                                               t.name))
        else:
            m.graph.initializer.add().CopyFrom(t)
    return m


def serialize(model: onnx.ModelProto, store, what: str) -> bytes:
    """The bytes of :func:`materialise`'s model; NotImplementedError (naming ``what``) when
    it would pass protobuf's 2 GB limit."""
    held = sum(np.asarray(store[t.name]).nbytes for t in model.graph.initializer
               if is_offloaded(t))
    if held + model.ByteSize() > PROTOBUF_LIMIT:
        raise NotImplementedError(
            f"{what}: the model is over protobuf's 2 GB limit ({held} bytes of frozen "
            "weights), so it cannot be stored inside one file: save the adapters "
            "(Trainer.save_adapter) and keep the model file beside them")
    return materialise(model, store).SerializeToString()


def session_copies(model: onnx.ModelProto, store) -> list[str]:
    """The stubs of ``model`` a CPU session should take its own copy of: its float32 ones
    when they total at most :data:`SESSION_COPY_LIMIT` bytes and ``store.session_copies``
    (False once a quantised base is put in it: that choice is memory), else none.

    Given as initializers (``SessionOptions.add_external_initializers``), onnxruntime folds
    ``Transpose(W)`` and prepacks the GEMM weights: a LoRA step on SmolLM-135M's shapes ran
    5-8% faster than with the weights bound as inputs (which MLAS packs again in every
    call), at the price of about 2.4 more copies of them in the session. Above the limit
    (the models this module exists for) memory wins: no copy."""
    if not getattr(store, "session_copies", True):
        return []
    held = [t for t in model.graph.initializer
            if is_offloaded(t) and t.data_type == TensorProto.FLOAT]
    total = sum(int(np.prod(t.dims, dtype=np.int64)) * 4 for t in held)
    names = [t.name for t in held]
    return names if store is not None and total <= SESSION_COPY_LIMIT else []


def as_inputs(model: onnx.ModelProto, keep=()) -> tuple[onnx.ModelProto, list[str]]:
    """``(a copy of model whose stubs are graph inputs, their names)``: what a session
    runs, the stubs bound to the store's arrays. Stubs named in ``keep`` stay stubs (the
    session is given their values as initializers)."""
    names = [t.name for t in model.graph.initializer if is_offloaded(t) and t.name not in keep]
    if not names:
        return model, []
    m = _copy_without_initializers(model)
    held = set(names)
    m.graph.initializer.extend(t for t in model.graph.initializer if t.name not in held)
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                         for t in model.graph.initializer if t.name in held)
    return m, names
