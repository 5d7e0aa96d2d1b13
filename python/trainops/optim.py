"""Optimizers for :class:`trainops.Trainer`: ONNX's training operators with their ONNX
attribute names (``ai.onnx.preview.training::Adam``, ``Adagrad``, ``Momentum``).

The learning rate ``lr`` is the node's ``R`` input, fed on every step, so it can change
between steps (``trainer.learning_rate = ...``). The update count ``T`` is 1 on the first
step and grows by one per step (PyTorch's and Keras' counting), so Adam's bias correction
applies from the first step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Adam", "Adagrad", "Momentum", "Optimizer", "from_dict"]


class Optimizer:
    op_type: str = ""
    state: tuple[str, ...] = ()  # per-parameter state tensors, in the node's input order
    lr: float

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


from . import schedules  # noqa: E402  (trainops.optim.schedules: learning-rate schedules)
