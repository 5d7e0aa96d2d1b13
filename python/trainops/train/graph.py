"""The step graph builder: :func:`build_step_graph` turns a model and
:class:`~trainops.train.spec.StepOptions` into a :class:`~trainops.train.spec.StepGraph`,
one ONNX model running forward, loss, backward and the optimizer, with its state table.

A pure function of its arguments: no session, no buffers (:mod:`.runtime` binds them).
"""

from __future__ import annotations

import numpy as np

import onnx
from onnx import TensorProto, helper

from ..autodiff.backward import toposort
from ..onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN
from .backward import forward_backward, resolve_params
from .spec import PREFIX as _P
from .spec import StateEntry, StepGraph, StepOptions

__all__ = ["build_step_graph", "optimizer_domain"]


def optimizer_domain(optimizer) -> str:
    """The domain of ``optimizer``'s node: its ``domain`` attribute, else ONNX's training
    domain (``Adam``, ``Adagrad``, ``Momentum``)."""
    return getattr(optimizer, "domain", TRAINING_DOMAIN)


def build_step_graph(model: onnx.ModelProto, options: StepOptions) -> StepGraph:
    """The one-session training step of ``model`` under ``options`` (``options.params``
    None: resolved to the default parameters; the returned graph's options carry them).

    Names (prefix ``trainops/``): inputs ``lr`` and ``T``; optimizer state ``<S>/<param>``
    with output ``new/<S>/<param>``; each parameter ``p`` is updated to ``new/p``. Under
    ``mixed_float16``: ``MixedPrecisionAdam`` (with float16 copies ``<p>/float16``),
    ``DynamicLossScale`` (``loss_scale``, ``good_steps``), the float32 loss
    ``loss_float32`` and the flag ``finite``."""
    params = resolve_params(model, options.loss, options.params)
    options = StepOptions(options.loss, options.optimizer, params, options.policy,
                          options.key_seed, options.batchnorm)
    bw = forward_backward(model, options)
    g, nodes, grads, values, ptypes = bw.graph, bw.nodes, bw.grads, bw.values, bw.ptypes
    mixed, opt, ps, loss = options.mixed, options.optimizer, params, options.loss

    r_name, t_name = f"{_P}/lr", f"{_P}/T"
    new = {p: f"{_P}/new/{p}" for p in ps}
    opt_states = [StateEntry(f"{_P}/{s}/{p}", f"{_P}/new/{s}/{p}", "optimizer",
                             np.zeros(values[p].shape, values[p].dtype), param=p, slot=s)
                  for s in opt.state for p in ps]
    state_in = [e.input for e in opt_states]
    state_out = [e.output for e in opt_states]
    params_states = [StateEntry(p, new[p], "param", values[p], param=p) for p in ps]
    scale_states: list[StateEntry] = []
    copy_states: list[StateEntry] = []
    loss_out, outs = loss, []
    if mixed:
        from ..mixed_precision import KERAS_INITIAL_LOSS_SCALE

        loss_out = f"{_P}/loss_float32"
        nodes.append(helper.make_node("Cast", [loss], [loss_out], to=TensorProto.FLOAT))
        copy_states = [StateEntry(bw.copies[p], f"{_P}/new/{bw.copies[p]}", "fp16_copy",
                                  values[p].astype(np.float16), param=p) for p in ps]
        scale_states = [
            StateEntry(f"{_P}/loss_scale", f"{_P}/new/loss_scale", "loss_scale",
                       np.array([KERAS_INITIAL_LOSS_SCALE], np.float32), slot="scale"),
            StateEntry(f"{_P}/good_steps", f"{_P}/new/good_steps", "loss_scale",
                       np.array([0], np.int64), slot="good_steps")]
        nodes.append(helper.make_node(
            "MixedPrecisionAdam", [r_name, t_name, f"{_P}/loss_scale"] + ps + grads + state_in,
            [f"{_P}/finite"] + [new[p] for p in ps] + state_out + [e.output for e in copy_states],
            domain=TRAINOPS_DOMAIN, name=f"{_P}/mixed_precision_adam",
            copy_dtype=TensorProto.FLOAT16, **opt.attributes()))
        nodes.append(helper.make_node(
            "DynamicLossScale", [f"{_P}/loss_scale", f"{_P}/good_steps", f"{_P}/finite"],
            [f"{_P}/new/loss_scale", f"{_P}/new/good_steps"], domain=TRAINOPS_DOMAIN,
            name=f"{_P}/dynamic_loss_scale"))
        outs = [f"{_P}/finite"]
    else:
        nodes.append(helper.make_node(
            opt.op_type, [r_name, t_name] + ps + grads + state_in,
            [new[p] for p in ps] + state_out, domain=optimizer_domain(opt),
            name=f"{_P}/{opt.op_type.lower()}", **opt.attributes()))

    r_type = TensorProto.DOUBLE if any(ptypes[p] == TensorProto.DOUBLE for p in ps) \
        and not mixed else TensorProto.FLOAT
    g.input.extend([helper.make_tensor_value_info(r_name, r_type, [1]),
                    helper.make_tensor_value_info(t_name, TensorProto.INT64, [1])])
    for e in params_states + opt_states:
        g.input.append(helper.make_tensor_value_info(e.input, ptypes[e.param],
                                                     list(values[e.param].shape)))
    g.input.extend([helper.make_tensor_value_info(f"{_P}/loss_scale", TensorProto.FLOAT, [1]),
                    helper.make_tensor_value_info(f"{_P}/good_steps", TensorProto.INT64, [1])]
                   if mixed else [])
    g.input.extend(helper.make_tensor_value_info(e.input, TensorProto.FLOAT16,
                                                 list(e.initial.shape)) for e in copy_states)
    available = {i.name for i in g.input} | {i.name for i in g.initializer}
    del g.node[:]
    g.node.extend(toposort(nodes, available))
    # Outputs: the loss, every state's new value (its input's type), the extra outputs.
    aliased = copy_states + scale_states + params_states + opt_states + bw.rng + bw.bn
    vi = {v.name: v for v in bw.inferred.value_info}
    types = {i.name: i.type for i in g.input}
    g.output.append(vi[loss_out] if loss_out in vi
                    else helper.make_empty_tensor_value_info(loss_out))
    if not g.output[0].type.HasField("tensor_type"):
        g.output[0].type.CopyFrom(helper.make_tensor_type_proto(
            TensorProto.FLOAT if mixed else bw.loss_type, None))
    for e in aliased:
        o = g.output.add()
        o.name = e.output
        o.type.CopyFrom(types[e.input])
    for name in outs:  # the finite flag
        g.output.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))

    domains = {o.domain: o.version for o in model.opset_import}
    domains[TRAINING_DOMAIN] = 1
    if mixed or bw.rng:
        domains[TRAINOPS_DOMAIN] = 1
    if not mixed:
        domains.setdefault(optimizer_domain(opt), 1)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in domains.items()],
                          producer_name="trainops.Trainer")
    m.ir_version = model.ir_version
    return StepGraph(
        model=m, options=options, data_inputs=bw.data_inputs, loss_output=loss_out,
        lr_input=r_name, lr_dtype=np.float64 if r_type == TensorProto.DOUBLE else np.float32,
        step_input=t_name,
        states=params_states + opt_states + scale_states + copy_states + bw.rng + bw.bn,
        extra_outputs=list(outs), finite_output=outs[0] if outs else None)
