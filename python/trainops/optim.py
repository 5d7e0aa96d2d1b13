"""Optimizers for :class:`trainops.Trainer`: ONNX's training operators with their ONNX
attribute names (``ai.onnx.preview.training::Adam``, ``Adagrad``, ``Momentum``), and
PyTorch's AdamW with PyTorch's names (``com.trainops::AdamW``); ``Adam`` and ``AdamW`` keep
their moments in 8 bits with ``state_dtype="int8"`` (``com.trainops::Adam8bit`` /
``AdamW8bit``, :mod:`trainops.quantized`; tensors under :data:`SMALL_TENSOR` values keep
float32 state) or in bfloat16 with ``state_dtype="bfloat16"`` (``AdamBf16State`` /
``AdamWBf16State``, stochastic rounding).

The learning rate ``lr`` is the node's ``R`` input, fed on every step, so it can change
between steps (``trainer.learning_rate = ...``). The update count ``T`` is 1 on the first
step and grows by one per step (PyTorch's and Keras' counting), so Adam's bias correction
applies from the first step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

from .onnx_defs import TRAINING_DOMAIN, TRAINOPS_DOMAIN

__all__ = ["Adam", "AdamW", "Adagrad", "Momentum", "Optimizer", "SMALL_TENSOR", "STATE_DTYPES",
           "check_lr", "check_optimizer", "float_state", "from_dict", "initial_state"]


def check_lr(lr, where: str) -> float:
    """``lr`` as a float: TypeError if it is no real number, ValueError (PyTorch's words,
    "Invalid learning rate: -1") if it is negative, NaN or infinite."""
    if isinstance(lr, (bool, str, bytes)) or not hasattr(lr, "__float__"):
        raise TypeError(f"{where}: the learning rate must be a real number, got "
                        f"{type(lr).__name__} {lr!r}")
    if not (math.isfinite(float(lr)) and float(lr) >= 0):
        raise ValueError(f"Invalid learning rate: {lr} ({where}: expected a finite number "
                         ">= 0)")
    return float(lr)


class Optimizer:
    """An optimizer node's description: its op (``domain``, ``op_type``), its attributes
    and its per-parameter state tensors."""

    op_type: ClassVar[str] = ""
    domain: ClassVar[str] = TRAINING_DOMAIN  # the node's domain
    state: tuple[str, ...] = ()  # per-parameter state tensors, in the node's input order
    lr: float

    def __post_init__(self) -> None:
        # Dataclass subclasses call this after their __init__: a bad lr fails here (and a
        # numpy scalar becomes a float, so to_dict() stays JSON).
        self.lr = check_lr(self.lr, type(self).__name__)

    def attributes(self) -> dict:
        """The node's attributes, by their ONNX names."""
        return {k: v for k, v in asdict(self).items() if k != "lr"}

    def to_dict(self) -> dict:
        """A JSON-ready description; :func:`from_dict` makes the optimizer back."""
        return {"type": type(self).__name__, **asdict(self)}


@dataclass
class Adam(Optimizer):
    """ONNX ``Adam``: ``V`` and ``H`` (first and second moments) per parameter.

    ONNX's formula, not PyTorch's: ``epsilon`` is added to ``sqrt(H)`` before the bias
    correction (which is folded into the rate), ``norm_coefficient`` adds an L2 term to the
    gradient, and ``norm_coefficient_post`` multiplies the whole updated weight after the
    step. For ``torch.optim.Adam``/``AdamW``'s arithmetic use :class:`AdamW`.

    ``state_dtype="int8"``: the moments in 8 bits (``com.trainops::Adam8bit``: the same
    formula on blockwise-quantised moments, state ``M_q, M_absmax, V_q, V_absmax``: 2.03
    bytes per parameter instead of 8; float32 parameters; not with ``mixed_float16``;
    parameters under :data:`SMALL_TENSOR` values keep float32 state, in an ``Adam`` node).
    ``state_dtype="bfloat16"``: the moments ``M``, ``V`` in bfloat16, stochastically
    rounded (``com.trainops::AdamBf16State``: 4 bytes per parameter)."""

    lr: float = 1e-3
    alpha: float = 0.9
    beta: float = 0.999
    epsilon: float = 1e-6
    norm_coefficient: float = 0.0
    norm_coefficient_post: float = 0.0
    state_dtype: str = "float32"

    def __post_init__(self):
        super().__post_init__()
        _check_state_dtype(self)

    @property
    def op_type(self) -> str:  # type: ignore[override]
        return {"int8": "Adam8bit", "bfloat16": "AdamBf16State"}.get(self.state_dtype, "Adam")

    @property
    def domain(self) -> str:  # type: ignore[override]
        return TRAINING_DOMAIN if self.state_dtype == "float32" else TRAINOPS_DOMAIN

    @property
    def state(self) -> tuple[str, ...]:  # type: ignore[override]
        return {"int8": _STATE_8BIT, "bfloat16": ("M", "V")}.get(self.state_dtype, ("V", "H"))

    def attributes(self) -> dict:
        """The node's attributes (ONNX Adam's five, for ``Adam8bit`` too)."""
        return _attributes(self, super().attributes())


