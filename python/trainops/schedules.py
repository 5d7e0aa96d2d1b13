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
import numbers
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

__all__ = ["Constant", "Cosine", "Exponential", "Lambda", "LinearWarmup", "OneCycle",
           "Schedule", "Step", "from_dict", "to_config"]


def _is_real(v) -> bool:
    """A real number (an int, a float, a numpy scalar), not a bool nor a string."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _positive_int(cls, name, v, minimum=1):
    """``v`` as an int: TypeError naming ``cls`` and ``name`` if it is no integer (a
    float, a string, a bool), ValueError if it is below ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{cls}: {name} {v!r}: expected an integer >= {minimum}, got "
                        f"{type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{cls}: {name} {v!r}: expected an integer >= {minimum}")
    return int(v)


def _number(cls, name, v, low=None, high=None, open_low=False):
    """``v`` as a float: TypeError naming ``cls`` and ``name`` if it is no real number (a
    string such as '0.1', a bool, None), ValueError if it is NaN, infinite or outside
    [low, high] (``open_low``: low excluded)."""
    if not _is_real(v):
        raise TypeError(f"{cls}: {name} {v!r}: expected a real number, got "
                        f"{type(v).__name__}")
    x = float(v)
    if not math.isfinite(x) or (low is not None and (x < low or (open_low and x == low))) \
            or (high is not None and x > high):
        if low is None:
            rng = ""
        elif high is None:
            rng = f" {'>' if open_low else '>='} {low:g}"
        else:
            rng = f" in {'(' if open_low else '['}{low:g}, {high:g}]"
        raise ValueError(f"{cls}: {name} {v!r}: expected a finite number{rng}")
    return x


def _base_lr(schedule) -> None:
    """``schedule.lr`` checked: None (the optimizer's, given by bind) or a finite number
    >= 0, stored as a float."""
    if schedule.lr is not None:
        schedule.lr = _number(type(schedule).__name__, "lr", schedule.lr, 0.0)


def _scaled(lr: float, factor: float, exponent: int) -> float:
    """``lr * factor ** exponent``; 0 when ``lr`` is 0 (PyTorch multiplies its way there
    from 0, never computing the power). A power past the float range raises Python's
    OverflowError, which :meth:`Schedule.__call__` turns into its ValueError."""
    return 0.0 if lr == 0 else lr * factor ** exponent


class Schedule:
    """A learning-rate schedule: ``schedule(step) -> lr`` (``step`` >= 0, updates made)."""

    lr: float | None

    def bind(self, lr: float) -> "Schedule":
        """This schedule with ``lr`` as its base rate if it has none (else itself)."""
        return replace(self, lr=lr) if getattr(self, "lr", 0) is None else self

    def __call__(self, step: int) -> float:
        """The learning rate of the update after ``step`` updates: a finite number, or a
        ValueError naming the schedule, the step and the value (a growing
        :class:`Exponential` or :class:`Step` past the float range, a :class:`Lambda`
        whose function returns a non-finite factor): raised before a Trainer changes
        anything. (A negative rate, which only a :class:`Lambda` or :class:`OneCycle`'s
        linear extrapolation at ``total_steps`` can give, as PyTorch's, is returned: the
        Trainer refuses it.)"""
        name = type(self).__name__
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"{name}: step {step!r}: expected an integer >= 0")
        if getattr(self, "lr", 0) is None:
            raise ValueError(f"{name}: no base learning rate: give lr= or "
                             "bind(optimizer.lr) (a Trainer does)")
        try:
            lr = float(self._lr(int(step)))
        except OverflowError:  # a power or an int past the float range (Python raises)
            lr = math.inf
        if not math.isfinite(lr):
            raise ValueError(f"{name}: the learning rate at step {step} is {lr!r}: expected a "
                             f"finite number ({self._why()})")
        return lr

    def _why(self) -> str:
        """Words on what made the rate what it is, for the error above."""
        return f"{self!r}"

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
        _base_lr(self)
        self.factor = _number("Constant", "factor", self.factor, 0.0, 1.0)
        self.total_iters = _positive_int("Constant", "total_iters", self.total_iters, 0)

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
        _base_lr(self)
        self.warmup_steps = _positive_int("LinearWarmup", "warmup_steps", self.warmup_steps)
        self.start_factor = _number("LinearWarmup", "start_factor", self.start_factor, 0.0, 1.0)
        self.end_factor = _number("LinearWarmup", "end_factor", self.end_factor, 0.0, 1.0)

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
        _base_lr(self)
        self.total_steps = _positive_int("Cosine", "total_steps", self.total_steps)
        self.warmup_steps = _positive_int("Cosine", "warmup_steps", self.warmup_steps, 0)
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"Cosine: warmup_steps {self.warmup_steps} must be below "
                             f"total_steps {self.total_steps}")
        self.floor = _number("Cosine", "floor", self.floor, 0.0)
        self.warmup_start_factor = _number("Cosine", "warmup_start_factor",
                                           self.warmup_start_factor, 0.0, 1.0)

    def _lr(self, step):
        w = self.warmup_steps
        if step < w:
            return _linear(self.lr, self.warmup_start_factor, 1.0, w, step)
        t, t_max = min(step, self.total_steps) - w, self.total_steps - w
        return self.floor + (self.lr - self.floor) * (1 + math.cos(math.pi * t / t_max)) / 2


