"""The step graph builder: :func:`build_step_graph` turns a model and
:class:`~trainops.train.spec.StepOptions` into a :class:`~trainops.train.spec.StepGraph`,
one ONNX model running forward, loss, backward and the optimizer, with its state table
(with ``accumulate`` > 1, two models: :mod:`.accumulate`).

A pure function of its arguments: no session, no buffers (:mod:`.runtime` binds them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import onnx
from onnx import TensorProto, helper

from ..onnx_defs import TRAINOPS_DOMAIN
from .accumulate import build_accumulating
from .backward import forward_backward, resolve_params
from .barrier import defer_writes, order_updates
from .spec import PREFIX as _P
from .spec import StepGraph, StepOptions
from .tail import assemble, optimizer_domain, update_tail

__all__ = ["build_step_graph", "optimizer_domain"]


def build_step_graph(model: onnx.ModelProto, options: StepOptions) -> StepGraph:
    """The one-session training step of ``model`` under ``options`` (``options.params``
    None: resolved to the default parameters; the returned graph's options carry them).

    Names (prefix ``trainops/``): inputs ``lr`` and ``T``; optimizer state ``<S>/<param>``
    with output ``new/<S>/<param>``; each parameter ``p`` is updated to ``new/p``. Under
    ``mixed_float16``: ``MixedPrecisionAdam`` (with float16 copies ``<p>/float16``),
    ``DynamicLossScale`` (``loss_scale``, ``good_steps``), the float32 loss
    ``loss_float32`` and the flag ``finite``. With ``clip_grad_norm``: the total norm
    ``grad_norm`` (:mod:`.clip`)."""
    params = resolve_params(model, options.loss, options.params)
    options = dataclasses.replace(options, params=params)
    bw = forward_backward(model, options)
    if options.accumulate > 1:
        return build_accumulating(model, options, bw)
    g, nodes, mixed, loss = bw.graph, bw.nodes, options.mixed, options.loss

    loss_out = loss
    if mixed:
        loss_out = f"{_P}/loss_float32"
        nodes.append(helper.make_node("Cast", [loss], [loss_out], to=TensorProto.FLOAT))
    tail = update_tail(options, bw.grads, bw.values, bw.ptypes, bw.copies)
    # All or nothing (.barrier): the Philox ops write fresh tensors, every in-place write
    # runs after every other node, nodes nothing needs are dropped.
    # States the forward pass writes (Philox's, BatchNorm's statistics) go to fresh tensors.
    deferred = defer_writes(g, nodes, bw.rng + bw.bn)
    nodes = order_updates(nodes + tail.nodes, tail.writers, [loss_out], f"{_P}/T", deferred,
                          bw.opset)
    vi = {v.name: v for v in bw.inferred.value_info}
    loss_vi = vi[loss_out] if loss_out in vi else helper.make_empty_tensor_value_info(loss_out)
    if not loss_vi.type.HasField("tensor_type"):
        loss_vi.type.CopyFrom(helper.make_tensor_type_proto(
            TensorProto.FLOAT if mixed else bw.loss_type, None))
    states = tail.states + bw.rng + bw.bn
    domains = dict(tail.domains)
    if bw.rng:
        domains.setdefault(TRAINOPS_DOMAIN, 1)
    m = assemble(g, nodes, states, tail.inputs, [loss_vi], tail.outputs, model, domains)
    extra = [o.name for o in tail.outputs]
    return StepGraph(
        model=m, options=options, data_inputs=bw.data_inputs, loss_output=loss_out,
        lr_input=f"{_P}/lr", lr_dtype=np.float64 if tail.lr_type == TensorProto.DOUBLE
        else np.float32, step_input=f"{_P}/T", states=states, extra_outputs=extra,
        finite_output=tail.finite, norm_output=tail.norm)