@dataclass
class Adagrad(Optimizer):
    """ONNX ``Adagrad``: ``H`` (accumulated squared gradients) per parameter."""

    lr: float = 1e-2
    decay_factor: float = 0.0
    epsilon: float = 1e-6
    norm_coefficient: float = 0.0
    op_type = "Adagrad"
    state = ("H",)


@dataclass
class Momentum(Optimizer):
    """ONNX ``Momentum`` (``mode`` ``"standard"`` or ``"nesterov"``): ``V`` per parameter.

    ONNX gives the attributes no defaults; these are PyTorch's ``SGD(momentum=0.9)``
    (``beta`` = 1 - dampening = 1)."""

    lr: float = 1e-2
    alpha: float = 0.9
    beta: float = 1.0
    mode: str = "standard"
    norm_coefficient: float = 0.0
    op_type = "Momentum"
    state = ("V",)


@dataclass
class AdamW(Optimizer):
    """PyTorch's ``torch.optim.AdamW`` (``com.trainops::AdamW``), with PyTorch's argument
    names and defaults and its arithmetic (docs/ops/adamw.md): ``M`` and ``V`` (first and
    second moments) per parameter, and ``Vmax`` with ``amsgrad``. ``T`` is torch's step.
    ``AdamW(weight_decay=0)`` is ``torch.optim.Adam``'s update.

    ``state_dtype="int8"``: the moments in 8 bits (``com.trainops::AdamW8bit``, torchao's
    ``AdamW8bit``: state ``M_q, M_absmax, V_q, V_absmax``, 2.03 bytes per parameter instead
    of 8; float32 parameters; no ``amsgrad``; parameters under :data:`SMALL_TENSOR` values
    keep float32 state, in an ``AdamW`` node). ``state_dtype="bfloat16"``: ``M``, ``V`` in
    bfloat16, stochastically rounded (``com.trainops::AdamWBf16State``: 4 bytes per
    parameter; no ``amsgrad``)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False
    state_dtype: str = "float32"
    domain = TRAINOPS_DOMAIN

    def __post_init__(self):
        super().__post_init__()
        betas = tuple(float(b) for b in self.betas)
        if len(betas) != 2:
            raise ValueError(f"AdamW: betas must be two floats, got {self.betas!r}")
        self.betas = betas
        _check_state_dtype(self)

    @property
    def op_type(self) -> str:  # type: ignore[override]
        return {"int8": "AdamW8bit", "bfloat16": "AdamWBf16State"}.get(self.state_dtype, "AdamW")

    @property
    def state(self) -> tuple[str, ...]:  # type: ignore[override]
        if self.state_dtype == "int8":
            return _STATE_8BIT
        if self.state_dtype == "bfloat16":
            return ("M", "V")
        return ("M", "V", "Vmax") if self.amsgrad else ("M", "V")

    def attributes(self) -> dict:
        """The node's attributes by their ONNX names (``beta1``, ``beta2``, ``epsilon``,
        ``weight_decay``, ``amsgrad``, ``maximize``)."""
        return _attributes(self, {
            "beta1": self.betas[0], "beta2": self.betas[1], "epsilon": float(self.eps),
            "weight_decay": float(self.weight_decay), "amsgrad": int(bool(self.amsgrad)),
            "maximize": int(bool(self.maximize))})

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["betas"] = list(self.betas)
        return d


# --- optimizer state in 8 bits (state_dtype="int8"): com.trainops::Adam8bit / AdamW8bit,
# in bfloat16 (state_dtype="bfloat16"): com.trainops::AdamBf16State / AdamWBf16State ---

STATE_DTYPES = ("float32", "int8", "bfloat16")
# With state_dtype="int8", parameters with fewer values keep float32 state (the float
# optimizer: Adam / AdamW), as bitsandbytes' and torchao's 8-bit optimizers do: a small
# tensor's second moment quantised to zero under a non-zero first moment makes a step of
# lr * m / eps, and its state is too small to be worth quantising.
SMALL_TENSOR = 4096
# The 8-bit ops' state per parameter (trainops.quantized.STATE's names): uint8 codes shaped
# like the parameter and float32 scales, one per 256 elements, for each moment.
_STATE_8BIT = ("M_q", "M_absmax", "V_q", "V_absmax")


def _check_state_dtype(opt) -> None:
    name = type(opt).__name__
    if opt.state_dtype not in STATE_DTYPES:
        raise ValueError(f"{name}: state_dtype {opt.state_dtype!r}: expected 'float32', "
                         "'int8' or 'bfloat16'")
    if opt.state_dtype == "int8" and getattr(opt, "amsgrad", False):
        raise ValueError(f"{name}: amsgrad has no 8-bit op: use state_dtype='float32'")
    if opt.state_dtype == "bfloat16" and getattr(opt, "amsgrad", False):
        raise ValueError(f"{name}: amsgrad has no bfloat16-state op: use "
                         "state_dtype='float32'")


def _attributes(opt, attrs: dict) -> dict:
    attrs = {k: v for k, v in attrs.items() if k != "state_dtype"}
    if opt.state_dtype != "float32":
        attrs.pop("amsgrad", None)
    return attrs


def float_state(opt: Optimizer) -> Optimizer:
    """``opt`` with float32 state (``state_dtype="float32"``): the optimizer of the
    parameters under :data:`SMALL_TENSOR` values when ``opt`` keeps 8-bit state."""
    import dataclasses

    if getattr(opt, "state_dtype", "float32") == "float32":
        return opt
    return dataclasses.replace(opt, state_dtype="float32")


def initial_state(opt: Optimizer, value) -> dict:
    """The optimizer state of one parameter ``value`` (numpy) before the first step, by
    state name: zeros like it, under ``state_dtype="int8"`` the 8-bit ops' zero state
    (:func:`trainops.quantized.zero_state`), under ``state_dtype="bfloat16"`` bfloat16
    zeros shaped like it (float32 parameters only for both).

    The zeros are read-only views of one element (``np.broadcast_to``), which take no
    memory: a runtime copies each state's initial value into a buffer of its own, and full
    arrays of zeros would double the optimizer state's peak footprint."""
    import numpy as np

    def zeros(dt):
        return np.broadcast_to(np.zeros((), dt), np.shape(value))

    dtype = getattr(opt, "state_dtype", "float32")
    if dtype == "float32":
        return {s: zeros(value.dtype) for s in opt.state}
    if value.dtype != np.float32:
        raise ValueError(f"{type(opt).__name__}(state_dtype={dtype!r}): the {opt.op_type} op "
                         f"takes float32 parameters, got {value.dtype}")
    if dtype == "bfloat16":
        from .onnx_defs import bfloat16_dtype

        return {s: zeros(bfloat16_dtype()) for s in opt.state}
    from .quantized import zero_state

    return zero_state(value.shape)


def from_dict(d: dict) -> Optimizer:
    """The optimizer :meth:`Optimizer.to_dict` described."""
    d = dict(d)
    cls = {"Adam": Adam, "AdamW": AdamW, "Adagrad": Adagrad, "Momentum": Momentum}[d.pop("type")]
    return cls(**d)


from . import schedules  # noqa: E402  (trainops.optim.schedules: learning-rate schedules)


def check_optimizer(optimizer) -> "Optimizer":
    """``optimizer`` (None: ``Adam()``), checked: TypeError saying what was expected."""
    if optimizer is None:
        return Adam()
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        raise TypeError(f"Trainer: optimizer is the class {optimizer.__name__}, not an "
                        f"optimizer: instantiate it, e.g. optim.{optimizer.__name__}() or "
                        f"optim.{optimizer.__name__}(lr=...)")
    if not isinstance(optimizer, Optimizer):
        raise TypeError("Trainer: optimizer must be a trainops.optim optimizer instance "
                        f"(e.g. trainops.optim.Adam(lr=1e-3)), got {type(optimizer).__name__} "
                        f"{optimizer!r}")
    return optimizer
