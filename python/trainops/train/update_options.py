"""The Trainer's update options beyond the optimizer, between the façade and checkpoints:
the learning-rate schedule (:mod:`trainops.schedules`) with ``clip_grad_norm`` and
``accumulate`` as a checkpoint's config records them (:func:`config_of`) and
:meth:`Trainer.load` reads them back (:func:`load_options`)."""

from __future__ import annotations

import math
import os
import warnings

from .. import schedules as _schedules

__all__ = ["bind", "config_of", "load_options", "lr_at", "schedule_config"]


def bind(schedule, optimizer):
    """``schedule`` checked (None, a :class:`trainops.schedules.Schedule` or a callable
    ``step -> lr``), with the optimizer's ``lr`` as its base rate if it has none."""
    if schedule is None:
        return None
    if isinstance(schedule, _schedules.Schedule):
        return schedule.bind(optimizer.lr)
    if not callable(schedule):
        raise TypeError(f"schedule: expected a trainops.optim.schedules schedule or a "
                        f"callable step -> lr, got {type(schedule).__name__}")
    return schedule


def lr_at(schedule, t: int) -> float:
    """The learning rate of update ``t`` (1 for the first): ``schedule(t - 1)``, checked
    to be a finite number >= 0."""
    lr = schedule(t - 1)
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"schedule({t - 1}) returned {lr!r}: expected a number") from None
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"schedule({t - 1}) returned {lr!r}: expected a finite learning "
                         "rate >= 0")
    return lr


def config_of(trainer) -> dict:
    """The checkpoint config entries a resumed trainer must share: ``clip_grad_norm`` when
    set and ``accumulate`` when above 1 (absent at their defaults, so the config of a plain
    trainer, and older checkpoints, stay as they were)."""
    out = {}
    if trainer.clip_grad_norm is not None:
        out["clip_grad_norm"] = trainer.clip_grad_norm
    if trainer.accumulate > 1:
        out["accumulate"] = trainer.accumulate
    return out


def schedule_config(trainer) -> dict:
    """The checkpoint config entry ``schedule`` when there is one
    (:func:`trainops.schedules.to_config`; not
    compared on load: ``Trainer.load(path, schedule=...)`` may replace it). A schedule that
    is a Python function cannot be saved: a UserWarning says so (the checkpoint records its
    repr, and :meth:`Trainer.load` then asks for ``schedule=``)."""
    config = _schedules.to_config(trainer.schedule)
    if config is None:
        return {}
    if config["type"] == "callable":
        warnings.warn(f"Trainer.save: the schedule {config['repr']} is a Python function and "
                      "is NOT saved in the checkpoint; pass it again as "
                      "Trainer.load(path, schedule=...)", UserWarning, stacklevel=4)
    return {"schedule": config}


def load_options(config: dict, schedule, path) -> dict:
    """The Trainer keyword arguments a checkpoint's ``config`` gives: ``clip_grad_norm``,
    ``accumulate`` and ``schedule`` (``schedule`` given: it, else the saved one;
    ValueError when the saved one was a Python function and none is given)."""
    saved = config.get("schedule")
    if schedule is None and saved is not None:
        if saved.get("type") == "callable":
            raise ValueError(f"Trainer.load({os.fspath(path)!r}): the checkpoint was trained "
                             f"with the schedule {saved.get('repr')}, a Python function that "
                             "checkpoints cannot hold: pass it again as schedule=")
        schedule = _schedules.from_dict(saved)
    return {"clip_grad_norm": config.get("clip_grad_norm"),
            "accumulate": config.get("accumulate", 1), "schedule": schedule}