@dataclass
class Step(Schedule):
    """``StepLR(step_size, gamma)``: ``lr * gamma ** (step // step_size)``. ``gamma`` above 1
    is allowed, as in PyTorch (the rate grows); the step at which it leaves the float range
    is a ValueError naming it."""

    step_size: int = 1
    gamma: float = 0.1
    lr: float | None = None

    def __post_init__(self):
        _base_lr(self)
        self.step_size = _positive_int("Step", "step_size", self.step_size)
        self.gamma = _number("Step", "gamma", self.gamma, 0.0)

    def _lr(self, step):
        return _scaled(self.lr, self.gamma, step // self.step_size)

    def _why(self):
        return f"lr {self.lr!r} * gamma {self.gamma!r} ** (step // {self.step_size})"


@dataclass
class Exponential(Schedule):
    """``ExponentialLR(gamma)``: ``lr * gamma ** step``. ``gamma`` above 1 is allowed, as in
    PyTorch (the rate grows); the step at which it leaves the float range is a ValueError
    naming it."""

    gamma: float = 0.99
    lr: float | None = None

    def __post_init__(self):
        _base_lr(self)
        self.gamma = _number("Exponential", "gamma", self.gamma, 0.0)

    def _lr(self, step):
        return _scaled(self.lr, self.gamma, step)

    def _why(self):
        return f"lr {self.lr!r} * gamma {self.gamma!r} ** step"


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
        self.max_lr = _number("OneCycle", "max_lr", self.max_lr, 0.0, open_low=True)
        self.total_steps = _positive_int("OneCycle", "total_steps", self.total_steps)
        self.pct_start = _number("OneCycle", "pct_start", self.pct_start, 0.0, 1.0)
        self.div_factor = _number("OneCycle", "div_factor", self.div_factor, 0.0,
                                  open_low=True)
        self.final_div_factor = _number("OneCycle", "final_div_factor", self.final_div_factor,
                                        0.0, open_low=True)
        if self.anneal not in ("cos", "linear"):
            raise ValueError(f"OneCycle: anneal {self.anneal!r}: expected 'cos' or 'linear'")
        if not isinstance(self.three_phase, bool):
            raise TypeError(f"OneCycle: three_phase {self.three_phase!r}: expected True or "
                            f"False, got {type(self.three_phase).__name__}")

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

    def __post_init__(self):
        _base_lr(self)
        if not callable(self.fn):
            raise TypeError(f"Lambda: fn {self.fn!r}: expected a callable step -> factor, got "
                            f"{type(self.fn).__name__}")

    def _lr(self, step):
        factor = self.fn(step)
        if not _is_real(factor):
            raise TypeError(f"Lambda: fn({step}) returned {factor!r}: expected a number")
        return self.lr * float(factor)

    def _why(self):
        return f"lr {self.lr!r} * fn(step)"

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
