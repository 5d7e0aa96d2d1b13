"""What follows the gradients in a step graph, shared by :func:`.graph.build_step_graph`
and the accumulation builder (:mod:`.accumulate`): :func:`update_tail` (clipping, the
optimizer node, under ``mixed_float16`` ``MixedPrecisionAdam`` + ``DynamicLossScale``)
with its states, and :func:`assemble` (graph inputs and outputs of the states, opsets).
Pure functions: no session, no buffers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import onnx
from onnx import TensorProto, helper

from ..autodiff.backward import toposort
from ..onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN
from ..optim import SMALL_TENSOR, float_state, initial_state
from .clip import clip_grad_norm
from .spec import PREFIX as _P
from .spec import StateEntry, StepOptions

__all__ = ["OPTIMIZER_SEED_INDEX", "Tail", "assemble", "optimizer_attributes",
           "optimizer_domain", "optimizer_groups", "update_tail"]

# The bfloat16-state ops' ``seed`` attribute (their stochastic rounding) is
# ``trainops.random.node_key(key_seed, OPTIMIZER_SEED_INDEX)``: a key of its own, apart
# from the Philox nodes' (indices 0, 1, ... in graph order).
OPTIMIZER_SEED_INDEX = 0xFFFFFFFF


def optimizer_attributes(optimizer, key_seed: int) -> dict:
    """The optimizer node's attributes: ``optimizer.attributes()``, and under
    ``state_dtype="bfloat16"`` the ``seed`` keyed by ``key_seed`` (a signed int64)."""
    attrs = optimizer.attributes()
    if getattr(optimizer, "state_dtype", "float32") == "bfloat16":
        from ..random import node_key

        k = node_key(key_seed, OPTIMIZER_SEED_INDEX)
        attrs["seed"] = k - (1 << 64) if k >= 1 << 63 else k
    return attrs


def optimizer_domain(optimizer) -> str:
    """The domain of ``optimizer``'s node: its ``domain`` attribute, else ONNX's training
    domain (``Adam``, ``Adagrad``, ``Momentum``)."""
    return getattr(optimizer, "domain", TRAINING_DOMAIN)


@dataclass
class Tail:
    """The update: ``nodes`` (the clipping), ``writers`` (the nodes writing state in place:
    the optimizer node(s) first (two under ``state_dtype="int8"`` with small tensors), then
    ``DynamicLossScale``); ``states`` (params, optimizer,
    loss scale, float16 copies,
    in ``KINDS`` order); ``inputs`` (lr, T: value infos); ``outputs`` (extra outputs:
    value infos: the finite flag, the gradient norm); ``finite``/``norm``: their names or
    None; ``lr_type``; ``domains`` the nodes need."""

    nodes: list
    writers: list
    states: list[StateEntry]
    inputs: list
    outputs: list
    finite: str | None
    norm: str | None
    lr_type: int
    domains: dict = field(default_factory=dict)


def optimizer_groups(opt, params: list[str], values: dict) -> list[tuple]:
    """``(optimizer, params)`` per optimizer node, in ``params`` order within each: one
    group, except under ``state_dtype="int8"`` where the parameters with fewer than
    :data:`trainops.optim.SMALL_TENSOR` values form a second group with float32 state
    (:func:`trainops.optim.float_state`); a group is left out when empty."""
    if getattr(opt, "state_dtype", "float32") != "int8":
        return [(opt, list(params))]
    big = [p for p in params if np.size(values[p]) >= SMALL_TENSOR]
    small = [p for p in params if np.size(values[p]) < SMALL_TENSOR]
    return [(o, g) for o, g in ((opt, big), (float_state(opt), small)) if g]


def update_tail(options: StepOptions, grads: list[str], values: dict, ptypes: dict,
                copies: dict, grad_types: list[int] | None = None) -> Tail:
    """The update of ``options.params`` (values, element types ``ptypes``, float16
    ``copies`` under ``mixed_float16``) from the gradients ``grads`` (in param order, of
    ``grad_types``, default float16 under ``mixed_float16`` else the params' types):
    clipped first with ``options.clip_grad_norm``.

    Names (prefix ``trainops/``): inputs ``lr`` and ``T``; optimizer state ``<S>/<param>``
    with output ``new/<S>/<param>``; each parameter ``p`` is updated to ``new/p``. Under
    ``mixed_float16``: ``MixedPrecisionAdam`` (with float16 copies ``<p>/float16``),
    ``DynamicLossScale`` (``loss_scale``, ``good_steps``) and the flag ``finite``."""
    mixed, opt, ps = options.mixed, options.optimizer, list(options.params)
    if grad_types is None:
        grad_types = [TensorProto.FLOAT16 if mixed else ptypes[p] for p in ps]
    r_name, t_name = f"{_P}/lr", f"{_P}/T"
    new = {p: f"{_P}/new/{p}" for p in ps}
    nodes, writers, outs, domains = [], [], [], {}
    norm = finite = None
    if options.clip_grad_norm is not None:
        c = clip_grad_norm(grads, grad_types, options.clip_grad_norm,
                           f"{_P}/loss_scale" if mixed else None)
        nodes += c.nodes
        grads, norm = c.grads, c.norm
        outs.append(helper.make_tensor_value_info(norm, c.norm_type, [1]))
    groups = optimizer_groups(opt, ps, values) if not mixed else [(opt, ps, grads)]
    if not mixed:
        at = {p: k for k, p in enumerate(ps)}
        groups = [(o, g, [grads[at[p]] for p in g]) for o, g in groups]
    opt_states = []
    for o, g, _ in groups:
        initial = {p: initial_state(o, values[p]) for p in g}
        opt_states += [StateEntry(f"{_P}/{s}/{p}", f"{_P}/new/{s}/{p}", "optimizer",
                                  initial[p][s], param=p, slot=s)
                       for s in o.state for p in g]
    state_in = [e.input for e in opt_states]
    state_out = [e.output for e in opt_states]
    params_states = [StateEntry(p, new[p], "param", values[p], param=p) for p in ps]
    scale_states: list[StateEntry] = []
    copy_states: list[StateEntry] = []
    if mixed:
        from ..mixed_precision import KERAS_INITIAL_LOSS_SCALE

        copy_states = [StateEntry(copies[p], f"{_P}/new/{copies[p]}", "fp16_copy",
                                  values[p].astype(np.float16), param=p) for p in ps]
        scale_states = [
            StateEntry(f"{_P}/loss_scale", f"{_P}/new/loss_scale", "loss_scale",
                       np.array([KERAS_INITIAL_LOSS_SCALE], np.float32), slot="scale"),
            StateEntry(f"{_P}/good_steps", f"{_P}/new/good_steps", "loss_scale",
                       np.array([0], np.int64), slot="good_steps")]
        finite = f"{_P}/finite"
        writers.append(helper.make_node(
            "MixedPrecisionAdam", [r_name, t_name, f"{_P}/loss_scale"] + ps + grads + state_in,
            [finite] + [new[p] for p in ps] + state_out + [e.output for e in copy_states],
            domain=TRAINOPS_DOMAIN, name=f"{_P}/mixed_precision_adam",
            copy_dtype=TensorProto.FLOAT16, **opt.attributes()))
        writers.append(helper.make_node(
            "DynamicLossScale", [f"{_P}/loss_scale", f"{_P}/good_steps", finite],
            [f"{_P}/new/loss_scale", f"{_P}/new/good_steps"], domain=TRAINOPS_DOMAIN,
            name=f"{_P}/dynamic_loss_scale"))
        outs.insert(0, helper.make_tensor_value_info(finite, TensorProto.BOOL, []))
        domains[TRAINOPS_DOMAIN] = 1
    else:
        # One node per group (int8 state: the 8-bit op, then the float op of the small
        # tensors); every one is a writer that .barrier orders after all other nodes.
        for o, g, gg in groups:
            st = [e for e in opt_states if e.param in set(g)]
            writers.append(helper.make_node(
                o.op_type, [r_name, t_name] + g + gg + [e.input for e in st],
                [new[p] for p in g] + [e.output for e in st], domain=optimizer_domain(o),
                name=f"{_P}/{o.op_type.lower()}", **optimizer_attributes(o, options.key_seed)))
            domains[optimizer_domain(o)] = 1
    r_type = TensorProto.DOUBLE if any(ptypes[p] == TensorProto.DOUBLE for p in ps) \
        and not mixed else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(r_name, r_type, [1]),
              helper.make_tensor_value_info(t_name, TensorProto.INT64, [1])]
    return Tail(nodes, writers, params_states + opt_states + scale_states + copy_states, inputs, outs,
                finite, norm, r_type, domains)


def assemble(graph: onnx.GraphProto, nodes: list, states: list[StateEntry], inputs: list,
             first_outputs: list, extra_outputs: list, source: onnx.ModelProto,
             domains: dict) -> onnx.ModelProto:
    """``graph`` (its initializers and data inputs kept) completed into a model:
    ``inputs`` (value infos), then every state's input not yet there (the type and shape
    of its initial value), ``nodes`` sorted; outputs
    ``first_outputs`` (value infos: the loss), every state's output (its input's type),
    ``extra_outputs``; opsets: ``source``'s, ``ai.onnx.preview.training`` and
    ``domains``; ``source``'s IR version."""
    present = {i.name for i in graph.input}
    graph.input.extend(i for i in inputs if i.name not in present)
    present |= {i.name for i in inputs}
    for e in states:
        if e.input in present:
            continue
        elem = helper.np_dtype_to_tensor_dtype(e.initial.dtype)
        graph.input.append(helper.make_tensor_value_info(e.input, elem, list(e.initial.shape)))
        present.add(e.input)
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    del graph.node[:]
    graph.node.extend(toposort(nodes, available))
    del graph.output[:]
    graph.output.extend(first_outputs)
    in_types = {i.name: i.type for i in graph.input}
    for e in states:
        o = graph.output.add()
        o.name = e.output
        o.type.CopyFrom(in_types[e.input])
    graph.output.extend(extra_outputs)
    opsets = {o.domain: o.version for o in source.opset_import}
    opsets[TRAINING_DOMAIN] = 1
    for d, v in domains.items():
        opsets.setdefault(d, v)
    for n in graph.node:  # trainops' gradient kernels (StepOptions.fused) among them
        if n.domain not in ("", "ai.onnx"):
            opsets.setdefault(n.domain, 1)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v)
                                                for d, v in opsets.items()],
                          producer_name="trainops.Trainer")
    m.ir_version = source.ir_version
    return m
