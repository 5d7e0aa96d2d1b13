"""The data-parallel step's two models (:func:`build_distributed`): the gradient model
(forward, loss, backward: parameters in, loss and gradients out) and the optimizer model
(one optimizer node on one flat tensor: all the parameters, or one rank's slice of them
under ``shard_optimizer``), with the flat buffers' layout. Element-wise optimizers make the
flat update the same as the per-tensor one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

import onnx
from onnx import TensorProto, helper

from ..autodiff.backward import toposort
from .backward import forward_backward, resolve_params
from .graph import optimizer_domain
from .spec import PREFIX as _P
from .spec import StateEntry, StepOptions

__all__ = ["DistributedGraphs", "Layout", "build_distributed"]


@dataclass
class Layout:
    """The flat buffers: each parameter (and its gradient) at ``offsets[p]``; ``total``
    elements, ``padded`` to a multiple of the ranks under ``shard_optimizer``; each rank's
    optimizer works on ``shard`` elements (``total`` unsharded)."""

    offsets: dict[str, int]
    total: int
    padded: int
    shard: int


@dataclass
class DistributedGraphs:
    """What :func:`build_distributed` builds: ``gradient_model`` (outputs: the loss, then
    ``grad_outputs`` in param order, then the Philox states' new values),
    ``optimizer_model`` (inputs ``trainops/lr``, ``trainops/T``, ``trainops/flat/params``,
    ``trainops/flat/grads``, ``trainops/flat/<S>``; outputs ``.../new``), ``options``
    (params resolved), ``data_inputs``, ``initial`` (param -> value), ``rng`` (Philox
    states, kind ``"rng"``), ``layout``, ``dtype`` (the parameters' numpy dtype, also
    the learning rate's), ``bn`` (the BatchNormalization running statistics: each rank
    keeps its own, updated from its shard of the batch; no SyncBatchNorm)."""

    gradient_model: onnx.ModelProto
    optimizer_model: onnx.ModelProto
    options: StepOptions
    data_inputs: list[str]
    grad_outputs: list[str]
    initial: dict
    rng: list[StateEntry]
    layout: Layout
    dtype: type
    bn: list[StateEntry]


def build_distributed(model: onnx.ModelProto, options: StepOptions, ranks: int,
                      shard_optimizer: bool) -> DistributedGraphs:
    """The two models of data-parallel training over ``ranks`` ranks (``options.key_seed``:
    this rank's Philox key seed)."""
    params = resolve_params(model, options.loss, options.params)
    options = dataclasses.replace(options, params=params)
    bw = forward_backward(model, options)
    g, nodes, values, ps = bw.graph, bw.nodes, bw.values, params
    dtypes = {bw.ptypes[p] for p in ps}
    if len(dtypes) != 1:
        raise ValueError("comm= needs parameters of one float type (they share one flat "
                         f"buffer), got {sorted(dtypes)}")
    ptype = dtypes.pop()
    offsets, total = {}, 0
    for p in ps:
        offsets[p] = total
        total += int(values[p].size)
    padded = -(-total // ranks) * ranks if shard_optimizer else total
    layout = Layout(offsets, total, padded, padded // ranks if shard_optimizer else total)

    taken = {i.name for i in g.input} | {i.name for i in g.initializer}
    for p in ps:
        g.input.append(helper.make_tensor_value_info(p, ptype, list(values[p].shape)))
    del g.output[:]
    vi = {v.name: v for v in bw.inferred.value_info}
    loss = options.loss
    g.output.append(vi[loss] if loss in vi else helper.make_tensor_value_info(
        loss, bw.loss_type, None))
    grad_outputs = []
    seen = {loss}
    for p, name in zip(ps, bw.grads):
        if name in taken or name in seen or name in ps:
            # a gradient that is an input, a constant or another output: copy it
            new = f"{_P}/grad/{p}"
            nodes.append(helper.make_node("Identity", [name], [new], name=f"{_P}/grad_copy/{p}"))
            name = new
        seen.add(name)
        grad_outputs.append(name)
        g.output.append(helper.make_tensor_value_info(name, ptype, list(values[p].shape)))
    for e in bw.rng:
        g.output.append(helper.make_tensor_value_info(e.output, TensorProto.UINT32, [6]))
    for e in bw.bn:
        g.output.append(helper.make_tensor_value_info(
            e.output, helper.np_dtype_to_tensor_dtype(e.initial.dtype), list(e.initial.shape)))
    available = {i.name for i in g.input} | {i.name for i in g.initializer}
    del g.node[:]
    g.node.extend(toposort(nodes, available))
    imports = list(model.opset_import)
    used = {n.domain for n in g.node} - {"", "ai.onnx"} - {o.domain for o in imports}
    imports += [helper.make_opsetid(d, 1) for d in sorted(used)]
    gm = helper.make_model(g, opset_imports=imports, producer_name="trainops.Trainer")
    gm.ir_version = model.ir_version

    opt = options.optimizer
    domain = optimizer_domain(opt)
    shard = layout.shard
    r_type = TensorProto.DOUBLE if ptype == TensorProto.DOUBLE else TensorProto.FLOAT
    x, gr = f"{_P}/flat/params", f"{_P}/flat/grads"
    st = [f"{_P}/flat/{s}" for s in opt.state]
    og = helper.make_graph(
        [helper.make_node(opt.op_type, [f"{_P}/lr", f"{_P}/T", x, gr] + st,
                          [x + "/new"] + [s + "/new" for s in st], domain=domain,
                          name=f"{_P}/{opt.op_type.lower()}", **opt.attributes())],
        "trainops_optimizer",
        [helper.make_tensor_value_info(f"{_P}/lr", r_type, [1]),
         helper.make_tensor_value_info(f"{_P}/T", TensorProto.INT64, [1])]
        + [helper.make_tensor_value_info(v, ptype, [shard]) for v in [x, gr] + st],
        [helper.make_tensor_value_info(v + "/new", ptype, [shard]) for v in [x] + st])
    om = helper.make_model(og, opset_imports=[helper.make_opsetid("", bw.opset),
                                              helper.make_opsetid(domain, 1)],
                           producer_name="trainops.Trainer")
    om.ir_version = model.ir_version
    return DistributedGraphs(gm, om, options, bw.data_inputs, grad_outputs, values, bw.rng,
                             layout, np.float64 if ptype == TensorProto.DOUBLE else np.float32,
                             bw.bn)
