""":class:`InPlaceOptimizer`: :func:`~trainops.mixed_precision.optimizer_model` in an ONNX
Runtime session, every state tensor bound in place through an IOBinding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import numpy as np

from ..bfloat16 import to_ortvalue
from .model import optimizer_model, optimizer_names, optimizer_state
from .policy import Policy

__all__ = ["InPlaceOptimizer"]

class InPlaceOptimizer:
    """:func:`optimizer_model` in an ONNX Runtime session, its state bound in place.

    Every state tensor (weights, moments, ``step``, ``loss_scale``, ``good_steps``) and
    every gradient lives in a numpy array owned by this object and wrapped (not copied)
    by an ``OrtValue``; one IOBinding binds each ``<name>.new`` output to its input's
    value, so a step rewrites those arrays and nothing is allocated or copied per step.
    ``w.copy`` outputs (mixed policies) go to persistent compute-dtype arrays.

    ``weights``: ``{name: initial array}``. ``lr``: the learning rate (change it with
    ``step(..., lr=)``). ``session``: an existing session of the same model (default:
    one is created with the trainops library; ``threads``, ``library`` and
    ``log_severity_level`` go to it). ``model_kwargs`` go to :func:`optimizer_model`.
    """

    def __init__(self, weights: Mapping[str, Any], policy: Union[str, Policy] = "float32",
                 lr: float = 1e-3, *, loss_scale: Optional[float] = None, session=None,
                 threads: Optional[int] = None, library: Optional[str] = None,
                 log_severity_level: Optional[int] = 3, **model_kwargs: Any):
        from ..models import session as make_session

        self.policy = Policy(policy)
        self.names = list(weights)
        self.model = optimizer_model([(n, np.shape(w)) for n, w in weights.items()],
                                     self.policy, **model_kwargs)
        self.session = session or make_session(self.model, threads=threads, library=library,
                                               log_severity_level=log_severity_level)
        self.state = optimizer_state(weights, self.policy, lr=lr, loss_scale=loss_scale)
        comp = self.policy.compute_np_dtype
        for n in self.names:
            self.state[n + ".grad"] = np.zeros(self.state[n].shape, comp)
        self._outputs: dict[str, np.ndarray] = {}
        if self.policy.is_mixed:
            self._outputs["finite"] = np.ones((), np.bool_)
            for n in self.names:
                self._outputs[n + ".copy"] = self.state[n].astype(comp)
        self._values = {k: to_ortvalue(a) for k, a in self.state.items()}
        self._out_values = {k: to_ortvalue(a) for k, a in self._outputs.items()}
        self.binding = self.session.io_binding()
        in_names, out_names = optimizer_names([(n, None) for n in self.names], self.policy)
        for name in in_names:
            self.binding.bind_ortvalue_input(name, self._values[name])
        for name in out_names:
            if name in self._out_values:
                self.binding.bind_ortvalue_output(name, self._out_values[name])
            else:
                self.binding.bind_ortvalue_output(name, self._values[name[:-len(".new")]])

    def step(self, grads: Mapping[str, Any], lr: Optional[float] = None) -> bool:
        """One optimizer step with ``grads`` (``{name: array}``, converted to the compute
        dtype; in ``mixed_float16`` the gradients of the loss multiplied by
        :attr:`loss_scale`). Returns whether the step was applied (``False``: non-finite
        gradients, skipped; always ``True`` in a plain policy)."""
        missing = set(self.names) - set(grads)
        extra = set(grads) - set(self.names)
        if missing or extra:
            raise KeyError(f"gradients for {sorted(missing)} missing, {sorted(extra)} unknown")
        for n in self.names:
            buf = self.state[n + ".grad"]
            g = np.asarray(grads[n])
            if g.shape != buf.shape:
                raise ValueError(f"gradient {n!r}: shape {g.shape}, expected {buf.shape}")
            buf[...] = g.astype(buf.dtype, copy=False)
        if lr is not None:
            self.state["lr"][...] = lr
        self.session.run_with_iobinding(self.binding)
        return bool(self._outputs["finite"]) if self.policy.is_mixed else True

    def __getitem__(self, name: str) -> np.ndarray:
        """The live array of a state value (``w``, ``w.m``, ``step``, ...) or output
        (``w.copy``, ``finite``): a view, rewritten by the next step."""
        if name in self._outputs:
            return self._outputs[name]
        return self.state[name]

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The variables (master weights), live arrays."""
        return {n: self.state[n] for n in self.names}

    @property
    def compute_weights(self) -> dict[str, np.ndarray]:
        """The weights in the compute dtype for the forward pass: the ``w.copy`` outputs
        in a mixed policy (live arrays), the variables themselves otherwise."""
        if self.policy.is_mixed:
            return {n: self._outputs[n + ".copy"] for n in self.names}
        return self.weights

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when the policy uses no loss scaling)."""
        if self.policy.uses_loss_scaling:
            return float(self.state["loss_scale"])
        return 1.0

    @property
    def good_steps(self) -> int:
        return int(self.state["good_steps"]) if self.policy.uses_loss_scaling else 0

    @property
    def iterations(self) -> int:
        """Steps applied so far (skipped steps do not count)."""
        return int(self.state["step"])

    @property
    def finite(self) -> bool:
        """The last step's verdict (``True`` in a plain policy)."""
        return bool(self._outputs["finite"]) if self.policy.is_mixed else True
