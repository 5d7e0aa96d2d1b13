"""Learning-rate schedules (``trainops.optim.schedules``): each is a callable
``schedule(step) -> lr`` where ``step`` counts the updates already made (0 for the first
update: ``last_epoch`` of ``torch.optim.lr_scheduler`` after ``step`` calls of
``scheduler.step()``), giving the closed-form values of PyTorch's schedulers:

- :class:`Constant` (``ConstantLR``; by default just ``lr``);
- :class:`LinearWarmup` (``LinearLR``);
- :class:`Cosine` (``CosineAnnealingLR``, after an optional ``LinearLR`` warmup as in
  ``SequentialLR``; held at ``floor`` after ``total_steps``);
- :class:`Step` (``StepLR``), :class:`Exponential` (``ExponentialLR``);
- :class:`OneCycle` (``OneCycleLR``, its defaults: cosine annealing, ``pct_start`` 0.3,
  ``div_factor`` 25, ``final_div_factor`` 1e4);
- :class:`Lambda` (``LambdaLR``: ``lr * fn(step)``); any plain callable ``step -> lr``
  works as a schedule too.

``lr=None`` (the default, except :class:`OneCycle`, whose peak is ``max_lr``) means the
optimizer's learning rate: :class:`trainops.Trainer` fills it in (:meth:`Schedule.bind`),
as PyTorch's schedulers take the optimizer's ``lr`` as their base.

:class:`trainops.Trainer` (``schedule=``) sets its learning-rate input from
``schedule(T - 1)`` before each update; checkpoints store the schedule's
:meth:`~Schedule.to_dict` (a :class:`Lambda` or plain callable cannot be stored:
:func:`to_config` says so).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

__all__ = ["Constant", "Cosine", "Exponential", "Lambda", "LinearWarmup", "OneCycle",
           "Schedule", "Step", "from_dict", "to_config"]


def _positive_int(cls, name, v, minimum=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{cls}: {name} {v!r}: expected an integer >= {minimum}")


def _number(cls, name, v, low=None, high=None, open_low=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or (low is not None and (v < low or (open_low and v == low))) \
            or (high is not None and v > high):
        rng = f" in {'(' if open_low else '['}{low}, {high}]" if low is not None else ""
        raise ValueError(f"{cls}: {name} {v!r}: expected a finite number{rng}")


class Schedule:
    """A learning-rate schedule: ``schedule(step) -> lr`` (``step`` >= 0, updates made)."""

    lr: float | None

    def bind(self, lr: float) -> "Schedule":
        """This schedule with ``lr`` as its base rate if it has none (else itself)."""
        return replace(self, lr=float(lr)) if getattr(self, "lr", 0) is None else self

    def __call__(self, step: int) -> float:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{type(self).__name__}: step {step!r}: expected an integer >= 0")
        if getattr(self, "lr", 0) is None:
            raise ValueError(f"{type(self).__name__}: no base learning rate: give lr= or "
                             "bind(optimizer.lr) (a Trainer does)")
        return float(self._lr(step))

    def _lr(self, step: int) -> float:
        raise NotImplementedError

    def to_dict(self) -> dict:
        """JSON-ready: ``{"type": <class name>, <fields>}`` (:func:`from_dict` inverts it)."""
        return {"type": type(self).__name__, **asdict(self)}


@dataclass
class Constant(Schedule):
    """``ConstantLR(factor, total_iters)``: ``lr * factor`` for the first ``total_iters``
    steps, then ``lr``. The defaults (factor 1) keep ``lr`` throughout."""

    lr: float | None = None
    factor: float = 1.0
    total_iters: int = 0

    def __post_init__(self):
        _number("Constant", "factor", self.factor, 0.0, 1.0)
        _positive_int("Constant", "total_iters", self.total_iters, 0)

    def _lr(self, step):
        return self.lr * self.factor if step < self.total_iters else self.lr


def _linear(lr, start, end, total, step):
    return lr * (start + (end - start) * min(step, total) / total)


@dataclass
class LinearWarmup(Schedule):
    """``LinearLR(start_factor, end_factor, total_iters=warmup_steps)``:
    ``lr * (start + (end - start) * min(step, warmup_steps) / warmup_steps)``.
    PyTorch's defaults (1/3, 1.0); ``start_factor`` 0 (lr 0 on the first step, Hugging
    Face's warmup) is allowed here, not in PyTorch."""

    warmup_steps: int = 5
    start_factor: float = 1.0 / 3
    end_factor: float = 1.0
    lr: float | None = None

    def __post_init__(self):
        _positive_int("LinearWarmup", "warmup_steps", self.warmup_steps)
        _number("LinearWarmup", "start_factor", self.start_factor, 0.0, 1.0)
        _number("LinearWarmup", "end_factor", self.end_factor, 0.0, 1.0)

    def _lr(self, step):
        return _linear(self.lr, self.start_factor, self.end_factor, self.warmup_steps, step)


