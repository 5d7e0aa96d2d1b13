"""Optimizers for :class:`trainops.Trainer`: ONNX's training operators with their ONNX
attribute names (``ai.onnx.preview.training::Adam``, ``Adagrad``, ``Momentum``), and
PyTorch's AdamW with PyTorch's names (``com.trainops::AdamW``).

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

__all__ = ["Adam", "AdamW", "Adagrad", "Momentum", "Optimizer", "check_lr", "from_dict"]


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
        return {"type": self.op_type, **asdict(self)}


@dataclass
class Adam(Optimizer):
    """ONNX ``Adam``: ``V`` and ``H`` (first and second moments) per parameter.

    ONNX's formula, not PyTorch's: ``epsilon`` is added to ``sqrt(H)`` before the bias
    correction (which is folded into the rate), ``norm_coefficient`` adds an L2 term to the
    gradient, and ``norm_coefficient_post`` multiplies the whole updated weight after the
    step. For ``torch.optim.Adam``/``AdamW``'s arithmetic use :class:`AdamW`."""

    lr: float = 1e-3
    alpha: float = 0.9
    beta: float = 0.999
    epsilon: float = 1e-6
    norm_coefficient: float = 0.0
    norm_coefficient_post: float = 0.0
    op_type = "Adam"
    state = ("V", "H")


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
    ``AdamW(weight_decay=0)`` is ``torch.optim.Adam``'s update."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False
    op_type = "AdamW"
    domain = TRAINOPS_DOMAIN

    def __post_init__(self):
        super().__post_init__()
        betas = tuple(float(b) for b in self.betas)
        if len(betas) != 2:
            raise ValueError(f"AdamW: betas must be two floats, got {self.betas!r}")
        self.betas = betas

    @property
    def state(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("M", "V", "Vmax") if self.amsgrad else ("M", "V")

    def attributes(self) -> dict:
        """The node's attributes by their ONNX names (``beta1``, ``beta2``, ``epsilon``,
        ``weight_decay``, ``amsgrad``, ``maximize``)."""
        return {"beta1": self.betas[0], "beta2": self.betas[1], "epsilon": float(self.eps),
                "weight_decay": float(self.weight_decay), "amsgrad": int(bool(self.amsgrad)),
                "maximize": int(bool(self.maximize))}

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["betas"] = list(self.betas)
        return d


def from_dict(d: dict) -> Optimizer:
    """The optimizer :meth:`Optimizer.to_dict` described."""
    d = dict(d)
    cls = {"Adam": Adam, "AdamW": AdamW, "Adagrad": Adagrad, "Momentum": Momentum}[d.pop("type")]
    return cls(**d)
