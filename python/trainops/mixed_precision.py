"""Mixed precision after Keras' dtype policies, with the optimizer step in ONNX Runtime.

:class:`Policy` mirrors Keras' ``Policy``/``DTypePolicy``: ``"float32"`` / ``"float64"``
(and ``"float16"`` / ``"bfloat16"``) compute and keep variables in that dtype;
``"mixed_float16"`` / ``"mixed_bfloat16"`` compute in 16 bits and keep float32 variables.
``mixed_float16`` uses dynamic loss scaling (Keras' ``LossScaleOptimizer``: initial scale
2**15, growth every 2000 finite steps); the others use none.

:func:`optimizer_model` emits one optimizer step under a policy as an ONNX model:

- ``float32`` / ``float64`` / ``float16`` / ``bfloat16``: one
  ``ai.onnx.preview.training::Adam`` node in that dtype;
- ``mixed_float16``: ``com.trainops::MixedPrecisionAdam`` (float16 gradients, float32
  weights and moments, float16 copies of the new weights for the next forward pass) and
  ``com.trainops::DynamicLossScale`` fed by its ``finite`` verdict;
- ``mixed_bfloat16``: ``MixedPrecisionAdam`` with bfloat16 gradients and copies and a fixed
  loss scale of 1 (no ``DynamicLossScale``).

:class:`InPlaceOptimizer` runs such a model with every state tensor bound in place through
an IOBinding::

    opt = InPlaceOptimizer({"w": w0, "b": b0}, "mixed_float16", lr=1e-3)
    for batch in data:
        w16, b16 = opt.compute_weights["w"], opt.compute_weights["b"]   # float16 copies
        gw, gb = backward(w16, b16, batch, scale=opt.loss_scale)        # scaled float16 grads
        if not opt.step({"w": gw, "b": gb}):
            print("skipped: non-finite gradients")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from .bfloat16 import to_ortvalue
from .onnx_defs import (IR_VERSION, TRAINING_DOMAIN, TRAINOPS_DOMAIN, numpy_dtype, opset_imports,
                        tensor_type)

__all__ = [
    "Policy",
    "ADAM_ATTRIBUTES",
    "optimizer_names",
    "optimizer_model",
    "optimizer_state",
    "InPlaceOptimizer",
]

ADAM_ATTRIBUTES = ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post")

# Plain policies: variables and computations in one float dtype.
_PLAIN = ("float16", "bfloat16", "float32", "float64")
_MIXED = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}

# Keras' LossScaleOptimizer defaults (Keras 2 and 3): initial_scale=2**15,
# dynamic_growth_steps=2000.
KERAS_INITIAL_LOSS_SCALE = 2.0 ** 15
KERAS_GROWTH_INTERVAL = 2000


class Policy:
    """A dtype policy, as Keras' ``tf.keras.mixed_precision.Policy`` /
    ``keras.DTypePolicy``.

    ``Policy(name)`` with ``name`` one of ``"float32"``, ``"float64"``, ``"float16"``,
    ``"bfloat16"`` (variables and computations in that dtype, no loss scaling),
    ``"mixed_float16"`` (compute float16, variables float32, dynamic loss scaling) or
    ``"mixed_bfloat16"`` (compute bfloat16, variables float32, no loss scaling). Any other
    string is a ``ValueError``, any non-string (other than a ``Policy``) a ``TypeError``.

    Attributes:
        name: the policy's name.
        compute_dtype: the dtype name computations use (``"float16"``, ``"bfloat16"``, ...).
        variable_dtype: the dtype name of the variables (weights and optimizer state).
        compute_np_dtype, variable_np_dtype: the same as numpy dtypes
            (``ml_dtypes.bfloat16`` for bfloat16).
        uses_loss_scaling: whether training scales the loss (only ``mixed_float16``).
        loss_scale: the initial dynamic loss scale (2**15, Keras' default) or ``None``.
        growth_interval: finite steps before the scale grows (2000, Keras' default), or
            ``None`` without loss scaling.
    """

    __slots__ = ("_name", "_compute", "_variable")

    def __init__(self, name: Union[str, "Policy"]):
        if isinstance(name, Policy):
            name = name.name
        if not isinstance(name, str):
            raise TypeError("'name' must be a string, such as 'mixed_float16'. "
                            f"Received: name={name!r} (of type {type(name).__name__})")
        if name in _MIXED:
            compute, variable = _MIXED[name], "float32"
        elif name in _PLAIN:
            compute = variable = name
        else:
            raise ValueError(f"Cannot convert '{name}' to a mixed precision Policy. Valid "
                             "policies include 'mixed_float16', 'mixed_bfloat16', and the "
                             "name of any float dtype such as 'float32' (here: "
                             f"{', '.join(repr(p) for p in _PLAIN)}).")
        self._name = name
        self._compute = compute
        self._variable = variable

    @property
    def name(self) -> str:
        return self._name

    @property
    def compute_dtype(self) -> str:
        return self._compute

    @property
    def variable_dtype(self) -> str:
        return self._variable

    @property
    def compute_np_dtype(self) -> np.dtype:
        return numpy_dtype(self._compute)

    @property
    def variable_np_dtype(self) -> np.dtype:
        return numpy_dtype(self._variable)

    @property
    def is_mixed(self) -> bool:
        """Compute and variable dtypes differ (``mixed_float16``, ``mixed_bfloat16``)."""
        return self._compute != self._variable

    @property
    def uses_loss_scaling(self) -> bool:
        return self._name == "mixed_float16"

    @property
    def loss_scale(self) -> Optional[float]:
        return KERAS_INITIAL_LOSS_SCALE if self.uses_loss_scaling else None

    @property
    def growth_interval(self) -> Optional[int]:
        return KERAS_GROWTH_INTERVAL if self.uses_loss_scaling else None

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("Policy", self._name))


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


class InPlaceOptimizer:
    """:func:`optimizer_model` in an ONNX Runtime session, its state bound in place.

    Every state tensor (weights, moments, ``step``, ``loss_scale``, ``good_steps``) and
    every gradient lives in a numpy array owned by this object and wrapped (not copied)
    by an ``OrtValue``; one IOBinding binds each ``<name>.new`` output to its input's
    value, so a step rewrites those arrays and nothing is allocated or copied per step.
    ``w.copy`` outputs (mixed policies) go to persistent compute-dtype arrays.

    ``weights``: ``{name: initial array}``. ``lr``: the learning rate (change it with
    ``step(..., lr=)``). ``session``: an existing session of the same model (default:
    one is created with the trainops library; ``threads``, ``library`` and
    ``log_severity_level`` go to it). ``model_kwargs`` go to :func:`optimizer_model`.
    """

    def __init__(self, weights: Mapping[str, Any], policy: Union[str, Policy] = "float32",
                 lr: float = 1e-3, *, loss_scale: Optional[float] = None, session=None,
                 threads: Optional[int] = None, library: Optional[str] = None,
                 log_severity_level: Optional[int] = 3, **model_kwargs: Any):
        from .models import session as make_session

        self.policy = Policy(policy)
        self.names = list(weights)
        self.model = optimizer_model([(n, np.shape(w)) for n, w in weights.items()],
                                     self.policy, **model_kwargs)
        self.session = session or make_session(self.model, threads=threads, library=library,
                                               log_severity_level=log_severity_level)
        self.state = optimizer_state(weights, self.policy, lr=lr, loss_scale=loss_scale)
        comp = self.policy.compute_np_dtype
        for n in self.names:
            self.state[n + ".grad"] = np.zeros(self.state[n].shape, comp)
        self._outputs: dict[str, np.ndarray] = {}
        if self.policy.is_mixed:
            self._outputs["finite"] = np.ones((), np.bool_)
            for n in self.names:
                self._outputs[n + ".copy"] = self.state[n].astype(comp)
        self._values = {k: to_ortvalue(a) for k, a in self.state.items()}
        self._out_values = {k: to_ortvalue(a) for k, a in self._outputs.items()}
        self.binding = self.session.io_binding()
        in_names, out_names = optimizer_names([(n, None) for n in self.names], self.policy)
        for name in in_names:
            self.binding.bind_ortvalue_input(name, self._values[name])
        for name in out_names:
            if name in self._out_values:
                self.binding.bind_ortvalue_output(name, self._out_values[name])
            else:
                self.binding.bind_ortvalue_output(name, self._values[name[:-len(".new")]])

    def step(self, grads: Mapping[str, Any], lr: Optional[float] = None) -> bool:
        """One optimizer step with ``grads`` (``{name: array}``, converted to the compute
        dtype; in ``mixed_float16`` the gradients of the loss multiplied by
        :attr:`loss_scale`). Returns whether the step was applied (``False``: non-finite
        gradients, skipped; always ``True`` in a plain policy)."""
        missing = set(self.names) - set(grads)
        extra = set(grads) - set(self.names)
        if missing or extra:
            raise KeyError(f"gradients for {sorted(missing)} missing, {sorted(extra)} unknown")
        for n in self.names:
            buf = self.state[n + ".grad"]
            g = np.asarray(grads[n])
            if g.shape != buf.shape:
                raise ValueError(f"gradient {n!r}: shape {g.shape}, expected {buf.shape}")
            buf[...] = g.astype(buf.dtype, copy=False)
        if lr is not None:
            self.state["lr"][...] = lr
        self.session.run_with_iobinding(self.binding)
        return bool(self._outputs["finite"]) if self.policy.is_mixed else True

    def __getitem__(self, name: str) -> np.ndarray:
        """The live array of a state value (``w``, ``w.m``, ``step``, ...) or output
        (``w.copy``, ``finite``): a view, rewritten by the next step."""
        if name in self._outputs:
            return self._outputs[name]
        return self.state[name]

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The variables (master weights), live arrays."""
        return {n: self.state[n] for n in self.names}

    @property
    def compute_weights(self) -> dict[str, np.ndarray]:
        """The weights in the compute dtype for the forward pass: the ``w.copy`` outputs
        in a mixed policy (live arrays), the variables themselves otherwise."""
        if self.policy.is_mixed:
            return {n: self._outputs[n + ".copy"] for n in self.names}
        return self.weights

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when the policy uses no loss scaling)."""
        if self.policy.uses_loss_scaling:
            return float(self.state["loss_scale"])
        return 1.0

    @property
    def good_steps(self) -> int:
        return int(self.state["good_steps"]) if self.policy.uses_loss_scaling else 0

    @property
    def iterations(self) -> int:
        """Steps applied so far (skipped steps do not count)."""
        return int(self.state["step"])

    @property
    def finite(self) -> bool:
        """The last step's verdict (``True`` in a plain policy)."""
        return bool(self._outputs["finite"]) if self.policy.is_mixed else True
