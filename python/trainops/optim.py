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


def _is_bool(v) -> bool:
    """A Python or numpy bool (numpy's is ``numpy.bool_``, named ``bool`` from numpy 2)."""
    return isinstance(v, bool) or (type(v).__module__ == "numpy"
                                   and type(v).__name__ in ("bool", "bool_"))


def _is_real(v) -> bool:
    """A real number: an int, a float, a numpy scalar or 0-d array; not a bool (a flag, not
    a rate), not a string ('0.1' converts, but is no number: the caller mixed arguments)."""
    if isinstance(v, (str, bytes)) or _is_bool(v):
        return False
    return hasattr(v, "__float__")


def check_lr(lr, where: str) -> float:
    """``lr`` as a float: TypeError if it is no real number, ValueError (PyTorch's words,
    "Invalid learning rate: -1") if it is negative, NaN or infinite."""
    if not _is_real(lr):
        raise TypeError(f"{where}: the learning rate must be a real number, got "
                        f"{type(lr).__name__} {lr!r}")
    if not (math.isfinite(float(lr)) and float(lr) >= 0):
        raise ValueError(f"Invalid learning rate: {lr} ({where}: expected a finite number "
                         ">= 0)")
    return float(lr)


# What each hyperparameter may be, checked when an optimizer is made (before anything is
# built, whatever its state_dtype): name -> (low, high, high excluded). Every float
# hyperparameter is a real number (TypeError otherwise) and finite; these add ranges.
# Adam/AdamW's are torch.optim.Adam/AdamW's (0 <= beta < 1, eps >= 0, weight_decay >= 0):
# out of them the moments or the bias correction divide by zero (beta1 = 1 trained to
# all-NaN weights with 8-bit state) or the update runs the wrong way.
UNIT = (0.0, 1.0, True)  # [0, 1)
NON_NEGATIVE = (0.0, math.inf, False)  # [0, inf)


def _check_real(where: str, name: str, v, bounds=None) -> float:
    """``v`` as a float, checked: TypeError naming ``name`` if it is no real number,
    ValueError if it is NaN, infinite or outside ``bounds`` (low, high, high excluded)."""
    if not _is_real(v):
        raise TypeError(f"{where}: {name} {v!r}: expected a real number, got "
                        f"{type(v).__name__}")
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(f"{where}: {name} {v!r}: expected a finite number")
    if bounds is not None:
        low, high, open_high = bounds
        if x < low or x > high or (open_high and x == high):
            rng = f"in [{low:g}, {high:g}{')' if open_high else ']'}" if high < math.inf \
                else f">= {low:g}"
            raise ValueError(f"{where}: {name} {v!r}: expected a number {rng}")
    return x


def _check_flag(where: str, name: str, v) -> bool:
    """``v`` as a bool: True/False (or 1/0, numpy bools); TypeError for anything else."""
    if _is_bool(v):
        return bool(v)
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, int):
        raise ValueError(f"{where}: {name} {v!r}: expected True or False")
    raise TypeError(f"{where}: {name} {v!r}: expected True or False, got {type(v).__name__}")


class Optimizer:
    """An optimizer node's description: its op (``domain``, ``op_type``), its attributes
    and its per-parameter state tensors."""

    op_type: ClassVar[str] = ""
    domain: ClassVar[str] = TRAINING_DOMAIN  # the node's domain
    state: tuple[str, ...] = ()  # per-parameter state tensors, in the node's input order
    lr: float

    # hyperparameter -> its range (UNIT, NON_NEGATIVE; None: any finite number), for the
    # float fields of each optimizer; ``flags``: its boolean fields.
    ranges: ClassVar[dict] = {}
    flags: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        # Dataclass subclasses call this after their __init__: a bad lr or hyperparameter
        # fails here, before anything is built (and a numpy scalar becomes a float, so
        # to_dict() stays JSON). One check for every state_dtype of an optimizer, so the
        # 8-bit and bfloat16-state variants refuse what the float32 one refuses.
        where = type(self).__name__
        self.lr = check_lr(self.lr, where)
        for name, bounds in self.ranges.items():
            setattr(self, name, _check_real(where, name, getattr(self, name), bounds))
        for name in self.flags:
            setattr(self, name, _check_flag(where, name, getattr(self, name)))

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
    # alpha and beta are torch's beta1 and beta2: [0, 1) (alpha = 1 makes the bias
    # correction 1 - alpha^T zero); the L2 coefficients are weight decays, >= 0.
    ranges = {"alpha": UNIT, "beta": UNIT, "epsilon": NON_NEGATIVE,
              "norm_coefficient": NON_NEGATIVE, "norm_coefficient_post": NON_NEGATIVE}

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
    ranges = {"decay_factor": None, "epsilon": None, "norm_coefficient": None}


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
    ranges = {"alpha": None, "beta": None, "norm_coefficient": None}

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in ("standard", "nesterov"):
            raise ValueError(f"Momentum: mode {self.mode!r}: expected 'standard' or "
                             "'nesterov'")


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
    ranges = {"eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE}
    flags = ("amsgrad", "maximize")

    def __post_init__(self):
        super().__post_init__()
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") \
                or not hasattr(betas, "__iter__"):
            raise TypeError(f"AdamW: betas {betas!r}: expected a pair of numbers "
                            f"(beta1, beta2), got {type(betas).__name__}")
        if len(betas) != 2:
            raise ValueError(f"AdamW: betas {betas!r}: expected a pair of numbers "
                             f"(beta1, beta2), got {len(betas)}")
        self.betas = tuple(_check_real("AdamW", f"betas[{k}]", b, UNIT)
                           for k, b in enumerate(betas))
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
    if not isinstance(opt.state_dtype, str):
        raise TypeError(f"{name}: state_dtype {opt.state_dtype!r}: expected 'float32', "
                        f"'int8' or 'bfloat16', got {type(opt.state_dtype).__name__}")
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
    types = {"Adam": Adam, "AdamW": AdamW, "Adagrad": Adagrad, "Momentum": Momentum}
    kind = d.pop("type", None)
    if kind not in types:
        raise ValueError(f"optim.from_dict: unknown optimizer type {kind!r}; expected one of "
                         f"{sorted(types)}")
    return types[kind](**d)


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
