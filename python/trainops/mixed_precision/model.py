"""One Adam step under a :class:`~trainops.mixed_precision.Policy` as an ONNX model
(:func:`optimizer_model`), its value names and its initial state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from ..onnx_defs import IR_VERSION, TRAINING_DOMAIN, TRAINOPS_DOMAIN, opset_imports, tensor_type
from .policy import KERAS_GROWTH_INTERVAL, Policy

__all__ = ["ADAM_ATTRIBUTES", "optimizer_names", "optimizer_model", "optimizer_state"]

ADAM_ATTRIBUTES = ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post")


def _params(params: Union[Mapping[str, Any], Sequence[tuple[str, Any]]]) -> list[tuple[str, Any]]:
    items = list(params.items()) if isinstance(params, Mapping) else [tuple(p) for p in params]
    if not items:
        raise ValueError("optimizer_model needs at least one parameter")
    out = []
    for item in items:
        if len(item) != 2:
            raise ValueError(f"a parameter is (name, shape), got {item!r}")
        name, shape = item
        if not isinstance(name, str) or not name:
            raise ValueError(f"a parameter name must be a non-empty string, got {name!r}")
        if shape is not None:
            shape = tuple(None if d is None else (d if isinstance(d, str) else int(d))
                          for d in shape)
        out.append((name, shape))
    return out


def optimizer_names(params, policy: Union[str, Policy] = "float32") -> tuple[list[str], list[str]]:
    """(graph input names, graph output names) of :func:`optimizer_model`."""
    policy = Policy(policy)
    names = [n for n, _ in _params(params)]
    inputs = ["lr", "step"]
    outputs = ["step.new"]
    if policy.uses_loss_scaling:
        inputs += ["loss_scale", "good_steps"]
        outputs += ["loss_scale.new", "good_steps.new"]
    if policy.is_mixed:
        outputs.append("finite")
    for suffix in ("", ".grad", ".m", ".v"):
        inputs += [n + suffix for n in names]
    for suffix in ("", ".m", ".v"):
        outputs += [n + suffix + ".new" for n in names]
    if policy.is_mixed:
        outputs += [n + ".copy" for n in names]
    seen: set[str] = set()
    for n in inputs + outputs:
        if n in seen:
            raise ValueError(f"parameter names clash: value name {n!r} would be used twice "
                             f"(reserved: lr, step, loss_scale, good_steps, finite and "
                             f"'<name>.grad/.m/.v/.new/.copy')")
        seen.add(n)
    return inputs, outputs


def optimizer_model(
    params: Union[Mapping[str, Any], Sequence[tuple[str, Any]]],
    policy: Union[str, Policy] = "float32",
    lr: Optional[float] = None,
    *,
    growth_interval: Optional[int] = None,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 0.0,
    **adam_attrs: float,
):
    """An ONNX model of one Adam step over ``params`` under ``policy``.

    ``params``: ``[(name, shape), ...]`` or ``{name: shape}`` (a shape may hold ``None``
    or strings for symbolic dimensions). ``lr``: ``None`` makes ``lr`` a required input; a
    number makes it an input with that default (an overridable initializer).
    ``adam_attrs``: Adam's ``alpha``, ``beta``, ``epsilon``, ``norm_coefficient``,
    ``norm_coefficient_post`` (ONNX defaults otherwise). ``growth_interval`` (default
    2000, Keras' and PyTorch's), ``growth_factor``, ``backoff_factor``, ``min_scale``:
    ``DynamicLossScale``'s attributes (``mixed_float16`` only).

    Graph inputs (``V`` = the policy's variable dtype, ``C`` = its compute dtype; in a
    plain policy both are the one dtype):

    ============== ========================================= ==========================
    name           meaning                                   type, shape
    ============== ========================================= ==========================
    ``lr``         learning rate                             float32 (float64 policy:
                                                             float64), ``()``
    ``step``       updates applied so far (0 before the      int64, ``()``
                   first); Adam's ``T`` is ``step + 1``
    ``loss_scale`` the loss scale the gradients carry        float32, ``()``
                   (``mixed_float16`` only)
    ``good_steps`` finite steps since the scale last         int64, ``()``
                   changed (``mixed_float16`` only)
    ``w``          the weights, per parameter ``w``          V, w's shape
    ``w.grad``     the gradient (``mixed_float16``: of the   C, w's shape
                   scaled loss)
    ``w.m``        Adam's first moment (``V`` of the op)     V, w's shape
    ``w.v``        Adam's second moment (``H`` of the op)    V, w's shape
    ============== ========================================= ==========================

    Graph outputs: ``step.new`` (``step + 1``; in a mixed policy ``step`` when the step
    was skipped), ``loss_scale.new`` and ``good_steps.new`` (``mixed_float16``),
    ``finite`` (bool ``()``, mixed policies: false when some unscaled gradient was
    not finite and the step was skipped), ``w.new``, ``w.m.new``, ``w.v.new``, and in mixed
    policies ``w.copy`` (``w.new`` in the compute dtype, for the next forward pass).

    For an in-place step, bind (IOBinding) every ``<name>.new`` output to the ``OrtValue``
    of input ``<name>``; bind ``w.copy`` to a persistent compute-dtype buffer.
    :class:`InPlaceOptimizer` does this.

    The model has IR version 8 and imports opset 17 of the default domain (``Add``,
    ``Cast``) and version 1 of every other domain it uses.
    """
    from onnx import TensorProto, helper

    policy = Policy(policy)
    params = _params(params)
    unknown = sorted(set(adam_attrs) - set(ADAM_ATTRIBUTES))
    if unknown:
        raise TypeError(f"unknown Adam attributes {unknown}; Adam has {list(ADAM_ATTRIBUTES)}")
    attrs = {k: float(v) for k, v in adam_attrs.items()}
    in_names, out_names = optimizer_names(params, policy)
    if not policy.uses_loss_scaling and (growth_interval is not None or growth_factor != 2.0
                                         or backoff_factor != 0.5 or min_scale != 0.0):
        raise ValueError(f"policy {policy.name!r} uses no loss scaling: the loss-scale "
                         "arguments do not apply")
    if growth_interval is None:
        growth_interval = KERAS_GROWTH_INTERVAL

    var_t = tensor_type(policy.variable_dtype)
    comp_t = tensor_type(policy.compute_dtype)
    lr_t = TensorProto.DOUBLE if policy.variable_dtype == "float64" else TensorProto.FLOAT
    names = [n for n, _ in params]
    shapes = dict(params)

    types: dict[str, tuple[int, Any]] = {
        "lr": (lr_t, []), "step": (TensorProto.INT64, []),
        "loss_scale": (TensorProto.FLOAT, []), "good_steps": (TensorProto.INT64, []),
        "step.new": (TensorProto.INT64, []), "loss_scale.new": (TensorProto.FLOAT, []),
        "good_steps.new": (TensorProto.INT64, []), "finite": (TensorProto.BOOL, []),
    }
    for n in names:
        s = shapes[n]
        types[n] = types[n + ".m"] = types[n + ".v"] = (var_t, s)
        types[n + ".new"] = types[n + ".m.new"] = types[n + ".v.new"] = (var_t, s)
        types[n + ".grad"] = types[n + ".copy"] = (comp_t, s)

    xs = names
    gs = [n + ".grad" for n in names]
    ms = [n + ".m" for n in names]
    vs = [n + ".v" for n in names]
    x_new = [n + ".new" for n in names]
    m_new = [n + ".m.new" for n in names]
    v_new = [n + ".v.new" for n in names]
    adam_attrs_ = {k: attrs[k] for k in ADAM_ATTRIBUTES if k in attrs}

    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    initializers = [one]
    nodes = []
    domains = {""}
    if not policy.is_mixed:
        # T = step + 1, which is also step.new (bound over step, Add reads before it writes).
        nodes.append(helper.make_node("Add", ["step", "one"], ["step.new"], name="step_count"))
        nodes.append(helper.make_node("Adam", ["lr", "step.new"] + xs + gs + ms + vs,
                                      x_new + m_new + v_new, name="adam",
                                      domain=TRAINING_DOMAIN, **adam_attrs_))
        domains.add(TRAINING_DOMAIN)
    else:
        copy_dtype = comp_t  # TensorProto.FLOAT16 or TensorProto.BFLOAT16
        if not policy.uses_loss_scaling:
            initializers.append(helper.make_tensor("loss_scale", TensorProto.FLOAT, [], [1.0]))
        nodes.append(helper.make_node("Add", ["step", "one"], ["T"], name="update_count"))
        nodes.append(helper.make_node(
            "MixedPrecisionAdam", ["lr", "T", "loss_scale"] + xs + gs + ms + vs,
            ["finite"] + x_new + m_new + v_new + [n + ".copy" for n in names],
            name="mixed_precision_adam", domain=TRAINOPS_DOMAIN, copy_dtype=copy_dtype,
            **adam_attrs_))
        # A skipped step does not count (PyTorch's GradScaler skips optimizer.step()).
        nodes.append(helper.make_node("Cast", ["finite"], ["applied"], to=TensorProto.INT64,
                                      name="applied"))
        nodes.append(helper.make_node("Add", ["step", "applied"], ["step.new"],
                                      name="step_count"))
        domains.add(TRAINOPS_DOMAIN)
        if policy.uses_loss_scaling:
            nodes.append(helper.make_node(
                "DynamicLossScale", ["loss_scale", "good_steps", "finite"],
                ["loss_scale.new", "good_steps.new"], name="dynamic_loss_scale",
                domain=TRAINOPS_DOMAIN, growth_interval=int(growth_interval),
                growth_factor=float(growth_factor), backoff_factor=float(backoff_factor),
                min_scale=float(min_scale)))

    if lr is not None:
        lr_np = np.float64 if lr_t == TensorProto.DOUBLE else np.float32
        initializers.append(helper.make_tensor("lr", lr_t, [], [lr_np(lr)]))

    def vi(name):
        elem, shape = types[name]
        return helper.make_tensor_value_info(name, elem, shape)

    graph = helper.make_graph(nodes, f"{policy.name}_adam_step",
                              [vi(n) for n in in_names], [vi(n) for n in out_names],
                              initializer=initializers)
    opsets = opset_imports(sorted(domains))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="trainops",
                              doc_string=f"one Adam step under the {policy.name!r} policy")
    model.ir_version = IR_VERSION
    return model


def optimizer_state(weights: Mapping[str, Any], policy: Union[str, Policy] = "float32",
                    lr: Optional[float] = None, loss_scale: Optional[float] = None
                    ) -> dict[str, np.ndarray]:
    """Initial values of every state input of :func:`optimizer_model` for ``weights``
    (``{name: array}``): the weights in the variable dtype, zero moments, ``step`` 0, and
    for ``mixed_float16`` ``loss_scale`` (default: the policy's, 2**15) and ``good_steps``
    0; ``lr`` too when given. Gradients are not included."""
    policy = Policy(policy)
    var = policy.variable_np_dtype
    state: dict[str, np.ndarray] = {}
    if lr is not None:
        state["lr"] = np.array(lr, np.float64 if policy.variable_dtype == "float64" else np.float32)
    state["step"] = np.array(0, np.int64)
    if policy.uses_loss_scaling:
        scale = policy.loss_scale if loss_scale is None else loss_scale
        state["loss_scale"] = np.array(scale, np.float32)
        state["good_steps"] = np.array(0, np.int64)
    elif loss_scale is not None:
        raise ValueError(f"policy {policy.name!r} uses no loss scaling")
    for name, w in weights.items():
        w = np.asarray(w)
        state[name] = np.array(w.astype(var), copy=True, order="C")
        state[name + ".m"] = np.zeros(w.shape, var)
        state[name + ".v"] = np.zeros(w.shape, var)
    return state
