"""The export checked against the module: onnxruntime runs the exported model (the real
values written back) on the example inputs, and its outputs must be the module's own
training-mode outputs, computed before the export from the same state.

Why: the export finds the parameters by filling them with other values while tracing
(:mod:`trainops.torch.exporter`); where the tracer records as a constant something the
forward computed from a filled tensor (a non-persistent buffer is no initializer, so the
rotary angles computed from one become a constant), that constant holds the fill values'
result. The filling is limited to the tensors known to be safe, and this check turns any
other such case (and any exporter fault that changes what the graph computes) into an
error instead of a model that trains something else.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import numpy as np
import torch

import onnx

__all__ = ["quiet_dropout", "reference", "verify"]

U = 2.0 ** -24  # float32's unit roundoff

# How far onnxruntime's float32 outputs may be from torch's float32 outputs of the same
# function. Both evaluate the same ops in float32, in other orders (other kernels,
# blocking, fused or unfused); how far such an evaluation strays from the exact value
# depends on the function and the input (cancellation, depth), not on a fixed fraction, so
# the width is measured on this function at this input: torch's own float32 outputs
# against its float64 outputs of a float64 copy of the module (``e``, the largest
# difference of each output). Each side is taken to be within twice that of the exact
# value (the same ops summed in other orders), so the two within ``4 e``, plus ``4 u`` of
# the output's largest magnitude where torch happens to be exact (the model the bridge's
# tests use, tests/test_torch_bridge.py's ``torch_model_grads``; a model, not a theorem).
# What this check exists to catch is a graph that computes something else (a constant
# baked from fill values in [1, 2) instead of the real ones): that changes the outputs
# by what the wrong constant contributes, hundreds of u at least in the cases seen
# (ModernBERT: 600 u of its largest logit, Llama: 1.7 * 10**5 u), where the faithful exports of
# 13 architectures differ by at most about 50 u, within their widths.
SPREAD = 4
# Where no float64 copy can run (an op without a float64 kernel), the width falls back to
# 1e-4 of the output's largest magnitude: about 1700 u, a few hundred roundings of values
# the size of the output adding up in the worst direction; coarser, it still catches the
# constants baked from fill values unless they hardly enter the outputs.
FALLBACK = 1e-4


def dropouts(module: torch.nn.Module) -> list:
    """The dropout modules of ``module`` in training mode with a non-zero rate (whose
    outputs are random)."""
    return [m for m in module.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)
            and m.training and m.p > 0]


@contextlib.contextmanager
def quiet_dropout(module: torch.nn.Module):
    """Every active dropout module of ``module`` in eval mode (the identity) inside."""
    active = dropouts(module)
    try:
        for m in active:
            m.training = False
        yield
    finally:
        for m in active:
            m.training = True


def reference(wrapped, tensors):
    """``(outputs, widths)``: the module's outputs (``wrapped``:
    :class:`~trainops.torch.wrap.Wrapped`) on ``tensors``, its dropout modules quiet, as
    float64 or integer numpy arrays, and for each floating output how far another float32
    evaluation may be from it (see ``SPREAD``; None for the others). None, with a warning,
    when two runs of the forward differ (random without its dropout modules: functional
    dropout, or a nondeterministic kernel): there is nothing to check against."""
    with quiet_dropout(wrapped.module), torch.no_grad():
        outs = [_numpy(o) for o in wrapped(*tensors)]
        again = [_numpy(o) for o in wrapped(*tensors)]
    if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(outs, again)):
        warnings.warn("trainops.torch.export: two runs of the module's forward differ even "
                      "with its dropout modules in eval mode (functional dropout? a "
                      "nondeterministic kernel?), so the export could not be checked "
                      "against it", stacklevel=3)
        return None
    try:
        copy64 = copy.deepcopy(wrapped).double()
        with quiet_dropout(copy64.module), torch.no_grad():
            outs64 = [_numpy(o) for o in copy64(*[
                t.double() if t.is_floating_point() else t for t in tensors])]
        del copy64
    except Exception:  # noqa: BLE001 -- no float64 forward: the coarse width
        outs64 = [None] * len(outs)
    out = []
    for o, o64 in zip(outs, outs64):
        if o.dtype.kind != "f":
            out.append(None)
        elif o64 is None or o64.shape != o.shape or not o.size:
            out.append(FALLBACK * float(np.abs(o).max()) if o.size else 0.0)
        else:
            e = float(np.abs(o - o64).max())
            out.append(SPREAD * (e + U * float(np.abs(o64).max())))
    return outs, out


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.double() if t.is_floating_point() else t).numpy()


def _quiet(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose Dropout nodes are in inference mode (their training_mode
    input dropped, which defaults to false: the identity), as :func:`quiet_dropout` makes
    the module."""
    out = onnx.ModelProto()
    out.CopyFrom(model)

    def visit(graph):
        for n in graph.node:
            if n.op_type == "Dropout" and n.domain in ("", "ai.onnx"):
                del n.input[2:]
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    visit(g)

    visit(out.graph)
    return out


def verify(model: onnx.ModelProto, names: list, tensors: list, want: tuple | None) -> None:
    """Runs ``model`` (dropout quiet) in onnxruntime on ``tensors`` (fed as ``names``) and
    compares each output with ``want`` (:func:`reference`'s outputs and widths): floating
    outputs within their widths, others exactly. ValueError naming the output that differs
    most (relative to its width). Nothing to check when ``want`` is None (a random
    forward).

    onnxruntime runs with its graph optimizations off: the check is of the graph, and
    onnxruntime 1.32's basic ones change what training-mode BatchNormalization computes
    (its ConstantSharing, which merges equal initializers such as fresh BatchNorms'
    statistics, moves ResNet-18's logits by 0.34 of 1.3)."""
    import onnxruntime as ort

    if want is None:
        return
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(_quiet(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, tensors)}
    outs = [o.name for o in model.graph.output]
    got = session.run(outs, feeds)
    worst = None
    for name, g, w, width in zip(outs, got, *want):
        if g.shape != w.shape:
            problem = (np.inf, f"{name} has the shape {list(g.shape)}, the module's "
                               f"{list(w.shape)}")
        elif width is None:
            problem = None if np.array_equal(g, w) else (np.inf, f"{name} differs")
        else:
            diff = float(np.abs(g.astype(np.float64) - w).max()) if w.size else 0.0
            problem = None if diff <= width else (  # NaN fails too
                diff / width if width else np.inf,
                f"{name} differs by {diff:.3g} (largest magnitude "
                f"{float(np.abs(w).max()):.3g}; float32 rounding allows {width:.3g})")
        if problem is not None and (worst is None or problem[0] > worst[0]):
            worst = problem
    if worst is None:
        return
    raise ValueError("trainops.torch.export: onnxruntime's outputs of the export are not "
                     f"the module's training-mode outputs: {worst[1]}. The export computes "
                     "something else than the module (a value the forward computes from a "
                     "buffer or parameter recorded as a constant?), so training it would "
                     "not train the module")
