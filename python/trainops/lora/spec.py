"""The LoRA configuration (:class:`LoRA`), checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["LoRA", "format_number"]


def format_number(x: float) -> str:
    """``x`` as a decimal string: ``"8"`` for an integral value, else ``repr(float(x))``."""
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on the MatMul / Gemm nodes ``targets`` names (PEFT's
    ``LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout)``).

    - ``rank``: an int >= 1, the adapters' inner dimension;
    - ``alpha``: a finite number > 0; the adapter's output is scaled by ``alpha / rank``;
    - ``targets``: a non-empty list of strings, each matched as a substring against the
      name of a MatMul / Gemm node and of its weight initializer (``"q_proj"`` matches
      ``/model/layers.0/self_attn/q_proj/MatMul``); a target that matches no node with a
      float weight initializer is an error naming it;
    - ``dropout``: ``0 <= dropout < 1``, dropout on the adapter's input while training
      (PEFT's ``lora_dropout``; the Trainer's seeded Philox masks), none at inference.
    """

    rank: int = 8
    alpha: float = 8.0
    targets: list = field(default_factory=list)
    dropout: float = 0.0

    def __post_init__(self):
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"LoRA: rank {r!r}: expected an int >= 1")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) \
                or a <= 0:
            raise ValueError(f"LoRA: alpha {a!r}: expected a finite number > 0")
        t = self.targets
        if isinstance(t, (str, bytes)) or not isinstance(t, (list, tuple)) or not t or \
                not all(isinstance(s, str) and s for s in t):
            raise ValueError(f"LoRA: targets {t!r}: expected a non-empty list of non-empty "
                             "strings (substrings of node or weight names, e.g. ['q_proj'])")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise ValueError(f"LoRA: dropout {d!r}: expected a number with 0 <= dropout < 1")
        object.__setattr__(self, "targets", list(t))
        object.__setattr__(self, "alpha", float(a))
        object.__setattr__(self, "dropout", float(d))

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the adapter's output."""
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout}

    @classmethod
    def from_dict(cls, d: dict) -> "LoRA":
        return cls(rank=d["rank"], alpha=d["alpha"], targets=list(d["targets"]),
                   dropout=d["dropout"])
