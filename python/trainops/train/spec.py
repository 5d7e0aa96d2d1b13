"""The step graph's description: what the builders (:mod:`.graph`, :mod:`.dist_graph`) make
and the runtimes (:mod:`.runtime`, :mod:`.dist_runtime`) bind. Data only: no onnxruntime.

- :class:`StepOptions`: what to build (loss, optimizer, parameters, policy, Philox key seed);
- :class:`StateEntry`: one state tensor the step reads as graph input ``input`` and writes
  as graph output ``output``; the runtime binds both to ONE buffer, so the session updates
  it in place (a parameter, an optimizer moment, a Philox state, the loss scale, ...);
- :class:`StepGraph`: the one-session training model with its table of states, data
  inputs and outputs. :meth:`StepGraph.to_manifest` is that table as JSON-ready data.

Adding a state kind: a constant in ``KINDS``, the builder that appends its
:class:`StateEntry` (input, output, initial value); the runtime and the checkpoint need
nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["BATCHNORM_MODES", "KINDS", "PREFIX", "StateEntry", "StepGraph", "StepOptions",
           "check_policy", "check_update_options", "fused_grads_enabled"]

PREFIX = "trainops"  # prefix of the names the builders add to a model

# State kinds, in the order the single-process builder lists them (the runtime's buffer
# order, hence the order of a checkpoint's values).
KINDS = ("param", "optimizer", "loss_scale", "fp16_copy", "rng", "grad_accum", "bn_stat")

POLICIES = ("float32", "float64", "mixed_float16")

# How a Trainer treats BatchNormalization: "train" (batch statistics, running statistics
# updated as state, as PyTorch's model.train()) or "frozen" (the inference form).
BATCHNORM_MODES = ("train", "frozen")


def check_policy(policy: str, optimizer) -> str:
    """``policy``'s name (a string or anything with ``.name``), checked against the
    policies a Trainer supports and the optimizer: ValueError naming what was expected."""
    policy = str(getattr(policy, "name", policy))
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected 'float32', 'float64' or "
                         "'mixed_float16'")
    if policy == "mixed_float16" and optimizer.op_type != "Adam":
        raise ValueError("policy 'mixed_float16' uses MixedPrecisionAdam: the optimizer "
                         f"must be Adam, got {optimizer.op_type}")
    return policy


def check_update_options(clip_grad_norm, accumulate) -> tuple[float | None, int]:
    """``(clip_grad_norm, accumulate)`` checked: ValueError unless ``clip_grad_norm`` is
    None or a finite number > 0 and ``accumulate`` an integer >= 1."""
    import math
    import numbers

    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real) \
                or not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm {clip_grad_norm!r}: expected None or a finite "
                             "number > 0 (the max_norm of torch's clip_grad_norm_)")
        clip_grad_norm = float(clip_grad_norm)
    if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral) \
            or accumulate < 1:
        raise ValueError(f"accumulate {accumulate!r}: expected an integer >= 1 (the "
                         "micro-batches per update)")
    return clip_grad_norm, int(accumulate)


@dataclass
class StepOptions:
    """What a step graph is built from, besides the model.

    - ``loss``: the model tensor minimised (a float scalar);
    - ``optimizer``: a :mod:`trainops.optim` optimizer (its ``op_type``, ``state`` names,
      ``attributes()``; its node goes in ``getattr(optimizer, "domain", TRAINING_DOMAIN)``);
    - ``params``: the initializers to train; ``None``: the default choice
      (:func:`trainops.train.graph.default_params`);
    - ``policy``: ``"float32"``, ``"float64"`` or ``"mixed_float16"``;
    - ``key_seed``: the 64-bit seed that keys the Philox nodes (a Trainer's ``seed``, or
      with ``comm`` :func:`trainops.distributed.rank_seed` of it and the rank);
    - ``clip_grad_norm``: None, or the ``max_norm`` of PyTorch's ``clip_grad_norm_`` applied
      to the gradients inside the graph before the update (:mod:`.clip`);
    - ``accumulate``: update every ``accumulate`` micro-batches on their mean gradient
      (:mod:`.accumulate`); 1: every step.
    - ``batchnorm``: ``"train"`` (batch statistics; the running statistics are ``bn_stat``
      states updated each step) or ``"frozen"`` (the inference form).
    - ``fused``: the backward uses trainops' gradient kernels (``com.trainops``: the
      convolution's, ReLU's, MaxPool's, ...) where a rule has one for the tensors' type;
      False: standard ONNX ops only (the Trainer sets it for the CPU placement alone: the
      kernels are CPU kernels).
    - ``recompute``: gradient checkpointing of the repeated blocks (:mod:`.recompute`).
    """

    loss: str
    optimizer: Any
    params: Sequence[str] | None = None
    policy: str = "float32"
    key_seed: int = 0
    clip_grad_norm: float | None = None
    accumulate: int = 1
    batchnorm: str = "train"
    fused: bool = False
    recompute: bool = False

    def __post_init__(self) -> None:
        self.policy = check_policy(self.policy, self.optimizer)
        self.clip_grad_norm, self.accumulate = check_update_options(self.clip_grad_norm,
                                                                    self.accumulate)
        if self.batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm {self.batchnorm!r}: expected 'train' or 'frozen'")
        if self.params is not None:
            self.params = list(self.params)

    @property
    def mixed(self) -> bool:
        """True under ``mixed_float16``."""
        return self.policy == "mixed_float16"

    def to_manifest(self) -> dict:
        """JSON-ready: loss, optimizer (``to_dict()``), params, policy, key_seed,
        clip_grad_norm, accumulate, batchnorm."""
        return {"loss": self.loss, "optimizer": self.optimizer.to_dict(),
                "params": self.params, "policy": self.policy, "key_seed": self.key_seed,
                "clip_grad_norm": self.clip_grad_norm, "accumulate": self.accumulate,
                "batchnorm": self.batchnorm}


@dataclass
class StateEntry:
    """One in-place state of the step: graph input ``input``, graph output ``output`` (its
    new value), bound to one buffer starting at ``initial``. A Trainer on the CPU points
    its parameter entries at the runtime's buffers once they hold copies of the initial
    values (one copy of the weights in the process, not two): from then on those entries
    hold the current values.

    ``kind``: one of ``KINDS`` (``"param"``, ``"optimizer"``, ``"loss_scale"``,
    ``"fp16_copy"``, ``"rng"``, ``"bn_stat"``: a BatchNormalization's running statistic,
    its input the model's initializer, slot ``"mean"``/``"var"``; ``"grad_accum"``: a
    gradient accumulation buffer, zero
    between updates, or the micro-batch count, slot ``"count"``); ``param``: the parameter
    it belongs to (optimizer state, float16 copy, accumulation buffer), else None;
    ``slot``: its name within the kind (the optimizer's state name ``"V"``/``"H"``;
    ``"scale"``/``"good_steps"`` for the loss scale), else None."""

    input: str
    output: str
    kind: str
    initial: np.ndarray
    param: str | None = None
    slot: str | None = None

    def to_manifest(self) -> dict:
        """JSON-ready: names, kind, param, slot, dtype and shape (not the values)."""
        return {"input": self.input, "output": self.output, "kind": self.kind,
                "param": self.param, "slot": self.slot, "dtype": str(self.initial.dtype),
                "shape": list(self.initial.shape)}

    @classmethod
    def from_manifest(cls, d: Mapping[str, Any], initial: np.ndarray) -> "StateEntry":
        """The entry :meth:`to_manifest` described, with its value ``initial``."""
        initial = np.asarray(initial)
        if str(initial.dtype) != d["dtype"] or list(initial.shape) != list(d["shape"]):
            raise ValueError(f"state {d['input']!r}: expected {d['dtype']} {d['shape']}, got "
                             f"{initial.dtype} {list(initial.shape)}")
        return cls(d["input"], d["output"], d["kind"], initial, d.get("param"), d.get("slot"))


@dataclass
class StepGraph:
    """A training step as one ONNX model, and how to bind it.

    - ``model``: forward, loss, backward and the optimizer (one session runs it);
    - ``options``: the :class:`StepOptions` it was built from (``params`` resolved);
    - ``data_inputs``: the inputs fed on every step (the model's non-initializer inputs);
    - ``loss_output``: the graph output holding the loss (under ``mixed_float16`` the loss
      cast to float32);
    - ``lr_input`` / ``lr_dtype``: the learning rate input (shape ``[1]``) and its numpy
      dtype; ``step_input``: the update count ``T`` (int64, shape ``[1]``);
    - ``states``: every in-place state, in ``KINDS`` order;
    - ``extra_outputs``: other outputs bound to buffers (``finite_output`` among them);
    - ``finite_output``: the flag "this step's gradients were finite" (mixed_float16), or
      None; a step where it is false was skipped;
    - ``norm_output``: the gradients' total 2-norm before clipping (float32 ``[1]``) with
      ``clip_grad_norm``, else None (among the extra outputs);
    - ``apply_model``: with ``accumulate`` > 1, ``model`` only adds each micro-batch's
      gradients into the ``grad_accum`` buffers and this second model (no data inputs)
      updates from them; its outputs ``finite_output`` and ``norm_output``. Else None.
    """

    model: Any
    options: StepOptions
    data_inputs: list[str]
    loss_output: str
    lr_input: str
    lr_dtype: type
    step_input: str
    states: list[StateEntry]
    extra_outputs: list[str] = field(default_factory=list)
    finite_output: str | None = None
    norm_output: str | None = None
    apply_model: Any = None

    @property
    def param_names(self) -> list[str]:
        """The trained parameters, in order."""
        return [e.param for e in self.states if e.kind == "param"]

    @property
    def initial(self) -> dict[str, np.ndarray]:
        """The parameters' initial values, by name."""
        return {e.param: e.initial for e in self.states if e.kind == "param"}

    def of_kind(self, kind: str) -> list[StateEntry]:
        """The states of one kind, in order."""
        return [e for e in self.states if e.kind == kind]

    def to_manifest(self) -> dict:
        """JSON-ready description of everything but the model and the values: options,
        data inputs, loss/lr/step names, lr dtype, the states table, extra outputs,
        whether there is an apply model."""
        return {"options": self.options.to_manifest(), "data_inputs": list(self.data_inputs),
                "loss_output": self.loss_output, "lr_input": self.lr_input,
                "lr_dtype": np.dtype(self.lr_dtype).name, "step_input": self.step_input,
                "states": [e.to_manifest() for e in self.states],
                "extra_outputs": list(self.extra_outputs),
                "finite_output": self.finite_output, "norm_output": self.norm_output,
                "apply_model": self.apply_model is not None}

    @classmethod
    def from_manifest(cls, model, manifest: Mapping[str, Any],
                      values: Mapping[str, np.ndarray], apply_model=None) -> "StepGraph":
        """The step graph :meth:`to_manifest` described, over ``model`` (its training
        model) and ``apply_model`` (needed when it had one), with each state's value from
        ``values`` (by state input name)."""
        from .. import optim

        o = manifest["options"]
        options = StepOptions(o["loss"], optim.from_dict(o["optimizer"]), o["params"],
                              o["policy"], o["key_seed"], o.get("clip_grad_norm"),
                              o.get("accumulate", 1), o.get("batchnorm", "train"))
        if manifest.get("apply_model") and apply_model is None:
            raise ValueError("StepGraph.from_manifest: this step graph has an apply model "
                             "(accumulate > 1): pass apply_model")
        missing = [d["input"] for d in manifest["states"] if d["input"] not in values]
        if missing:
            raise ValueError(f"StepGraph.from_manifest: no values for states {missing}")
        states = [StateEntry.from_manifest(d, values[d["input"]]) for d in manifest["states"]]
        return cls(model, options, list(manifest["data_inputs"]), manifest["loss_output"],
                   manifest["lr_input"], np.dtype(manifest["lr_dtype"]).type,
                   manifest["step_input"], states, list(manifest["extra_outputs"]),
                   manifest["finite_output"], manifest.get("norm_output"), apply_model)


def fused_grads_enabled() -> bool:
    """False when the environment sets ``TRAINOPS_FUSED_GRADS=0``: the CPU Trainer then
    builds its backward from standard ONNX ops only, as for the portable graph (to compare
    the two, or to rule the gradient kernels out when chasing a problem)."""
    import os

    return os.environ.get("TRAINOPS_FUSED_GRADS", "1") != "0"