@dataclass
class Cosine(Schedule):
    """Cosine annealing from ``lr`` to ``floor`` (an absolute rate: ``eta_min``) over
    ``total_steps`` updates, after ``warmup_steps`` of :class:`LinearWarmup` (from
    ``warmup_start_factor * lr``): PyTorch's ``SequentialLR([LinearLR(start_factor,
    total_iters=warmup_steps), CosineAnnealingLR(T_max=total_steps - warmup_steps,
    eta_min=floor)], milestones=[warmup_steps])``, i.e. ``floor + (lr - floor) * (1 +
    cos(pi * t / T_max)) / 2`` with ``t = step - warmup_steps``. From ``total_steps`` on
    it stays at ``floor`` (PyTorch's ``CosineAnnealingLR`` would rise again)."""

    total_steps: int = 1000
    warmup_steps: int = 0
    floor: float = 0.0
    warmup_start_factor: float = 1.0 / 3
    lr: float | None = None

    def __post_init__(self):
        _positive_int("Cosine", "total_steps", self.total_steps)
        _positive_int("Cosine", "warmup_steps", self.warmup_steps, 0)
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"Cosine: warmup_steps {self.warmup_steps} must be below "
                             f"total_steps {self.total_steps}")
        _number("Cosine", "floor", self.floor, 0.0)
        _number("Cosine", "warmup_start_factor", self.warmup_start_factor, 0.0, 1.0)

    def _lr(self, step):
        w = self.warmup_steps
        if step < w:
            return _linear(self.lr, self.warmup_start_factor, 1.0, w, step)
        t, t_max = min(step, self.total_steps) - w, self.total_steps - w
        return self.floor + (self.lr - self.floor) * (1 + math.cos(math.pi * t / t_max)) / 2


