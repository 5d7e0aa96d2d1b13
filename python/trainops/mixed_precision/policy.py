"""Keras-style dtype policies (:class:`Policy`) and Keras' loss-scale defaults."""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from ..onnx_defs import numpy_dtype

__all__ = ["Policy", "KERAS_INITIAL_LOSS_SCALE", "KERAS_GROWTH_INTERVAL"]

# Plain policies: variables and computations in one float dtype.
_PLAIN = ("float16", "bfloat16", "float32", "float64")
_MIXED = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}

# Keras' LossScaleOptimizer defaults (Keras 2 and 3): initial_scale=2**15,
# dynamic_growth_steps=2000.
KERAS_INITIAL_LOSS_SCALE = 2.0 ** 15
KERAS_GROWTH_INTERVAL = 2000


class Policy:
    """A dtype policy, as Keras' ``tf.keras.mixed_precision.Policy`` /
    ``keras.DTypePolicy``.

    ``Policy(name)`` with ``name`` one of ``"float32"``, ``"float64"``, ``"float16"``,
    ``"bfloat16"`` (variables and computations in that dtype, no loss scaling),
    ``"mixed_float16"`` (compute float16, variables float32, dynamic loss scaling) or
    ``"mixed_bfloat16"`` (compute bfloat16, variables float32, no loss scaling). Any other
    string is a ``ValueError``, any non-string (other than a ``Policy``) a ``TypeError``.

    Attributes:
        name: the policy's name.
        compute_dtype: the dtype name computations use (``"float16"``, ``"bfloat16"``, ...).
        variable_dtype: the dtype name of the variables (weights and optimizer state).
        compute_np_dtype, variable_np_dtype: the same as numpy dtypes
            (``ml_dtypes.bfloat16`` for bfloat16).
        uses_loss_scaling: whether training scales the loss (only ``mixed_float16``).
        loss_scale: the initial dynamic loss scale (2**15, Keras' default) or ``None``.
        growth_interval: finite steps before the scale grows (2000, Keras' default), or
            ``None`` without loss scaling.
    """

    __slots__ = ("_name", "_compute", "_variable")

    def __init__(self, name: Union[str, "Policy"]):
        if isinstance(name, Policy):
            name = name.name
        if not isinstance(name, str):
            raise TypeError("'name' must be a string, such as 'mixed_float16'. "
                            f"Received: name={name!r} (of type {type(name).__name__})")
        if name in _MIXED:
            compute, variable = _MIXED[name], "float32"
        elif name in _PLAIN:
            compute = variable = name
        else:
            raise ValueError(f"Cannot convert '{name}' to a mixed precision Policy. Valid "
                             "policies include 'mixed_float16', 'mixed_bfloat16', and the "
                             "name of any float dtype such as 'float32' (here: "
                             f"{', '.join(repr(p) for p in _PLAIN)}).")
        self._name = name
        self._compute = compute
        self._variable = variable

    @property
    def name(self) -> str:
        return self._name

    @property
    def compute_dtype(self) -> str:
        return self._compute

    @property
    def variable_dtype(self) -> str:
        return self._variable

    @property
    def compute_np_dtype(self) -> np.dtype:
        return numpy_dtype(self._compute)

    @property
    def variable_np_dtype(self) -> np.dtype:
        return numpy_dtype(self._variable)

    @property
    def is_mixed(self) -> bool:
        """Compute and variable dtypes differ (``mixed_float16``, ``mixed_bfloat16``)."""
        return self._compute != self._variable

    @property
    def uses_loss_scaling(self) -> bool:
        return self._name == "mixed_float16"

    @property
    def loss_scale(self) -> Optional[float]:
        return KERAS_INITIAL_LOSS_SCALE if self.uses_loss_scaling else None

    @property
    def growth_interval(self) -> Optional[int]:
        return KERAS_GROWTH_INTERVAL if self.uses_loss_scaling else None

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("Policy", self._name))
