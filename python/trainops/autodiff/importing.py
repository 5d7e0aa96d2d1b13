"""Models as exporters and the ONNX zoo write them, read the way the gradient code needs
them; shared by :func:`~trainops.autodiff.expand_gradients` and the Trainer's importer
(:func:`trainops.train.importer.import_model`).

- :func:`load`: a ModelProto, serialized bytes or a path (its external data loaded); a
  ModelProto whose tensors still point to external files is an error naming them;
- :func:`unlist_initializers`: initializers also listed as graph inputs (IR < 4 models, the
  zoo) taken out of the inputs (returned, so that a caller may list them again);
- :func:`sort_nodes`: nodes in any order sorted topologically; a cycle, or a tensor with
  two definitions (two nodes writing it, or a node writing a graph input or initializer:
  :func:`~.hygiene.check_definitions`), is a GradientError naming it;
- :func:`upgrade`: a model older than its gradient rules need
  (:func:`~.coverage.opset_needs`) converted with ``onnx.version_converter`` to the lowest
  opset that satisfies them, said in one ``logging.getLogger("trainops")`` line;
- :func:`~.fold.fold_shape_constants` (re-exported): shape chains onnx's inference misses.
"""

from __future__ import annotations

import logging
import os

import onnx
from onnx import helper

from ..offload import is_offloaded
from .coverage import opset_needs
from .fold import fold_shape_constants
from .graph import GradientError, default_opset, skeleton
from .hygiene import check_definitions, toposort
from .sequences import unsequence

__all__ = ["fold_shape_constants", "load", "sort_nodes", "unlist_initializers", "upgrade"]

log = logging.getLogger("trainops")


def load(model) -> onnx.ModelProto:
    """A copy of ``model`` (a ModelProto, serialized bytes or a path; a path's external
    data loaded). OSError when the file cannot be opened; ValueError naming the file when
    it is no ONNX model (protobuf cannot parse it, or it holds no graph), when its external
    data is missing or lies outside the model's folder (onnx refuses such paths), and for
    tensors whose external data is not loaded."""
    from google.protobuf.message import DecodeError
    from onnx.checker import ValidationError

    if isinstance(model, (str, os.PathLike)):
        what = f"'{os.fspath(model)}'"
        try:
            m = onnx.load(os.fspath(model), load_external_data=True)
        except DecodeError as exc:
            raise ValueError(f"{what} is not an ONNX model: protobuf cannot parse it as an "
                             f"onnx.ModelProto ({exc})") from None
        except ValidationError as exc:  # onnx's checks of external data locations
            raise ValueError(f"{what}: its external data cannot be loaded: {exc}") from None
        if not m.HasField("graph"):
            raise ValueError(f"{what} is not an ONNX model: it parses as an onnx.ModelProto "
                             "that holds no graph")
    elif isinstance(model, bytes):
        try:
            m = onnx.load_from_string(model)
        except DecodeError as exc:
            raise ValueError(f"model: {len(model)} bytes that are not an ONNX model: protobuf "
                             f"cannot parse them as an onnx.ModelProto ({exc})") from None
    elif isinstance(model, onnx.ModelProto):
        m = onnx.ModelProto()
        m.CopyFrom(model)
    else:
        raise TypeError(f"model: expected an onnx.ModelProto, bytes or a path, got "
                        f"{type(model).__name__}")
    external = [t.name for t in m.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL and not is_offloaded(t)]
    if external:
        raise ValueError(f"initializers {external[:5]} hold their data in external files "
                         "that are not loaded: pass the model's path (or onnx.load it with "
                         "load_external_data=True)")
    return m


def unlist_initializers(m: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Take the initializers that are also graph inputs out of ``m``'s inputs (in place;
    the IR version raised to 4, which allows that); returns the inputs as they were."""
    g = m.graph
    before = [onnx.ValueInfoProto() for _ in g.input]
    for b, i in zip(before, g.input):
        b.CopyFrom(i)
    inits = {i.name for i in g.initializer}
    if any(i.name in inits for i in g.input):
        keep = [i for i in g.input if i.name not in inits]
        del g.input[:]
        g.input.extend(keep)
        m.ir_version = max(m.ir_version, 4)  # IR 3 requires initializers among the inputs
    return before


def sort_nodes(m: onnx.ModelProto) -> None:
    """``m``'s main-graph nodes in topological order (in place); GradientError for a
    cycle, or a tensor defined twice in any of its graphs (checked first: sorting would
    keep one of the two writers)."""
    g = m.graph
    check_definitions(g)
    if g.node:
        nodes = toposort(list(g.node), {i.name for i in g.input}
                         | {i.name for i in g.initializer})
        del g.node[:]
        g.node.extend(nodes)
    unsequence(m)  # sequences whose elements are known statically become tensors


def upgrade(m: onnx.ModelProto, train_batchnorm: bool, name: str) -> onnx.ModelProto:
    """``m`` converted to the lowest opset its gradient rules need (itself if new enough);
    GradientError when onnx's converter fails. ``m`` should list no initializer among its
    inputs (:func:`unlist_initializers`)."""
    opset = default_opset(m)
    needs = opset_needs(m.graph.node, train_batchnorm)
    target = max(needs.values())
    if opset >= target:
        return m
    from onnx import version_converter

    light, big = skeleton(m)
    try:
        out = version_converter.convert_version(light, target)
    except Exception as exc:  # noqa: BLE001 - the converter's errors are of many types
        raise GradientError(f"{name} imports opset {opset}; its gradients need opset {target} "
                            f"({', '.join(w for w, v in needs.items() if v > opset)}) and "
                            f"onnx's version converter failed: {exc}. Export the model with "
                            f"opset_version={target} or later") from exc
    names = {i.name for i in big}
    keep = [i for i in out.graph.input if i.name not in names]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    out.graph.initializer.extend(big)
    # The converter may write its own (newest) IR version: keep the oldest that fits, which
    # older onnxruntimes read.
    out.ir_version = max(m.ir_version, helper.find_min_ir_version_for(
        [o for o in out.opset_import if o.domain in ("", "ai.onnx")]))
    why = ", ".join(f"{w} ({v})" for w, v in needs.items() if v > opset)
    log.info("upgraded %s from opset %d to %d for %s", name, opset, target, why)
    return out