@dataclass
class Step(Schedule):
    """``StepLR(step_size, gamma)``: ``lr * gamma ** (step // step_size)``."""

    step_size: int = 1
    gamma: float = 0.1
    lr: float | None = None

    def __post_init__(self):
        _positive_int("Step", "step_size", self.step_size)
        _number("Step", "gamma", self.gamma, 0.0)

    def _lr(self, step):
        return self.lr * self.gamma ** (step // self.step_size)


@dataclass
class Exponential(Schedule):
    """``ExponentialLR(gamma)``: ``lr * gamma ** step``."""

    gamma: float = 0.99
    lr: float | None = None

    def __post_init__(self):
        _number("Exponential", "gamma", self.gamma, 0.0)

    def _lr(self, step):
        return self.lr * self.gamma ** step


@dataclass
class OneCycle(Schedule):
    """``OneCycleLR(max_lr, total_steps, pct_start, anneal_strategy, div_factor,
    final_div_factor, three_phase)`` (learning rate only; PyTorch also cycles the
    momentum, which this does not): from ``max_lr / div_factor`` up to ``max_lr`` by step
    ``pct_start * total_steps - 1``, then down to ``max_lr / div_factor /
    final_div_factor`` at step ``total_steps - 1`` (``three_phase``: back to the initial
    rate by ``2 * pct_start * total_steps - 2`` first), each phase annealed by
    ``anneal`` (``"cos"``: ``end + (start - end) * (1 + cos(pi * pct)) / 2``, or
    ``"linear"``). A step past ``total_steps`` is a ValueError, as in PyTorch."""

    max_lr: float = 0.1
    total_steps: int = 1000
    pct_start: float = 0.3
    anneal: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False

    def __post_init__(self):
        _number("OneCycle", "max_lr", self.max_lr, 0.0, open_low=True)
        _positive_int("OneCycle", "total_steps", self.total_steps)
        _number("OneCycle", "pct_start", self.pct_start, 0.0, 1.0)
        _number("OneCycle", "div_factor", self.div_factor, 0.0, open_low=True)
        _number("OneCycle", "final_div_factor", self.final_div_factor, 0.0, open_low=True)
        if self.anneal not in ("cos", "linear"):
            raise ValueError(f"OneCycle: anneal {self.anneal!r}: expected 'cos' or 'linear'")

    @property
    def lr(self) -> float:  # the peak; OneCycle ignores the optimizer's rate, as PyTorch's
        return self.max_lr

    def bind(self, lr: float) -> "Schedule":
        return self

    def _lr(self, step):
        if step > self.total_steps:
            raise ValueError(f"OneCycle: step {step} is past total_steps {self.total_steps}")
        initial = self.max_lr / self.div_factor
        low = initial / self.final_div_factor
        n, p = self.total_steps, self.pct_start
        phases = ([(float(p * n) - 1, initial, self.max_lr),
                   (float(2 * p * n) - 2, self.max_lr, initial), (n - 1, initial, low)]
                  if self.three_phase else
                  [(float(p * n) - 1, initial, self.max_lr), (n - 1, self.max_lr, low)])
        begin = 0.0
        for i, (end, start_lr, end_lr) in enumerate(phases):
            if step <= end or i == len(phases) - 1:
                pct = (step - begin) / (end - begin)
                if self.anneal == "cos":
                    return end_lr + (start_lr - end_lr) / 2.0 * (math.cos(math.pi * pct) + 1)
                return (end_lr - start_lr) * pct + start_lr
            begin = end
        raise AssertionError("unreachable")


@dataclass
class Lambda(Schedule):
    """``LambdaLR(fn)``: ``lr * fn(step)``. Not storable in a checkpoint (a Python
    function); pass it again to :meth:`trainops.Trainer.load`."""

    fn: Callable[[int], float] = lambda step: 1.0
    lr: float | None = None

    def _lr(self, step):
        return self.lr * float(self.fn(step))

    def to_dict(self) -> dict:
        raise TypeError("schedules.Lambda holds a Python function: it cannot be stored")


_TYPES = {c.__name__: c for c in (Constant, LinearWarmup, Cosine, Step, Exponential, OneCycle)}


def from_dict(d: dict) -> Schedule:
    """The schedule :meth:`Schedule.to_dict` described."""
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in _TYPES:
        raise ValueError(f"schedules.from_dict: unknown schedule type {kind!r}; expected one "
                         f"of {sorted(_TYPES)}")
    return _TYPES[kind](**d)


def to_config(schedule: Any) -> dict | None:
    """What a checkpoint stores for ``schedule``: None for none, its ``to_dict()``, or
    for a :class:`Lambda` / plain callable ``{"type": "callable", "repr": ...}`` (the
    function itself cannot be saved: :meth:`trainops.Trainer.load` then needs
    ``schedule=``)."""
    if schedule is None:
        return None
    if isinstance(schedule, Schedule) and not isinstance(schedule, Lambda):
        return schedule.to_dict()
    return {"type": "callable", "repr": repr(schedule)}
