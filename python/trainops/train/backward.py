"""The part of the step graph both builders share (:func:`forward_backward`): the forward
graph in training mode (Dropout on, random nodes as seeded Philox ops, float16 compute under
``mixed_float16``) with the backward pass (:mod:`trainops.autodiff`) appended."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..autodiff import GradientError, build_backward, infer
from ..autodiff.backward import default_opset, toposort
from ..autodiff.graph import Builder, skeleton
from ..offload import is_offloaded
from .batchnorm import training_batchnorm
from ..autodiff.batchnorm_forward import batchnorm_forward
from ..autodiff.cross_entropy_forward import cross_entropy_forward
from ..autodiff.depthwise import depthwise_forward
from ..autodiff.simplify import merge_gru_train, merge_recomputations
from ..autodiff.simplify_graph import simplify_backward, step_shapes
from .fp16 import to_fp16_graph
from .params import default_params
from .torch_meta import trainable_params
from .rng import philox_states
from .spec import PREFIX as _P
from .spec import StateEntry, StepOptions

__all__ = ["Backward", "FLOATS", "data_inputs", "forward_backward", "resolve_params",
           "training_source"]

FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)


def resolve_params(model: onnx.ModelProto, loss: str, params) -> list[str]:
    """The parameters to train: ``params``, or for a model of :func:`trainops.torch.export`
    the initializers of the module's trainable parameters (:mod:`.torch_meta`: frozen ones
    stay constants), else the float initializers that are weights
    (:func:`.params.default_params`: never a Dropout ratio, a shape, a 0-d constant or a
    BatchNormalization running statistic). ValueError if ``loss`` is no tensor of the
    model, a param no float initializer, or none is left."""
    g = model.graph
    if loss not in {o for n in g.node for o in n.output} | {i.name for i in g.input}:
        raise ValueError(f"loss {loss!r} is not a tensor of the model")
    float_inits = [i.name for i in g.initializer if i.data_type in FLOATS]
    exported = trainable_params(model) if params is None else None
    if exported is not None:
        params = exported
        if not params:
            raise ValueError("every parameter of the exported torch module is frozen "
                             "(requires_grad=False): nothing to train")
    if params is None:
        params = default_params(model)
        if not params:
            raise ValueError("the model has no float initializers that are weights of an "
                             "op (trainops.train.params); name them with params=")
    params = list(params)
    missing = [p for p in params if p not in float_inits]
    if missing:
        raise ValueError(f"params {missing} are not float initializers of the model")
    if not params:
        raise ValueError("the model has no float initializers to train")
    return params


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` (without large initializers' data) with its nodes in
    topological order, for inference: the rewrites append nodes, keeping positions."""
    m, _ = skeleton(model)
    names = {i.name for i in m.graph.input} | {i.name for i in m.graph.initializer}
    nodes = toposort(list(m.graph.node), names)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def data_inputs(model: onnx.ModelProto) -> list[str]:
    """The model's inputs that are not initializers: the data fed on every step."""
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def training_source(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every Dropout of its main graph in training mode (as PyTorch's
    ``model.train()``: ``training_mode`` a constant true) and with a mask output, which
    its gradient uses, and the labels of every SoftmaxCrossEntropyLoss /
    NegativeLogLikelihoodLoss checked in the graph (:func:`trainops.losses.guard_labels`:
    the same refusal on every placement). Node positions are kept (they give the Philox
    node keys)."""
    from ..losses import guard_labels

    m = onnx.ModelProto()
    m.CopyFrom(model)
    guard_labels(m.graph)
    drops = [n for n in m.graph.node if n.op_type == "Dropout" and n.domain in ("", "ai.onnx")]
    if not drops:
        return m
    if default_opset(m) < 12:
        raise GradientError(f"Dropout before opset 12 (this model imports opset "
                            f"{default_opset(m)}) has no training mode: export the model "
                            "with opset 12 or later to train it")
    on = f"{_P}/training_mode"
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), on))
    for k, n in enumerate(drops):
        ins = list(n.input) + [""] * (3 - len(n.input))
        ins[2] = on
        outs = list(n.output) + [""] * (2 - len(n.output))
        if not outs[1]:
            outs[1] = f"{_P}/dropout_mask/{k}"
        del n.input[:], n.output[:]
        n.input.extend(ins)
        n.output.extend(outs)
    return m


@dataclass
class Backward:
    """The forward graph with the backward pass appended.

    ``graph``: the forward graph, renamed ``<name>_training``, without the parameters'
    initializers and without outputs, with the Philox states among its inputs (its nodes
    are replaced by ``nodes`` once the builder adds its own); ``nodes``: forward
    (Philox-rewritten) and backward nodes; ``grads``: the gradient names in param order;
    ``inferred``: the inferred graph (value types); ``ptypes``/``values``: each param's
    element type and initial value; ``copies``: param -> float16 copy (mixed_float16);
    ``loss_type``: the loss' element type; ``rng``: the Philox states; ``data_inputs``;
    ``opset``: the default-domain opset of the model; ``bn``: the BatchNormalization
    running statistics (``bn_stat`` states, :mod:`.batchnorm`), already graph inputs."""

    graph: onnx.GraphProto
    nodes: list
    grads: list[str]
    inferred: onnx.GraphProto
    ptypes: dict
    values: dict
    copies: dict
    loss_type: int
    rng: list[StateEntry]
    data_inputs: list[str]
    opset: int
    bn: list[StateEntry]


def forward_backward(model: onnx.ModelProto, options: StepOptions) -> Backward:
    """The shared part of both builders, from ``model`` and ``options`` (``params``
    resolved). Under ``mixed_float16`` the gradient seed is the float16 loss scale
    (input ``trainops/loss_scale``), so the gradients come out scaled."""
    params, loss, mixed = list(options.params), options.loss, options.mixed
    inputs = data_inputs(model)
    src = training_source(model)
    opset = default_opset(src)
    bn = training_batchnorm(src, options.batchnorm, opset, params)
    inferred = infer(_sorted(src)).graph
    ptypes, values = {}, {}
    for init in src.graph.initializer:
        if init.name in params:
            values[init.name] = numpy_helper.to_array(init)
            ptypes[init.name] = init.data_type

    g = skeleton(src, limit=-1)[0].graph  # a copy without any initializer ...
    g.name = (src.graph.name or "model") + "_training"
    del g.input[len(src.graph.input):]
    g.initializer.extend(i for i in src.graph.initializer if i.name not in values)  # ... but these
    del g.output[:]
    copies = {}
    if mixed and bn:
        raise NotImplementedError("policy 'mixed_float16' with BatchNormalization in "
                                  "training mode is not supported yet: pass "
                                  "batchnorm='frozen'")
    if mixed:
        for p in values:
            if ptypes[p] != TensorProto.FLOAT:
                raise ValueError(f"mixed_float16 needs float32 parameters; {p!r} is not")
        copies = to_fp16_graph(g, params, inputs)
        inferred_src = onnx.ModelProto()
        inferred_src.CopyFrom(src)
        inferred_src.graph.CopyFrom(g)
        del inferred_src.graph.node[:]
        inferred_src.graph.node.extend(toposort(list(g.node), {i.name for i in g.input}))
        for p, c in copies.items():
            inferred_src.graph.input.append(helper.make_tensor_value_info(
                c, TensorProto.FLOAT16, list(values[p].shape)))
        inferred = infer(inferred_src).graph
    wrt = [copies.get(p, p) for p in params]

    b = Builder(inferred, opset, prefix=f"{_P}/grad")
    b.fused = options.fused
    loss_t = b.dtype(loss)
    if loss_t not in FLOATS:
        raise GradientError(f"loss {loss!r} must be a float tensor (its type is {loss_t})")
    seed = None
    if mixed:
        seed = b.op("Cast", [f"{_P}/loss_scale"], to=TensorProto.FLOAT16)
        if b.shape(loss) not in (None, []):
            seed = b.op("Expand", [seed, b.op("Shape", [loss])])
    b, grads = build_backward(inferred, opset, loss, wrt, seed=seed, builder=b)
    forward, rng = philox_states(src, g, inferred, options.key_seed)
    forward, bnodes = merge_recomputations(forward, list(b.nodes))
    nodes = merge_gru_train(_simplified(src, g, forward + bnodes, values, ptypes, copies,
                                        set(grads) | {loss} | {e.output for e in rng + bn}, opset))
    if options.fused:  # depthwise Conv, training BatchNormalization and the cross-entropy
        # loss forwards on trainops' kernels (autodiff.depthwise, autodiff.batchnorm_forward,
        # autodiff.cross_entropy_forward)
        nodes = cross_entropy_forward(batchnorm_forward(depthwise_forward(nodes, b), b), b)
    if options.recompute:  # gradient checkpointing of the repeated blocks (.recompute)
        from .recompute import recompute_blocks

        if mixed:  # measured: the adapters moved off recompute=False's bits
            raise NotImplementedError("recompute=True with policy 'mixed_float16' is not "
                                      "supported yet: use policy 'float32'")
        nodes = recompute_blocks(nodes, {o for n in forward for o in n.output},
                                 {i.name for i in g.input} | {i.name for i in g.initializer}
                                 | set(values) | set(copies.values()),
                                 set(grads) | {loss} | {e.output for e in rng + bn}, opset)
    return Backward(g, nodes, grads, inferred, ptypes, values, copies,
                    loss_t, rng, inputs, opset, bn)


def _simplified(src, g, nodes, values, ptypes, copies, keep, opset) -> list:
    """``nodes`` after :func:`~trainops.autodiff.simplify_graph.simplify_backward` (exact
    rewrites), with the shapes onnx infers for the whole step and ``g``'s constant
    initializers; ``keep``: the values the step's tail reads."""
    m = onnx.ModelProto()  # src's opsets and g, without src's weights
    m.ir_version = src.ir_version
    m.opset_import.extend(src.opset_import)
    m.graph.CopyFrom(g)
    typed = [helper.make_tensor_value_info(p, ptypes[p], list(v.shape)) for p, v in values.items()]
    typed += [helper.make_tensor_value_info(c, TensorProto.FLOAT16, list(values[p].shape))
              for p, c in copies.items()]
    names = {i.name for i in g.input} | {i.name for i in g.initializer} | set(values) \
        | set(copies.values())
    order = toposort(nodes, names)
    shapes = step_shapes(m, order, typed)
    consts = {i.name: numpy_helper.to_array(i) for i in g.initializer
              if int(np.prod(i.dims)) <= 4096 and not is_offloaded(i)}
    return simplify_backward(order, shapes, keep, consts, opset)
