"""Benchmarks: ``python -m trainops bench <target> [options]``.

Not tests: timings depend on the machine and on whatever else runs on it. Every peer of a
size runs in one process, interleaved, and is reported as a ratio to a baseline peer
(:mod:`.harness`). The package:

- :mod:`.harness`: :class:`Peer`, :class:`Case`, :class:`Target`, :func:`measure`,
  :func:`format_table` and the command line (:func:`main`);
- :mod:`.host`: the machine, the versions and how busy the machine was during a run;
- :mod:`.yardsticks`: peers with a target's memory traffic and no work (memset,
  ``com.trainops.bench::MemoryCeiling``);
- one module per target, each defining ``TARGET`` (a :class:`Target`): :mod:`.adam`,
  :mod:`.philox`, :mod:`.distributions` (target ``random``), with :mod:`.optimizers` (the
  rows of ``adam --optimizers``: every optimizer and weight type against its own
  ``MemoryCeiling``), :mod:`.optim` (PyTorch-style optimizers, AdamW, against their
  ceiling and torch's fused step), :mod:`.train` (a training
  step against PyTorch eager: a target with its own command line, ``Target(...,
  command=)``), :mod:`.lora` (a LoRA fine-tuning step against PyTorch + PEFT, likewise),
  :mod:`.arch` (torchvision / transformers architectures against torch eager,
  torch.compile and their FLOP bound, likewise), :mod:`.distributed` (data-parallel
  scaling over MPI, likewise).

Adding a target is one module here that defines ``TARGET = Target(name, help, build,
add_arguments, default_sizes, after)``, where ``build(nbytes, args)`` returns the
:class:`Case` of one size, and one line in :data:`TARGETS` below.
"""

from __future__ import annotations

from importlib import import_module

from .harness import (Case, Peer, Result, Target, build_parser, format_table, main, measure,
                      ort_session, parse_size, run, size_label)
from .yardsticks import MemsetPair, ceiling_peers

__all__ = [
    "TARGETS", "load_target", "targets", "Peer", "Case", "Result", "Target", "measure",
    "format_table", "parse_size", "size_label", "ort_session", "MemsetPair", "ceiling_peers",
    "build_parser", "run", "main",
]

# The targets of `python -m trainops bench`: name -> module of this package defining TARGET.
TARGETS: dict[str, str] = {
    "philox": "philox",
    "adam": "adam",
    "optim": "optim",
    "random": "distributions",
    "train": "train",
    "lora": "lora",
    "arch": "arch",
    "distributed": "distributed",
}


def load_target(name: str) -> Target:
    """The :class:`Target` called ``name`` (its module is imported on first use)."""
    target = import_module(f".{TARGETS[name]}", __name__).TARGET
    if target.name != name:
        raise RuntimeError(f"trainops.bench.{TARGETS[name]} defines target {target.name!r}, "
                           f"listed as {name!r}")
    return target


def targets() -> dict[str, Target]:
    """Every target of :data:`TARGETS`, in its order."""
    return {name: load_target(name) for name in TARGETS}
