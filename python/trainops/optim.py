"""Optimizers for :class:`trainops.Trainer`: ONNX's training operators with their ONNX
attribute names (``ai.onnx.preview.training::Adam``, ``Adagrad``, ``Momentum``).

The learning rate ``lr`` is the node's ``R`` input, fed on every step, so it can change
between steps (``trainer.learning_rate = ...``). The update count ``T`` is 1 on the first
step and grows by one per step (PyTorch's and Keras' counting), so Adam's bias correction
applies from the first step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["Adam", "Adagrad", "Momentum", "Optimizer", "check_lr", "from_dict"]


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
    op_type: str = ""
    state: tuple[str, ...] = ()  # per-parameter state tensors, in the node's input order
    lr: float

    def __post_init__(self) -> None:
        # Dataclass subclasses call this after their __init__: a bad lr fails here (and a
        # numpy scalar becomes a float, so to_dict() stays JSON).
        self.lr = check_lr(self.lr, type(self).__name__)

    def attributes(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "lr"}

    def to_dict(self) -> dict:
        return {"type": self.op_type, **asdict(self)}


@dataclass
class Adam(Optimizer):
    """ONNX ``Adam``: ``V`` and ``H`` (first and second moments) per parameter."""

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


def from_dict(d: dict) -> Optimizer:
    d = dict(d)
    cls = {"Adam": Adam, "Adagrad": Adagrad, "Momentum": Momentum}[d.pop("type")]
    return cls(**d)
