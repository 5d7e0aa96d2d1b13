"""Gradient accumulation (``accumulate=k``): :func:`build_accumulating` makes the
:class:`~trainops.train.spec.StepGraph` of two models over one state table.

- ``model`` (every call of ``Trainer.step``): forward, loss, backward, then each gradient
  is added in place into its accumulation buffer ``trainops/accum/<p>`` (a ``grad_accum``
  state, zero-initialised, of the parameter's type; float32 under ``mixed_float16``) and
  the micro-batch count ``trainops/accum/count`` goes up by one. The parameters, the
  optimizer state and the loss scale are only read (the loss scale seeds the backward
  pass under ``mixed_float16``, so the buffers sum scaled gradients).
- ``apply_model`` (run after every k-th micro-batch): ``mean = accum / k``, then exactly
  what a one-model step does after its backward pass (:func:`.tail.update_tail`:
  clipping, the optimizer node, the loss scale), on ``mean``. The runtime then zeroes the
  buffers and the count (:mod:`.accumulate_runtime`).

So no optimizer work happens on the other calls, the parameters and the optimizer state
change only on the k-th, and ``T`` counts updates. Both models are all or nothing: the
update model by construction (every node it has feeds the optimizer), the micro-batch
model by :mod:`.barrier`'s ordering, as the one-model step (the count, the buffers'
``Add``, the Philox states and BatchNorm's running statistics, which every micro-batch
updates as PyTorch's forward does, are written after every other node has run); the
runtime undoes the k-th micro-batch's writes when the update after it fails. For a loss
that is a mean over the batch, k micro-batches of B equal one batch of kB (up to float32
summation order).
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..onnx_defs import TRAINOPS_DOMAIN
from .backward import Backward
from .barrier import defer_writes, order_updates
from .spec import PREFIX as _P
from .spec import StateEntry, StepGraph, StepOptions
from .tail import assemble, update_tail

__all__ = ["COUNT", "build_accumulating"]

COUNT = f"{_P}/accum/count"  # the micro-batches added since the last update (int64 [1])


def build_accumulating(model: onnx.ModelProto, options: StepOptions, bw: Backward) -> StepGraph:
    """The accumulating step graph of ``model`` under ``options`` (``params`` resolved,
    ``accumulate`` > 1), from its forward and backward pass ``bw``."""
    k, mixed, ps, loss = options.accumulate, options.mixed, list(options.params), options.loss
    g, nodes = bw.graph, list(bw.nodes)
    acc_dtype = {p: np.dtype(np.float32) if mixed else bw.values[p].dtype for p in ps}
    accs = [StateEntry(f"{_P}/accum/{p}", f"{_P}/new/accum/{p}", "grad_accum",
                       np.zeros(bw.values[p].shape, acc_dtype[p]), param=p, slot="sum")
            for p in ps]
    count = StateEntry(COUNT, f"{_P}/new/accum/count", "grad_accum", np.zeros([1], np.int64),
                       slot="count")
    # The micro-batch model: forward, backward, accum += gradient, count += 1.
    loss_out = loss
    if mixed:
        loss_out = f"{_P}/loss_float32"
        nodes.append(helper.make_node("Cast", [loss], [loss_out], to=TensorProto.FLOAT))
    # The writers: count += 1 (reading the count through the barrier's "+ 0"), then each
    # buffer += its gradient (reading the gradient through the barrier's Reshape), so that
    # a micro-batch whose run fails changes no buffer, no count and no other state.
    nodes.append(helper.make_node("Constant", [], [f"{COUNT}/one"], name=f"{COUNT}/one",
                                  value=numpy_helper.from_array(np.array([1], np.int64))))
    writers = [helper.make_node("Add", [COUNT, f"{COUNT}/one"], [count.output], name=COUNT)]
    held = []
    for e, grad in zip(accs, bw.grads):
        if mixed:
            nodes.append(helper.make_node("Cast", [grad], [f"{e.input}/grad"],
                                          to=TensorProto.FLOAT, name=f"{e.input}/cast"))
            grad = f"{e.input}/grad"
        writers.append(helper.make_node("Add", [e.input, grad], [e.output],
                                        name=f"{e.input}/add"))
        held.append((grad, e.initial.shape))
    deferred = defer_writes(g, nodes, bw.rng + bw.bn)
    nodes = order_updates(nodes, writers, [loss_out], COUNT, deferred, bw.opset, held)
    # The update model, on the mean of the buffers.
    means = [f"{e.input}/mean" for e in accs]
    apply_nodes = []
    for e, mean in zip(accs, means):
        kk = f"{e.input}/k"
        apply_nodes += [helper.make_node("Constant", [], [kk], name=kk, value=numpy_helper
                                         .from_array(np.array([k], e.initial.dtype))),
                        helper.make_node("Div", [e.input, kk], [mean], name=mean)]
    grad_types = [helper.np_dtype_to_tensor_dtype(e.initial.dtype) for e in accs]
    tail = update_tail(options, means, bw.values, bw.ptypes, bw.copies, grad_types)
    # The micro model reads (without writing) the tail's states its nodes use.
    used = {i for n in nodes for i in n.input}
    reads = [helper.make_tensor_value_info(e.input, helper.np_dtype_to_tensor_dtype(
        e.initial.dtype), list(e.initial.shape)) for e in tail.states if e.input in used]
    vi = {v.name: v for v in bw.inferred.value_info}
    loss_vi = vi[loss_out] if loss_out in vi else helper.make_empty_tensor_value_info(loss_out)
    if not loss_vi.type.HasField("tensor_type"):
        loss_vi.type.CopyFrom(helper.make_tensor_type_proto(
            TensorProto.FLOAT if mixed else bw.loss_type, None))
    domains = {TRAINOPS_DOMAIN: 1} if bw.rng else {}
    written = bw.rng + accs + [count] + bw.bn  # the states the micro-batch model writes
    micro = assemble(g, nodes, written, reads, [loss_vi], [], model, domains)
    ag = helper.make_graph([], "trainops_apply", [], [])
    acc_in = [helper.make_tensor_value_info(e.input, t, list(e.initial.shape))
              for e, t in zip(accs, grad_types)]
    apply = assemble(ag, apply_nodes + tail.nodes + tail.writers, tail.states, tail.inputs + acc_in, [],
                     tail.outputs, model, tail.domains)
    return StepGraph(
        model=micro, options=options, data_inputs=bw.data_inputs, loss_output=loss_out,
        lr_input=f"{_P}/lr", lr_dtype=np.float64 if tail.lr_type == TensorProto.DOUBLE
        else np.float32, step_input=f"{_P}/T",
        states=tail.states + written,
        extra_outputs=[o.name for o in tail.outputs], finite_output=tail.finite,
        norm_output=tail.norm, apply_model=apply)
